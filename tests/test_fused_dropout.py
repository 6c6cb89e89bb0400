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

from dilated_attention import MultiheadDilatedAttention, dilated_attention, fused, kernels
from dilated_attention.distributed import comm
from dilated_attention.kernels import KernelOptions
from dilated_attention.patterns import Heads
from dist_harness import run_distributed
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


def test_a_piece_and_a_slice_of_heads_draw_what_the_whole_call_draws() -> None:
    """Note [fused dropout]: the masks count the sequence's rows and heads
    (Dropout.first_row, first_head), so a sequence-parallel piece whose segments lie in it
    and a head-parallel rank's heads equal those rows and heads of the whole call under
    the same key, out, lse and gradients."""
    case = Case(32, (8, 16), (1, 2), True, h=4, hk=2)
    leaves, dout, _, _ = inputs(case)
    q, k, v = (x.detach() for x in leaves)
    patterns = (case.segment_lengths, case.dilation_rates)
    call = dict(causal=True, scale=case.d ** -0.5, documents=None, key_mask=None)
    seed = torch.tensor([77], device=DEVICE)

    def run(q, k, v, dout, heads, first_head=0, **piece):
        dropout = fused.Dropout.of(0.3, 2, seed, first_head=first_head)
        out, lse = fused.forward(q, k, v, patterns, heads=heads, dropout=dropout, **piece,
                                 **call)
        return (out, lse, *fused.backward(dout, q, k, v, out, lse, None, patterns, heads=heads,
                                          dropout=dropout, **piece, **call))

    whole = run(q, k, v, dout, Heads.of(4, 2))
    rows = slice(16, 32)  # rank 1 of two: the segments of 8 and 16 rows lie in it
    piece = run(q[:, rows], k[:, rows], v[:, rows], dout[:, rows], Heads.of(4, 2),
                piece=(16, 32))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), piece, whole):
        close(got.cpu(), want[:, rows].cpu().double(), case.dtype, f"piece {name}")
    # query heads 2 and 3 and their key/value head 1, as a head-parallel rank holds them
    sliced = run(q[:, :, 2:], k[:, :, 1:], v[:, :, 1:], dout[:, :, 2:], Heads(2, (0, 0)),
                 first_head=2)
    for name, got, want, heads in zip(("out", "lse", "dq", "dk", "dv"), sliced, whole,
                                      (slice(2, 4),) * 3 + (slice(1, 2),) * 2):
        close(got.cpu(), want[:, :, heads].cpu().double(), case.dtype, f"heads {name}")


def test_a_launch_draws_one_pattern_under_its_own_seed() -> None:
    """A launch of the triton backend (kernels.attention_forward: a sequence-parallel call's
    launch on received keys) drops as one pattern over its block's rows, its Philox key
    the launch's seed (Note [dropout streams]); the backward draws the same masks."""
    case = Case(24, (24,), (1,), True, h=2, hk=1)
    leaves, dout, _, _ = inputs(case)
    q, k, v = (x.detach() for x in leaves)
    opts = KernelOptions(True, case.d ** -0.5, "triton", 0.3, seed=2**40 + 3)
    out, lse = kernels.attention_forward(q, k, v, opts)
    got = kernels.attention_backward(dout, q, k, v, out, lse, opts)
    ref_leaves = [x.cpu().double().requires_grad_() for x in (q, k, v)]
    selections = torch.ones(case.n, case.n).tril()[None, None, None].expand(1, 1, 2, -1, -1)
    factors = fused_dropout_factors(2**40 + 3, 0.3, selections)
    ref_out, ref_lse = attention_with_counts(*ref_leaves, selections.sum(0), case.scale,
                                             factors)
    assert (factors == 0).any() and (factors > 0).any()
    close(out.cpu(), ref_out, case.dtype, "out")
    close(lse.transpose(1, 2).cpu(), ref_lse, case.dtype, "lse")
    want = grads([ref_out], [dout.cpu().double()], ref_leaves)
    for name, g, w in zip("qkv", got, want):
        close(g.cpu(), w, case.dtype, f"d{name}")


# Sequence-parallel calls with backend "triton" and dropout on two gloo ranks: (strategy,
# segments, rates). Ulysses' ranks compute the whole op for their heads: the one-device
# call under the same torch.manual_seed. Segments across the ranks add the exchange's
# launches on received keys. (The exchange's own pairs where no segment crosses the ranks,
# on a 2 x 2 mesh: tests/test_fused.py's test_a_mesh_runs_each_ranks_own_pairs_fused.)
SHARDED_DROPOUT = {
    "ulysses": ("ulysses", (8, 16), (1, 2)),
    "exchange-crossing": ("exchange", (8, 32), (1, 2)),
}


def _sharded_dropout(group):
    rank = comm.group_rank(group)
    rows = slice(16 * rank, 16 * rank + 16)
    case = Case(32, (8, 16), (1, 2), True, h=4, hk=2)
    leaves, dout, _, _ = inputs(case)
    direction = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(3))
    results = {}
    for name, (strategy, segments, rates) in SHARDED_DROPOUT.items():
        def call(x, p=0.3, group=group, seed=11):
            torch.manual_seed(seed)
            return dilated_attention(*x, segments, rates, is_causal=True, dropout_p=p,
                                     backend="triton", group=group, strategy=strategy)

        mine = [x.detach()[:, rows].clone().requires_grad_() for x in leaves]
        out = call(mine)
        result = {"got": (out, *torch.autograd.grad(out, mine, dout[:, rows]))}
        if name != "exchange-crossing":
            whole = [x.detach().clone().requires_grad_() for x in leaves]
            out = call(whole, group=None)
            want = (out, *torch.autograd.grad(out, whole, dout))
            result["want"] = tuple(x[:, rows] for x in want)
            results[name] = result
            continue
        result["replayed"] = torch.equal(call(mine), out)
        # nearly every pair dropped: few (row, head)s keep any key, the launches' included
        result["rows_kept"] = int((call(mine, p=0.999).abs().amax(-1) > 0).sum())
        # the derivative along q of <out, dout> (summed over the ranks) under fixed masks
        eps = 1e-2
        shifted = [(call([mine[0].detach() + s * eps * direction[:, rows], *mine[1:]])
                    * dout[:, rows]).sum().item() for s in (1, -1)]
        result["difference"] = (shifted[0] - shifted[1]) / (2 * eps)
        result["directional"] = (result["got"][1] * direction[:, rows]).sum().item()
        results[name] = result
    return results


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
def test_sequence_parallel_calls_apply_the_fused_dropout() -> None:
    """Ulysses equals one device; where a segment crosses the ranks, the exchange's masks
    replay (the backward's are the forward's: the derivative along q matches central
    differences) and the launches on received keys drop too (p = 0.999 leaves few rows
    any key; launches without dropout leave all of rank 1's)."""
    ranks = run_distributed(_sharded_dropout, 2, timeout=600)
    for name in SHARDED_DROPOUT:
        results = [r[name] for r in ranks]
        for rank, r in enumerate(results):
            for what, got, want in zip(("out", "dq", "dk", "dv"), r["got"], r.get("want", ())):
                close(got, want.double(), torch.float32, f"{name} rank {rank} {what}")
        if "want" not in results[0]:
            for rank, r in enumerate(results):
                assert r["replayed"], (name, rank)
                assert r["rows_kept"] < 16, (name, rank, r["rows_kept"])  # of 64
            difference = sum(r["difference"] for r in results)
            directional = sum(r["directional"] for r in results)
            assert difference == pytest.approx(directional, rel=1e-3), name


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
