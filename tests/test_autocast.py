"""torch.autocast around the ops, the module and the models.

Under autocast the public ops take q, k, v in autocast's dtype, as
``F.scaled_dot_product_attention`` does (float64 left alone), and compute exactly what
they compute on inputs of that dtype: autocast reaches none of their kernels or merges, in
forward or backward, even when backward runs inside the autocast region. The module takes
inputs of another dtype than its weights where autocast casts both in its projections.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dilated_attention import (LongNetConfig, LongNetLM, MultiheadDilatedAttention,
                               dilated_attention, ring_attention)
from dist_harness import run_distributed

AUTOCAST = torch.bfloat16
BF16 = dict(rtol=2e-2, atol=2e-2)

CALLS = {
    "dilated": functools.partial(dilated_attention, segment_lengths=[8, 16],
                                 dilation_rates=[1, 2], is_causal=True),
    # the pure-PyTorch kernel: the one whose matrix products autocast reached
    "dilated blockwise": functools.partial(dilated_attention, segment_lengths=[8, 16],
                                           dilation_rates=[1, 2], backend="blockwise"),
    "dilated documents and mask": functools.partial(
        dilated_attention, segment_lengths=[8, 16], dilation_rates=[1, 2],
        cu_seqlens=[0, 21, 64], key_padding_mask=torch.arange(64)[None] > 60),
    "ring": functools.partial(ring_attention, is_causal=True),
    "window": functools.partial(ring_attention, is_causal=True, window_size=(5, 0)),
}


def _inputs(dtype: torch.dtype, n: int = 64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, heads, 16, generator=gen).to(dtype).requires_grad_()
            for heads in (4, 2, 2)]


def _run(call, inputs, dout, *, autocast: bool):
    """out and the inputs' gradients, the backward inside the autocast region."""
    with torch.autocast("cpu", dtype=AUTOCAST, enabled=autocast):
        out = call(*inputs)
        out.backward(dout.to(out.dtype))
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return out, grads


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("dtype, computes_in", [
    (torch.float32, AUTOCAST),  # cast, as SDPA's inputs are
    (torch.bfloat16, torch.bfloat16),  # already autocast's dtype
    (torch.float64, torch.float64),  # never cast
])
def test_the_ops_compute_in_autocasts_dtype_and_nothing_else(name, dtype, computes_in):
    """Under bf16 autocast: bit for bit the op without autocast on the inputs rounded to
    the dtype it computes in, that dtype's output, the inputs' dtype for the gradients."""
    inputs = _inputs(dtype)
    rounded = [x.detach().to(computes_in).requires_grad_() for x in inputs]
    dout = torch.randn(1, 64, 4, 16, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = _run(CALLS[name], rounded, dout, autocast=False)
    out, grads = _run(CALLS[name], inputs, dout, autocast=True)
    assert out.dtype == computes_in
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


def test_module_takes_autocasts_dtype():
    """A float32 MultiheadDilatedAttention under bf16 autocast takes bf16 inputs (its
    projections cast both) and gives what it gives for their float32 copies; a float64
    input, which autocast does not cast, is still the dtype error naming it."""
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2])
    x = torch.randn(2, 40, 32).to(AUTOCAST)
    with torch.autocast("cpu", dtype=AUTOCAST):
        got, _ = attn(x, x, x, is_causal=True)
        want, _ = attn(x.float(), x.float(), x.float(), is_causal=True)
        with pytest.raises(TypeError, match="query must have the module's dtype"):
            attn(x.double(), x.double(), x.double())
    assert got.dtype == AUTOCAST
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="query must have the module's dtype"):
        attn(x, x, x)  # no autocast: nothing casts the projections


def test_model_trains_and_generates_under_autocast():
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1))
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=AUTOCAST):
        _, loss = model(tokens, tokens)
        loss.backward()
        ids = model.generate(tokens[:, :20], 4)
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and
               torch.isfinite(p.grad).all() for p in model.parameters())
    assert ids.shape == (2, 24) and torch.equal(ids[:, :20], tokens[:, :20])


# ---------------------------------------------------------------------------
# Sequence-parallel: each rank's float32 piece under autocast gives its rows of the
# single-process result under autocast.

def _sharded(group, n):
    rank, world = group.rank(), group.size()
    rows = slice(rank * n // world, (rank + 1) * n // world)
    inputs = _inputs(torch.float32, n)
    pieces = [x.detach()[:, rows].clone().requires_grad_() for x in inputs]
    dout = torch.randn(1, n, 4, 16, generator=torch.Generator().manual_seed(1))[:, rows]
    out = {}
    for name in ("dilated", "ring", "window"):
        got, grads = _run(functools.partial(CALLS[name], group=group), pieces, dout,
                          autocast=True)
        out[name] = (got.detach(), [g.detach() for g in grads])
    return out


@pytest.mark.distributed
def test_sequence_parallel_under_autocast_equals_one_process():
    n = 64
    results = run_distributed(_sharded, 2, n, timeout=120)
    inputs = _inputs(torch.float32, n)
    dout = torch.randn(1, n, 4, 16, generator=torch.Generator().manual_seed(1))
    for name in ("dilated", "ring", "window"):
        want_out, want_grads = _run(CALLS[name], inputs, dout, autocast=True)
        got = [r[name] for r in results]
        assert all(out.dtype == AUTOCAST for out, _ in got)
        # to bf16 rounding: the ranks merge their parts in another order than one process
        torch.testing.assert_close(torch.cat([out for out, _ in got], 1), want_out, **BF16)
        for i, want in enumerate(want_grads):
            assert all(grads[i].dtype == torch.float32 for _, grads in got)
            torch.testing.assert_close(torch.cat([grads[i] for _, grads in got], 1), want,
                                       **BF16)
