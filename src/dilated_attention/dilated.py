"""Exact dilated attention on one device: forward, backward, autograd.

Notation: b batch, n sequence, h query heads, hk key/value heads, d head dim;
a pattern is (w, r) = (segment length, dilation rate).

Per pattern, the segments' selected rows are gathered into dense batches
(a free view when r == 1, a strided view where the device reads one),
launched in row blocks and head groups (policy.py sizes them), and each
launch's (out, lse) is merged on the fly into fp32 accumulators with the
log-sum-exp merge (launches.py). The backward reuses the merged (out, lse):
each pattern's kernel backward recomputes its share of the *global* softmax,
so dq sums over patterns and no lse gradient is needed from any kernel. With
backend "triton" one fused kernel computes every pattern in one pass instead
(fused.py), forward and backward.

The public entry point, which validates the call once and picks this op or
a sequence-parallel one, is ``functional.dilated_attention``.
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import fused, launches
from .kernels import (KernelOptions, lse_dtype, records_backward, save_for_backward,
                      saved_for_backward)
from .patterns import Heads, Patterns
from .layout import Documents, Layout
from .plan import Plan, make_plan


def local_plan(q: Tensor, k: Tensor, patterns: Patterns, causal: bool, heads: Optional[Heads],
               documents: Documents) -> Plan:
    """The plan of one device holding the whole sequence (q (b, n, h, d), k (b, n, hk, d))."""
    heads = heads or Heads.of(q.shape[2], k.shape[2])
    layout = Layout.contiguous([q.shape[1]])
    return make_plan(layout, patterns, causal, heads, 0, str(q.device), documents)


class LocalCall(NamedTuple):
    """A validated single-device call, less its tensors. nonfinite_rule: the fused kernels
    apply docs/spec.md's non-finite rule (the caller checked nothing; see `forward_local`)."""

    patterns: Patterns
    opts: KernelOptions
    heads: Heads
    documents: Documents
    nonfinite_rule: bool

    def flat(self) -> Tuple:
        """The call as the custom ops take it (their arguments after q, k, v; key_mask goes
        before nonfinite_rule)."""
        opts = self.opts
        return (list(self.patterns[0]), list(self.patterns[1]), opts.causal, opts.scale,
                opts.backend, opts.dropout_p, opts.seed, self.heads.first,
                list(self.heads.kv_of), None if self.documents is None else list(self.documents))


