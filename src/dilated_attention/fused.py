"""backend="triton": every dilation pattern in one fused pass, forward and backward.

The maths and the plan: Note [fused kernel] in fused_plan.py; the kernels:
triton_kernels.py. Here: the host side. ``forward``/``backward`` compute the
single-device op (dilated.py's custom ops call them), ``dense_forward``/
``dense_backward`` one block of plain attention (kernels.py's per-launch
"triton" kernel, for the ring and the sequence-parallel exchange).

q, k, v are read in place through their strides (no copy, whatever their
layout); out, lse, dq, dk, dv are written once each, with no zero fill. The
backward runs two kernels: dq over the query tiles (it also stores delta =
rowsum(dout * out) - dlse, one fp32 per (row, head)), then dK/dV over the
key tiles, which reads delta (none where k and v are frozen: no gradient).
Each runs once per tile height of its plan: tiles of few rows launch apart at
a smaller BLOCK_M (Note [fused kernel], "Narrow tiles"), all of dq's before
dK/dV's. With a `nonfinite` check (the
single-device op: a 0 on the device, which the plain forward makes NaN where a
q row, an out or a k row is not finite) the rule's kernels follow, one launch
for the forward and one for the backward's dq and dK/dV together, over every
tile: they do nothing unless the check is not finite, and then write everything
a second time (triton_kernels' module docstring). With attention dropout
(`Dropout`) every kernel applies the same masks (Note [fused dropout]).

Notation: b batch, n rows (m key rows), h query heads, hk key/value heads,
d head dim; layout (b, n, h, d); lse and delta (b, n, h) float32.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .fused_plan import MAX_MASK_PATTERNS, TilePlan, dense_plan, tile_plan
from .patterns import Heads, Patterns
from .layout import Documents
from .triton_launch import COMPILE_OPTIONS, RECIPES


class KernelTiles(NamedTuple):
    """One kernel's tile: rows per program (query rows; key rows for dK/dV), elements of the
    other side per chunk of its loop, and warps per program; span_counts: a span's counts
    are computed once and held through its chunks where the plan's periods allow (Note
    [fused kernel], "Split spans"), not per chunk. Off where holding them spills."""

    rows: int
    chunk: int
    num_warps: int
    span_counts: bool = True

    def counts_per_span(self, plan: TilePlan) -> bool:
        """The kernels' SPAN_COUNTS for `plan`: its counts repeat from chunk to chunk."""
        return self.span_counts and self.chunk % plan.period_lcm == 0

    def warps(self, block_m: int) -> int:
        """Warps of a launch of `block_m` rows (a plan's narrow tiles: fewer than `rows`):
        as many rows per warp as the tile, but at least 4 (or num_warps): in one or two a
        thread holds too much of the chunk's loads and products (d 128 spilled 4-260
        bytes at 255 registers on sm_80/86/120, benchmarks/cross_compile.py)."""
        return min(self.num_warps, max(4, self.num_warps * block_m // self.rows))


@dataclasses.dataclass(frozen=True)
class TileSizes:
    """The three kernels' tiles on one device, how many chunks ahead their loops load
    (Triton's num_stages), how many chunks each piece of a split span must keep
    (split_chunks; Note [fused kernel] in fused_plan.py, "Split spans"), the fewest
    rows a launch of narrow tiles may have (narrowest: tl.dot's least, 16; "Narrow tiles"),
    the windows in which a launch's tiles go heaviest first (order_window, in tiles; 0: cell
    by cell; "Tile order"), and the most programs a launch of a kernel for the non-finite
    rule has, over its batch rows (rule_programs), each taking every so many tiles. A
    finite call's rule kernels only read the check and return: with a program per tile
    they scheduled as many programs as the plain launch (98,304 per kernel at 1M tokens in
    LongNet's setting). 1,024 is several per SM on any GPU (132 on an H100), so
    that the rule's work still spreads where it runs; not timed.

    Eight chunks: a piece's partial last chunk and its loop's start (the loads' pipeline
    filling again) then cost at most about an eighth of a chunk's work more per piece,
    against a sixth of every chunk's instructions that a plan without counts saves
    (sm_90). A guess from that arithmetic, not timed yet."""

    forward: KernelTiles
    dq: KernelTiles
    dkdv: KernelTiles
    num_stages: int = 2
    split_chunks: int = 8
    narrowest: int = 16
    order_window: int = 0
    rule_programs: int = 1024

    def plan(self, kernel: str) -> Dict[str, Any]:
        """fused_plan.tile_plan's arguments for `kernel` ("forward", "dq" or "dkdv")."""
        tiles = getattr(self, kernel)
        return dict(block_m=tiles.rows, keys=kernel == "dkdv",
                    split_keys=self.split_chunks * tiles.chunk, narrowest=self.narrowest,
                    order_window=self.order_window)

    def for_dropout(self) -> "TileSizes":
        """The tiles of the kernels with attention dropout: each chunk halved (tl.dot's 16 at
        least). Philox's four words per pair of a chunk (triton_dropout.dropped) spilled at
        the portable tables' chunks (up to 168 bytes at 255 registers on sm_80 and sm_90,
        bf16, d 64 and 128: benchmarks/cross_compile.py --flags dropout
        causal+mask+dropout); halved, at most 40 bytes on any architecture, bf16, d 64 to
        256 (BENCHMARKS.md, "Dropout in the fused kernels"). Not timed."""
        def halved(tiles: KernelTiles) -> KernelTiles:
            return tiles._replace(chunk=max(16, tiles.chunk // 2))

        return dataclasses.replace(self, forward=halved(self.forward), dq=halved(self.dq),
                                   dkdv=halved(self.dkdv))

    def grid(self, tiles: Tensor, batch: int, rule: bool) -> Tuple[int, int]:
        """A launch's grid over `tiles` (T, 6) and `batch` rows: a program per tile, or
        (`rule`: a kernel for the non-finite rule) at most rule_programs in all."""
        count = tiles.shape[0]
        return (min(count, max(1, self.rule_programs // batch)) if rule else count), batch


# Triton's interpreter (CPU tensors) runs one numpy operation per block operation: fewer,
# larger blocks are faster there (16 is tl.dot's least size). Spans split where every piece
# fills a chunk (the tests' short sequences rarely do; tests/test_fused.py also forces it).
# Two programs of a rule kernel per batch row: every test of non-finite inputs runs its
# loop over several tiles. Tiles heaviest first in windows of three: every test runs the
# plans in an order other than cell by cell (the kernels must not depend on it).
INTERPRETER_TILE_SIZES = TileSizes(*[KernelTiles(32, 32, num_warps=1)] * 3, num_stages=1,
                                   split_chunks=1, order_window=3, rule_programs=2)

# CUDA, by the dot products' kind (fp16/bf16 "half"; fp32 on tensor cores "tf32", or on CUDA
# cores "ieee") and the head dim padded to a power of two (64 at least, 256 at most). Each
# kernel's tile began as the largest (rows, then chunk; then fewer warps) that spilled
# nothing on sm_80 and sm_90 in the hungriest case, and was made smaller where needed until
# it compiles, with its loop pipelined, for each of six architectures: A100 (sm_80),
# consumer Ampere and Ada (sm_86, sm_89), H100/H200 (sm_90), B200 (sm_100), consumer
# Blackwell (sm_120). So it fits the 99 KiB of shared memory a block has on sm_86/89/120 (a
# bigger one would not launch there: Triton's OutOfResources) and does not spill at 255
# registers a thread, with and without causal and a padding mask, three extra counts per
# span or one (benchmarks/cross_compile.py; tests/test_cross_compile.py checks bf16 in CI).
# Where ptxas gives a kernel fewer registers on its own (for occupancy) it may spill a few
# bytes. They are the tiles of every GPU whose capability has no timed entry below
# (TUNED_TILE_SIZES, from benchmarks/tune_tiles.py; on the H100 these were 1.2-2x slower).
# The largest head dim the tables have tiles for (backends.select_backend refuses more).
MAX_HEAD_DIM = 256
CUDA_TILE_SIZES = {
    ("half", 64): TileSizes(KernelTiles(128, 32, 8), KernelTiles(128, 32, 8),
                            KernelTiles(64, 32, 8)),
    # the forward's span counts would spill 4-44 bytes (sm_80, 86, 89, 120)
    ("half", 128): TileSizes(KernelTiles(128, 32, 8, span_counts=False), KernelTiles(64, 32, 4),
                             KernelTiles(64, 32, 8)),
    ("half", 256): TileSizes(KernelTiles(64, 32, 8), KernelTiles(32, 32, 4),
                             KernelTiles(32, 32, 8)),
    ("tf32", 64): TileSizes(KernelTiles(128, 16, 8), KernelTiles(128, 16, 8),
                            KernelTiles(32, 64, 8)),
    ("tf32", 128): TileSizes(KernelTiles(64, 32, 8), KernelTiles(32, 32, 4),
                             KernelTiles(32, 32, 8)),
    # dq in 8 warps: in 4, LongNet's split spans (no counts) spilled 8 bytes at 255 on sm_80
    ("tf32", 256): TileSizes(KernelTiles(32, 16, 8), KernelTiles(16, 16, 8),
                             KernelTiles(16, 16, 8)),
    ("ieee", 64): TileSizes(KernelTiles(32, 16, 8), KernelTiles(16, 32, 8),
                            KernelTiles(32, 32, 8)),
    ("ieee", 128): TileSizes(KernelTiles(32, 16, 4), KernelTiles(16, 32, 4),
                             KernelTiles(32, 16, 8)),
    ("ieee", 256): TileSizes(KernelTiles(16, 16, 4), KernelTiles(16, 16, 4),
                             KernelTiles(16, 16, 4)),
}


# Tiles timed on a GPU (benchmarks/tune_tiles.py: candidates in the op, bf16, 64K tokens,
# LongNet's setting), by compute capability: there they replace CUDA_TILE_SIZES' portable
# entry. sm_90 (H100): 4 warps and 3 stages were the fastest for all three kernels (d 64:
# the whole backward 0.48 of the portable tiles' time, the forward 0.80; d 128: forward
# 0.67, backward about 0.5; BENCHMARKS.md, "Tuning the tiles"), although ptxas spills up to
# a few hundred bytes at 255 registers in them, which the portable table avoids (the spill
# rule of benchmarks/cross_compile.py stands in for a timing where there is none).
TUNED_TILE_SIZES = {
    ((9, 0), "half", 64): TileSizes(KernelTiles(128, 64, 4), KernelTiles(128, 64, 4),
                                    KernelTiles(128, 32, 4), num_stages=3),
    ((9, 0), "half", 128): TileSizes(KernelTiles(128, 32, 4), KernelTiles(128, 32, 4),
                                     KernelTiles(64, 32, 4), num_stages=3),
}


def tile_sizes(device: torch.device, dtype: torch.dtype, head_dim: int,
               dropout: bool = False) -> TileSizes:
    """The tile sizes of the fused kernels for a call on `device` (Triton's interpreter
    anywhere but CUDA), with attention dropout or not."""
    if device.type != "cuda":
        return INTERPRETER_TILE_SIZES.for_dropout() if dropout else INTERPRETER_TILE_SIZES
    return cuda_tile_sizes(_capability(device), dtype, head_dim, dropout)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Tuple[int, int]:
    """A GPU's compute capability, fixed for the process (as validation.signature takes
    it): torch looks it up again on every call, in the host time before a call's first
    launch."""
    return torch.cuda.get_device_capability(device)


def cuda_tile_sizes(capability: Tuple[int, int], dtype: torch.dtype, head_dim: int,
                    dropout: bool = False) -> TileSizes:
    """The tiles on a GPU of compute `capability`: a timed entry where there is one, else
    the portable one. With attention dropout the portable one's (TileSizes.for_dropout):
    the timed entries were timed without it, and on sm_90 their 4-warp tiles spilled up to
    448 bytes with it at 255 registers, chunks halved (benchmarks/cross_compile.py)."""
    key = cuda_tile_key(dtype, head_dim)
    if dropout:
        return CUDA_TILE_SIZES[key].for_dropout()
    return TUNED_TILE_SIZES.get((tuple(capability),) + key, CUDA_TILE_SIZES[key])


def cuda_tile_key(dtype: torch.dtype, head_dim: int) -> Tuple[str, int]:
    """The CUDA_TILE_SIZES entry of a call: its products' kind and padded head dim."""
    kind = "half" if dtype in (torch.float16, torch.bfloat16) else _precision(dtype)
    return kind, min(max(_head_block(head_dim), 64), MAX_HEAD_DIM)


def _kernels(device: torch.device):
    """The Triton kernels, checked to run on `device` (CPU: only interpreted ones)."""
    from . import triton_kernels

    interpreted = type(triton_kernels.fused_forward).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "backend='triton' on CPU tensors runs Triton's interpreter, but dilated_attention's "
            "Triton kernels were created for a GPU: TRITON_INTERPRET=1 was not in the "
            f"environment when they were first used in this process (it is "
            f"{os.environ.get('TRITON_INTERPRET')!r} now). Set it before the first call."
        )
    return triton_kernels


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 products as torch would compute them (full fp32
    unless torch.set_float32_matmul_precision allows TF32); half precision is exact anyway."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _head_block(d: int) -> int:
    """The head dim padded to a power of two, at least tl.dot's 16."""
    return max(16, 1 << (d - 1).bit_length())


def _rule_last(plan: TilePlan, nonfinite: Optional[Tensor]
               ) -> Tuple[Tuple[bool, List[Tuple[Tensor, int]]], ...]:
    """(NONFINITE, its launches) of a forward: the plain kernel's, one per tile height, then
    (with a `nonfinite` check and a tile) the rule's variant in one launch over every tile
    at the plan's widest height (a narrower tile is the same with fewer of its rows real)."""
    plain = (False, plan.launches())
    if nonfinite is None or not plan.heights:
        return (plain,)
    return plain, (True, [(plan.tiles, plan.block_m)])


def _mask_arg(mask: Optional[Tensor], fallback: Tensor) -> Tuple[Tensor, Tuple[int, int, int]]:
    """A key padding mask (b, m, hk) as the kernels read it (bytes, its strides), or a
    placeholder pointer with zero strides."""
    if mask is None:
        return fallback, (0, 0, 0)
    return mask.view(torch.uint8), mask.stride()


# Note [fused dropout]
#     docs/spec.md's dropout drops each pattern's probabilities independently. Merged by
#     the count form (Note [fused kernel] in fused_plan.py), a pair (t, u) that m patterns
#     select weighs exp(s - lse) * (the patterns that keep it) / (1 - p) in the output. A
#     kernel visits the pair once per span that reaches it, with the bits of the patterns
#     that span counts there (fused_plan.TilePlan), and pattern i keeps the pair where the
#     31 high bits of Philox word i mod 4 of counter (t, u, batch row, query head * 8 +
#     i // 4) under the call's key are at least p * 2^31 (triton_dropout.dropped): a
#     function of the pair and the pattern alone, so the forward, dq and dK/dV, which tile
#     the pairs differently, draw the same masks, and the patterns draw theirs
#     independently. Rows and heads are the sequence's (Dropout.first_row, first_head):
#     a sequence-parallel rank's piece and a head-parallel rank's heads draw what one
#     device would draw for those pairs under the same key (ranks whose generators agree
#     draw the same key), and no two ranks draw alike for different pairs. The lse keeps
#     every key. The key is an int64 drawn on the device from torch's generator
#     (`new_seed`): torch.manual_seed fixes the masks, no host sync, and a CUDA graph
#     replays a new draw. Backward: ds = dropped(p) * dp - p * delta, dV from the dropped
#     p. At most fused_plan.MAX_MASK_PATTERNS patterns (the masks' bits). One block of
#     plain attention (`dense_forward`: a sequence-parallel launch on received keys) is
#     one pattern whose key is the launch's own (`launch_seed`), its rows the block's.


class Dropout(NamedTuple):
    """Attention dropout in the fused kernels (Note [fused dropout]): a pattern keeps a pair
    where its 31 random bits are at least `threshold`, and the kept ones weigh keep_scale
    (1 / the probability of keeping); patterns: the call's count (the kernels unroll their
    draws); seed: (1,) int64 on the device, the Philox key; first_row, first_head: the
    sequence's row and head of the tensors' first (a sequence-parallel piece, a
    head-parallel rank's heads), what the masks count from."""

    threshold: int
    keep_scale: float
    patterns: int
    seed: Tensor
    first_row: int = 0
    first_head: int = 0

    @classmethod
    def of(cls, dropout_p: float, patterns: int, seed: Tensor, *,
           first_head: int = 0) -> "Dropout":
        threshold = int(dropout_p * 2**31)
        return cls(threshold, 2**31 / (2**31 - threshold), patterns, seed, 0, first_head)

    def key(self) -> Tuple[int, float, int, int, int]:
        """What the launches' numbers are of (the seed goes as a tensor)."""
        return self.threshold, self.keep_scale, self.patterns, self.first_row, self.first_head


def check_dropout_patterns(count: int) -> None:
    """A ValueError unless the kernels' dropout can draw for `count` patterns (a bit each)."""
    if count > MAX_MASK_PATTERNS:
        raise ValueError(
            f"backend 'triton' applies dropout to at most {MAX_MASK_PATTERNS} patterns (a bit "
            f"each in its masks), got {count} patterns; use backend='blockwise' or 'auto'")


def new_seed(device: torch.device) -> Tensor:
    """A dropout call's Philox key: (1,) int64 from `device`'s generator."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def launch_seed(seed: int, device: torch.device) -> Tensor:
    """The Philox key of one launch whose seed the host holds (kernels.KernelOptions: a
    sequence-parallel launch's own), as the kernels take it: one fill, no copy."""
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def _dropout_args(dropout: Optional[Dropout], fallback: Tensor
                  ) -> Tuple[Tensor, int, float, int, int, int]:
    """(Seed, threshold, keep_scale, first_row, first_head, PATTERNS) of a launch; PATTERNS
    0 without dropout."""
    if dropout is None:
        return fallback, 0, 1.0, 0, 0, 0
    return (dropout.seed, dropout.threshold, dropout.keep_scale, dropout.first_row,
            dropout.first_head, dropout.patterns)


# --------------------------------------------------------------------------
# The single-device op, and one block of plain attention (kernels.attention_forward /
# attention_backward). A planner(**TileSizes.plan(kernel)) gives the plan on the device;
# the launches ask for it only when they run (not for an empty call, nor on meta tensors).

Planner = Callable[..., TilePlan]


def forward(q: Tensor, k: Tensor, v: Tensor, patterns: Patterns, *, causal: bool, scale: float,
            heads: Heads, documents: Documents, key_mask: Optional[Tensor],
            piece: Optional[Tuple[int, int]] = None,
            nonfinite: Optional[Tensor] = None,
            into: Optional[Tuple[Tensor, Tensor]] = None,
            dropout: Optional[Dropout] = None) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d), key_mask (b, n) or None -> out, lse (b, n, h).

    piece (first row, total rows): q, k, v are rows [first, first + n) of a longer sequence
    (a sequence-parallel rank's); out and lse are then those rows' attention over these
    keys alone (tile_plan's window), a part to merge with the other keys' by the lse.

    nonfinite: a float32 (1,) of 0 on the device (`new_check`), which the plain kernel
    makes NaN where a q row, an out or a k row is not finite: where it is not finite, the
    kernels' variant that applies docs/spec.md's non-finite rule runs too (no host sync:
    its programs read it). None: the caller has replaced non-finite rows
    (functional._nonfinite_keys), as the sequence-parallel paths do.

    into: (out, lse) to write instead of new tensors, views of larger ones allowed (the
    kernels write through strides): a zigzag rank's chunks write one output.

    dropout: attention dropout (Note [fused dropout]; with a piece its masks count from
    the piece's first row)."""
    return _forward(q, k, v, _planner(q, k, patterns, causal, heads, documents, piece), causal,
                    scale, _per_kv_head(key_mask, k), nonfinite, into, _in_piece(dropout, piece))


def new_check(device: torch.device) -> Tensor:
    """A check for `forward`'s `nonfinite` (then `backward`'s): finite until a kernel finds a
    NaN or an infinity in its inputs. One fill on the device (the kernels read every input
    themselves: no reduction, no read-back)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             dlse: Optional[Tensor], patterns: Patterns, *, causal: bool, scale: float,
             heads: Heads, documents: Documents, key_mask: Optional[Tensor],
             piece: Optional[Tuple[int, int]] = None,
             nonfinite: Optional[Tensor] = None,
             into: Optional[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]] = None,
             kv_grad: bool = True, dropout: Optional[Dropout] = None
             ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of `forward` from the final out and lse (dlse (b, n, h): the gradient of
    lse); with a `piece`, those of its pairs (rows and keys both in it); nonfinite: the
    forward's check; into: (dq, dk, dv) to write, as `forward`'s (dk, dv None: dq alone).
    kv_grad False (k and v frozen; without `into`): dq alone, dk and dv None, no dK/dV
    kernel. dropout: the forward's."""
    return _backward(dout, q, k, v, out, lse, dlse,
                     _planner(q, k, patterns, causal, heads, documents, piece), causal, scale,
                     _per_kv_head(key_mask, k), nonfinite, into, kv_grad,
                     _in_piece(dropout, piece))


def _planner(q: Tensor, k: Tensor, patterns: Patterns, causal: bool, heads: Heads,
             documents: Documents, piece: Optional[Tuple[int, int]]) -> Planner:
    first, total = piece or (0, q.shape[1])
    return functools.partial(tile_plan, total, patterns, heads, k.shape[2], causal, documents,
                             device=str(q.device), window=(first, first + q.shape[1]))


def _in_piece(dropout: Optional[Dropout], piece: Optional[Tuple[int, int]]
              ) -> Optional[Dropout]:
    """The dropout of a piece's call: its masks count from the piece's first row."""
    if dropout is None or piece is None:
        return dropout
    return dropout._replace(first_row=piece[0])


def _per_kv_head(key_mask: Optional[Tensor], k: Tensor) -> Optional[Tensor]:
    """(b, n) -> (b, n, hk), a view: the kernels read a mask per key/value head."""
    return None if key_mask is None else key_mask[:, :, None].expand(-1, -1, k.shape[2])


def dense_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                  key_mask: Optional[Tensor], dropout: Optional[Dropout] = None
                  ) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d) against k/v (b, m, hk, d) (n == m when causal: the square lower
    triangle); key_mask (b, m, hk) -> out (b, n, h, d), lse (b, n, h). dropout: of one
    pattern (Note [fused dropout])."""
    return _forward(q, k, v, _dense_planner(q, k, causal), causal, scale, key_mask, None,
                    dropout=dropout)


def dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dlse: Optional[Tensor], *, causal: bool, scale: float,
                   key_mask: Optional[Tensor], dropout: Optional[Dropout] = None,
                   kv_grad: bool = True) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of `dense_forward`, given the final (merged) out and lse; without
    `kv_grad`, dq alone (as `backward`'s)."""
    return _backward(dout, q, k, v, out, lse, dlse, _dense_planner(q, k, causal), causal, scale,
                     key_mask, None, kv_grad=kv_grad, dropout=dropout)


def _dense_planner(q: Tensor, k: Tensor, causal: bool) -> Planner:
    hk = k.shape[2]

    def planner(block_m: int, keys: bool, split_keys: int, narrowest: int,
                order_window: int) -> TilePlan:
        # one span per head of all the other side's rows, no extras: nothing to split, and
        # every tile full but the last
        return dense_plan(q.shape[1], k.shape[1], Heads.of(q.shape[2], hk), hk, block_m, keys,
                          device=str(q.device), causal=causal, order_window=order_window)

    return planner


# --------------------------------------------------------------------------
# Launches


def _forward(q: Tensor, k: Tensor, v: Tensor, planner: Planner, causal: bool, scale: float,
             mask: Optional[Tensor], nonfinite: Optional[Tensor],
             into: Optional[Tuple[Tensor, Tensor]] = None,
             dropout: Optional[Dropout] = None) -> Tuple[Tensor, Tensor]:
    b, n, h, d = q.shape
    out, lse = into or (torch.empty((b, n, h, d), dtype=q.dtype, device=q.device),
                        torch.empty((b, n, h), dtype=torch.float32, device=q.device))
    if out.numel() == 0 or q.device.type == "meta":
        return out, lse
    sizes = tile_sizes(q.device, q.dtype, d, dropout is not None)
    plan = planner(**sizes.plan("forward"))
    has_mask = mask is not None
    mask, mask_strides = _mask_arg(mask, lse)
    check = lse if nonfinite is None else nonfinite
    seed, threshold, keep_scale, first_row, first_head, patterns = _dropout_args(dropout, lse)
    # the call's tensors, and what decides every other argument of its launches
    tensors = (q, k, v, out, lse, mask, check, seed)
    key = ("forward", id(plan), sizes, causal, scale, _precision(q.dtype), has_mask,
           nonfinite is None, None if dropout is None else dropout.key())
    if RECIPES.replay(key, tensors):
        return out, lse
    kernels = _kernels(q.device)
    record = RECIPES.recorder(key, tensors, kept=(plan,))
    launch = record(kernels.fused_forward)
    # a plan has a tile for every (row, head): none only for an empty sequence. One launch
    # per tile height, the plain one completing the check (REPORT), the first launch's
    # programs reading every row of k for it; then the rule's variant over every tile at
    # once (it overwrites them where it runs)
    for rule, launches in _rule_last(plan, nonfinite):
        report = not rule and nonfinite is not None
        for i, (tiles, block_m) in enumerate(launches):
            launch[sizes.grid(tiles, b, rule)](
                q, k, v, out, lse, mask, check, seed, tiles, plan.rows, plan.spans,
                plan.extras, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *lse.stride(), *mask_strides, d, scale * kernels.LOG2E,
                k.shape[1] if report and i == 0 else 0, k.shape[2], threshold, keep_scale,
                first_row, first_head, tiles.shape[0], CAUSAL=causal, HAS_MASK=has_mask,
                PRECISION=_precision(q.dtype), EXTRAS=plan.max_extras,
                POW2_PERIODS=plan.pow2_periods, SPAN_COUNTS=sizes.forward.counts_per_span(plan),
                NONFINITE=rule, REPORT=report, PATTERNS=patterns, BLOCK_M=block_m,
                BLOCK_N=sizes.forward.chunk, BLOCK_D=_head_block(d),
                num_warps=sizes.forward.warps(block_m), num_stages=sizes.num_stages,
                **COMPILE_OPTIONS,
            )
    record.keep()
    return out, lse


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              dlse: Optional[Tensor], planner: Planner, causal: bool, scale: float,
              mask: Optional[Tensor], nonfinite: Optional[Tensor],
              into: Optional[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]] = None,
              kv_grad: bool = True, dropout: Optional[Dropout] = None
              ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    b, n, h, d = q.shape
    # in each input's layout where it is dense (what autograd's accumulation keeps as is);
    # the kernels write through strides. Frozen k and v (not kv_grad): no dK/dV
    if into is not None:
        dq, dk, dv = into
    else:
        dq = torch.empty_like(q)
        dk, dv = (torch.empty_like(k), torch.empty_like(v)) if kv_grad else (None, None)
    # delta shares lse's (contiguous) strides in the kernels; on meta tensors (estimate's
    # dry run) it is made all the same, as what the launches hold
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty_like(lse)
    if q.device.type == "meta" or b == 0 or h == 0 or d == 0:
        return dq, dk, dv
    sizes = tile_sizes(q.device, q.dtype, d, dropout is not None)
    queries = planner(**sizes.plan("dq"))
    keys = planner(**sizes.plan("dkdv"))
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    dlse_arg = lse if dlse is None else dlse.to(torch.float32)
    has_mask = mask is not None
    mask, mask_strides = _mask_arg(mask, lse)
    # where there is no dK/dV the rule's kernel takes dq's pointer and strides for them,
    # unread: it visits no key tile
    dk_arg, dv_arg = (dq, dq) if dk is None else (dk, dv)
    key_tiles = keys.tiles.shape[0] if dk is not None else 0
    seed, threshold, keep_scale, first_row, first_head, patterns = _dropout_args(dropout, lse)
    # as the forward's (_forward)
    tensors = (q, k, v, out, dout, lse, dlse_arg, delta, dq, dk_arg, dv_arg, mask,
               lse if nonfinite is None else nonfinite, seed)
    key = ("backward", id(queries), id(keys), sizes, causal, scale, _precision(q.dtype),
           has_mask, dlse is None, nonfinite is None, key_tiles > 0,
           None if dropout is None else dropout.key())
    if RECIPES.replay(key, tensors):
        return dq, dk, dv
    kernels = _kernels(q.device)
    record = RECIPES.recorder(key, tensors, kept=(queries, keys))
    launch_dq, launch_dkdv = record(kernels.fused_dq), record(kernels.fused_dkdv)
    flags = dict(CAUSAL=causal, HAS_MASK=has_mask, PRECISION=_precision(q.dtype),
                 PATTERNS=patterns, BLOCK_D=_head_block(d), num_stages=sizes.num_stages,
                 **COMPILE_OPTIONS)
    for tiles, block_m in queries.launches():
        launch_dq[sizes.grid(tiles, b, False)](
            q, k, v, out, dout, lse, dlse_arg, delta, dq, mask, seed, tiles, queries.rows,
            queries.spans, queries.extras,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *dout.stride(),
            *lse.stride(), *dlse_arg.stride(), *dq.stride(), *mask_strides,
            d, scale * kernels.LOG2E, scale, threshold, keep_scale, first_row, first_head,
            HAS_DLSE=dlse is not None, EXTRAS=queries.max_extras,
            POW2_PERIODS=queries.pow2_periods, SPAN_COUNTS=sizes.dq.counts_per_span(queries),
            BLOCK_M=block_m, BLOCK_N=sizes.dq.chunk, num_warps=sizes.dq.warps(block_m),
            **flags,
        )
    for tiles, block_m in keys.launches() if key_tiles else ():
        launch_dkdv[sizes.grid(tiles, b, False)](
            q, k, v, dout, lse, delta, dk, dv, mask, seed, tiles, keys.rows, keys.spans,
            keys.extras, *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
            *dk.stride(), *dv.stride(), *mask_strides,
            d, scale * kernels.LOG2E, scale, threshold, keep_scale, first_row, first_head,
            EXTRAS=keys.max_extras, POW2_PERIODS=keys.pow2_periods,
            SPAN_COUNTS=sizes.dkdv.counts_per_span(keys),
            BLOCK_M=block_m, BLOCK_N=sizes.dkdv.chunk, num_warps=sizes.dkdv.warps(block_m),
            **flags,
        )
    if nonfinite is not None and queries.heights:
        # the rule's dq and dK/dV in one launch (triton_kernels' module docstring), after
        # the plain kernels, whose delta it reads; its programs loop over both plans' tiles
        most = queries.tiles if len(queries.tiles) >= key_tiles else keys.tiles
        record(kernels.fused_backward_rule)[sizes.grid(most, b, True)](
            q, k, v, out, dout, lse, dlse_arg, delta, dq, dk_arg, dv_arg, mask, nonfinite, seed,
            queries.tiles, queries.rows, queries.spans, queries.extras,
            keys.tiles, keys.rows, keys.spans, keys.extras,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *dout.stride(),
            *lse.stride(), *dlse_arg.stride(), *dq.stride(), *dk_arg.stride(),
            *dv_arg.stride(), *mask_strides, d, scale * kernels.LOG2E, scale, threshold,
            keep_scale, first_row, first_head, queries.tiles.shape[0], key_tiles,
            HAS_DLSE=dlse is not None,
            QUERY_EXTRAS=queries.max_extras, QUERY_POW2_PERIODS=queries.pow2_periods,
            QUERY_SPAN_COUNTS=sizes.dq.counts_per_span(queries), QUERY_BLOCK_M=queries.block_m,
            QUERY_BLOCK_N=sizes.dq.chunk, KEY_EXTRAS=keys.max_extras,
            KEY_POW2_PERIODS=keys.pow2_periods, KEY_SPAN_COUNTS=sizes.dkdv.counts_per_span(keys),
            KEY_BLOCK_M=keys.block_m, KEY_BLOCK_N=sizes.dkdv.chunk,
            num_warps=max(sizes.dq.num_warps, sizes.dkdv.num_warps), **flags,
        )
    record.keep()
    return dq, dk, dv
