"""The public ops: validate a call once, agree on it across ranks, run the right path.

``dilated_attention`` and ``ring_attention`` are what users (and the
modules) call. Each builds the call's configuration inside the callable
that ``comm.agree`` runs, so the checks run at most once per call (a call
whose signature passed them before skips the static ones,
``validation.CheckedCalls``) and a bad argument on one rank is an error on
every rank of the group, never a hang.
The agreed configuration then travels down as values (``patterns``,
``KernelOptions``, every rank's piece length, the documents) to the op that
computes it:

    dilated_attention --(group None or size 1)--> dilated.dilated_attention_local
                      --(group of P > 1 ranks)--> distributed.sequence_parallel
                      --(strategy "ulysses", or a 2-D mesh)--> distributed.ulysses,
                        then the local op or the exchange over the mesh's 2nd dim
    ring_attention    ---------------------------> distributed.ring
                      --(a 2-D mesh)--> distributed.ulysses, then the ring
                      --(documents or a padding mask)--> the dilated ops, one
                        segment per document (dense attention is that case)

``distributed.strategy`` decides which (``strategy="auto"`` compares the
traffic of the exchange and of Ulysses for the agreed call).

Notation: b batch, n rows (this rank's piece under sequence parallelism),
h query heads, hk key/value heads, d head dim; layout (b, n, h, d).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Dict, NoReturn, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import fused
from . import validation as check
from .backends import select_backend
from .dilated import dilated_attention_local
from .distributed import comm
# check_group_type: for constructors above the ops (modules, models) that keep a group
# until a call
from .distributed.comm import GroupLike, check_group_type  # noqa: F401
from .distributed import strategy as strategies
from .distributed.halo import halo_attention
from .distributed.ring import RingAttentionFunction
from .distributed.sequence_parallel import sequence_parallel_dilated_attention
from .distributed.sharding import check_layout, check_piece_lengths
from .distributed.ulysses import ulysses_attention
from .kernels import KernelOptions, autocast_dtype, input_sums, lse_dtype
from .patterns import Heads, Patterns
from .layout import CuSeqlens, Documents, Layout, unread_rows
from .window import window_attention_local


def dropout_seed(dropout_p: float) -> int:
    """A seed from torch's default generator, so `torch.manual_seed` fixes dropout."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def fail_on_every_rank(group: GroupLike, error: Exception) -> NoReturn:
    """Raise `error` here, and a ValueError naming it on every other rank of `group`.

    For callers above the ops (modules, models) whose own check of their inputs
    failed before they reached an op: the other ranks wait in that op's
    agreement, which this rank joins with its error instead of a configuration,
    so every rank raises and none hangs. Without a group it just raises. (Here,
    not in the modules: they reach other ranks only through the public ops.)
    """
    comm.fail_on_all_ranks(comm.resolve_group(group), error)


def _tensor_config(q: Tensor, k: Tensor, v: Tensor, key_padding_mask, *,
                   allow_empty: bool) -> Dict[str, Any]:
    """The checked shapes every rank must share, and this rank's length ("n", per_rank):
    static checks (validation.signature); `_data_config` adds the rest."""
    check.check_qkv(q, k, v, allow_empty=allow_empty)
    mask = check.check_key_padding_mask(key_padding_mask, q)
    b, n, h, d = q.shape
    return {
        "dtype": q.dtype, "device_type": q.device.type, "batch": b, "heads": h,
        "kv_heads": k.shape[2], "head_dim": d,
        # autograd: every rank runs the backward collectives, or none does
        "requires_grad": torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)),
        "key_padding_mask": mask is not None,
        "n": n,
        # which of q and k/v this rank differentiates (per_rank: `_differentiated`)
        "differentiates": (torch.is_grad_enabled() and q.requires_grad,
                           torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)),
    }


def _data_config(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], *,
                 check_finite: bool) -> Dict[str, Any]:
    """What a call reads every time, after its static checks passed: no torch.func
    transform, and this rank's data (per_rank): whether its mask ignores any key, and
    (check_finite) whether a q, k or v entry is not finite (a read-back; see
    `_nonfinite_keys`)."""
    check.check_no_transform(q, k, v)
    return {
        "masked_keys": key_padding_mask is not None and (not _inspects(q)
                                                         or bool(key_padding_mask.any())),
        "nonfinite": check_finite and _inspects(q) and not _all_finite(q, k, v),
    }


