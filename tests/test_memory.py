"""Training memory of the models: the chunked head loss (Note [chunked head loss]), the
checkpoint modes and the chunked feed-forward (Note [checkpoint modes]), each equal to the
plain computation in float64."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dilated_attention import LongNet, LongNetConfig, LongNetLM, all_reduce_gradients
from dilated_attention.distributed.sharding import shard_sequence
from dilated_attention.models import IGNORE_INDEX
from dilated_attention.models.checkpointing import CHECKPOINT_MODES, HostOffload, PendingCopy
from dilated_attention.models.loss import (chunked_token_mean_loss, loss_chunk_rows,
                                           token_mean_loss)

from dist_harness import run_distributed

SMALL = dict(vocab_size=23, embed_dim=24, num_heads=6, ffn_dim=32, num_layers=2,
             num_encoder_layers=2, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))


def small_config(**overrides) -> LongNetConfig:
    return LongNetConfig(**{**SMALL, **overrides})


def _build(cls, config: LongNetConfig, dtype=torch.float64):
    torch.manual_seed(0)
    model = cls(config, dtype=dtype)
    with torch.no_grad():  # norms and biases away from 1 and 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _data(b: int, n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    targets = torch.randint(0, vocab, (b, n), generator=g)
    targets[:, ::5] = IGNORE_INDEX
    return tokens, targets


def _loss_and_grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    logits, loss = model(*args, **kwargs)
    loss.backward()
    return logits, loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(got, want, tol=dict(rtol=1e-10, atol=1e-12)):
    (_, loss, grads), (_, ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, **tol)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **tol, msg=lambda m: f"{name}: {m}")


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op creates while active (views of `existing`
    tensors' storage not counted)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.bytes = 0
        self.existing = {x.untyped_storage().data_ptr() for x in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and \
                    t.untyped_storage().data_ptr() not in self.existing:
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors that ops create while active and that are alive
    together: each storage counted once, until it is freed (PYTORCH-NOTES.md's method);
    `existing` tensors' storage (and views of it) not counted."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen = {x.untyped_storage().data_ptr() for x in existing}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.seen:
                self.seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


# ---------------------------------------------------------------------------
# The chunked head loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_equals_token_mean_loss(dtype, bias):
    """The function alone: loss and gradients (hidden, weight, bias) of F.linear + the plain
    loss, for one row a chunk, a few and all at once; ignored rows; an empty input."""
    g = torch.Generator().manual_seed(0)
    b, n, e, v = 2, 37, 8, 11
    hidden = torch.randn(b, n, e, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(v, e, generator=g).to(dtype).requires_grad_()
    bias_ = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (b, n), generator=g)
    targets[:, ::3] = IGNORE_INDEX
    inputs = [x for x in (hidden, weight, bias_) if x is not None]
    ref = token_mean_loss(F.linear(hidden, weight, bias_), targets, None)
    ref_grads = torch.autograd.grad(ref, inputs)
    # bf16: the plain path's dW is one bf16 matmul, ours sums the chunks' in fp32
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else \
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    item = 8 if dtype == torch.float64 else 4
    for rows in (1, 5, b * n):
        assert loss_chunk_rows(v, dtype, rows * v * item) == rows
        loss = chunked_token_mean_loss(hidden, weight, targets, None, bias=bias_,
                                       chunk_bytes=rows * v * item)
        assert loss.dtype == ref.dtype
        torch.testing.assert_close(loss, ref, **tol)
        for got, want in zip(torch.autograd.grad(loss, inputs), ref_grads):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, **tol)
    # no rows at all (an empty piece): 0, connected, zero gradients
    empty = chunked_token_mean_loss(hidden[:, :0], weight, targets[:, :0], None, bias=bias_)
    assert empty.item() == 0.0
    assert all(not x.any() for x in torch.autograd.grad(empty, inputs))


@pytest.mark.parametrize("needs", ["all", "hidden", "weight"])
def test_chunked_loss_backward_twice(needs):
    """The forward forms the gradients and the first backward scales them; a second backward
    of the same graph (retain_graph) recomputes them: each equals the plain path's, also
    when only some inputs need a gradient, and a loss built without gradients forms none."""
    g = torch.Generator().manual_seed(2)
    b, n, e, v = 2, 13, 6, 9
    hidden = torch.randn(b, n, e, generator=g, dtype=torch.float64)
    weight = torch.randn(v, e, generator=g, dtype=torch.float64)
    bias_ = torch.randn(v, generator=g, dtype=torch.float64)
    hidden.requires_grad_(needs in ("all", "hidden"))
    weight.requires_grad_(needs in ("all", "weight"))
    bias_.requires_grad_(needs == "all")
    inputs = [x for x in (hidden, weight, bias_) if x.requires_grad]
    targets = torch.randint(0, v, (b, n), generator=g)
    targets[:, ::4] = IGNORE_INDEX
    ref = token_mean_loss(F.linear(hidden, weight, bias_), targets, None)
    want = torch.autograd.grad(ref * 3, inputs)
    loss = chunked_token_mean_loss(hidden, weight, targets, None, bias=bias_,
                                   chunk_bytes=4 * v * 8)
    for _ in range(2):
        got = torch.autograd.grad(loss * 3, inputs, retain_graph=True)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_mean_loss(hidden, weight, targets, None,
                                                           bias=bias_), ref.detach())
    # not training (evaluation with gradients on): a backward recomputes, once or twice
    loss = chunked_token_mean_loss(hidden, weight, targets, None, bias=bias_, training=False)
    for _ in range(2):
        got = torch.autograd.grad(loss * 3, inputs, retain_graph=True)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)


def test_chunked_loss_under_autocast():
    """Autocast runs the head in its dtype, as F.linear there: the same loss and gradients."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (2, 9), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = token_mean_loss(F.linear(hidden, weight), targets, None)
        loss = chunked_token_mean_loss(hidden, weight, targets, None, chunk_bytes=4 * 13 * 4)
    for got, want in zip(torch.autograd.grad(loss, (hidden, weight)),
                         torch.autograd.grad(ref, (hidden, weight))):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)


