"""Attention dropout in the fused kernels (Note [fused dropout] in fused.py).

The kernels' masks are a function of (seed, batch row, head, query row, key row, pattern), so
the reference rebuilds them (reference.fused_dropout_factors, Philox in numpy) and the
outputs and gradients of one call are checked exactly, as without dropout; the op's own
calls are checked for what depends on its draw of the seed: reproducible under
torch.manual_seed, new masks per call, the backward's masks the forward's, and the mean
over masks the undropped output. Triton's interpreter on CPU (tests/conftest.py).

Notation: b batch, n rows, h query heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

import os

import pytest
import torch

from dilated_attention import MultiheadDilatedAttention, dilated_attention, fused
from dilated_attention.backends import select_backend
from dilated_attention.patterns import Heads
from dist_harness import error_of, run_distributed
from reference import (attention_with_counts, close, dilated_counts, fused_dropout_factors,
                       grads)
from test_fused import CASES, DEVICE, Case, inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and no TRITON_INTERPRET (tests/conftest.py sets it)")

# (duplicates-and-extras runs with its spans split, below; six-patterns folds duplicates)
DROPOUT_CASES = {
    name: CASES[name] for name in ("longnet-gqa-causal", "lcm-not-power-of-two",
                                   "documents-and-padding", "fp16-causal-documents")
}
# six patterns of rate 1: a pair in one 8-row segment is selected six times, two Philox
# calls' worth of patterns
DROPOUT_CASES["six-patterns"] = Case(32, (8, 8, 8, 16, 16, 32), (1, 1, 1, 1, 1, 1), True,
                                   h=2, hk=1)
# the op's own calls: a few launches each (the interpreter's time goes per block operation)
SMALL = Case(32, (8, 16), (1, 2), True, h=2, hk=1)


def _selections(case: Case, mask):
    """(P, b, h, n, n): 1 where pattern i selects the pair (masked keys: none)."""
    alone = torch.stack([
        dilated_counts(case.n, case.h, [w], [r], case.causal, case.cu_seqlens)
        for w, r in zip(case.segment_lengths, case.dilation_rates)])
    alone = alone[:, None].expand(-1, case.b, -1, -1, -1)
    if mask is not None:
        alone = alone.masked_fill(mask.cpu()[None, :, None, None, :], 0)
    return alone


def _fused(case: Case, leaves, mask, dropout, nonfinite=None):
    """out, lse (b, h, n) of fused.forward with `dropout`, and its backward as a function of
    (dout, dlse (b, h, n))."""
    q, k, v = (x.detach() for x in leaves)
    call = dict(causal=case.causal, scale=case.scale or case.d ** -0.5,
                heads=Heads.of(case.h, case.hk), documents=case.cu_seqlens, key_mask=mask)
    patterns = (case.segment_lengths, case.dilation_rates)
    out, lse = fused.forward(q, k, v, patterns, nonfinite=nonfinite, dropout=dropout, **call)

    def backward(dout, dlse):
        return fused.backward(dout, q, k, v, out, lse, dlse.transpose(1, 2), patterns,
                              nonfinite=nonfinite, dropout=dropout, **call)

    return out, lse.transpose(1, 2), backward


@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_matches_the_reference_with_the_same_masks(name: str) -> None:
    _check_with_the_same_masks(DROPOUT_CASES[name])


@pytest.mark.parametrize("name", ["duplicates-and-extras"])
def test_split_spans_draw_the_same_masks(name: str, monkeypatch) -> None:
    """Every span with extras split into spans without (Note [fused kernel], "Split
    spans"; this case's plan keeps none): a piece's bits are its leader's and its phase's
    extras' (up to three patterns a span; LongNet's nested rates split alike, 15 s more)."""
    plan = fused.tile_plan
    monkeypatch.setattr(fused, "tile_plan",
                        lambda *args, **kwargs: plan(*args, **{**kwargs, "split_keys": 1}))
    _check_with_the_same_masks(CASES[name])


def _check_with_the_same_masks(case: Case) -> None:
    """out, lse and dq, dk, dv of one call against the reference with the kernels' masks."""
    leaves, dout, dlse, mask = inputs(case)
    p, seed = 0.3, 0x5DEECE66D + case.n
    selections = _selections(case, mask)
    counts = selections.sum(0)
    dropout = fused.Dropout.of(p, len(case.segment_lengths),
                               torch.tensor([seed], device=DEVICE))
    out, lse, backward = _fused(case, leaves, mask, dropout, fused.new_check(leaves[0].device))
    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in leaves]
    factors = fused_dropout_factors(seed, p, selections)
    ref_out, ref_lse = attention_with_counts(*ref_leaves, counts, case.scale, factors)
    # the masks drop pairs and keep pairs, and where patterns overlap, some pair is kept by
    # some but not all of its patterns
    assert ((factors == 0) & (counts > 0)).any() and (factors > 0).any()
    assert not (counts > 1).any() or ((factors > 0) & (factors * (1 - p) < 0.99)).any()
    close(out.cpu(), ref_out, case.dtype, "out")
    close(lse.cpu(), ref_lse, case.dtype, "lse")
    want = grads([ref_out, ref_lse], [dout.cpu().double(), dlse.cpu()], ref_leaves)
    for name, g, w in zip("qkv", backward(dout, dlse), want):
        close(g.cpu(), w, case.dtype, f"d{name}")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
