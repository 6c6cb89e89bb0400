"""Exact dilated attention on one device: forward, backward, autograd, and decoding.

Notation: b batch, n sequence, h query heads, hk key/value heads, d head dim;
a pattern is (w, r) = (segment length, dilation rate).

Per pattern, every segment's selected rows are gathered into one dense batch
(a free view when r == 1), one kernel launch returns (out, lse) for all of
them, and the result is merged on the fly into fp32 accumulators with the
log-sum-exp merge (launches.py). The backward reuses the merged (out, lse):
each pattern's kernel backward recomputes its share of the *global* softmax,
so dq sums over patterns and no lse gradient is needed from any kernel.

The public entry point, which validates the call once and picks this op or
a sequence-parallel one, is ``functional.dilated_attention``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import validation as check
from .kernels import KernelOptions, attention_forward, lse_dtype, save_for_backward
from .kernels import saved_for_backward
from .launches import backward_launches, forward_launches, merge_rows, sequence_launches
from .merge import empty_accumulators
from .patterns import Patterns, Region, cross_head_groups, gather


def dilated_forward(q: Tensor, k: Tensor, v: Tensor, patterns: Patterns,
                    opts: KernelOptions) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32."""
    b, n, h, d = q.shape
    acc_out, acc_lse = empty_accumulators((b, n, h, d), q.dtype, q.device)
    launches = sequence_launches(n, h, k.shape[2], patterns, q.device)
    forward_launches(q, k, v, launches, acc_out, acc_lse, opts)
    return acc_out.to(q.dtype), acc_lse


def dilated_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     patterns: Patterns, opts: KernelOptions,
                     dlse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of `dilated_forward`, given its final out (b, n, h, d) and lse (b, n, h)."""
    n, h = q.shape[1], q.shape[2]
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    launches = sequence_launches(n, h, k.shape[2], patterns, q.device)
    backward_launches(dout, q, k, v, out, lse, launches, dq, dk, dv, opts, dlse)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class DilatedAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `dilated_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, patterns, opts):
        result = dilated_forward(q, k, v, patterns, opts)
        return save_for_backward(ctx, q, k, v, result, (patterns, opts))

    @staticmethod
    def backward(ctx, dout, dlse):
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        patterns, opts = ctx.args
        dq, dk, dv = dilated_backward(dout, q, k, v, out, lse, patterns, opts, dlse)
        return dq, dk, dv, None, None


def cached_dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths: Sequence[int],
                             dilation_rates: Sequence[int], *,
                             scale: Optional[float] = None) -> Tensor:
    """Causal dilated attention of the LAST position against all earlier keys (decoding).

    q (b, 1, h, d) is the query at position t = m - 1; k, v (b, m, hk, d)
    hold positions 0..t. Equals row t of the causal op over the m positions:
    per pattern (w, r) the segment of t starts at a = (t // w) * w (also
    right when w > t: the segment is then min(w, m) = m long and starts at
    0), and its heads read the rows of the slice [a, t] that
    ``patterns.cross_head_groups`` selects for the query row t - a. Patterns
    merge by log-sum-exp. Inference only (no gradient).
    """
    b, _, h, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    t = m - 1
    opts = KernelOptions(causal=False, scale=check.check_scale(scale, d))
    acc_out, acc_lse = empty_accumulators((b, 1, h, d), q.dtype, q.device)
    query = Region(0, 1, 1)
    for w, r in zip(segment_lengths, dilation_rates):
        a = (t // w) * w
        keys = Region(a, 1, t - a + 1)
        # the query row t - a of the segment against its key rows 0 .. t - a
        for g in cross_head_groups(t - a, t - a + 1, 0, t - a + 1, r, h, hk, str(q.device)):
            # query indices are relative to the query row: row 0 of q
            out_g, lse_g = attention_forward(
                gather(q, query, g.q_heads, g.q_index, g.identity),
                gather(k, keys, g.kv_heads, g.kv_index, g.identity),
                gather(v, keys, g.kv_heads, g.kv_index, g.identity),
                opts,
            )
            merge_rows(acc_out, acc_lse, query, g, out_g, lse_g)
    return acc_out.to(q.dtype)