def test_chunked_loss_forms_gradients_only_where_a_backward_follows(monkeypatch):
    """A training model's loss under torch.no_grad() or inference_mode (a validation loop
    without model.eval(); a reentrant checkpoint's first forward) runs no backward: its
    forward forms no gradients (it did: two more head matmuls, a (v, e) and a (b n, e)
    buffer), and gives the same loss."""
    from dilated_attention.models import loss as loss_module
    formed = []
    real = loss_module.head_loss_with_gradients
    monkeypatch.setattr(loss_module, "head_loss_with_gradients",
                        lambda *a, **k: formed.append(1) or real(*a, **k))
    model = _build(LongNetLM, small_config(num_layers=1))
    tokens, targets = _data(2, 11, SMALL["vocab_size"])
    _, want = model(tokens, targets)
    assert formed == [1]  # training with gradients: formed in the forward
    for context in (torch.no_grad, torch.inference_mode):
        formed.clear()
        with context():
            _, loss = model(tokens, targets)
        assert formed == []
        torch.testing.assert_close(loss, want.detach(), rtol=0, atol=0)
    formed.clear()
    dummy = torch.zeros((), dtype=torch.float64, requires_grad=True)
    loss = checkpoint(lambda d: model(tokens, targets)[1] + d, dummy, use_reentrant=True)
    assert formed == []  # the first forward runs without gradients
    loss.backward()
    assert formed == [1]  # the recomputation, which a backward follows


def test_chunked_loss_float16_weight_gradient_stays_finite():
    """A float16 head: one chunk's d weight of the summed loss (incoming gradient 1) passes
    float16's 65504 (40,000 rows, all the same target, hidden 4), where the mean's does not:
    the forward scales that chunk's product by a power of two, and the gradients equal the
    float64 ones to float16 rounding, as the plain path's (d weight was -inf)."""
    g = torch.Generator().manual_seed(0)
    n, e, v = 40000, 8, 4
    hidden = (4 + 0.1 * torch.randn(1, n, e, generator=g)).half().requires_grad_()
    weight = (0.01 * torch.randn(v, e, generator=g)).half().requires_grad_()
    targets = torch.zeros(1, n, dtype=torch.long)
    ref = token_mean_loss(F.linear(hidden.double(), weight.double()), targets, None)
    want = torch.autograd.grad(ref, (hidden, weight))
    loss = chunked_token_mean_loss(hidden, weight, targets, None)
    got = torch.autograd.grad(loss, (hidden, weight))
    for x, y in zip(got, want):
        assert x.dtype == torch.float16 and bool(x.isfinite().all())
        torch.testing.assert_close(x.double(), y.double(), rtol=2e-2, atol=1e-6)


