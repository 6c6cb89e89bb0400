"""What a fused plan computes against the per-pattern floor: pure arithmetic on its tables.

The fused kernels compute a (row, key) pair that two patterns select once, and pad tiles to
their launch's rows and spans to whole chunks; ``occupancy`` counts both against every
pattern's dense kernel on its gathered rows alone (docs/spec.md's per-pattern work), the
ratio docs/backends.md quotes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .fused_plan import span_reach, tile_plan
from .layout import Documents, segments_between
from .patterns import Heads, Patterns


class Occupancy(NamedTuple):
    """(row, key) pairs per batch row: `computed` by the kernel (its tiles padded to
    their launch's BLOCK_M rows and its spans to block_n keys, after the causal bound of
    each tile),
    `visited` (the tiles' rows times those keys, no padding; causal: the masked pairs
    inside the bound included) and `floor`: every pattern's dense kernel on its
    gathered rows alone (docs/spec.md's per-pattern work; causal: the lower triangles)."""

    computed: int
    visited: int
    floor: int

    @property
    def ratio(self) -> float:
        return self.computed / self.floor


def occupancy(n: int, patterns: Patterns, heads: Heads, causal: bool, documents: Documents,
              block_m: int, block_n: int, split_keys: Optional[int] = None,
              narrowest: Optional[int] = None) -> Occupancy:
    """The query plan's work against the per-pattern floor (forward; dq does the same)."""
    plan = tile_plan(n, patterns, heads, max(heads.kv_of) + 1, causal, documents, block_m,
                     False, split_keys=split_keys, narrowest=narrowest)
    tiles, rows, spans = plan.tiles.long(), plan.rows.long(), plan.spans.long()
    tile, count = span_reach(tiles, rows, spans, causal, False)
    padded = -(-count // block_n) * block_n
    heights, launch_tiles = zip(*plan.heights)
    launch_rows = torch.repeat_interleave(torch.tensor(heights), torch.tensor(launch_tiles))
    computed = int((padded * launch_rows[tile]).sum())
    visited = int((count * tiles[tile, 2]).sum())
    return Occupancy(computed, visited, _floor(n, patterns, heads, causal, documents))


def _floor(n: int, patterns: Patterns, heads: Heads, causal: bool, documents: Documents) -> int:
    total = 0
    for w, r in zip(*patterns):
        _, lengths = segments_between(0, n, w, documents, n)
        for j in range(heads.count):
            offset = (heads.first + j) % r
            # rows of each segment at local index = offset mod r
            k = torch.clamp(-((offset - lengths) // r), min=0)
            total += int((k * (k + 1) // 2 if causal else k * k).sum())
    return total