def test_the_nonfinite_rules_kernels_apply_the_same_masks() -> None:
    """A NaN in one query row runs the rule's kernels over every tile, which write every out
    and gradient again: the other rows still equal the reference with the same masks."""
    case = Case(32, (8, 16), (1, 2), True, h=2, hk=1, b=2)
    leaves, dout, dlse, mask = inputs(case)
    with torch.no_grad():
        leaves[0][0, 5, 1] = float("nan")
    p, seed = 0.5, 1234
    selections = _selections(case, mask)
    counts = selections.sum(0)
    dropout = fused.Dropout.of(p, len(case.segment_lengths),
                               torch.tensor([seed], device=DEVICE))
    check = fused.new_check(leaves[0].device)
    out, lse, backward = _fused(case, leaves, mask, dropout, check)
    assert not torch.isfinite(check).all()
    dq, dk, dv = backward(dout, torch.zeros_like(dlse))
    # the reference without the NaN row: the rows that do not attend it
    ref_leaves = [x.detach().cpu().double().nan_to_num(0.0).requires_grad_() for x in leaves]
    ref_out, ref_lse = attention_with_counts(*ref_leaves, counts, case.scale,
                                             fused_dropout_factors(seed, p, selections))
    clean = torch.ones(case.b, case.n, dtype=torch.bool)
    clean[0, 5] = False
    close(out[clean].cpu(), ref_out[clean], case.dtype, "out")
    assert out[0, 5, 1].isnan().all() and not out[0, 5, 0].isnan().any()
    # dk, dv of batch row 1, which the NaN row (batch row 0) does not reach
    want = grads([ref_out], [dout.cpu().double()], ref_leaves)
    for name, g, w in (("k", dk, want[1]), ("v", dv, want[2])):
        close(g[1].cpu(), w[1], case.dtype, f"d{name}")


def _op(q, k, v, dropout_p, case=SMALL):
    return dilated_attention(q, k, v, list(case.segment_lengths), list(case.dilation_rates),
                             is_causal=case.causal, backend="triton", dropout_p=dropout_p)


def test_the_ops_masks_follow_torch_manual_seed() -> None:
    leaves, _, _, _ = inputs(SMALL)
    with torch.no_grad():
        torch.manual_seed(3)
        first = _op(*leaves, 0.3)
        again = _op(*leaves, 0.3)
        torch.manual_seed(3)
        replayed = _op(*leaves, 0.3)
        exact = _op(*leaves, 0.0)
    assert torch.equal(first, replayed)
    assert not torch.equal(first, again)  # a new draw per call
    assert not torch.allclose(first, exact)


def test_the_ops_backward_uses_its_forwards_masks() -> None:
    """The op's gradient along a direction against a central difference of two calls drawing
    the same masks (reseeded): a backward with other masks would be off by O(1)."""
    leaves, dout, _, _ = inputs(SMALL)
    gen = torch.Generator().manual_seed(9)
    direction = [torch.randn(x.shape, generator=gen) for x in leaves]

    def loss(*xs):
        torch.manual_seed(11)
        return (_op(*xs, 0.4) * dout).sum()

    got = sum((g * e).sum() for g, e in zip(torch.autograd.grad(loss(*leaves), leaves),
                                            direction))
    eps = 1e-2
    with torch.no_grad():
        plus = loss(*[x + eps * e for x, e in zip(leaves, direction)])
        minus = loss(*[x - eps * e for x, e in zip(leaves, direction)])
    want = (plus - minus) / (2 * eps)
    assert abs(got - want) < 2e-3 * max(1.0, abs(want))


