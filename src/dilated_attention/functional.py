"""The public ops: validate a call once, agree on it across ranks, run the right path.

``dilated_attention`` and ``ring_attention`` are what users (and the
modules) call. Each builds the call's configuration inside the callable
that ``comm.agree`` runs, so the checks run exactly once per call and a bad
argument on one rank is an error on every rank of the group, never a hang.
The agreed configuration then travels down as values (``patterns``,
``KernelOptions``, every rank's piece length) to the op that computes it:

    dilated_attention --(group None or size 1)--> dilated.dilated_attention_local
                      --(group of P > 1 ranks)--> distributed.sequence_parallel
    ring_attention    ---------------------------> distributed.ring

Notation: b batch, n rows (this rank's piece under sequence parallelism),
h query heads, hk key/value heads, d head dim; layout (b, n, h, d).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import validation as check
from .dilated import dilated_attention_local
from .distributed import comm
from .distributed.ring import RingAttentionFunction
from .distributed.sequence_parallel import sequence_parallel_dilated_attention
from .distributed.sharding import check_layout, check_piece_lengths
from .kernels import KernelOptions, select_backend


def dropout_seed(dropout_p: float) -> int:
    """A seed from torch's default generator, so `torch.manual_seed` fixes dropout."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _tensor_config(q: Tensor, k: Tensor, v: Tensor, *, allow_empty: bool) -> Dict[str, Any]:
    """The checked shapes every rank must share (and this rank's length, "n")."""
    check.check_qkv(q, k, v, allow_empty=allow_empty)
    b, n, h, d = q.shape
    return {"dtype": q.dtype, "device_type": q.device.type, "batch": b, "heads": h,
            "kv_heads": k.shape[2], "head_dim": d, "n": n}


def _documents(cu_seqlens: Optional[Tuple[int, ...]], total: int) -> Optional[Tuple[int, ...]]:
    """The agreed boundaries, checked against the sequence length; None for one document."""
    if cu_seqlens is None:
        return None
    if cu_seqlens[-1] != total:
        raise ValueError(
            f"cu_seqlens must end at the sequence length {total}, got {cu_seqlens[-1]} "
            f"(cu_seqlens {check.brief(cu_seqlens)})"
        )
    return None if len(cu_seqlens) == 2 else cu_seqlens


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
    cu_seqlens=None,
    key_padding_mask: Optional[Tensor] = None,
):
    """Exact LongNet dilated attention (see docs/spec.md).

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
        cu_seqlens: packed documents: boundaries [0, c1, ..., N] along the
            sequence (an int tensor or a list), shared by every batch row;
            each document is an independent sequence (segments restart at
            its start, W = min(w, its length), causal stays inside it). With
            `group`, the global boundaries, identical on every rank.
        key_padding_mask: (batch, seq_len) bool, True = ignore that key (this
            rank's rows with `group`). Positions and segments do not move.

    Returns:
        out (batch, seq_len, heads, head_dim), or (out, lse) with lse float32
        (float64 for float64 inputs). A query that attends nothing gets zeros
        and lse = -inf (and zero gradients).
    """
    distributed = comm.is_distributed(group)

    def config() -> Dict[str, Any]:
        segs, rates = check.check_patterns(segment_lengths, dilation_rates)
        p = check.check_dropout(dropout_p)
        mask = check.check_key_padding_mask(key_padding_mask, q)
        return {
            **_tensor_config(q, k, v, allow_empty=distributed),
            "segment_lengths": segs,
            "dilation_rates": rates,
            "causal": check.check_bool("is_causal", is_causal),
            "return_lse": check.check_bool("return_lse", return_lse),
            "scale": check.check_scale(scale, q.shape[-1]),
            "dropout_p": p,
            "cu_seqlens": check.check_cu_seqlens(cu_seqlens),
            "key_padding_mask": mask is not None,
            "masked_keys": mask is not None and bool(mask.any()),
            "backend": select_backend(q.device, q.dtype, dropout_p=p, backend=backend,
                                      masked=mask is not None),
            "seed": dropout_seed(p),
        }

    infos = comm.agree(group, config, per_rank=("n", "seed", "masked_keys"))
    call = infos[0]  # rank 0's dropout seed is the call's
    lengths = tuple(info["n"] for info in infos)
    documents = _documents(call["cu_seqlens"], sum(lengths))
    patterns = (call["segment_lengths"], call["dilation_rates"])
    opts = KernelOptions(call["causal"], call["scale"], call["backend"], call["dropout_p"],
                         call["seed"])
    # a mask that ignores nothing on any rank changes nothing: skip its cost
    mask = key_padding_mask if any(info["masked_keys"] for info in infos) else None
    if distributed:
        out, lse = sequence_parallel_dilated_attention(q, k, v, patterns, opts, group, lengths,
                                                       documents=documents, key_mask=mask)
    else:
        out, lse = dilated_attention_local(q, k, v, patterns, opts, documents=documents,
                                           key_mask=mask)
    if return_lse:
        # (b, n, h) -> (b, h, n)
        return out, lse.transpose(1, 2)
    return out


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    group=None,
    return_lse: bool = False,
    layout: str = "contiguous",
    backend: str = "auto",
):
    """Exact dense attention over the whole sequence spread across `group`.

    Args:
        q: (batch, seq_len, heads, head_dim), this rank's piece.
        k, v: (batch, seq_len, kv_heads, head_dim); kv_heads divides heads.
        is_causal: queries see only keys at or before their global position.
        scale: softmax scale, default 1/sqrt(head_dim).
        group: the process group the sequence is spread over; None (or one
            rank) is plain local attention.
        return_lse: also return the log-sum-exp (batch, heads, seq_len).
        layout: "contiguous" (rank p holds the p-th piece; pieces may differ
            in length and be empty) or "zigzag" (2P equal chunks, rank p
            holds chunks p and 2P-1-p concatenated: even causal work; see
            ``shard_sequence``).
        backend: kernel override, as for ``dilated_attention``.

    Returns:
        This rank's rows of out (batch, seq_len, heads, head_dim), or
        (out, lse) with lse float32 (float64 for float64 inputs). Every rank
        must call this (and its backward) with the same configuration; a
        mismatch or a bad argument on any rank raises on every rank.
    """
    distributed = comm.is_distributed(group)

    def config() -> Dict[str, Any]:
        return {
            **_tensor_config(q, k, v, allow_empty=distributed),
            "is_causal": check.check_bool("is_causal", is_causal),
            "return_lse": check.check_bool("return_lse", return_lse),
            "scale": check.check_scale(scale, q.shape[-1]),
            "layout": check_layout(layout),
            "backend": select_backend(q.device, q.dtype, backend=backend),
        }

    infos = comm.agree(group, config, per_rank=("n",))
    call = infos[0]
    lengths = tuple(info["n"] for info in infos)
    if sum(lengths) == 0:
        raise ValueError(f"the sequence is empty on every rank (piece lengths {list(lengths)})")
    check_piece_lengths(lengths, layout)
    opts = KernelOptions(call["is_causal"], call["scale"], call["backend"])
    out, lse = RingAttentionFunction.apply(q, k, v, opts, group, layout, lengths)
    if return_lse:
        # (b, n, h) -> (b, h, n)
        return out, lse.transpose(1, 2)
    return out
