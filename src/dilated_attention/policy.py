"""The memory policy: how large the op's row blocks and launches are, and where results accumulate.

Every size and switch that trades working memory against launch overhead lives
here, one table per knob keyed by device type, with the measurement that chose
it; a device type a table does not list takes the CPU's entry (sizes) or
False (switches). plan.py, launches.py, window.py and ``estimate`` read them
through the functions below, at call time, so a test or benchmark that
patches a table (``mock.patch.dict(policy.ROWS_PER_BLOCK, ...)``) changes what
every one of them does. The kernels' own tile sizes stay with the kernels
(fused.py, merge_kernel.py): they change speed, not memory.

What each knob bounds (Note [block accumulators] in launches.py):
- ROWS_PER_BLOCK, MAX_BLOCKS: the rows whose fp32 accumulators are live at once;
- ROWS_PER_LAUNCH, GATHERED_SHARE: a launch's gathered copies and outputs;
- MIN_ROWS_PER_BLOCK_PART: when a sparse segment part runs whole (Note [plan]);
- SLICE_ELEMENTS: the temporaries of merges and scatters;
- STRIDED_VIEWS, DENSE_KERNEL_INPUTS: whether selections are views or copies;
- WINDOW_TILE_ROWS: a sliding window's tile rows (Note [window tiles] in window.py);
- ``in_output``: which blocks accumulate in the output tensor itself.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, TypeVar

import torch

from .kernels import lse_dtype

T = TypeVar("T")

# Rows per block (and so per launch): at least this many rows, and at most
# MAX_BLOCKS blocks per rank, so that the accumulators of a block stay a small
# fraction of the rank's rows while the per-launch Python overhead stays
# constant in n (which also keeps shape-only dry runs on meta tensors fast).
# CUDA: 4096 rows (12 heads: 49,152 query rows, about 3 waves of the H100's
# 132 SMs) keeps working memory at 64K tokens under 1.25 / 4.5 input-sized
# tensors (forward / training, bf16: a launch's outputs, and in backward the
# kernel's fp32 dq, are a sixteenth of an input each); blocks of 131,072 rows
# held 3.13 / 10.16 there (estimate --device cuda --dry-run). From 128K tokens
# on, blocks are n / MAX_BLOCKS rows.
ROWS_PER_BLOCK: Dict[str, int] = {"cpu": 2048, "cuda": 4096}
MAX_BLOCKS = 32

# Segments batched into one launch hold at most this many rows (a longer
# segment is one launch): a launch's gathers, outputs and the kernel's own
# scratch stay a fraction of a block. None: a whole block (the block already
# bounds them; a GPU wants the largest launches that fit).
ROWS_PER_LAUNCH: Dict[str, Optional[int]] = {"cpu": 2048, "cuda": None}

# A launch on gathered rows copies its q, k, v and allocates its output (in
# backward also dout, out and three gradients), where a launch on a view
# allocates only its output: a gathered launch holds at most this share of a
# launch's (row, head) entries, cut by heads (patterns.split_heads).
GATHERED_SHARE = 4

# Below this many rows per head in a block's share of a segment, launches per pair of
# blocks would be tiny: such a segment part runs whole (Note [plan], sparse parts). A
# GPU's launches must be larger: with 4096-row blocks, LongNet's geometric schedule
# (2048..65536 / 1..32) at 64K tokens made 273 launches of 6144 query rows (median)
# with 256, 63 of 12,288 with 2048.
MIN_ROWS_PER_BLOCK_PART: Dict[str, int] = {"cpu": 256, "cuda": 2048}

# Merges and scatters go in slices of at most this many elements: their
# temporaries (an fp32 copy of a low-precision launch output, the selected
# accumulator rows) stay small whatever the launch size. A GPU needs far larger
# slices: each slice is several kernel launches, and at the CPU's size the
# launch latency dominated (measured on an H100: the op ran 6-17x its kernels'
# time with 2^19).
SLICE_ELEMENTS: Dict[str, int] = {"cpu": 1 << 17, "cuda": 1 << 24}

# Whether a device's launches read arithmetic selections (rate r, one offset per
# run of heads) as strided views (patterns.Stride): on CPU a rate-2 launch's
# merges and scatters then copy nothing (its forward kernel reads dense copies,
# DENSE_KERNEL_INPUTS, no advanced indexing); the CUDA kernels are given dense
# gathered copies, as measured on an H100, until views are measured there
# (gpu_suite's strided part).
STRIDED_VIEWS: Dict[str, bool] = {"cpu": True, "cuda": False}

# Whether a device's forward kernels read dense copies of the strided views a launch
# selects (patterns.Stride: a rate-r group's rows and heads, with gaps). Measured on CPU,
# LongNet fp32, one thread, CPU time, the variants taking turns (a busy machine): the
# flash kernel ran the rate-2 views slower than dense copies of them, by more than the
# copies cost (8K, 20 turns: the forward's kernels 4.2% faster, the forward 2.4%, paired
# medians; 16K: kernels 1.64 against 1.79 s, forward 1.75 against 1.88 s, medians of 8).
# Its backward did not gain (8K: kernels 1.0% slower, the step 2.5%), so backward
# launches read the views. Merges and scatters write through the views either way (no
# advanced indexing). A launch holds its copies of q, k, v (ROWS_PER_LAUNCH rows at most)
# until its kernel returns (working memory, forward, fp32: 16K 1.146 -> 1.297, 64K
# 1.050 -> 1.086 input-sized tensors). On meta (estimate's dry run) only a CPU plan has
# views with gaps: copied, as on the CPU.
DENSE_KERNEL_INPUTS: Dict[str, bool] = {"cpu": True, "meta": True}

# Sliding windows: query rows per tile row at most (B), forward and backward. A triangle
# of B rows costs the CPU flash kernel about 3/4 of a B-square at 1024 rows (it skips
# 512 keys at a time above the diagonal only), so longer rows waste more; shorter
# ones make more launches and merges, and in backward more dK/dV partials (the
# middle's keys, per tile row) to add.
WINDOW_TILE_ROWS: Dict[str, Tuple[int, int]] = {"cpu": (512, 1024), "cuda": (4096, 4096)}


def _size(table: Dict[str, T], device_type: str) -> T:
    return table.get(device_type, table["cpu"])


def rows_per_block(device_type: str) -> int:
    """The least rows per block on `device_type` (blocks grow past it above MAX_BLOCKS)."""
    return _size(ROWS_PER_BLOCK, device_type)


def rows_per_launch(device_type: str, block: int) -> int:
    """Rows of a launch's segments at most, in blocks of `block` rows."""
    return _size(ROWS_PER_LAUNCH, device_type) or block


