"""``merge.merge_`` as one Triton kernel: read both sides once, write the accumulators once.

The chain of eager ops in ``merge.merge_`` (logaddexp, two exps, a mul_, an
addcmul_, copies) is several full passes over the accumulator plus fp32
temporaries; on a GPU the merges are memory-bound, so one pass matters (an
H100 profile of a 1M-token forward spent 12.2 ms of 50.5 in the chain). The
kernel computes the same function with the same operations, in fp32,
rounding the output once:

    new = logaddexp(acc_lse, lse);  top = max(acc_lse, lse), or 0 where it is -inf
    w_acc, w_out = exp(acc_lse - top), exp(lse - top), each divided by their sum
    acc_out = acc_out * w_acc + out * w_out

Imported only where it runs (``merge.merge_`` on CUDA tensors when triton is
installed): triton is optional, and whether ``@triton.jit`` makes compiled or
interpreted kernels is decided when this module is imported
(TRITON_INTERPRET=1 at that moment gives the interpreter, which runs on CPU
tensors: that is how the tests check it).

Notation: R rows (every leading index of the (..., d) tensors), d head dim;
BLOCK_R rows and BLOCK_D columns (d padded to a power of two) per program.
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_launch import COMPILE_OPTIONS

# Leading dims the kernel indexes through their strides: every caller's shape fits
# ((b, segments, rows, heads, d) at most); views need no copy whatever their strides.
MAX_DIMS = 4
# Elements (rows x the head dim padded to a power of two) per program: on a GPU 4,096 (64
# rows of 64), 16 KB of fp32 per tensor side, 32 elements per thread of each side, which
# leaves no register spilled up to d = 256 on sm_80 and sm_90 (benchmarks/cross_compile.py);
# the interpreter (CPU tensors, tests) runs a program as numpy operations, so fewer, larger
# programs are faster there.
BLOCK_ELEMENTS = {"cuda": 4096, "cpu": 65536}


@triton.jit
def _offsets(r, n1, n2, n3, s0, s1, s2, s3):
    """Element offsets (int64) of leading indices r (BLOCK_R,) in one tensor: r decomposed
    over the sizes (n0, n1, n2, n3) (the last fastest), dotted with that tensor's strides s.
    In int32 where r is (WIDE_ROWS off): a GPU divides 64-bit integers in a called
    subroutine, and the calls made the kernel spill (benchmarks/cross_compile.py)."""
    i3 = r % n3
    r = r // n3
    i2 = r % n2
    r = r // n2
    return ((r // n1).to(tl.int64) * s0 + (r % n1).to(tl.int64) * s1 + i2.to(tl.int64) * s2
            + i3.to(tl.int64) * s3)


# Every integer is specialised as Triton does by default (1, a multiple of 16, or neither:
# a few compiles, not one per shape). The strides' hints are what make each row's elements
# one vector load: without them every element needed its own 64-bit address (255
# registers and 1,224 bytes spilled on sm_90, benchmarks/cross_compile.py).
@triton.jit
def _merge_kernel(acc_out, acc_lse, out, lse, rows, d, n1, n2, n3,
                  ao0, ao1, ao2, ao3, ao4, al0, al1, al2, al3, al4,
                  o0, o1, o2, o3, o4, l0, l1, l2, l3, l4,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                  WIDE_ROWS: tl.constexpr):
    """One program: BLOCK_R rows of all four tensors. Strides: ao acc_out, al acc_lse, o out,
    l lse; 0-3 the leading dims, 4 the last (unused for the lse tensors). WIDE_ROWS: the
    rows are counted in int64 (2^31 rows or more)."""
    if WIDE_ROWS:
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    else:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    r = tl.where(row_ok, r, 0)
    acc_lse_ptr = acc_lse + _offsets(r, n1, n2, n3, al0, al1, al2, al3)
    a = tl.load(acc_lse_ptr, mask=row_ok, other=0.0)
    b = tl.load(lse + _offsets(r, n1, n2, n3, l0, l1, l2, l3), mask=row_ok,
                other=0.0).to(tl.float32)
    # logaddexp as torch computes it: max + log1p(exp(-|a - b|)); equal infinities stay
    m = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    both_inf = (a == b) & (tl.abs(a) == float("inf"))
    gap = tl.abs(tl.where(both_inf, 0.0, a) - tl.where(both_inf, 0.0, b))  # no inf - inf
    new = tl.where(both_inf, a, m + _log1p(tl.exp(-gap)))
    # the weights against the larger side, divided by their sum (merge._weights: out does
    # not inherit the rounding of `new`); a row with no keys on either side gets weights 0
    top = tl.where(m == -float("inf"), 0.0, m)
    w_acc = tl.exp(a - top)
    w_out = tl.exp(b - top)
    total = w_acc + w_out
    total = tl.where(total == 0.0, 1.0, total)
    w_acc = w_acc / total
    w_out = w_out / total
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    ok = row_ok[:, None] & (cols < d)[None, :]
    acc_ptr = (acc_out + _offsets(r, n1, n2, n3, ao0, ao1, ao2, ao3)[:, None]
               + cols[None, :] * ao4)
    out_ptr = out + _offsets(r, n1, n2, n3, o0, o1, o2, o3)[:, None] + cols[None, :] * o4
    acc = tl.load(acc_ptr, mask=ok, other=0.0)
    x = tl.load(out_ptr, mask=ok, other=0.0).to(tl.float32)
    merged = acc.to(tl.float32) * w_acc[:, None] + x * w_out[:, None]
    if BF16:
        tl.store(acc_ptr, _round_bf16(merged), mask=ok)
    else:
        tl.store(acc_ptr, merged.to(acc.dtype), mask=ok)
    tl.store(acc_lse_ptr, new, mask=row_ok)


@triton.jit
def _round_bf16(x):
    """fp32 -> bf16 rounded to nearest, ties to even, as torch and a GPU's conversion do,
    spelled out in integer ops: Triton's interpreter truncates (3.9), and the tests run
    the kernel there. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x == x, rounded, x.to(tl.bfloat16))


