"""Exact dilated attention on one device: forward, backward, autograd, public op.

Notation: b batch, n sequence, h query heads, hk key/value heads, d head dim;
a pattern is (w, r) = (segment length, dilation rate).

Per pattern, every segment's selected rows are gathered into one dense batch
(a free view when r == 1), one kernel launch returns (out, lse) for all of
them, and the result is merged on the fly into fp32 accumulators with the
log-sum-exp merge. The backward reuses the merged (out, lse): each pattern's
kernel backward recomputes its share of the *global* softmax, so dq sums over
patterns and no lse gradient is needed from any kernel.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _validation as check
from .comm import is_distributed
from .kernels import attention_backward, attention_forward, lse_dtype, select_backend
from .merge import empty_accumulators, merge_, merge_selected_
from .patterns import Region, gather, head_groups, regions, scatter_add_, segments_view

Patterns = Tuple[Tuple[int, ...], Tuple[int, ...]]

# Segments are launched in chunks of at most max(ROWS_PER_LAUNCH, 1/16 of the
# region) rows: the gathered copies and the kernel's output stay a small
# fraction of the input whatever n is, each launch is large enough to keep
# every core busy (a GPU needs far more rows in flight than a CPU to hide its
# launch latency), and a region never takes more than ~16 launches, so the
# per-launch Python and merge overhead stays constant too (this is also what
# keeps shape-only runs on meta tensors fast).
ROWS_PER_LAUNCH = {"cpu": 4096, "cuda": 131072}
MAX_LAUNCHES_PER_REGION = 16


def chunks(region: Region, device: torch.device) -> Iterator[Region]:
    """Split a region into consecutive regions that each make one launch."""
    rows = max(
        ROWS_PER_LAUNCH.get(device.type, ROWS_PER_LAUNCH["cpu"]),
        -(-region.num_segments * region.seg_len // MAX_LAUNCHES_PER_REGION),
    )
    per_launch = max(1, rows // region.seg_len)
    for first in range(0, region.num_segments, per_launch):
        yield Region(
            region.start + first * region.seg_len,
            min(per_launch, region.num_segments - first),
            region.seg_len,
        )


def _launches(n: int, h: int, hk: int, patterns: Patterns, device: torch.device):
    """Every kernel launch of the op: (launch id, region, head group)."""
    launch = 0
    for w, r in zip(*patterns):
        for region in regions(n, w):
            groups = head_groups(0, region.seg_len, r, h, hk, str(device))
            for chunk in chunks(region, device):
                for group in groups:
                    yield launch, chunk, group
                    launch += 1


def dilated_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    patterns: Patterns,
    *,
    causal: bool,
    scale: float,
    backend: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32."""
    b, n, h, d = q.shape
    hk = k.shape[2]
    acc_out, acc_lse = empty_accumulators((b, n, h, d), q.dtype, q.device)
    forward_launches(
        q, k, v, _launches(n, h, hk, patterns, q.device), acc_out, acc_lse, causal=causal,
        scale=scale, backend=backend, dropout_p=dropout_p, seed=seed,
    )
    return acc_out.to(q.dtype), acc_lse


def forward_launches(
    q: Tensor, k: Tensor, v: Tensor, launches, acc_out: Tensor, acc_lse: Tensor, *,
    causal: bool, scale: float, backend: str, dropout_p: float, seed: int,
) -> None:
    """Run `launches` ((launch id, region, head group) over rows of q and k/v) and merge
    each result into the (b, n, h, ...) accumulators. Shared with sequence_parallel.py."""
    for launch, region, group in launches:
        # (b, n, h, d) -> (b * segments, rows, heads, d)
        q_g = gather(q, region, group.q_heads, group.q_index, group.identity)
        k_g = gather(k, region, group.kv_heads, group.kv_index, group.identity)
        v_g = gather(v, region, group.kv_heads, group.kv_index, group.identity)
        out_g, lse_g = attention_forward(
            q_g, k_g, v_g, causal=causal, scale=scale, backend=backend, dropout_p=dropout_p,
            seed=seed + launch,
        )
        del q_g, k_g, v_g
        _merge_rows(acc_out, acc_lse, region, group, out_g, lse_g)
        del out_g, lse_g  # free before the next launch gathers


def _merge_rows(acc_out, acc_lse, region: Region, group, out_g: Tensor, lse_g: Tensor) -> None:
    """Merge a launch's (b * s, rows, heads, ...) results into the (b, n, h, ...) accumulators."""
    seg_out, seg_lse = segments_view(acc_out, region), segments_view(acc_lse, region)
    # (b * s, rows, heads, ...) -> (b, s, rows, heads, ...)
    out_g = out_g.unflatten(0, seg_out.shape[:2])
    lse_g = lse_g.unflatten(0, seg_out.shape[:2])
    if group.identity:
        merge_(seg_out, seg_lse, out_g, lse_g)
        return
    merge_selected_(seg_out, seg_lse, (slice(None), slice(None), group.q_index, group.q_heads),
                    out_g, lse_g)