def test_chunked_loss_of_large_logits_is_finite():
    """Each row's max is subtracted before the exp: logits far past exp's float32 range (~88)
    give the plain path's finite loss and gradients, training or not."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 6, 8, generator=g) * 30).requires_grad_()
    weight = (torch.randn(5, 8, generator=g) * 10).requires_grad_()
    targets = torch.randint(0, 5, (1, 6), generator=g)
    ref = token_mean_loss(F.linear(hidden, weight), targets, None)
    assert ref.item() > 100  # logits in the thousands
    want = torch.autograd.grad(ref, (hidden, weight))
    for training in (True, False):
        loss = chunked_token_mean_loss(hidden, weight, targets, None, chunk_bytes=2 * 5 * 4,
                                       training=training)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
        for got, ref_grad in zip(torch.autograd.grad(loss, (hidden, weight)), want):
            torch.testing.assert_close(got, ref_grad, rtol=1e-4, atol=1e-5)


def test_chunked_loss_forward_forms_only_the_gradients_it_needs():
    """The forward forms gradients only when training, and only those needed: an evaluation
    forward (training=False) or a frozen head allocates no (v, e) d weight, a frozen hidden
    no (N, e) d hidden."""
    g = torch.Generator().manual_seed(0)
    b, n, e, v = 1, 8, 64, 50  # d weight 25.6 KB, d hidden 4 KB, a chunk's logits 800 B
    chunk = 2 * v * 8
    hidden = torch.randn(b, n, e, dtype=torch.float64, generator=g)
    weight = torch.randn(v, e, dtype=torch.float64, generator=g)
    targets = torch.randint(0, v, (b, n), generator=g)

    def largest(needs_hidden: bool, needs_weight: bool, training: bool) -> int:
        h = hidden.clone().requires_grad_(needs_hidden)
        w = weight.clone().requires_grad_(needs_weight)
        with LargestTensor(h, w, targets) as made:
            chunked_token_mean_loss(h, w, targets, None, chunk_bytes=chunk, training=training)
        return made.bytes

    assert largest(True, True, True) == v * e * 8  # training: d weight formed in the forward
    assert largest(True, True, False) <= chunk  # evaluation: the loss alone
    assert largest(True, False, True) == b * n * e * 8  # frozen head: d hidden only
    assert largest(False, True, True) == v * e * 8
    assert largest(False, False, True) <= chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_against_float64(dtype, bias):
    """Loss and gradients (hidden, weight, bias) against float64 of the unchunked loss of the
    same inputs: within 2x the plain path's error in the same dtype (F.linear, then the loss
    in fp32), training (gradients formed in the forward) and not (recomputed), with chunks
    small enough that a half-precision d weight's product takes several vocabulary slices."""
    g = torch.Generator().manual_seed(0)
    b, n, e, v, rows = 2, 150, 64, 1000, 7
    hidden = torch.randn(b, n, e, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, e, generator=g)).to(dtype).requires_grad_()
    bias_ = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (b, n), generator=g)
    targets[:, ::7] = IGNORE_INDEX
    inputs = [x for x in (hidden, weight, bias_) if x is not None]
    exact = [x.detach().double().requires_grad_() for x in inputs]
    ref = token_mean_loss(F.linear(*exact), targets, None)
    want = (ref,) + torch.autograd.grad(ref, exact)

    def errors(loss):
        got = (loss,) + torch.autograd.grad(loss, inputs)
        return [((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, want)]

    plain = errors(token_mean_loss(F.linear(hidden, weight, bias_), targets, None))
    assert max(plain) < (1e-6 if dtype == torch.float32 else 1e-2)
    for training in (True, False):
        got = errors(chunked_token_mean_loss(hidden, weight, targets, None, bias=bias_,
                                             chunk_bytes=rows * v * 4, training=training))
        assert all(x <= 2 * y for x, y in zip(got, plain)), (training, got, plain)


def test_chunked_half_precision_loss_holds_no_weight_sized_temporary():
    """A bfloat16 loss's training forward holds its gradients (d hidden, fp32 d weight), one
    chunk's fp32 logits and their bf16 copy, and nothing of (v, e) more: each chunk's d
    weight product made a (v, e) bf16 temporary (v e 2 bytes beside the accumulator)."""
    g = torch.Generator().manual_seed(0)
    b, n, e, v, rows = 2, 32, 64, 1000, 8
    hidden = torch.randn(b, n, e, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(v, e, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (b, n), generator=g)
    with LiveBytes(hidden, weight, targets) as live:
        loss = chunked_token_mean_loss(hidden, weight, targets, None, chunk_bytes=rows * v * 4)
    formed = b * n * e * 2 + v * e * 4  # d hidden (bf16), d weight (fp32)
    chunk = rows * v * (4 + 2)
    assert formed + chunk <= live.peak <= formed + chunk + 4096, live.peak
    loss.backward()  # and the gradients are those of test_chunked_loss_against_float64


def test_chunk_budget_below_one_row():
    """A chunk budget smaller than one row of logits runs one row a chunk."""
    assert loss_chunk_rows(100, torch.float32, 1) == 1
    assert loss_chunk_rows(100, torch.float32, 399) == 1
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (1, 5), generator=g)
    ref = token_mean_loss(F.linear(hidden, weight), targets, None)
    loss = chunked_token_mean_loss(hidden, weight, targets, None, chunk_bytes=1)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-13)


