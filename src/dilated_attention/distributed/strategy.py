"""How a call spreads over its ranks: the exchange of selected rows, Ulysses, or both.

Notation: b batch, h query heads, hk key/value heads, d head dim, s bytes per element,
P ranks, n_p rank p's rows.

- exchange (``sequence_parallel``): every rank keeps its rows and all heads; a segment
  that spans ranks fetches the selected key/value rows of the other ranks' parts. Its
  traffic follows the patterns (about w / r rows per spanning segment, nothing for
  segments inside a piece), whatever N is.
- ulysses (``ulysses``): an all-to-all turns (my rows, all heads) into (all rows, h / P
  heads), the attention runs locally, a second all-to-all brings the output back. Its
  traffic follows N: q, k, v and out cross the group once, (P - 1) / P of them per rank.
- a 2-D mesh (U head-parallel x S sequence-parallel) runs Ulysses over U and the
  exchange over S on the heads each rank then holds.

``choose`` picks, for "auto" on a one-dimensional group, the strategy whose busiest rank
sends fewer forward bytes (an exact count for both: the exchange's from the plan's
schedule, Ulysses' from the all-to-all sizes); a tie keeps the exchange, which holds
no second copy of q, k, v. The same model prints in ``bench`` and ``estimate``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, List, Optional, Sequence, Tuple

from ..patterns import Heads, Patterns
from ..layout import Documents, Layout
from ..plan import transfer_counts
from . import comm
from .ulysses import HeadSplit


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the traffic of a call depends on (every rank's agreed facts)."""

    lengths: Tuple[int, ...]  # every rank's rows, in piece order
    patterns: Patterns
    causal: bool
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    itemsize: int  # bytes per element of q, k, v
    lse_itemsize: int
    documents: Documents


def exchange_bytes(shape: Shape, layout: Layout, heads: Optional[Heads] = None) -> List[int]:
    """Per rank, the forward bytes the exchange sends: k and v of every selected pair."""
    heads = heads or Heads.of(shape.heads, shape.kv_heads)
    counts = transfer_counts(layout, shape.patterns, shape.causal, heads, shape.documents)
    return [c.sent * 2 * shape.batch * shape.head_dim * shape.itemsize for c in counts]


def ulysses_bytes(shape: Shape, lengths: Sequence[int], lse: bool = True) -> List[int]:
    """Per rank of a head group holding `lengths` rows, the forward bytes its all-to-alls send:
    q and k, v of its rows for the other ranks' heads, then out and lse (without `lse`: out
    only) of the other ranks' rows for its own heads. Backward sends the same gradients
    the other way (less those of inputs that no rank differentiates).

    O(U): rank u sends its rows of every head column but its own (the group's
    columns less u's), and receives the other ranks' rows (N less its n) of its heads.
    """
    split = HeadSplit.of(len(lengths), shape.heads, shape.kv_heads)
    row = shape.batch * shape.head_dim * shape.itemsize  # one row of one head
    back_row = row + (shape.batch * shape.lse_itemsize if lse else 0)
    # head columns (query heads + k and v heads) each rank receives in the first all-to-all
    columns = [len(split.query(u)) + 2 * len(split.kv(u)) for u in range(len(lengths))]
    every, total = sum(columns), sum(lengths)
    return [n * row * (every - columns[u]) + (total - n) * len(split.query(u)) * back_row
            for u, n in enumerate(lengths)]


def traffic(kind: str, shape: Shape, grid: Tuple[int, int], lse: bool = True) -> List[int]:
    """Per rank (piece order), the forward bytes of strategy `kind` over a U x S grid (`lse`:
    see `ulysses_bytes`). O(P) beyond the exchange's own schedule."""
    u_size, s_size = grid
    if kind == "exchange":
        return exchange_bytes(shape, Layout.contiguous(shape.lengths))
    blocks = [shape.lengths[t * u_size:(t + 1) * u_size] for t in range(s_size)]
    heads = [ulysses_bytes(shape, block, lse) for block in blocks]
    if s_size == 1:  # no sequence dimension: nothing else travels
        return heads[0]
    split = HeadSplit.of(u_size, shape.heads, shape.kv_heads)
    layout = Layout.contiguous([sum(b) for b in blocks])
    sequence = [exchange_bytes(shape, layout, split.local_heads(u)) for u in range(u_size)]
    return [heads[t][u] + sequence[u][t] for t in range(s_size) for u in range(u_size)]


def choose(strategy: str, group: Any, shape: Shape, layout: str) -> str:
    """The strategy a call runs: "local", "exchange" or "ulysses" (same on every rank).

    `group` is resolved (``comm.resolve_group``); a Grid (2-D mesh) always runs
    Ulysses over its first dimension.
    """
    if not comm.is_distributed(group):
        return "local"
    grid = isinstance(group, comm.Grid)
    if grid or strategy == "ulysses":
        if layout != "contiguous":
            raise ValueError(
                f"layout={layout!r} runs with strategy='exchange' on a one-dimensional group "
                f"only; Ulysses and 2-D meshes take contiguous pieces"
            )
        if grid and strategy == "exchange":
            raise ValueError(
                "strategy='exchange' needs a one-dimensional group: a 2-D mesh runs Ulysses "
                "over its first dimension and the exchange over its second (pass a 1-D "
                "group over the same ranks for the exchange alone)"
            )
        # a clear error, on every rank, when the heads do not split
        HeadSplit.of(group.shape[0] if grid else comm.group_size(group), shape.heads,
                     shape.kv_heads)
        return "ulysses"
    if strategy == "exchange" or layout != "contiguous":
        return "exchange"
    return auto_choice(shape)


@functools.lru_cache(maxsize=256)
def auto_choice(shape: Shape) -> str:
    """"auto" on a one-dimensional group: the strategy whose busiest rank sends less."""
    size = len(shape.lengths)
    if shape.heads % size:
        return "exchange"  # Ulysses cannot split these heads
    exchange = max(traffic("exchange", shape, (1, size)))
    ulysses = max(traffic("ulysses", shape, (size, 1)))
    return "ulysses" if ulysses < exchange else "exchange"