def test_the_mean_over_masks_is_the_undropped_output() -> None:
    case = Case(16, (16,), (1,), False, h=1, hk=1)
    leaves, _, _, _ = inputs(case)
    samples = 32
    with torch.no_grad():
        exact = _op(*leaves, 0.0, case)
        outs = torch.stack([_op(*leaves, 0.25, case) for _ in range(samples)])
    single_error = (outs[0] - exact).abs().mean()
    mean_error = (outs.mean(0) - exact).abs().mean()
    # one sample is far off; the mean of 32 is ~5.7x closer (1/sqrt(32))
    assert single_error > 0.05
    assert mean_error < single_error / 3


def test_a_module_drops_in_training_only() -> None:
    torch.manual_seed(0)
    module = MultiheadDilatedAttention(16, 4, [8, 16], [1, 2], dropout=0.5,
                                       backend="triton").to(DEVICE)
    x = torch.randn(1, 16, 16, device=DEVICE, requires_grad=True)
    module.train()
    first, second = module(x, x, x)[0], module(x, x, x)[0]
    assert not torch.equal(first, second)
    first.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    module.eval()
    assert torch.equal(module(x, x, x)[0], module(x, x, x)[0])


def test_launches_of_a_sequence_parallel_call_refuse_it() -> None:
    """The exchange's launches take no fused dropout: a named triton backend is refused there
    (auto runs the blockwise kernel)."""
    with pytest.raises(ValueError, match=r"backend 'triton' applies dropout \(dropout_p=0.1\)"):
        select_backend(torch.device("cpu"), torch.float32, dropout_p=0.1, backend="triton")
    assert select_backend(torch.device("cpu"), torch.float32, dropout_p=0.1, backend="triton",
                          whole_op=True) == "triton"


def _under_a_group(group):
    q = torch.randn(1, 8, 2, 4)
    return error_of(lambda: dilated_attention(q, q, q, [4], [1], backend="triton",
                                              dropout_p=0.1, group=group))[0]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
def test_a_group_refuses_the_fused_dropout_on_every_rank() -> None:
    for message in run_distributed(_under_a_group, 2):
        assert message.startswith("ValueError: backend 'triton' applies dropout"), message


def test_a_checkpointed_call_recomputes_the_same_masks() -> None:
    """torch.utils.checkpoint restores the generator state before the recomputation, so the
    seed the op draws on the device, and with it every mask, is the same: gradients equal
    the call's without checkpointing."""
    leaves, dout, _, _ = inputs(SMALL)

    def grads_of(checkpointed: bool):
        torch.manual_seed(5)
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(_op, *leaves, 0.3, use_reentrant=False)
        else:
            out = _op(*leaves, 0.3)
        return torch.autograd.grad(out, leaves, dout)

    for got, want in zip(grads_of(True), grads_of(False)):
        assert torch.equal(got, want)


def test_more_patterns_than_the_masks_hold_are_refused() -> None:
    q = torch.randn(1, 8, 1, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"at most 31 .*32 patterns"):
        dilated_attention(q, q, q, [4] * 32, [1] * 32, backend="triton", dropout_p=0.1)


def test_a_double_backward_is_refused() -> None:
    """create_graph=True runs the blockwise kernel's launches, whose masks are not the fused
    forward's: refused, not a wrong second derivative."""
    leaves, dout, _, _ = inputs(SMALL)
    out = _op(*leaves, 0.3)
    with pytest.raises(ValueError, match=r"create_graph=True.*dropout_p=0.3"):
        torch.autograd.grad(out, leaves, dout, create_graph=True)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Dynamo on the seed's .item()
def test_a_compiled_call_draws_the_eager_masks() -> None:
    """Under torch.compile (fullgraph) the op is its custom op pair with the seed an input:
    the same draw, outputs and gradients as eager."""
    leaves, dout, _, _ = inputs(SMALL)
    compiled = torch.compile(_op, backend="eager", fullgraph=True)
    results = []
    for run in (compiled, _op):
        torch.manual_seed(2)
        out = run(*leaves, 0.3)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graphs_replays_draw_new_masks() -> None:
    """The seed is drawn on the device from torch's generator, which a CUDA graph advances
    at every replay: each replay of a captured training step draws new masks, and its
    gradients are those of its own forward (the central-difference check above, eager)."""
    leaves, dout, _, _ = inputs(SMALL)
    graphed = torch.cuda.make_graphed_callables(lambda q, k, v: _op(q, k, v, 0.3),
                                                tuple(leaves))
    outs = []
    for _ in range(2):
        for x in leaves:
            x.grad = None
        out = graphed(*leaves)
        out.backward(dout)
        outs.append((out.detach().clone(), leaves[0].grad.clone()))
    assert not torch.equal(outs[0][0], outs[1][0]) and not torch.equal(outs[0][1], outs[1][1])
    assert all(torch.isfinite(x).all() for pair in outs for x in pair)
