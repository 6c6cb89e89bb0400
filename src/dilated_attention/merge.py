"""The one log-sum-exp merge of partial attention results.

Dilation patterns and ring steps both produce partial results ``(out_i,
lse_i)`` over disjoint sets of keys; the exact attention over their union is

    lse = logsumexp_i(lse_i),   out = sum_i exp(lse_i - lse) * out_i.

The merge runs in place on fp32 accumulators (fp64 for fp64 inputs), its
weights normalised by their sum (`_weights`: the merged out does not inherit
the rounding of the merged lse), and is never differentiated: backward passes
recompute each block's softmax from the merged ``out``/``lse`` (see
kernels.attention_backward), which is exact.

On a GPU the merge is one Triton kernel where triton is installed
(merge_kernel.py: one read of each side, one write, no fp32 temporaries),
else the chain of eager ops below; both compute the same function in fp32.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Tuple

import torch
from torch import Tensor

from .kernels import lse_dtype

# Whether a device type's merges run the Triton kernel (when triton is installed and the
# device runs it): the eager chain costs several passes over the accumulators and their
# fp32 temporaries, which on a GPU are memory-bound launches. Not on CPU: there the
# chain's ops are a few percent of a call, and Triton runs only interpreted.
MERGE_KERNEL = {"cuda": True}
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def empty_accumulators(shape_out, dtype: torch.dtype, device) -> Tuple[Tensor, Tensor]:
    """Zeros ``out`` (..., d) and ``-inf`` ``lse`` (...): the merge's identity."""
    acc = lse_dtype(dtype)
    out = torch.zeros(shape_out, dtype=acc, device=device)
    lse = torch.full(shape_out[:-1], -math.inf, dtype=acc, device=device)
    return out, lse


@torch.no_grad()
def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """``(acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse))`` in place.

    acc_out (..., d) fp32/fp64, acc_lse (...); out (..., d) any float dtype,
    lse (...). Rows where both sides are -inf stay (0, -inf), never NaN.
    An acc_out in a lower precision than acc_lse (an output that is its own
    accumulator, policy.in_output) merges through an fp32 copy, rounded once.
    """
    if _use_kernel(acc_out.device):
        from . import merge_kernel

        if merge_kernel.supports(acc_out, acc_lse, out, lse):
            merge_kernel.merge_(acc_out, acc_lse, out, lse)
            return
    if lse.dtype != acc_lse.dtype:
        lse = lse.to(acc_lse.dtype)
    w_acc, w_new = _weights(acc_lse, lse)
    # the merged lse straight into acc_lse, read last by the weights (no temporary and copy)
    torch.logaddexp(acc_lse, lse, out=acc_lse)
    merged = acc_out if acc_out.dtype == acc_lse.dtype else acc_out.to(acc_lse.dtype)
    merged.mul_(w_acc.unsqueeze(-1))
    merged.addcmul_(out, w_new.unsqueeze(-1))
    if merged is not acc_out:
        acc_out.copy_(merged)


def _weights(acc_lse: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    """The two sides' weights (...) in a merge: exp(lse_i - lse), computed against the larger
    side's lse and divided by their sum, not against the merged lse.

    The merged lse is rounded to its dtype, an error of up to half an ulp of |lse| (fp32,
    scores ~ 200: 7.6e-6), and exp(lse_i - lse) would pass it on to both weights alike: a
    scale error on the whole merged row, larger than the kernels' own error on such rows.
    Against the larger side, one weight is 1 and the other exact to an ulp or two; their
    sum is what the merged lse rounds, and dividing by it leaves out without that rounding
    (as a flash kernel keeps its running max and sum apart). A row that no side has keys
    for gets weights 0 (never NaN).
    """
    # One op where the chain had a comparison and a masked_fill (a copy): -inf becomes the
    # dtype's least finite value, not 0, which gives the same weights (exp(-inf - top) is 0
    # for any finite top); finite tops and NaN pass unchanged. In place on fresh temporaries.
    # With merge_'s lse written in place: 7 ops fewer a merge, bit for bit the same; a
    # decode step's merge of (1, 1, 2, 16) took 30 -> 22 us (one CPU thread), and a tiny
    # LongNetLM decode step (8 merges) about 10% less.
    top = torch.maximum(acc_lse, lse).clamp_min_(torch.finfo(acc_lse.dtype).min)
    w_acc, w_new = torch.sub(acc_lse, top).exp_(), torch.sub(lse, top).exp_()
    # in [1, 2] (the larger side's weight is exactly 1), or 0 where neither side has keys,
    # which becomes 1; NaN stays NaN
    total = torch.add(w_acc, w_new).clamp_min_(1.0)
    return w_acc.div_(total), w_new.div_(total)


@torch.no_grad()
def merge_selected_(acc_out: Tensor, acc_lse: Tensor, index: tuple, out: Tensor,
                    lse: Tensor) -> None:
    """`merge_` into the entries ``acc_out[index]``, ``acc_lse[index]`` only, in place.

    `index` holds index tensors (advanced indexing), which read a copy, so the
    merged selection is written back; out/lse have the selection's shape.
    """
    sel_out, sel_lse = acc_out[index], acc_lse[index]
    # under this function's no_grad already
    merge_.__wrapped__(sel_out, sel_lse, out, lse)
    acc_out[index] = sel_out
    acc_lse[index] = sel_lse


def _use_kernel(device: torch.device) -> bool:
    """Whether merges on `device` run merge_kernel (MERGE_KERNEL, triton installed, a GPU
    Triton compiles for); never while torch.compile traces (it fuses the chain itself)."""
    if not (_HAS_TRITON and MERGE_KERNEL.get(device.type, False)):
        return False
    return not torch.compiler.is_compiling() and _triton_runs_on(device)


@functools.lru_cache(maxsize=None)
def _triton_runs_on(device: torch.device) -> bool:
    # Triton 3 compiles for compute capability 8.0+; CPU only in its interpreter (tests)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True
