"""The one log-sum-exp merge of partial attention results.

Dilation patterns and ring steps both produce partial results ``(out_i,
lse_i)`` over disjoint sets of keys; the exact attention over their union is

    lse = logsumexp_i(lse_i),   out = sum_i exp(lse_i - lse) * out_i.

The merge runs in place on fp32 accumulators (fp64 for fp64 inputs) and is
never differentiated: backward passes recompute each block's softmax from the
merged ``out``/``lse`` (see kernels.attention_backward), which is exact.

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
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    # a row with no keys on either side: keep weights finite (both become 0)
    safe = new_lse.masked_fill(new_lse == -math.inf, 0.0)
    merged = acc_out if acc_out.dtype == acc_lse.dtype else acc_out.to(acc_lse.dtype)
    merged.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    merged.addcmul_(out, torch.exp(lse - safe).unsqueeze(-1))
    if merged is not acc_out:
        acc_out.copy_(merged)
    acc_lse.copy_(new_lse)


@torch.no_grad()
def merge_selected_(acc_out: Tensor, acc_lse: Tensor, index: tuple, out: Tensor,
                    lse: Tensor) -> None:
    """`merge_` into the entries ``acc_out[index]``, ``acc_lse[index]`` only, in place.

    `index` holds index tensors (advanced indexing), which read a copy, so the
    merged selection is written back; out/lse have the selection's shape.
    """
    sel_out, sel_lse = acc_out[index], acc_lse[index]
    merge_(sel_out, sel_lse, out, lse)
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