def test_chunked_loss_second_derivatives_of_an_empty_piece():
    """create_graph=True on a rank without rows (an empty piece): zero first derivatives,
    and a second derivative through them, as the plain path gives."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.zeros(1, 0, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.zeros(1, 0, dtype=torch.long)
    loss = chunked_token_mean_loss(hidden, weight, targets, None)
    dh, dw = torch.autograd.grad(loss, (hidden, weight), create_graph=True)
    assert dh.shape == hidden.shape and dw.shape == weight.shape and not dw.any()
    (second,) = torch.autograd.grad((dw ** 2).sum() + loss, weight, allow_unused=True)
    assert second is None or not second.any()


@pytest.mark.parametrize("frozen_hidden", [False, True])
def test_chunked_loss_second_derivatives(frozen_hidden):
    """create_graph=True (a gradient penalty, a Hessian-vector product): the recorded backward
    gives the plain path's first and second derivatives, chunk sizes of 1, 5 and all rows,
    ignored rows and a bias; with hidden not requiring grad (a trained head alone) too."""
    g = torch.Generator().manual_seed(2)
    b, n, e, v = 2, 13, 6, 9
    hidden = torch.randn(b, n, e, generator=g, dtype=torch.float64)
    hidden.requires_grad_(not frozen_hidden)
    weight = torch.randn(v, e, generator=g, dtype=torch.float64, requires_grad=True)
    bias_ = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (b, n), generator=g)
    targets[:, ::4] = IGNORE_INDEX
    inputs = [x for x in (hidden, weight, bias_) if x.requires_grad]
    vectors = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]

    def derivatives(loss):
        first = torch.autograd.grad(loss, inputs, create_graph=True)
        product = sum((d * u).sum() for d, u in zip(first, vectors))
        return first + torch.autograd.grad(product, inputs)

    want = derivatives(token_mean_loss(F.linear(hidden, weight, bias_), targets, None))
    for rows in (1, 5, b * n):
        loss = chunked_token_mean_loss(hidden, weight, targets, None, bias=bias_,
                                       chunk_bytes=rows * v * 8)
        for got, ref in zip(derivatives(loss), want):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)


def test_model_gradient_penalty_equals_the_logits_path():
    """The model's default loss (chunked) under create_graph=True: the same gradient penalty
    and second-order gradients as return_logits=True."""
    model = _build(LongNetLM, small_config(num_layers=1))
    tokens, targets = _data(1, 11, SMALL["vocab_size"])
    params = list(model.parameters())
    results = []
    for kwargs in ({}, {"return_logits": True}):
        _, loss = model(tokens, targets, **kwargs)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum((x ** 2).sum() for x in grads)
        results.append((penalty.detach(), torch.autograd.grad(penalty, params)))
    (penalty, grads), (ref_penalty, ref_grads) = results
    torch.testing.assert_close(penalty, ref_penalty, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kind", ["lm", "encdec"])
@pytest.mark.parametrize("tie", [True, False])
def test_model_loss_without_logits_equals_with(kind, tie):
    """model(.., targets) (chunked, no logits) == model(.., targets, return_logits=True)
    (logits, then the plain loss): loss and every parameter gradient, float64."""
    model = _build(LongNetLM if kind == "lm" else LongNet,
                   small_config(tie_embeddings=tie, loss_chunk_bytes=8 * 23 * 3))
    tokens, targets = _data(2, 29, 23)
    args = (tokens, targets) if kind == "lm" else (_data(2, 17, 23, seed=3)[0], tokens, targets)
    plain = _loss_and_grads(model, *args, return_logits=True)
    chunked = _loss_and_grads(model, *args)
    assert plain[0].shape == (2, 29, 23) and chunked[0] is None
    _assert_same(chunked, plain)
    expected = F.cross_entropy(plain[0].flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(chunked[1], expected, rtol=1e-12, atol=1e-12)
    logits, nothing = model(*args[:-1])
    assert nothing is None
    torch.testing.assert_close(logits, plain[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="return_logits must be a bool, got 1"):
        model(*args, return_logits=1)


def test_model_loss_never_holds_the_logits():
    """No tensor of a training step is larger than one chunk of the logits (the plain path
    makes ones the size of all of them)."""
    chunk = 64 * 1024
    # vocab 300: the logits of 2 x 64 tokens are 300 KB in float64, the head 56 KB
    model = _build(LongNetLM, small_config(vocab_size=300, loss_chunk_bytes=chunk))
    tokens, targets = _data(2, 64, 300)
    sizes = {}
    for label, kwargs in (("plain", dict(return_logits=True)), ("chunked", {})):
        with LargestTensor() as largest:
            model(tokens, targets, **kwargs)[1].backward()
        sizes[label] = largest.bytes
    assert sizes["plain"] >= 2 * 64 * 300 * 8
    assert sizes["chunked"] <= chunk, sizes


def test_config_checks_the_chunk_size():
    with pytest.raises(ValueError, match="loss_chunk_bytes must be a positive int, got 0"):
        small_config(loss_chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got -1"):
        chunked_token_mean_loss(torch.zeros(1, 2, 3), torch.zeros(4, 3),
                                torch.zeros(1, 2, dtype=torch.long), None, chunk_bytes=-1)


# ---------------------------------------------------------------------------
# Checkpoint modes


@pytest.mark.parametrize("kind", ["lm", "encdec"])
@pytest.mark.parametrize("mode", ["layers", "offload"])
def test_checkpoint_modes_give_the_same_gradients(kind, mode):
    """fp64: "layers" and "offload" (on CPU: "layers") equal "none", with packed documents
    (lm) and the encoder output as every decoder block's memory (encdec)."""
    cls = LongNetLM if kind == "lm" else LongNet
    tokens, targets = _data(2, 33, 23)
    args = (tokens, targets) if kind == "lm" else (_data(2, 21, 23, seed=2)[0], tokens, targets)
    kwargs = dict(cu_seqlens=(0, 5, 20, 33)) if kind == "lm" else {}
    runs = [_loss_and_grads(_build(cls, small_config(num_kv_heads=3, checkpoint=m)), *args,
                            **kwargs) for m in ("none", mode)]
    _assert_same(runs[1], runs[0], tol=dict(rtol=0, atol=0))