def _inspects(q: Tensor) -> bool:
    """Whether the call may read data-dependent facts: not while torch.compile traces (nor on
    meta tensors), where a mask counts as masking and keys as finite."""
    return q.device.type != "meta" and not torch.compiler.is_compiling()


_PER_RANK = ("n", "differentiates", "masked_keys", "nonfinite")

# Each op's checked configurations by call signature (validation.CheckedCalls).
_DILATED_CALLS = check.CheckedCalls()
_RING_CALLS = check.CheckedCalls()


def _all_finite(*tensors: Tensor) -> bool:
    """No NaN or infinity in any of `tensors` (``kernels.input_sums``), read back: on a
    GPU a device sync (once per call; three before, seen in an H100 profile). A sum of
    finite entries that overflows also says non-finite: the call then takes the exact path
    for non-finite rows (``_nonfinite_keys``), which finds none and gives the same result,
    slower."""
    # the sums read back, then checked in Python: torch.isfinite(...).all() on the device
    # dispatched five more ops per call for three numbers
    return all(map(math.isfinite, input_sums(*tensors).tolist()))


def _bad_keys(k: Tensor, v: Tensor) -> Tensor:
    """(b, n, hk, 2) bool: the key rows whose k, or whose v, holds a NaN or an infinity."""
    return torch.stack([~torch.isfinite(k).all(-1), ~torch.isfinite(v).all(-1)], dim=-1)


def _differentiated(infos) -> Tuple[bool, bool]:
    """Whether some rank differentiates q, and k or v: the backward communicates a gradient
    that no rank needs not at all (the same decision on every rank: it comes from the
    agreement). A rank that does not need a gradient another rank needs takes part and
    discards its share (docs/sequence-parallel.md: ranks may differentiate different
    inputs)."""
    return (any(info["differentiates"][0] for info in infos),
            any(info["differentiates"][1] for info in infos))


def _agreed_lengths(infos) -> Tuple[int, ...]:
    lengths = tuple(info["n"] for info in infos)
    if sum(lengths) == 0:
        raise ValueError(f"the sequence is empty on every rank (piece lengths {list(lengths)})")
    return lengths


def _shape(call: Dict[str, Any], lengths: Tuple[int, ...], patterns: Patterns, causal: bool,
           documents: Documents) -> strategies.Shape:
    """What the strategy choice depends on, from the agreed call."""
    return strategies.Shape(
        lengths, patterns, causal, call["heads"], call["kv_heads"], call["head_dim"],
        call["batch"], call["dtype"].itemsize, lse_dtype(call["dtype"]).itemsize, documents)


@dataclasses.dataclass(frozen=True)
class _Route:
    """How the agreed call runs over its ranks (``distributed.strategy.choose``).

    kind "local" or "exchange": the op over `sequence` (None: locally) on every
    head; "ulysses": an all-to-all over `heads` to all rows of the head group's
    block for heads / U heads, then the op over `sequence` (the second dimension
    of a 2-D mesh; None: locally), then back.
    """

    kind: str
    heads: Any
    sequence: Any

    @classmethod
    def of(cls, strategy: str, group, layout: str, shape: strategies.Shape) -> "_Route":
        kind = strategies.choose(strategy, group, shape, layout)
        if kind != "ulysses":
            return cls(kind, None, group)
        if isinstance(group, comm.Grid):
            return cls(kind, group.heads, group.sequence)
        return cls(kind, group, None)

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
            lengths: Tuple[int, ...], opts: KernelOptions, sequence,
            grads: Tuple[bool, bool]) -> Tuple[Tensor, Tensor]:
        """``sequence(q, k, v, heads, mask, opts, group, lengths)`` computes the attention of
        the rows over `group` (None: locally) for `heads` (None: all of them); `grads`:
        ``_differentiated``."""
        if self.kind != "ulysses":
            return sequence(q, k, v, None, mask, opts, self.sequence, lengths)
        size, u = comm.group_size(self.heads), comm.group_rank(self.heads)
        blocks = [lengths[t * size:(t + 1) * size]
                  for t in range(comm.group_size(self.sequence))]
        block_lengths = tuple(sum(block) for block in blocks)
        # each head-parallel rank's launches draw their own masks (equal launch ids)
        head_opts = opts.for_rank(u, head_parallel=True)

        def attend(q_u, k_u, v_u, heads: Heads, mask_u):
            return sequence(q_u, k_u, v_u, heads, mask_u, head_opts, self.sequence,
                            block_lengths)

        return ulysses_attention(q, k, v, mask, self.heads,
                                 blocks[comm.group_rank(self.sequence)], attend, grads=grads)


