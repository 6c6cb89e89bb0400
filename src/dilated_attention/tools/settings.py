"""Settings and defaults shared by the command's tools (bench, verify, estimate, launch).

One place for what more than one tool needs: the default attention setting
(LongNet's), the dtype names the command accepts, the unit of reported
memory, the layout rule of the dense ring, threads per rank, and the checks
of the attention options.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Tuple

import torch

from .. import validation as check

PROG = "dilated-attention"
# what `bench --impl` times: dilated attention, the dense ring, single-device SDPA
IMPLS = ("dilated", "ring", "sdpa")
DTYPES = ("float32", "float16", "bfloat16", "float64")
MB = 1e6  # reported megabytes are 10^6 bytes

# LongNet's setting (Ding et al., 2023): segments 2048 and 4096 with rates 1 and 2.
LONGNET_SEGMENTS = (2048, 4096)
LONGNET_RATES = (1, 2)
DEFAULT_SEQ_LENS = (8192, 16384, 32768)
DEFAULT_WORLD_SIZES = (1, 2, 4)


def megabytes(x: float) -> str:
    """Bytes as reported: "1,234.5 MB"."""
    return f"{x / MB:,.1f} MB"


def plural(count: int, noun: str, nouns: Optional[str] = None) -> str:
    """"1 thread", "2 threads", "1,024 messages", "1 pass": a count with its noun in the
    right number (`nouns`: the plural when it is not `noun` + "s")."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def default_threads(world_size: int) -> int:
    """Torch threads per rank when not given: the cores shared out over the ranks, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)


def ring_layout(causal: bool, world_size: int) -> str:
    """The layout the tools run dense ring attention in: zigzag balances causal work."""
    return "zigzag" if causal and world_size > 1 else "contiguous"


def check_setting(
    segment_lengths: Optional[Sequence[int]], dilation_rates: Optional[Sequence[int]], heads: int,
    kv_heads: Optional[int],
) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """Patterns (default LongNet's) and kv heads (default: heads), checked."""
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError("give --segment-lengths and --dilation-rates together")
    segs, rates = check.check_patterns(
        list(segment_lengths or LONGNET_SEGMENTS), list(dilation_rates or LONGNET_RATES)
    )
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide --heads {heads}")
    return segs, rates, kv_heads


@dataclasses.dataclass(frozen=True)
class AttentionSetting:
    """The attention call that bench and estimate take (``cli._add_model_options``)."""

    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    heads: int
    head_dim: int
    kv_heads: int
    batch: int
    dtype: str
    causal: bool
    window: Optional[int]  # ring attention's sliding window: `window` keys each side

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def window_size(self) -> Tuple[int, int]:
        """ring_attention's window_size: `window` keys back (and ahead unless causal)."""
        if self.window is None:
            return (-1, -1)
        return (self.window, 0 if self.causal else self.window)


def check_mesh_heads(mesh: Tuple[int, int], heads: int) -> None:
    """A --mesh UxS whose U head-parallel ranks do not divide the query heads: a ValueError
    naming it (bench's and estimate's)."""
    u, sp = mesh
    if heads % u:
        raise ValueError(f"--mesh {u}x{sp}: its {u} head-parallel ranks must divide the "
                         f"{heads} query heads")


def check_window(window: Optional[int], ring: bool) -> None:
    """--window (bench and estimate): an int >= 1 keys each side, of ring attention only."""
    if window is None:
        return
    if not ring:
        raise ValueError(f"--window {window} is a sliding window of ring attention: add "
                         f"--impl ring")
    if type(window) is not int or window < 1:
        raise ValueError(f"--window must be an int >= 1, got {window!r}")


def check_zigzag(n: int, world_size: int) -> None:
    """Causal ring attention runs in the zigzag layout: N must cut into 2P equal chunks."""
    if world_size > 1 and n % (2 * world_size):
        raise ValueError(
            f"causal ring attention uses the zigzag layout, which needs the sequence length to "
            f"divide into 2 * ranks chunks: {n} % {2 * world_size} != 0"
        )
