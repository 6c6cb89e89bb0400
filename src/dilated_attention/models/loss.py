"""The language-model loss: token-mean cross-entropy over every rank, and its gradient convention.

Under sequence parallelism each rank holds its own tokens; the loss is the
global token mean on every rank and its gradient P times this rank's share
(Note [gradients across ranks] in distributed/gradients.py).

Two ways to the same loss: ``token_mean_loss`` from logits, and
``chunked_token_mean_loss`` from the final hidden states and the head's
weight, which never holds the logits (Note [chunked head loss]).

Notation: b batch, n tokens (this rank's piece), e embed dim, v vocabulary,
r rows of one chunk.

Note [chunked head loss]
    The logits of n tokens take n v accumulator-dtype numbers (fp32 for
    half-precision models): 4.2 GB for 32K tokens of a 32K vocabulary, and
    autograd keeps them, their fp32 copy and their gradient alive together.
    ``chunked_token_mean_loss`` computes the summed cross-entropy r rows at
    a time (r chosen so that one chunk's accumulator logits take at most
    ``chunk_bytes``): per chunk the logits, their log-sum-exp and the
    picked target logit, then the chunk is dropped; it saves the hidden
    states (b n, e), which the head would have saved anyway, and the
    per-row log-sum-exp (b n). The loss is the end of the graph, so its
    gradients differ from those of the summed loss only by the incoming
    gradient, a scalar: where a gradient is needed, the forward also forms
    each chunk's softmax - onehot(target) (zero on ignored rows) from the
    logits it has, and accumulates d hidden chunk by chunk and d weight
    (and d bias) over the chunks, in the accumulator dtype; the backward
    multiplies them by the incoming gradient, in place. Three head matmuls
    instead of four (the plain path's three), for d hidden and d weight
    existing from the forward on: d weight exists through the whole
    backward either way, and the peak stays about one chunk's logits plus
    one (v, e) accumulator and one (b n, e), whatever n. A second backward
    of the graph (retain_graph=True) recomputes each chunk's logits from
    the saved hidden states and lse instead (the first one used the
    gradients up), and so does the compiled custom op pair.
    Only a forward that a backward can follow forms them (gradients enabled,
    the model training). In float16 one chunk's unscaled d weight (the
    summed loss's: up to r rows of |d logits| |hidden|, where the plain path
    has them times 1 / count) can pass 65504: where r max|hidden| could,
    the chunk's hidden rows enter that matmul scaled by a power of two (exact)
    and its product is scaled back in the fp32 accumulator.
    The matmuls run in the model's dtype and the softmax in the accumulator
    dtype, as the plain path (``F.linear`` then ``token_mean_loss``) does,
    so the loss and gradients equal the plain ones to rounding (fp64 tests).
    In a half-precision model a chunk's logits come from the matmul in a
    model-dtype buffer, cast into the accumulator one; its d logits go back
    into the model-dtype buffer for the d hidden and d weight matmuls (d bias
    sums them before, in fp32). Both buffers are made once per call
    (``_ChunkBuffers``), and d weight's model-dtype product is made in
    vocabulary slices inside the accumulator buffer, free by then: a chunk
    holds its logits in fp32 and in the model's dtype and no (v, e)
    temporary (a bf16 loss made one per chunk, v e 2 bytes: more than a
    chunk's logits for a large vocabulary). A matmul with an fp32 output
    for half inputs (``torch.mm(..., out_dtype=)``) would spare the casts
    and the slices, but torch 2.13's CPU build has no kernel for it (any
    dtype: NotImplementedError), and on CUDA, which has one, it would be
    untested here: not used.
    Under ``create_graph=True`` the backward is itself recorded: out-of-place
    ops, each chunk's softmax recomputed from its logits, so a second
    derivative holds every chunk's softmax (the logits' memory, as the plain
    path's second derivative does).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import validation as check
from ..distributed import comm
from ..distributed.gradients import sum_across_ranks
from ..functional import autocast_dtype

IGNORE_INDEX = -100

# One chunk's accumulator logits (Note [chunked head loss]): at most 64 MiB; 167 rows of
# LongNet's 100,277-id vocabulary, 524 rows of a 32,000-id one (fp32).
LOSS_CHUNK_BYTES = 64 * 2**20


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed in: fp32 for half-precision logits, fp64 stays fp64
    (the attention's lse dtype; the models stay above the kernels, so it is said again)."""
    return torch.promote_types(dtype, torch.float32)