def _no_window(window_size) -> Tuple[int, int]:
    """dilated_attention takes no sliding window: anything but (-1, -1) is a ValueError. The
    value is checked by ring_attention's validator first, so both ops take the same forms of
    (-1, -1) (NumPy ints, a list) and refuse a malformed window with the same message."""
    if check.check_window(window_size, False) == (-1, -1):
        return (-1, -1)
    raise ValueError(
        f"window_size={window_size!r}: dilated_attention takes no sliding window; "
        f"ring_attention(q, k, v, window_size=(left, right)) computes exact sliding-window "
        f"attention (one device and sequence-parallel)")


def _effective_window(window: Tuple[int, int], total: int) -> Tuple[int, int]:
    """The agreed window with each side that reaches the whole sequence as -1 (unbounded)."""
    return tuple(-1 if side >= total - 1 else side for side in window)


def _eager_across_ranks(op):
    """Under torch.compile, a call with a group runs eagerly: a graph break between the
    compiled code around it. The sequence-parallel paths agree across ranks on pickled values
    and size their messages and launches from the agreed data, which Dynamo cannot trace;
    eagerly they run as they do outside compile (the single-device op is one custom op, and
    compiles)."""

    @functools.wraps(op)
    def call(q, k, v, *args, **kwargs):
        if kwargs.get("group") is not None and torch.compiler.is_compiling():
            # disabled here, not when the module loads: torch.compiler.disable imports Dynamo,
            # a second of every import of the library (and of every spawned rank's)
            return torch.compiler.disable(op)(q, k, v, *args, **kwargs)
        return op(q, k, v, *args, **kwargs)

    return call


def _follows_autocast(op):
    """Under torch.autocast for the inputs' device, the op takes q, k, v in autocast's dtype,
    as ``F.scaled_dot_product_attention`` does, and runs with autocast off: its kernels and
    merges compute in that dtype and their own accumulators, not autocast's per-op choices."""

    @functools.wraps(op)
    def call(q, k, v, *args, **kwargs):
        # a non-tensor q is for the checks to name
        dtype = autocast_dtype(q.device.type, q.dtype) if isinstance(q, Tensor) else None
        if dtype is None:
            return op(q, k, v, *args, **kwargs)
        q, k, v = (x.to(dtype) if isinstance(x, Tensor) and autocast_dtype(x.device.type, x.dtype)
                   else x for x in (q, k, v))
        with torch.autocast(q.device.type, enabled=False):
            return op(q, k, v, *args, **kwargs)

    return call