@pytest.mark.parametrize("mode", ["layers", "offload"])
def test_checkpointing_replays_the_dropout_masks(mode):
    """Recomputation draws the same masks as the forward: nn.Dropout and the attention op's
    dropout (its seed comes from torch's default generator, whose state checkpoint restores)."""
    runs = {}
    for m, attention_dropout in (("none", 0.2), (mode, 0.2), ("none", 0.0)):
        model = _build(LongNetLM, small_config(dropout=0.1, attention_dropout=attention_dropout,
                                               checkpoint=m))
        torch.manual_seed(7)
        runs[m, attention_dropout] = _loss_and_grads(model, *_data(2, 33, 23))
    _assert_same(runs[mode, 0.2], runs["none", 0.2], tol=dict(rtol=0, atol=0))
    assert runs["none", 0.0][1] != runs["none", 0.2][1]  # the attention's dropout was on


class CloningCopies:
    """Host "copies" that are clones (this machine has no accelerator), with a log."""

    def __init__(self) -> None:
        self.log = []

    def to_host(self, t):
        self.log.append("out")
        return PendingCopy(t.detach().clone(), None)

    def to_device(self, host, device, ahead):
        self.log.append("ahead" if ahead else "in")
        return PendingCopy(host.tensor.clone(), None)

    def wait(self, copy):
        return copy.tensor