def loss_chunk_rows(vocab_size: int, dtype: torch.dtype,
                    chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Rows per chunk: the most whose accumulator-dtype logits fit in chunk_bytes (at least 1)."""
    itemsize = torch.empty((), dtype=accumulator_dtype(dtype)).element_size()
    return max(1, chunk_bytes // (itemsize * vocab_size))


def token_mean_loss(logits: Tensor, targets: Tensor, group: comm.GroupLike) -> Tensor:
    """Cross-entropy averaged over every non-ignored token of every rank.

    Targets are aligned with the logits (position t predicts targets[t]);
    every rank of `group` calls it, a rank without targets too. When no rank
    has a target that is not ignored the loss is 0 (not 0/0 = NaN), still
    connected to the logits, so ``backward`` gives zero gradients. Under a
    group of P ranks the value is the global mean on every rank and the
    gradient is P times this rank's share of it, so that averaging the
    gradients over the group (all_reduce_gradients, DDP, FSDP2) sums the
    shares (Note [gradients across ranks] in distributed/gradients.py).
    """
    # (b, n, v) -> (b n, v)
    total = F.cross_entropy(logits.to(accumulator_dtype(logits.dtype)).flatten(0, 1),
                            targets.flatten().long(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return _mean_over_ranks(total, targets, group)


def chunked_token_mean_loss(hidden: Tensor, weight: Tensor, targets: Tensor, group, *,
                            bias: Optional[Tensor] = None, chunk_bytes: int = LOSS_CHUNK_BYTES,
                            training: bool = True) -> Tensor:
    """``token_mean_loss(F.linear(hidden, weight, bias), targets, group)`` without the logits.

    hidden (b, n, e) the final hidden states, weight (v, e) the head's (the
    token embedding when tied), bias (v,) or None, targets (b, n). The
    cross-entropy runs over chunks of rows whose accumulator-dtype logits
    take at most `chunk_bytes` (Note [chunked head loss]); value, gradients
    and the sequence-parallel convention are ``token_mean_loss``'s. Under
    autocast the head runs in the autocast dtype, as ``F.linear`` would.
    training: a backward follows (the models pass their ``training``), so a
    forward that needs gradients forms them from the logits it has; False
    (evaluation with gradients on, which may never run a backward) keeps
    the forward to the loss and recomputes the logits in a backward. Forming
    them also needs gradients enabled (a training model's forward under
    ``torch.no_grad()`` or ``inference_mode``, a validation loop without
    ``model.eval()``, runs no backward).
    """
    chunk_bytes = check.check_positive_int("chunk_bytes", chunk_bytes)
    check.check_bool("training", training)
    # the dtype F.linear(hidden, ...) computes in here: autocast's, else hidden's
    compute = autocast_dtype(hidden.device.type, hidden.dtype) or hidden.dtype
    rows = loss_chunk_rows(weight.shape[0], compute, chunk_bytes)
    # (b, n, e) -> (b n, e); (b, n) -> (b n,)
    flat = (hidden.flatten(0, 1), weight, bias, targets.flatten(), rows, compute)
    if torch.compiler.is_compiling():
        # a custom op, as the attention: its chunk loop runs at run time, not traced (it
        # would fix the sequence length)
        total = _forward_op(*flat)[0]
    else:
        # Function.forward runs with gradients off: whether a backward can follow is decided here
        total = _ChunkedHeadLoss.apply(*flat, training and torch.is_grad_enabled())
    return _mean_over_ranks(total, targets, group)


def _autocast_off(device_type: str):
    """Autocast off for `device_type` (nothing to turn off where it has none, e.g. meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _mean_over_ranks(total: Tensor, targets: Tensor, group) -> Tensor:
    """The global token mean from this rank's summed loss: one all-reduce of (sum, count)."""
    count = (targets != IGNORE_INDEX).sum().to(total.dtype)
    summed = sum_across_ranks(torch.stack([total, count]), group)
    # count 0 means total 0 (an empty sum): 0 / 1 instead of NaN; count >= 1 is unchanged
    return summed[0] / summed[1].clamp(min=1)


def head_loss_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                      rows: int) -> Tuple[Tensor, Tensor]:
    """hidden (N, e), targets (N,) -> (summed cross-entropy of the non-ignored rows, lse (N,)).

    hidden, weight and bias in one dtype (the model's); the sums in its accumulator dtype.
    """
    acc = accumulator_dtype(hidden.dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    buffers = _ChunkBuffers(hidden, weight, rows)
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        logits = buffers.logits(hidden[start:stop], weight, bias)  # (r, v)
        total += _chunk_loss_(logits, targets[start:stop], lse[start:stop])[0]
    return total, lse


class _ChunkBuffers:
    """The chunk loop's (rows, v) buffers, made once per call and reused by every chunk (a
    fresh 64 MiB chunk a time is new pages to fault in on a CPU): the accumulator-dtype
    logits, and in a half-precision model the matmuls' model-dtype logits and d logits
    (Note [chunked head loss]). product: d weight is formed, whose half-precision product
    slices take the accumulator buffer's storage (at least one (e,) row of it)."""

    def __init__(self, hidden: Tensor, weight: Tensor, rows: int, product: bool = False):
        acc = accumulator_dtype(hidden.dtype)
        rows, (v, e) = min(rows, hidden.shape[0]), weight.shape
        half = acc != hidden.dtype
        numel = max(rows * v, e) if product and half else rows * v
        self.flat = torch.empty(numel, dtype=acc, device=hidden.device)
        self.acc = self.flat[:rows * v].view(rows, v)
        self.low = torch.empty((rows, v), dtype=hidden.dtype, device=hidden.device) \
            if half else None

    def logits(self, h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """h (r, e) -> F.linear(h, weight, bias) in the accumulator dtype, (r, v), in the
        buffer (F.linear's own matmul: bit for bit the plain path's logits)."""
        out = self.acc[:h.shape[0]]
        low = out if self.low is None else self.low[:h.shape[0]]
        if bias is None:
            torch.mm(h, weight.t(), out=low)
        else:
            torch.addmm(bias, h, weight.t(), out=low)
        return out if self.low is None else out.copy_(low)

    def model_dtype(self, d: Tensor) -> Tensor:
        """A chunk's d logits (r, v), accumulator dtype, in the model's dtype (the buffer)."""
        return d if self.low is None else self.low[:d.shape[0]].copy_(d)

    def product_slices(self, d: Tensor, h: Tensor):
        """(vocabulary slice, d[:, slice]^T h in the model's dtype) pairs covering the
        vocabulary, each product in the accumulator logits' storage (call once d has been
        cast out of it)."""
        scratch = self.flat.view(d.dtype)
        e = h.shape[1]
        step = max(1, min(d.shape[1], scratch.numel() // e))
        for lo in range(0, d.shape[1], step):
            hi = min(lo + step, d.shape[1])
            # (r, s)^T (r, e) -> (s, e)
            yield slice(lo, hi), torch.mm(d[:, lo:hi].t(), h,
                                          out=scratch[:(hi - lo) * e].view(hi - lo, e))


def _chunk_loss_(logits: Tensor, t: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    """One chunk's summed cross-entropy over its kept rows, from its accumulator logits (r, v)
    and targets t (r,): writes the rows' log-sum-exp into `lse` (r,), turns `logits` into
    exp(logits - the row's max) in place and returns (the sum, those rows' sums (r,)), so
    that the softmax is logits / sums. One exp per logit, in place: torch.logsumexp took
    three times as long as these passes on CPU (and a softmax after it another exp)."""
    # (r,) -> (r, 1) indices: each row's target logit (ignored rows read column 0)
    picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    peak = logits.amax(dim=-1)
    sums = logits.sub_(peak[:, None]).exp_().sum(dim=-1)
    torch.add(sums.log(), peak, out=lse)
    return torch.where(t != IGNORE_INDEX, lse - picked, 0).sum(), sums


def head_loss_with_gradients(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                             targets: Tensor, rows: int, needs: Tuple[bool, bool, bool]
                             ) -> Tuple[Tensor, Tensor, Tuple[Optional[Tensor], ...]]:
    """``head_loss_forward`` and the gradients of its total (incoming gradient 1) w.r.t.
    (hidden, weight, bias), those `needs` asks for, from the same logits: each chunk's
    logits are computed once, not again in backward (Note [chunked head loss]).

    Returns (total, lse, (d hidden, d weight, d bias)); d hidden in hidden's dtype, d weight
    and d bias in the accumulator dtype, as ``head_loss_backward`` returns them.
    """
    acc = accumulator_dtype(hidden.dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    grads = _gradient_buffers(hidden, weight, acc, needs)
    buffers = _ChunkBuffers(hidden, weight, rows, product=needs[1])
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h, t = hidden[start:stop], targets[start:stop]
        logits = buffers.logits(h, weight, bias)  # (r, v)
        loss, sums = _chunk_loss_(logits, t, lse[start:stop])
        total += loss
        keep = t != IGNORE_INDEX
        # the softmax in place (ignored rows 0): (r,) -> (r, 1) factors
        d = logits.mul_(torch.where(keep, sums.reciprocal(), 0)[:, None])
        # (r,) -> (r, 1): minus one at each kept row's target
        d.scatter_add_(1, t.clamp(min=0)[:, None], -keep.to(acc)[:, None])
        _add_chunk(d, h, weight, start, grads, buffers, unscaled=True)
    return total, lse, grads


def head_loss_backward(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                       targets: Tensor, lse: Tensor, rows: int,
                       needs: Tuple[bool, bool, bool]) -> Tuple[Optional[Tensor], ...]:
    """Gradients of ``grad * total`` w.r.t. (hidden, weight, bias), those `needs` asks for.

    d logits = grad (softmax - onehot(target)) on kept rows, 0 on ignored
    ones, cast to the model's dtype (as the plain path casts it back); then
    d hidden = d logits @ weight chunk by chunk, and d weight += d logits^T
    hidden and d bias += its column sums over the chunks, summed in the
    accumulator dtype (returned in it: the caller casts).
    """
    if torch.is_grad_enabled():
        return _recorded_head_loss_backward(grad, hidden, weight, bias, targets, rows, needs)
    acc = lse.dtype
    grads = _gradient_buffers(hidden, weight, acc, needs)
    buffers = _ChunkBuffers(hidden, weight, rows, product=needs[1])
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h, t = hidden[start:stop], targets[start:stop]
        keep = t != IGNORE_INDEX
        # the softmax in place: exp(logits - lse), (r, v)
        d = buffers.logits(h, weight, bias).sub_(lse[start:stop, None]).exp_()
        # (r,) -> (r, 1): minus one at each kept row's target
        d.scatter_add_(1, t.clamp(min=0)[:, None], -keep.to(acc)[:, None])
        _add_chunk(d.mul_((grad * keep)[:, None]), h, weight, start, grads, buffers)
    return grads


def _gradient_buffers(hidden: Tensor, weight: Tensor, acc: torch.dtype,
                      needs: Tuple[bool, bool, bool]) -> Tuple[Optional[Tensor], ...]:
    """(d hidden in hidden's dtype, d weight and d bias zeroed in `acc`), those `needs` asks
    for (None for the others)."""
    need_h, need_w, need_b = needs
    return (torch.empty_like(hidden) if need_h else None,
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None,
            torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None)


def _add_chunk(d: Tensor, h: Tensor, weight: Tensor, start: int,
               grads: Tuple[Optional[Tensor], ...], buffers: _ChunkBuffers,
               unscaled: bool = False) -> None:
    """One chunk's d logits (r, v) in the accumulator dtype (in `buffers`), of hidden rows h
    (r, e) from `start`: d bias += d's column sums, then, with d in the model's dtype (as
    the plain path casts it back), d hidden's rows = d @ weight and d weight += d^T h, in
    the buffers' accumulator dtype. unscaled: d is the summed loss's (|d| <= 1, no incoming
    gradient applied), whose float16 d^T h may pass float16's range."""
    dh, dw, db = grads
    if db is not None:
        db += d.sum(0)
    d = buffers.model_dtype(d)
    if dh is not None:
        torch.mm(d, weight, out=dh[start:start + d.shape[0]])
    if dw is None:
        return
    if d.dtype == dw.dtype:
        dw.addmm_(d.t(), h)
        return
    scale = None
    if unscaled and d.dtype == torch.float16:
        # |d^T h| <= r max|h| (each |d| <= 1): h enters scaled by 2^-k, k the least that
        # brings that bound under 2^15 (0 almost always: the same bits), and the product
        # is scaled back as the fp32 sum takes it; no host sync (the scale is a tensor)
        k = torch.log2(h.abs().amax().float() * d.shape[0] / 2**15).ceil().clamp(min=0)
        h, scale = h * torch.exp2(-k).to(h.dtype), torch.exp2(k)
    # half precision: each chunk's product in it, their sum in fp32
    for rows, product in buffers.product_slices(d, h):
        if scale is None:
            dw[rows] += product
        else:
            dw[rows].addcmul_(product, scale)


def _recorded_head_loss_backward(grad: Tensor, hidden: Tensor, weight: Tensor,
                                 bias: Optional[Tensor], targets: Tensor, rows: int,
                                 needs: Tuple[bool, bool, bool]) -> Tuple[Optional[Tensor], ...]:
    """``head_loss_backward`` recorded for a second derivative (backward under
    ``create_graph=True``): out-of-place ops, and each chunk's softmax recomputed from its
    logits (the saved lse is a constant to autograd). Autograd then keeps every chunk's
    softmax, (N, v) in all: the logits' memory, which a second derivative needs anyway."""
    acc = accumulator_dtype(hidden.dtype)
    need_h, need_w, need_b = needs
    dh = []
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h, t = hidden[start:stop], targets[start:stop]
        keep = t != IGNORE_INDEX
        probs = torch.softmax(F.linear(h, weight, bias).to(acc), dim=-1)  # (r, v)
        # (r,) -> (r, v): one at each kept row's target
        onehot = F.one_hot(t.clamp(min=0), weight.shape[0]).to(acc) * keep.to(acc)[:, None]
        d = ((probs - onehot) * (grad * keep)[:, None]).to(hidden.dtype)
        if need_h:
            dh.append(d @ weight)
        if need_w:
            dw = dw + (d.t() @ h).to(acc)
        if need_b:
            db = db + d.sum(0, dtype=acc)
    return (torch.cat(dh) if dh else torch.zeros_like(hidden)) if need_h else None, \
        dw if need_w else None, db if need_b else None


class _ChunkedHeadLoss(torch.autograd.Function):
    """hidden (N, e), weight (v, e), bias, targets (N,) -> summed cross-entropy.

    The head runs in `compute` (the model's dtype, or autocast's) with
    autocast off inside, in forward and backward alike; gradients come back
    in each input's own dtype. The eager twin of the custom op pair below,
    but for one step: where a gradient is needed, the forward forms the
    gradients of the total from the logits it computes anyway
    (``head_loss_with_gradients``), and the first backward scales them by
    the incoming gradient, in place, instead of computing every chunk's
    logits again (one head matmul of four). A second backward of the same
    graph (retain_graph) or a recorded one (create_graph) takes the
    recomputing path, from the saved inputs and lse.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, compute, backward_follows):
        inputs = (hidden, weight, bias, targets, rows, compute)
        needs = _needs(ctx, bias)
        ctx.grads = None
        if not (backward_follows and any(needs)):
            total, lse = _forward_flat(*inputs)
        else:
            with _autocast_off(hidden.device.type):
                total, lse, grads = head_loss_with_gradients(
                    *_cast(compute, hidden, weight, bias), targets, rows, needs)
            ctx.grads = grads
        _setup_context(ctx, inputs, (total, lse))
        return total

    @staticmethod
    def backward(ctx, grad):
        grads, ctx.grads = ctx.grads, None
        if grads is None or torch.is_grad_enabled():
            return _op_backward(ctx, grad, None) + (None,)
        hidden, weight, bias = ctx.saved_tensors[:3]
        # the gradients of the total times the incoming gradient, in place (this graph's
        # first backward owns them), then in each input's dtype
        return tuple(None if g is None else g.mul_(grad).to(x.dtype)
                     for g, x in zip(grads, (hidden, weight, bias))) + (None, None, None, None)


def _cast(dtype: torch.dtype, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    return tuple(None if t is None else t.to(dtype) for t in tensors)


# Under torch.compile: the loss as a custom op pair (forward, backward), autograd registered on
# the forward; a gradient that is not needed (or a bias that does not exist) comes back empty.

def _forward_flat(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                  rows: int, compute: torch.dtype) -> Tuple[Tensor, Tensor]:
    with _autocast_off(hidden.device.type):
        return head_loss_forward(*_cast(compute, hidden, weight, bias), targets, rows)


def _backward_flat(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                   targets: Tensor, lse: Tensor, rows: int, compute: torch.dtype, need_h: bool,
                   need_w: bool, need_b: bool) -> Tuple[Tensor, Tensor, Tensor]:
    with _autocast_off(hidden.device.type):
        grads = head_loss_backward(grad, *_cast(compute, hidden, weight, bias), targets, lse,
                                   rows, (need_h, need_w, need_b))
    return tuple(hidden.new_empty(0) if g is None else g.to(x.dtype)
                 for g, x in zip(grads, (hidden, weight, bias)))


_forward_op = torch.library.custom_op("dilated_attention::head_loss_forward", _forward_flat,
                                      mutates_args=())
_backward_op = torch.library.custom_op("dilated_attention::head_loss_backward", _backward_flat,
                                       mutates_args=())


@_forward_op.register_fake
def _forward_shapes(hidden, weight, bias, targets, rows, compute):
    acc = accumulator_dtype(compute)
    return hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape[0], dtype=acc)


@_backward_op.register_fake
def _backward_shapes(grad, hidden, weight, bias, targets, lse, rows, compute, *needs):
    return tuple(torch.empty_like(x) if need else hidden.new_empty(0)
                 for x, need in zip((hidden, weight, bias), needs))


def _needs(ctx, bias: Optional[Tensor]) -> Tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) take a gradient (no bias, none)."""
    return tuple(ctx.needs_input_grad[:2]) + (ctx.needs_input_grad[2] and bias is not None,)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, targets, rows, compute = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.rows, ctx.compute = rows, compute


def _op_backward(ctx, grad, _):
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    needs = _needs(ctx, bias)
    # the op where a compiled graph traces this backward; eager (the Function's backward, no
    # dispatcher), or create_graph=True, the Python, which autograd records (Note [chunked
    # head loss]): the op has no derivative
    compiled = torch.compiler.is_compiling() and not torch.is_grad_enabled()
    backward = _backward_op if compiled else _backward_flat
    grads = backward(grad, hidden, weight, bias, targets, lse, ctx.rows, ctx.compute, *needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None, None, None)


torch.library.register_autograd("dilated_attention::head_loss_forward", _op_backward,
                                setup_context=_setup_context)