def dilated_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    patterns: Patterns,
    *,
    causal: bool,
    scale: float,
    backend: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    dlse: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of `dilated_forward`, given its final out (b, n, h, d) and lse (b, n, h)."""
    b, n, h, d = q.shape
    hk = k.shape[2]
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    backward_launches(
        dout, q, k, v, out, lse, _launches(n, h, hk, patterns, q.device), dq, dk, dv,
        causal=causal, scale=scale, backend=backend, dropout_p=dropout_p, seed=seed, dlse=dlse,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_launches(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, launches,
    dq: Tensor, dk: Tensor, dv: Tensor, *, causal: bool, scale: float, backend: str,
    dropout_p: float, seed: int, dlse: Optional[Tensor],
) -> None:
    """Gradients of `forward_launches`' launches, accumulated into dq, dk, dv (fp32).
    Shared with sequence_parallel.py."""
    for launch, region, group in launches:
        q_sel = (region, group.q_heads, group.q_index, group.identity)
        kv_sel = (region, group.kv_heads, group.kv_index, group.identity)
        dq_g, dk_g, dv_g = attention_backward(
            gather(dout, *q_sel),
            gather(q, *q_sel),
            gather(k, *kv_sel),
            gather(v, *kv_sel),
            gather(out, *q_sel),
            gather(lse, *q_sel),
            causal=causal,
            scale=scale,
            backend=backend,
            dropout_p=dropout_p,
            seed=seed + launch,
            dlse=None if dlse is None else gather(dlse, *q_sel),
        )
        scatter_add_(dq, *q_sel, dq_g)
        scatter_add_(dk, *kv_sel, dk_g)
        scatter_add_(dv, *kv_sel, dv_g)
        del dq_g, dk_g, dv_g  # free before the next launch gathers


class _DilatedAttention(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `dilated_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, patterns, causal, scale, backend, dropout_p, seed):
        out, lse = dilated_forward(
            q, k, v, patterns, causal=causal, scale=scale, backend=backend,
            dropout_p=dropout_p, seed=seed,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (patterns, causal, scale, backend, dropout_p, seed)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        patterns, causal, scale, backend, dropout_p, seed = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = dilated_backward(
            dout, q, k, v, out, lse, patterns, causal=causal, scale=scale, backend=backend,
            dropout_p=dropout_p, seed=seed, dlse=dlse,
        )
        return dq, dk, dv, None, None, None, None, None, None


def dropout_seed(dropout_p: float) -> int:
    """A seed from torch's default generator, so `torch.manual_seed` fixes dropout."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    group=None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Exact LongNet dilated attention (see SPEC.md).

    Args:
        q: (batch, seq_len, heads, head_dim).
        k, v: (batch, seq_len, kv_heads, head_dim); kv_heads divides heads.
        segment_lengths, dilation_rates: one (w, r) pair per pattern, r <= w.
        is_causal: queries see only keys at or before their position.
        scale: softmax scale, default 1/sqrt(head_dim).
        dropout_p: attention dropout probability (pass 0.0 in evaluation).
        group: a torch.distributed process group for sequence parallelism;
            each rank passes its own contiguous piece of the sequence. None
            (or a group of size 1) runs locally.
        return_lse: also return the log-sum-exp (batch, heads, seq_len).
        backend: kernel override: "auto", "cpu_flash", "cuda_flash",
            "cuda_efficient", "flash_attn" or "blockwise".

    Returns:
        out (batch, seq_len, heads, head_dim), or (out, lse) with lse float32
        (float64 for float64 inputs). A query that attends nothing gets zeros
        and lse = -inf.
    """
    distributed = is_distributed(group)
    try:
        check.check_qkv(q, k, v, allow_empty=group is not None)
        patterns = check.check_patterns(segment_lengths, dilation_rates)
        is_causal = check.check_bool("is_causal", is_causal)
        return_lse = check.check_bool("return_lse", return_lse)
        scale = check.check_scale(scale, q.shape[-1])
        dropout_p = check.check_dropout(dropout_p)
        backend = select_backend(q.device, q.dtype, dropout_p=dropout_p, backend=backend)
        seed = dropout_seed(dropout_p)
    except (TypeError, ValueError) as error:
        if not distributed:
            raise
        from .sequence_parallel import fail_on_all_ranks

        # the other ranks wait in the agreement collective: fail there, on all of them
        fail_on_all_ranks(group, error)
    if distributed:
        from .sequence_parallel import sequence_parallel_dilated_attention

        out, lse = sequence_parallel_dilated_attention(
            q, k, v, patterns, causal=is_causal, scale=scale, dropout_p=dropout_p, seed=seed,
            group=group, backend=backend,
        )
    else:
        check.check_qkv(q, k, v)
        out, lse = _DilatedAttention.apply(
            q, k, v, patterns, is_causal, scale, backend, dropout_p, seed
        )
    if return_lse:
        # (b, n, h) -> (b, h, n)
        return out, lse.transpose(1, 2)
    return out