def forward_local(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                  dropout_seed: Optional[Tensor], call: LocalCall
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """The single-device forward: q (b, n, h, d), k/v (b, n, hk, d), key_mask (b, n) bool
    (True = ignore that key) -> out (b, n, h, d), lse (b, n, h) fp32, and an fp32 check (1,)
    for the backward. With call.nonfinite_rule the vector is the fused kernels' check, left
    on the device and not finite where q, k or v holds a NaN or an infinity that the
    kernels read (fused.new_check, made NaN by the forward kernel; triton_kernels' module
    docstring), else unset and unread. dropout_seed: the fused kernels' dropout key
    (fused.new_seed; None without dropout or with another backend, whose launches draw their
    masks from opts.seed)."""
    opts = call.opts
    if opts.backend == "triton" and call.nonfinite_rule:
        nonfinite = fused.new_check(q.device)
    else:
        nonfinite = torch.empty(1, dtype=torch.float32, device=q.device)
    if opts.backend == "triton":
        out, lse = fused.forward(q, k, v, call.patterns, causal=opts.causal, scale=opts.scale,
                                 heads=call.heads, documents=call.documents, key_mask=key_mask,
                                 nonfinite=nonfinite if call.nonfinite_rule else None,
                                 dropout=_fused_dropout(call, dropout_seed))
    else:
        plan = local_plan(q, k, call.patterns, opts.causal, call.heads, call.documents)
        out, lse = launches.forward(q, k, v, plan, opts, key_mask=key_mask)
    return out, lse, nonfinite


def backward_local(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dlse: Optional[Tensor], nonfinite: Tensor, key_mask: Optional[Tensor],
                   dropout_seed: Optional[Tensor], call: LocalCall, kv_grad: bool = True
                   ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of `forward_local`, given its final out (b, n, h, d), lse (b, n, h) and
    nonfinite check; not `kv_grad` (k and v frozen): dk and dv may be None (the fused
    kernels then skip their dK/dV work; the other backends compute them anyway)."""
    opts = call.opts
    # a recorded backward (create_graph=True) runs launches of a differentiable kernel
    # (kernels.attention_backward); the fused kernel has no derivative
    recorded = records_backward(dout, q, k, v, out, lse, dlse)
    if recorded and dropout_seed is not None:
        # those launches would draw other masks than the fused forward's
        raise ValueError(
            f"a recorded backward (create_graph=True) of backend 'triton' with dropout "
            f"(dropout_p={opts.dropout_p}) is not supported: its launches would draw other "
            f"masks; use backend='blockwise'")
    if opts.backend == "triton" and not recorded:
        return fused.backward(dout, q, k, v, out, lse, dlse, call.patterns, causal=opts.causal,
                              scale=opts.scale, heads=call.heads, documents=call.documents,
                              key_mask=key_mask,
                              nonfinite=nonfinite if call.nonfinite_rule else None,
                              kv_grad=kv_grad, dropout=_fused_dropout(call, dropout_seed))
    plan = local_plan(q, k, call.patterns, opts.causal, call.heads, call.documents)
    return launches.backward(dout, q, k, v, out, lse, plan, opts, dlse=dlse, key_mask=key_mask)


def _fused_dropout(call: LocalCall, seed: Optional[Tensor]) -> Optional[fused.Dropout]:
    """The fused kernels' dropout (Note [fused dropout] in fused.py): a bit per pattern."""
    if seed is None:
        return None
    return fused.Dropout.of(call.opts.dropout_p, len(call.patterns[0]), seed,
                            first_head=call.heads.first)


# Under torch.compile the single-device op is a pair of custom ops (forward, backward):
# the compiler sees one opaque node per call instead of tracing the planning and every
# launch, and autograd is registered on the forward. Their arguments are the call
# flattened to the types custom ops take (LocalCall.flat). Eager calls run the same
# functions through a plain autograd.Function (`_LocalAttention`), with the call as one
# argument: the dispatcher's wrapping of a custom op cost more host time than the fused
# forward's own Python, and so did flattening the call and building it again
# (bench_call_overhead.py --host-only; BENCHMARKS.md, "Host time per call").


def forward_flat(q: Tensor, k: Tensor, v: Tensor, segment_lengths: List[int],
                 dilation_rates: List[int], causal: bool, scale: float, backend: str,
                 dropout_p: float, seed: int, first_head: int, kv_of: List[int],
                 cu_seqlens: Optional[List[int]], key_mask: Optional[Tensor],
                 dropout_seed: Optional[Tensor], nonfinite_rule: bool
                 ) -> Tuple[Tensor, Tensor, Tensor]:
    """`forward_local` with the call flattened (LocalCall.flat; key_mask and dropout_seed
    before nonfinite_rule)."""
    return forward_local(q, k, v, key_mask, dropout_seed, _unflatten(
        segment_lengths, dilation_rates, causal, scale, backend, dropout_p, seed, first_head,
        kv_of, cu_seqlens, nonfinite_rule))


def backward_flat(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  dlse: Optional[Tensor], nonfinite: Tensor, segment_lengths: List[int],
                  dilation_rates: List[int], causal: bool, scale: float, backend: str,
                  dropout_p: float, seed: int, first_head: int, kv_of: List[int],
                  cu_seqlens: Optional[List[int]], key_mask: Optional[Tensor],
                  dropout_seed: Optional[Tensor], nonfinite_rule: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """`backward_local` with the call flattened, as `forward_flat`'s."""
    call = _unflatten(segment_lengths, dilation_rates, causal, scale, backend, dropout_p, seed,
                      first_head, kv_of, cu_seqlens, nonfinite_rule)
    return backward_local(dout, q, k, v, out, lse, dlse, nonfinite, key_mask, dropout_seed, call)


_forward_op = torch.library.custom_op("dilated_attention::forward", forward_flat,
                                      mutates_args=())
_backward_op = torch.library.custom_op("dilated_attention::backward", backward_flat,
                                       mutates_args=())


def _unflatten(segment_lengths, dilation_rates, causal, scale, backend, dropout_p, seed,
               first_head, kv_of, cu_seqlens, nonfinite_rule) -> LocalCall:
    return LocalCall((tuple(segment_lengths), tuple(dilation_rates)),
                     KernelOptions(causal, scale, backend, dropout_p, seed),
                     Heads(first_head, tuple(kv_of)),
                     None if cu_seqlens is None else tuple(cu_seqlens), nonfinite_rule)


@_forward_op.register_fake
def _forward_shapes(q, k, v, *args):
    return (torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype)),
            q.new_empty(1, dtype=torch.float32))


@_backward_op.register_fake
def _backward_shapes(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    # not materialising gradients matters: a zeros dlse would cost every backward launch
    # the lse-gradient padding (kernels.attention_backward)
    q, k, v, *flat = inputs
    _save(ctx, q, k, v, key_mask=flat[-3], dropout_seed=flat[-2],
          call=_unflatten(*flat[:-3], flat[-1]), output=output)


def _save(ctx, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
          dropout_seed: Optional[Tensor], call: LocalCall,
          output: Tuple[Tensor, Tensor, Tensor]) -> None:
    """What `_backward` reads: the inputs, the output and its check, the call."""
    out, lse, nonfinite = output
    save_for_backward(ctx, q, k, v, (out, lse), call, nonfinite)
    ctx.key_mask, ctx.dropout_seed = key_mask, dropout_seed


def _backward(ctx, dout, dlse, _):
    dout, q, k, v, out, lse, nonfinite = saved_for_backward(ctx, dout)
    call, key_mask, seed = ctx.args, ctx.key_mask, ctx.dropout_seed
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return _backward_op(dout, q, k, v, out, lse, dlse, nonfinite, *call.flat(), key_mask,
                            seed, call.nonfinite_rule)
    # eager; or create_graph=True (double backward): the backward op has no derivative, so
    # its Python code runs, which autograd records (its launches then use the blockwise
    # kernel, built from differentiable ops; kernels.attention_backward). out and lse keep
    # their own graph through this op, so the second derivative is exact.
    return backward_local(dout, q, k, v, out, lse, dlse, nonfinite, key_mask, seed, call,
                          kv_grad=ctx.needs_input_grad[1] or ctx.needs_input_grad[2])


# the custom op's inputs after q, k, v: the flat call, key_mask, dropout_seed, nonfinite_rule
_CALL_INPUTS = forward_flat.__code__.co_argcount - 3


def _op_backward(ctx, dout, dlse, nonfinite):
    # no gradient for the call's inputs
    return _backward(ctx, dout, dlse, nonfinite) + (None,) * _CALL_INPUTS


torch.library.register_autograd("dilated_attention::forward", _op_backward,
                                setup_context=_setup_context)


class _LocalAttention(torch.autograd.Function):
    """The eager twin of the custom op pair: the same forward, context and backward, with
    the call as one argument. The forward takes `ctx` itself: a separate setup_context
    would make every apply bind its arguments by inspect.signature, host time on every
    call."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, dropout_seed, call):
        output = forward_local(q, k, v, key_mask, dropout_seed, call)
        ctx.mark_non_differentiable(output[2])
        _save(ctx, q, k, v, key_mask, dropout_seed, call, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse, nonfinite):
        return _backward(ctx, dout, dlse, nonfinite) + (None, None, None)


# Heads.of, kept for eager calls (Dynamo cannot trace an lru_cache): building it took 2.5 us
# of every call's host time
_all_heads = functools.lru_cache(maxsize=256)(Heads.of)


def dilated_attention_local(q: Tensor, k: Tensor, v: Tensor, patterns: Patterns,
                            opts: KernelOptions, *, heads: Optional[Heads] = None,
                            documents: Documents = None, key_mask: Optional[Tensor] = None,
                            nonfinite_rule: bool = False) -> Tuple[Tensor, Tensor]:
    """The single-device op, differentiable: out (b, n, h, d), lse (b, n, h) fp32.

    The call is already validated (``functional.dilated_attention``), and its non-finite
    rows replaced (``functional._nonfinite_keys``) unless `nonfinite_rule`: then the fused
    kernels apply the rule themselves (other backends ignore it).
    """
    compiling = torch.compiler.is_compiling()
    heads = heads or (Heads.of if compiling else _all_heads)(q.shape[2], k.shape[2])
    call = LocalCall(patterns, opts, heads, documents, nonfinite_rule)
    # the fused kernels' dropout key, drawn on the device (Note [fused dropout] in fused.py)
    seed = (fused.new_seed(q.device) if opts.dropout_p > 0.0 and opts.backend == "triton"
            else None)
    if compiling:
        out, lse, _ = _forward_op(q, k, v, *call.flat(), key_mask, seed, nonfinite_rule)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse, _ = _LocalAttention.apply(q, k, v, key_mask, seed, call)
    else:
        # nothing to differentiate: the Function's machinery would be host time alone
        out, lse, _ = forward_local(q, k, v, key_mask, seed, call)
    return out, lse