def test_host_offload_moves_block_inputs_and_fetches_ahead():
    """HostOffload around checkpointed blocks: one copy out per block input, backward fetches
    block k - 1's input while it unpacks block k's; the gradients are unchanged."""
    model = _build(LongNetLM, small_config(num_layers=3))
    x0 = torch.randn(2, 19, 24, dtype=torch.float64, requires_grad=True)

    def run(offload):
        x = x0
        with offload:
            for layer in model.layers:
                x = checkpoint(functools.partial(layer), x, use_reentrant=False,
                               early_stop=False)
        model.zero_grad(set_to_none=True)
        x.pow(2).sum().backward()
        return [p.grad.clone() for p in model.layers.parameters()]

    plain = run(contextlib.nullcontext())
    copies = CloningCopies()
    offloaded = run(HostOffload(torch.device("cpu"), copies=copies))
    assert copies.log == ["out"] * 3 + ["ahead", "in", "ahead"]
    for got, want in zip(offloaded, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_host_offload_leaves_empty_tensors_alone():
    """Nothing to move: an empty saved tensor (torch 2.11's checkpoint saves one per block)
    is kept as it is, not copied out and fetched back."""
    copies = CloningCopies()
    empty, full = torch.empty(0, requires_grad=True), torch.randn(3, requires_grad=True)
    with HostOffload(torch.device("cpu"), copies=copies):
        y = (empty.exp().sum() + full.exp().sum())
    y.backward()
    assert copies.log == ["out", "in"]
    torch.testing.assert_close(full.grad, full.exp())


def test_checkpoint_mode_is_checked():
    with pytest.raises(ValueError, match=r"checkpoint must be one of \('none', 'layers', "
                                         r"'offload'\), got 'all'"):
        small_config(checkpoint="all")


# ---------------------------------------------------------------------------
# Sequence parallel: one spawn of 2 gloo ranks for every case


def _sharded_step(model, group, tokens, targets, *extra, seed=None, **kwargs):
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    _, loss = model(*(shard_sequence(x, group) for x in (*extra, tokens, targets)), **kwargs)
    loss.backward()
    all_reduce_gradients(model, group)
    return None, loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _sp_rank(group):
    """Each case's sharded checkpointed step == one process without checkpointing (the loss
    from its logits), and with dropout the sharded step without checkpointing."""
    done = []
    cases = [("lm", dict(checkpoint="layers"), {}, 31),
             ("lm", dict(checkpoint="offload"), dict(cu_seqlens=(0, 4, 20, 31)), 31),
             ("encdec", dict(checkpoint="layers"), {}, 26),
             ("lm", dict(checkpoint="layers"), {}, 1),  # 1 token: rank 1's piece is empty
             ("lm", dict(checkpoint="layers", ffn_chunk_bytes=2 * 4 * 32 * 8), {}, 31)]
    for kind, overrides, kwargs, n in cases:
        cls = LongNetLM if kind == "lm" else LongNet
        tokens, targets = _data(2, n, 23, seed=n)
        extra = () if kind == "lm" else (_data(2, n + 5, 23, seed=1)[0],)
        one = _build(cls, small_config(num_kv_heads=2))
        want = _sharded_step(one, None, tokens, targets, *extra, return_logits=True, **kwargs)
        torch.manual_seed(0)
        sharded = cls(small_config(num_kv_heads=2, **overrides), dtype=torch.float64,
                      process_group=group)
        sharded.load_state_dict(one.state_dict())
        _assert_same(_sharded_step(sharded, group, tokens, targets, *extra, **kwargs), want)
        done.append((kind, overrides, n))
    # dropout: the recomputation on every rank replays that rank's masks
    tokens, targets = _data(2, 30, 23, seed=5)
    runs = []
    for mode in CHECKPOINT_MODES:
        torch.manual_seed(0)
        model = LongNetLM(small_config(dropout=0.1, attention_dropout=0.2, checkpoint=mode),
                          dtype=torch.float64, process_group=group)
        runs.append(_sharded_step(model, group, tokens, targets, seed=11))
    for run in runs[1:]:
        _assert_same(run, runs[0], tol=dict(rtol=0, atol=0))
    done.append("dropout")
    return done


@pytest.mark.distributed
def test_checkpoint_modes_sequence_parallel_equal_one_process():
    for done in run_distributed(_sp_rank, 2, timeout=240):
        assert len(done) == 6, done


# ---------------------------------------------------------------------------
# The feed-forward over chunks of rows


@pytest.mark.parametrize("kind", ["lm", "encdec"])
@pytest.mark.parametrize("mode", ["none", "layers"])
def test_chunked_feed_forward_gives_the_same_gradients(kind, mode):
    cls = LongNetLM if kind == "lm" else LongNet
    tokens, targets = _data(2, 33, 23)
    args = (tokens, targets) if kind == "lm" else (_data(2, 21, 23, seed=2)[0], tokens, targets)
    # (2, 5 rows, ffn_dim 32) float64 per chunk: 7 chunks of 33 rows
    runs = [_loss_and_grads(_build(cls, small_config(checkpoint=mode, ffn_chunk_bytes=chunk)),
                            *args) for chunk in (None, 2 * 5 * 32 * 8)]
    _assert_same(runs[1], runs[0], tol=dict(rtol=1e-12, atol=1e-14))


class WidestRows(TorchDispatchMode):
    """The most elements of any activation (3-D or more) an op creates whose last dim is
    `width` (the (b, n, ffn_dim) ones; not the weights)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.numel = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() > 2 and t.shape[-1] == self.width:
                self.numel = max(self.numel, t.numel())
        return out


def test_chunked_feed_forward_holds_one_chunk():
    """Under "layers" with ffn_chunk_bytes no (.., ffn_dim) activation exceeds one chunk;
    without it they span every row."""
    sizes = {}
    for chunk in (None, 2 * 8 * 96 * 8):  # 8 rows of (2, 64, 96)
        model = _build(LongNetLM, small_config(ffn_dim=96, checkpoint="layers",
                                               ffn_chunk_bytes=chunk))
        with WidestRows(96) as widest:
            model(*_data(2, 64, 23))[1].backward()
        sizes[chunk] = widest.numel
    assert sizes[None] == 2 * 64 * 96
    assert sizes[2 * 8 * 96 * 8] == 2 * 8 * 96


def test_training_step_runs_on_meta():
    """estimate's dry run builds the models on meta: the offloaded checkpoints (ShapeCopies
    keep the shapes only), the chunked loss and the chunked feed-forward run there."""
    config = small_config(checkpoint="offload", ffn_chunk_bytes=1024, loss_chunk_bytes=1024)
    tokens = torch.empty(2, 40, dtype=torch.long, device="meta")
    for model, args in ((LongNetLM(config, device="meta"), (tokens, tokens)),
                        (LongNet(config, device="meta"), (tokens[:, :30], tokens, tokens))):
        _, loss = model(*args)
        loss.backward()
        assert loss.device.type == "meta"
        assert all(p.grad is not None for p in model.parameters())


def test_host_offload_lets_its_host_copies_go_without_the_garbage_collector():
    from dilated_attention.models.checkpointing import HostOffload, PendingCopy

    refs = []

    class Copies:
        def to_host(self, t):
            host = t.detach().clone()
            refs.append(weakref.ref(host))
            return PendingCopy(host, None)

        def to_device(self, host, device, ahead):
            return PendingCopy(host.tensor.clone(), None)

        def wait(self, copy):
            return copy.tensor

    layers = [torch.nn.Linear(8, 8).double() for _ in range(3)]
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with HostOffload(torch.device("cpu"), copies=Copies()):
            y = x
            for layer in layers:
                y = checkpoint(functools.partial(layer), y, use_reentrant=False,
                               early_stop=False)
        y.pow(2).sum().backward()
        del y
        assert len(refs) == 3 and all(r() is None for r in refs)
    finally:
        if enabled:
            gc.enable()