def min_rows_per_block_part(device_type: str) -> int:
    return _size(MIN_ROWS_PER_BLOCK_PART, device_type)


def slice_elements(device_type: str) -> int:
    return _size(SLICE_ELEMENTS, device_type)


def strided_views(device_type: str) -> bool:
    return STRIDED_VIEWS.get(device_type, False)


def dense_kernel_inputs(device_type: str) -> bool:
    return DENSE_KERNEL_INPUTS.get(device_type, False)


def block_rows(n: int, segment_lengths: Sequence[int], device_type: str) -> int:
    """Rows per block of a rank holding `n` rows: the launch minimum or n / MAX_BLOCKS, a
    multiple of the largest segment length that fits (so those segments never straddle a
    block border).

    With at most two patterns a segment up to twice that fits too: a block that
    only whole segments write then gets at most two writes per entry, and such a
    block accumulates in the output itself, in any dtype (``in_output``), so a
    larger block costs no accumulator and saves the cut segments' launches.
    """
    target = max(rows_per_block(device_type), -(-n // MAX_BLOCKS))
    fits = target * (2 if len(segment_lengths) <= 2 else 1)
    unit = max([w for w in segment_lengths if w <= fits], default=1)
    return max(unit, target // unit * unit)


def window_tile_rows(left: int, right: int, device_type: str, backward: bool = False) -> int:
    """B: query rows per tile row of a sliding window's pass (Note [window tiles])."""
    rows = _size(WINDOW_TILE_ROWS, device_type)[int(backward)]
    return max(1, min(left + right, rows))


def window_stripe_rows(tile_rows: int, device_type: str) -> int:
    """S: rows per stripe (the window's row block) of a sliding window's pass, a multiple
    of its tile rows."""
    return max(tile_rows, rows_per_block(device_type) // tile_rows * tile_rows)


def in_output(entry_writes: int, dtype: torch.dtype) -> bool:
    """Whether a block accumulates in the output tensor itself, with no fp32 copy, given
    its ``Block.entry_writes`` (the most writes any of its entries gets; 0: unbounded).

    Always for the accumulator dtype. In half precision when no entry gets more
    than two writes: the first lands exactly (a merge into the identity, an add
    to zero), the second is computed in fp32 and rounded once, which is what an
    fp32 accumulator written out at the end gives, bit for bit. A third write
    would round twice.
    """
    return dtype == lse_dtype(dtype) or 0 < entry_writes <= 2