@_eager_across_ranks
@_follows_autocast
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
    group: GroupLike = None,
    return_lse: bool = False,
    backend: str = "auto",
    cu_seqlens: CuSeqlens = None,
    key_padding_mask: Optional[Tensor] = None,
    layout: str = "contiguous",
    strategy: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact LongNet dilated attention (see docs/spec.md).

    Args:
        q: (batch, seq_len, heads, head_dim).
        k, v: (batch, seq_len, kv_heads, head_dim); kv_heads divides heads.
        segment_lengths, dilation_rates: one (w, r) pair per pattern, r <= w.
        is_causal: queries see only keys at or before their position.
        scale: softmax scale, default 1/sqrt(head_dim).
        dropout_p: attention dropout probability (pass 0.0 in evaluation).
        group: sequence parallelism: a torch.distributed ProcessGroup or a
            1-D DeviceMesh (each rank passes its own contiguous piece of the
            sequence, in rank order), or a 2-D DeviceMesh (head-parallel x
            sequence-parallel: the rank at mesh coordinate (u, s) passes
            piece s * U + u). None (or one rank) runs locally.
        return_lse: also return the log-sum-exp (batch, heads, seq_len).
        backend: kernel override: "auto", "cpu_flash", "cuda_cudnn",
            "cuda_flash", "cuda_efficient", "flash_attn", "blockwise" or
            "triton" (every pattern in one fused Triton kernel; CPU tensors
            need TRITON_INTERPRET=1); a named kernel that cannot run here (a
            CUDA kernel on CPU tensors, a dtype or GPU it does not take,
            flash-attn or triton not installed) is a ValueError saying what
            it needs.
        cu_seqlens: packed documents: boundaries [0, c1, ..., N] along the
            sequence (an int tensor or a list), shared by every batch row;
            each document is an independent sequence (segments restart at
            its start, W = min(w, its length), causal stays inside it). With
            `group`, the global boundaries, identical on every rank.
        key_padding_mask: (batch, seq_len) bool, True = ignore that key (this
            rank's rows with `group`). Positions and segments do not move.
        layout: with `group`, which rows a rank holds: "contiguous" (rank p
            the p-th piece; pieces may differ in length and be empty) or
            "zigzag" (2P equal chunks, rank p holds chunks p and 2P-1-p:
            balances causal work when segments span ranks; see
            ``shard_sequence``; exchange strategy only).
        strategy: with a one-dimensional `group`, "exchange" (each rank keeps
            its rows; spanning segments fetch selected key/value rows),
            "ulysses" (all-to-all to all rows of heads / P, local attention,
            all-to-all back; needs P to divide the heads) or "auto" (the one
            whose busiest rank sends fewer bytes, see
            ``distributed.strategy``). A 2-D mesh always runs Ulysses over its
            first dimension and the exchange over its second ("auto" or
            "ulysses").
        window_size: only (-1, -1): a sliding window is ``ring_attention``'s
            (``window_size=``); any other value is a ValueError.

    Returns:
        out (batch, seq_len, heads, head_dim), or (out, lse) with lse float32
        (float64 for float64 inputs). A query that attends nothing gets zeros
        and lse = -inf (and zero gradients). A query that is not finite, or
        that attends a key whose k or v row is not finite, gets NaN, on one
        device and sequence-parallel alike; every other query is exact.
    """
    group = comm.resolve_group(group)
    distributed = comm.is_distributed(group)

    def checked() -> Dict[str, Any]:
        segs, rates = check.check_patterns(segment_lengths, dilation_rates)
        p = check.check_dropout(dropout_p)
        tensors = _tensor_config(q, k, v, key_padding_mask, allow_empty=distributed)
        kernel = functools.partial(select_backend, q.device, q.dtype, dropout_p=p,
                                   backend=backend, masked=tensors["key_padding_mask"],
                                   head_dim=q.shape[-1])
        whole_op_backend = kernel(whole_op=True)
        if p > 0.0 and whole_op_backend == "triton":
            fused.check_dropout_patterns(len(segs))
        return {
            **tensors,
            "segment_lengths": segs,
            "dilation_rates": rates,
            # keys named as the arguments: a rank mismatch names what the user passed
            "is_causal": check.check_bool("is_causal", is_causal),
            "return_lse": check.check_bool("return_lse", return_lse),
            "scale": check.check_scale(scale, q.shape[-1]),
            "dropout_p": p,
            "cu_seqlens": check.check_cu_seqlens(cu_seqlens),
            "layout": check_layout(layout),
            "strategy": check.check_strategy(strategy),
            "window_size": _no_window(window_size),
            # derived from the arguments above (the comm check names the first key that
            # differs, in this order): the kernel of the exchange's launches (a named kernel
            # is each launch's too, checked once; auto may differ per launch); the kernel
            # where a rank computes the whole op on its rows (one device, or a Ulysses
            # rank's heads over all rows of its block: auto may pick the fused kernel
            # there, which then runs the exchange's own pairs too). Under a group a named
            # kernel is checked for launches too
            "backend": kernel() if backend == "auto" or distributed else whole_op_backend,
            "whole_op_backend": whole_op_backend,
        }

    def config() -> Dict[str, Any]:
        call = _DILATED_CALLS.get(
            check.signature((q, k, v, key_padding_mask),
                            (segment_lengths, dilation_rates, dropout_p, distributed, backend,
                             is_causal, return_lse, scale, cu_seqlens, layout, strategy,
                             window_size)),
            checked)
        # whether a q, k or v row holds a non-finite number (this rank's own). Not read back
        # where one device runs the fused kernels: they apply the rule themselves, from a
        # flag left on the device (no sync). This rank's dropout seed.
        data = _data_config(q, k, v, key_padding_mask, check_finite=(
            distributed or call["whole_op_backend"] != "triton"))
        return {**call, **data, "seed": dropout_seed(call["dropout_p"])}

    infos = comm.agree(group, config, per_rank=_PER_RANK + ("seed",))
    call = infos[0]  # rank 0's dropout seed is the call's
    lengths = _agreed_lengths(infos)
    grads = _differentiated(infos)
    check_piece_lengths(lengths, layout)
    documents = check.check_documents(call["cu_seqlens"], sum(lengths))
    patterns = (call["segment_lengths"], call["dilation_rates"])
    opts = KernelOptions(call["is_causal"], call["scale"], call["backend"], call["dropout_p"],
                         call["seed"])
    route = (_Route.of(call["strategy"], group, layout,
                       _shape(call, lengths, patterns, call["is_causal"], documents))
             if distributed else _Route("local", None, group))
    if comm.group_rank(group) == 0:
        _warn_unread(sum(lengths), patterns, call["heads"], documents)

    def sequence(q: Tensor, k: Tensor, v: Tensor, heads: Optional[Heads], mask: Optional[Tensor],
                 opts: KernelOptions, group, lengths) -> Tuple[Tensor, Tensor]:
        """The attention of these rows over `group` (the exchange), or locally."""
        if comm.is_distributed(group):
            # the rank's own pairs in fused calls where the whole op would run fused
            return sequence_parallel_dilated_attention(
                q, k, v, patterns, opts, group, lengths, heads=heads, documents=documents,
                key_mask=mask, layout=Layout.named(layout, lengths),
                fused_pairs=call["whole_op_backend"] == "triton", kv_grad=grads[1])
        # one device checked nothing (the config's "nonfinite"): the fused kernels apply the
        # rule; Ulysses ranks replaced their non-finite rows (_attend)
        # (not dataclasses.replace: 2 us of host time a call)
        whole_op = KernelOptions(opts.causal, opts.scale, call["whole_op_backend"],
                                 opts.dropout_p, opts.seed)
        return dilated_attention_local(
            q, k, v, patterns, whole_op,
            heads=heads, documents=documents, key_mask=mask, nonfinite_rule=not distributed)

    run = functools.partial(route.run, lengths=lengths, opts=opts, sequence=sequence,
                            grads=grads)
    out, lse = _attend(run, q, k, v, key_padding_mask, infos)
    if return_lse:
        # (b, n, h) -> (b, h, n)
        return out, lse.transpose(1, 2)
    return out


def _attend(run, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
            infos) -> Tuple[Tensor, Tensor]:
    """`run(q, k, v, mask)`, with what every rank agreed about masks and non-finite keys."""
    # a mask that ignores nothing on any rank changes nothing: skip its cost
    mask = key_padding_mask if any(info["masked_keys"] for info in infos) else None
    if not any(info["nonfinite"] for info in infos):
        return run(q, k, v, mask)
    return _nonfinite_keys(run, q, k, v, mask)


def _nonfinite_keys(run, q: Tensor, k: Tensor, v: Tensor,
                    mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Attention where some q, k or v rows hold NaN/inf (on some rank): exact elsewhere.

    A kernel multiplies a masked-out probability (0) by a value row anyway
    (0 * NaN = NaN), so a non-finite row would reach queries that never
    attend it, and which ones depends on how launches are cut (one device
    and sequence-parallel would differ). So: attend with those rows zeroed,
    then attend once more with zero queries and values that mark them (1 in
    column 0 for a bad k row, column 1 for a bad v row; no gradient): every
    logit is then 0, so a query's marker output is positive exactly where it
    attends a marked row (with a positive count: masked pairs stay 0), and its
    output (and for a bad k its lse) becomes NaN, as exact arithmetic would
    give. A bad v row alone leaves the lse exact (its k is kept).
    """
    bad = _bad_keys(k, v)  # (b, n, hk, 2)
    # a non-finite query reaches its own row only (the CPU kernel would return 0 for it)
    bad_q = ~torch.isfinite(q).all(-1)  # (b, n, h)
    q = q.masked_fill(bad_q[..., None], 0.0)
    out, lse = run(q, k.masked_fill(bad[..., :1], 0.0), v.masked_fill(bad[..., 1:], 0.0), mask)
    with torch.no_grad():
        zero_q = torch.zeros_like(q)
        # the marked rows' k zeroed too: only finite values reach the marker's products
        k_kept = k.detach().masked_fill(bad.any(-1, keepdim=True), 0.0)
        if v.shape[-1] >= 2:
            marker = torch.zeros_like(v)
            marker[..., :2] = bad.to(v.dtype)
            hits = run(zero_q, k_kept, marker, mask)[0][..., :2]
        else:  # one value column: a marker run per column
            hits = torch.cat([run(zero_q, k_kept, bad[..., i:i + 1].to(v.dtype), mask)[0]
                              for i in range(2)], dim=-1)
    hit_k = (hits[..., 0] > 0) | bad_q  # (b, n, h)
    out = out.masked_fill((hit_k | (hits[..., 1] > 0))[..., None], math.nan)
    return out, lse.masked_fill(hit_k, math.nan)


def _warn_unread(n: int, patterns: Patterns, heads: int, documents: Documents) -> None:
    """A UserWarning (once per pattern set) when some (row, head) is read by no pattern."""
    if torch.compiler.is_compiling():
        # the count is pure planning (no data), but Dynamo would trace its cache wrapper;
        # an eager call of the same pattern set warns
        return
    count = unread_rows(n, patterns, heads, documents)
    if count:
        # the text names the pattern set only, so Python shows it once per pattern set
        warnings.warn(
            f"dilated attention with segment_lengths {list(patterns[0])} and dilation_rates "
            f"{list(patterns[1])} over {heads} heads leaves some (row, head) pairs unread: "
            f"no head's pattern selects them, so their outputs are 0 (docs/spec.md, 'One "
            f"pattern'). Add a pattern with rate 1, or rates that the heads' offsets cover.",
            # at the user's call: _warn_unread, the op, _follows_autocast's and
            # _eager_across_ranks' wrappers, the caller
            UserWarning, stacklevel=5,
        )


@_eager_across_ranks
@_follows_autocast
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    group: GroupLike = None,
    return_lse: bool = False,
    layout: str = "contiguous",
    backend: str = "auto",
    cu_seqlens: CuSeqlens = None,
    key_padding_mask: Optional[Tensor] = None,
    window_size: Tuple[int, int] = (-1, -1),
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact dense attention over the whole sequence spread across `group`.

    Args:
        q: (batch, seq_len, heads, head_dim), this rank's piece.
        k, v: (batch, seq_len, kv_heads, head_dim); kv_heads divides heads.
        is_causal: queries see only keys at or before their global position.
        scale: softmax scale, default 1/sqrt(head_dim).
        group: the process group (or 1-D DeviceMesh) the sequence is spread
            over, or a 2-D DeviceMesh: head-parallel (Ulysses) over its first
            dimension, the ring over its second; the rank at mesh coordinate
            (u, s) passes piece s * U + u. None (or one rank) is plain local
            attention.
        return_lse: also return the log-sum-exp (batch, heads, seq_len).
        layout: "contiguous" (rank p holds the p-th piece; pieces may differ
            in length and be empty) or "zigzag" (2P equal chunks, rank p
            holds chunks p and 2P-1-p concatenated: even causal work; see
            ``shard_sequence``).
        backend: kernel override, as for ``dilated_attention``.
        window_size: a sliding window (left, right), flash-attn's convention:
            query t attends the keys t - left .. t + right (of its document),
            -1 unbounded on that side; (-1, -1) (the default) is dense. With
            is_causal the right side is 0 (a positive one is a ValueError).
            One device: exact banded tiles; under a group each rank fetches
            only the `left` rows before its piece and the `right` rows after
            it (a halo exchange), whatever the sequence length.
        cu_seqlens, key_padding_mask: packed documents and key padding, as
            for ``dilated_attention``. With either, the attention runs on the
            dilated machinery with one segment per document (dense attention
            is its special case): a document inside one rank costs no
            traffic, one that spans ranks moves only its own rows.

    Returns:
        This rank's rows of out (batch, seq_len, heads, head_dim), or
        (out, lse) with lse float32 (float64 for float64 inputs). Every rank
        must call this (and its backward) with the same configuration; a
        mismatch or a bad argument on any rank raises on every rank.
    """
    group = comm.resolve_group(group)
    distributed = comm.is_distributed(group)

    def checked() -> Dict[str, Any]:
        tensors = _tensor_config(q, k, v, key_padding_mask, allow_empty=distributed)
        causal = check.check_bool("is_causal", is_causal)
        return {
            **tensors,
            "is_causal": causal,
            "window_size": check.check_window(window_size, causal),
            "return_lse": check.check_bool("return_lse", return_lse),
            "scale": check.check_scale(scale, q.shape[-1]),
            "layout": check_layout(layout),
            "cu_seqlens": check.check_cu_seqlens(cu_seqlens),
            "backend": select_backend(q.device, q.dtype, backend=backend,
                                      masked=tensors["key_padding_mask"],
                                      head_dim=q.shape[-1]),
        }

    def config() -> Dict[str, Any]:
        call = _RING_CALLS.get(
            check.signature((q, k, v, key_padding_mask),
                            (distributed, is_causal, window_size, return_lse, scale, layout,
                             cu_seqlens, backend)),
            checked)
        return {**call, **_data_config(q, k, v, key_padding_mask, check_finite=True)}

    infos = comm.agree(group, config, per_rank=_PER_RANK)
    call = infos[0]
    lengths = _agreed_lengths(infos)
    grads = _differentiated(infos)
    check_piece_lengths(lengths, layout)
    documents = check.check_documents(call["cu_seqlens"], sum(lengths))
    window = _effective_window(call["window_size"], sum(lengths))
    # a window unbounded on the left and ending at the query is causal attention
    windowed = window not in ((-1, -1), (-1, 0))
    opts = KernelOptions(call["is_causal"] or window == (-1, 0), call["scale"], call["backend"])
    dense_patterns = ((sum(lengths),), (1,))
    # a 2-D mesh: Ulysses over its heads dimension, the ring over its sequence dimension
    route = _Route.of("ulysses" if isinstance(group, comm.Grid) else "exchange", group, layout,
                      _shape(call, lengths, dense_patterns, opts.causal, documents))

    def dense(q: Tensor, k: Tensor, v: Tensor, heads: Optional[Heads], mask: Optional[Tensor],
              opts: KernelOptions, group, lengths) -> Tuple[Tensor, Tensor]:
        """Dense or windowed attention of these rows over `group` (the ring, the halo
        exchange or the dilated exchange), or locally."""
        if (windowed or (mask is None and documents is None)) and heads is not None \
                and not heads.grouped:
            # a head-parallel rank's query heads read its kv heads unevenly: give each
            # query head its own copy (the kernels broadcast only j -> j // g)
            k, v = k[:, :, list(heads.kv_of)], v[:, :, list(heads.kv_of)]
        if windowed:
            if not comm.is_distributed(group):
                return window_attention_local(q, k, v, window, opts, documents=documents,
                                              key_mask=mask)
            return halo_attention(q, k, v, window, opts, group, Layout.named(layout, lengths),
                                  documents=documents, key_mask=mask, kv_grad=grads[1])
        if mask is None and documents is None:
            return RingAttentionFunction.apply(q, k, v, opts, group, layout, lengths, None,
                                               grads[1])
        if not comm.is_distributed(group):
            return dilated_attention_local(q, k, v, dense_patterns, opts, heads=heads,
                                           documents=documents, key_mask=mask)
        return sequence_parallel_dilated_attention(
            q, k, v, dense_patterns, opts, group, lengths, heads=heads, documents=documents,
            key_mask=mask, layout=Layout.named(layout, lengths), kv_grad=grads[1])

    run = functools.partial(route.run, lengths=lengths, opts=opts, sequence=dense,
                            grads=grads)
    out, lse = _attend(run, q, k, v, key_padding_mask, infos)
    if return_lse:
        # (b, n, h) -> (b, h, n)
        return out, lse.transpose(1, 2)
    return out
