"""Training memory of the models: the chunked head loss (Note [chunked head loss]), equal to
the plain computation in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dilated_attention import LongNet, LongNetConfig, LongNetLM
from dilated_attention.models import IGNORE_INDEX
from dilated_attention.models.loss import (chunked_token_mean_loss, loss_chunk_rows,
                                           token_mean_loss)

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
    """The bytes of the largest tensor any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
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