@triton.jit
def _log1p(x):
    """log(1 + x) for x in [0, 1], accurate for small x (no libdevice: the interpreter
    and every Triton version run it): log(u) * x / (u - 1) with u = 1 + x (Goldberg)."""
    u = 1.0 + x
    exact = u == 1.0
    return tl.where(exact, x, tl.log(u) * x / tl.where(exact, 1.0, u - 1.0))


def supports(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> bool:
    """Whether the kernel computes this merge: fp32 accumulators (fp64 stays eager), at most
    MAX_DIMS leading dims, matching shapes."""
    return (acc_lse.dtype == torch.float32 and acc_out.dim() - 1 <= MAX_DIMS
            and acc_out.shape == out.shape and acc_lse.shape == lse.shape == acc_out.shape[:-1])


def _strides(x: Tensor, leading: int) -> List[int]:
    """x's strides: MAX_DIMS leading ones (zeros in front for missing dims), then the last
    (0 for a tensor with no last dim of its own, the lse)."""
    strides = list(x.stride())
    last = strides.pop() if x.dim() > leading else 0
    return [0] * (MAX_DIMS - leading) + strides[:leading] + [last]


@torch.no_grad()
def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """``merge.merge_`` in one kernel: acc_out (..., d) fp32 or the output's own dtype,
    acc_lse (...) fp32; out (..., d) any float dtype, lse (...). In place, on any strides
    (``supports`` says which calls it takes)."""
    leading = acc_out.dim() - 1
    rows = acc_lse.numel()
    if rows == 0:
        return
    d = acc_out.shape[-1]
    sizes = [1] * (MAX_DIMS - leading) + list(acc_out.shape[:-1])
    strides = [s for x in (acc_out, acc_lse, out, lse) for s in _strides(x, leading)]
    block_d = max(16, triton.next_power_of_2(d))
    block = max(1, BLOCK_ELEMENTS.get(acc_out.device.type, BLOCK_ELEMENTS["cuda"]) // block_d)
    _merge_kernel[(triton.cdiv(rows, block),)](
        acc_out, acc_lse, out, lse, rows, d, *sizes[1:], *strides, BLOCK_R=block,
        BLOCK_D=block_d, BF16=acc_out.dtype == torch.bfloat16,
        WIDE_ROWS=rows + block >= 2**31, **COMPILE_OPTIONS)
