"""Sequence-parallel dilated attention: the plan (one process) and real spawned gloo ranks.

The plan tests simulate every rank's plan in one process and check that,
together, the ranks compute exactly the (query, key, head, pattern) pairs of
the single-device op, once each, and that every send meets its receive. The
distributed tests run `dilated_attention(..., group=pg)` on 2, 3 and 4 gloo
ranks (one spawn per world size, many cases each) and compare out, lse, dq,
dk, dv with the single-process op on the concatenated sequence in float64.
"""

from __future__ import annotations

import math
import time
from typing import Dict
from unittest import mock

import pytest
import torch

from dilated_attention import dilated_attention, ring_attention, validation
from dilated_attention.distributed import comm
from dilated_attention.distributed.sharding import piece_ranges
from dilated_attention.plan import Layout, make_plan
from dilated_attention.patterns import Heads
from dist_harness import SharedSpawn, subgroup
from reference import reference_dilated_attention

# --------------------------------------------------------------------------
# Real spawned gloo ranks: sharded result == single-process result (float64)

B, D = 2, 4

# (lengths, segment_lengths, dilation_rates, causal, h, hk); the lengths set P
SP_CASES = {
    2: [
        ((8, 12), (4,), (2,), False, 3, 1),  # every segment inside one rank
        ((7, 10), (4, 8, 32), (1, 2, 3), True, 5, 1),  # span two; w > N spans all
        ((7, 10), (4, 8, 32), (1, 2, 3), False, 4, 2),
        ((0, 9), (4, 2), (2, 1), True, 3, 1),  # an empty piece
        ((5, 6), (11,), (1,), False, 2, 2),  # dense, w == N
        ((7, 10), (4, 2**63 - 1), (1, 2**62), True, 5, 1),  # int64-sized w and r span all
    ],
    3: [
        ((5, 6, 7), (4, 8), (1, 2), True, 3, 3),
        ((5, 6, 7), (4, 8), (1, 2), False, 4, 2),
        ((3, 0, 11), (32, 5), (3, 1), True, 5, 5),  # w > N with r > 1 spans all
        ((9, 2, 4), (6, 3), (2, 3), False, 7, 7),
    ],
    4: [
        ((4, 4, 4, 4), (16,), (1,), False, 2, 1),  # dense: rotates around all ranks
        ((4, 4, 4, 4), (16,), (1,), True, 2, 1),
        ((6, 1, 2, 9), (7, 3, 20), (2, 3, 4), True, 7, 7),
        ((6, 1, 2, 9), (7, 3, 20), (2, 3, 4), False, 6, 3),
        ((3, 0, 7, 4), (32, 5, 2), (3, 1, 2), False, 6, 2),
        ((4, 4, 4, 4), (5, 4), (2, 1), True, 3, 1),  # local and spanning patterns mixed
    ],
}


def _inputs(lengths, h, hk, seed, dtype=torch.float64):
    """Full-sequence q, k, v and upstream gradients (dout, dlse (b, h, n)), deterministic."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return randn(B, n, h, D), randn(B, n, hk, D), randn(B, n, hk, D), randn(B, n, h, D), randn(
        B, h, n
    )


def _loss(out, lse, dout, dlse):
    # rows that attend nothing have lse = -inf: they take no lse gradient
    return (out * dout).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum()


def _run_sharded(group, lengths, segs, rates, causal, h, hk, seed, dtype=torch.float64):
    """This rank's piece through the sequence-parallel op, with its gradients and traffic."""
    rank = comm.group_rank(group)
    lo = sum(lengths[:rank])
    hi = lo + lengths[rank]
    q, k, v, dout, dlse = _inputs(lengths, h, hk, seed, dtype)
    q, k, v = (x[:, lo:hi].clone().requires_grad_() for x in (q, k, v))
    with comm.count_communication() as fwd:
        out, lse = dilated_attention(q, k, v, segs, rates, is_causal=causal, group=group,
                                     return_lse=True)
    with comm.count_communication() as bwd:
        _loss(out, lse, dout[:, lo:hi], dlse[:, :, lo:hi]).backward()
    return {
        "out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
        "fwd": (fwd.messages, fwd.bytes_sent, fwd.agreements),
        "bwd": (bwd.messages, bwd.bytes_sent, bwd.agreements),
    }


def _single(lengths, segs, rates, causal, h, hk, seed, dtype=torch.float64):
    """The single-process op on the concatenated sequence: out, lse (b, h, n), grads."""
    q, k, v, dout, dlse = _inputs(lengths, h, hk, seed, dtype)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = dilated_attention(q, k, v, segs, rates, is_causal=causal, return_lse=True)
    _loss(out, lse, dout, dlse).backward()
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


FLOAT32_CASE = ((6, 9, 5), (4, 8, 32), (1, 2, 4), True, 4, 2)


def _error_of(fn):
    t0 = time.monotonic()
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None, time.monotonic() - t0


def _bytes_case(group, c, causal):
    """Pieces 8c + 4, 8c + 8, ..., 8c + 8, 8c + 4: every boundary cuts a segment of 8 in
    halves, whatever c is; pattern (2, 1) stays local."""
    world = comm.group_size(group)
    lengths = (8 * c + 4,) + (8 * c + 8,) * (world - 2) + (8 * c + 4,)
    res = _run_sharded(group, lengths, (8, 2), (2, 1), causal, 2, 2, seed=c)
    return res["fwd"], res["bwd"]


def _spawned_cases(group, world):
    rank = comm.group_rank(group)
    res: Dict[str, object] = {}
    for i, case in enumerate(SP_CASES[world]):
        res[f"case{i}"] = _run_sharded(group, *case, seed=100 + i)
    res["bytes"] = {(c, causal): _bytes_case(group, c, causal)
                    for c in (1, 2, 5) for causal in (False, True)}

    # different configurations: ValueError on every rank, fast
    x = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    res["mismatch"] = _error_of(
        lambda: dilated_attention(x, x, x, (4,), (1,), is_causal=rank == 1, group=group)
    )
    # one rank's own input is bad (3-D q): every rank raises instead of hanging
    bad = x[0] if rank == world - 1 else x
    res["bad_input"] = _error_of(lambda: dilated_attention(bad, x, x, (4,), (2,), group=group))

    res["qkv_checks"] = _qkv_checks_per_call(group)
    res["nonfinite"] = _nonfinite_calls(group)
    if world == 2:
        res["dropout"] = _dropout_case(group)
    if world == 3:
        sub = subgroup([1, 2])  # a subgroup, not WORLD: group ranks 0, 1 are global 1, 2
        if sub is not None:
            res["subgroup"] = _run_sharded(sub, (5, 7), (4, 16), (2, 1), True, 4, 2, seed=7)
        res["float32"] = _run_sharded(group, *FLOAT32_CASE, seed=8, dtype=torch.float32)
    return res


# (tensor, row, head, value) planted in 22 rows: every rank's piece holds one at P = 2 and 3
NONFINITE = [("k", 3, 1, -math.inf), ("q", 9, 2, math.nan), ("v", 12, 1, math.nan),
             ("k", 17, 0, math.inf), ("v", 20, 0, math.inf)]


def _nonfinite_calls(group):
    """docs/spec.md's non-finite rule under a group: each call's (out, lse) on this rank's
    rows, for inputs with NaN and infinities planted on several ranks (None: one process)."""
    world = comm.group_size(group) if group is not None else 1
    rank = comm.group_rank(group) if group is not None else 0
    q, k, v, _, _ = _inputs((22,), 4, 2, seed=11)
    planted = {"q": q, "k": k, "v": v}
    for name, row, head, value in NONFINITE:
        planted[name][:, row, head, 1] = value
    (lo, hi), = piece_ranges(22, world, rank)
    q, k, v = (x[:, lo:hi] for x in (q, k, v))
    calls = {
        "exchange": lambda: dilated_attention(q, k, v, (4, 8, 32), (1, 2, 3), is_causal=True,
                                              strategy="exchange", group=group, return_lse=True),
        "ring": lambda: ring_attention(q, k, v, is_causal=True, group=group, return_lse=True),
        "window": lambda: ring_attention(q, k, v, is_causal=True, window_size=(5, 0),
                                         group=group, return_lse=True),
    }
    if world != 3:  # 4 heads, 2 kv heads over P ranks
        calls["ulysses"] = lambda: dilated_attention(
            q, k, v, (4, 8, 32), (1, 2, 3), strategy="ulysses", group=group, return_lse=True)
    return {name: call() for name, call in calls.items()}


def _qkv_checks_per_call(group):
    """How often each sequence-parallel op runs validation.check_qkv per call (forward and
    backward): it validates once, inside the agreement."""
    x = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    counts = {}
    with mock.patch.object(validation, "check_qkv", wraps=validation.check_qkv) as spy:
        dilated_attention(x, x, x, (4, 8), (1, 2), is_causal=True, group=group).sum().backward()
        counts["dilated"] = spy.call_count
        spy.reset_mock()
        ring_attention(x, x, x, is_causal=True, group=group).sum().backward()
        counts["ring"] = spy.call_count
    return counts


def _dropout_case(group):
    """p > 0 (blockwise kernel): reproducible under torch.manual_seed, and the backward
    replays the forward's masks, so the gradient matches a central difference."""
    rank = comm.group_rank(group)
    lengths, segs, rates, h, hk = (7, 10), (4, 8, 32), (1, 2, 3), 4, 2
    lo, hi = sum(lengths[:rank]), sum(lengths[: rank + 1])
    full = _inputs(lengths, h, hk, seed=5)
    q, k, v, dout = (x[:, lo:hi].clone() for x in full[:4])
    gen = torch.Generator().manual_seed(6)
    dirs = [torch.randn(x.shape[0], sum(lengths), *x.shape[2:], generator=gen,
                        dtype=x.dtype)[:, lo:hi] for x in (q, k, v)]

    def loss(q, k, v, p=0.3):
        torch.manual_seed(1234)  # fixes the dropout seed (rank 0's draw is agreed)
        out = dilated_attention(q, k, v, segs, rates, is_causal=True, dropout_p=p, group=group)
        return (out * dout).sum()

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    value = loss(*inputs)
    value.backward()
    eps = 1e-6
    with torch.no_grad():
        plus = loss(*(x + eps * u for x, u in zip((q, k, v), dirs)))
        minus = loss(*(x - eps * u for x, u in zip((q, k, v), dirs)))
        again = loss(q, k, v)
        no_dropout = loss(q, k, v, p=0.0)
        # the same piece on both ranks (segments inside each): their own masks (Note
        # [dropout streams]), so other outputs
        twin = torch.randn(1, 8, 2, 8, generator=torch.Generator().manual_seed(9),
                           dtype=torch.float64)
        torch.manual_seed(1)
        twin_out = dilated_attention(twin, twin, twin, (8,), (1,), dropout_p=0.5, group=group)
    return {
        "twin": twin_out,
        "value": value.item(), "again": again.item(), "no_dropout": no_dropout.item(),
        "difference": (plus - minus).item() / (2 * eps),
        "directional": sum((x.grad * u).sum() for x, u in zip(inputs, dirs)).item(),
    }


def _spawn(world):
    """One spawn per world size, shared by all the tests below (SPAWNS)."""
    return SPAWNS.results(world, _spawned_cases, world)


def _cat(results, key, dim=1):
    return torch.cat([r[key] for r in results], dim=dim)


def _assert_matches_single(results, case, seed, dtype=torch.float64, tol=1e-9):
    want = _single(*case, seed=seed, dtype=dtype)
    got_lse = _cat(results, "lse", dim=2)
    for key in ("out", "dq", "dk", "dv"):
        assert _cat(results, key).dtype == dtype
        torch.testing.assert_close(_cat(results, key), want[key], rtol=tol, atol=tol / 10,
                                   msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(got_lse, want["lse"], rtol=tol, atol=tol / 10)
    return want


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,i", [(w, i) for w, cases in SP_CASES.items() for i in range(len(cases))]
)
def test_sharded_equals_single_process(world, i):
    case = SP_CASES[world][i]
    results = [r[f"case{i}"] for r in _spawn(world)]
    want = _assert_matches_single(results, case, seed=100 + i)
    lengths, segs, rates, causal, h, hk = case
    q, k, v, _, _ = _inputs(lengths, h, hk, 100 + i)
    ref_out, ref_lse = reference_dilated_attention(q, k, v, segs, rates, causal=causal)
    torch.testing.assert_close(want["out"], ref_out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(want["lse"], ref_lse, rtol=1e-9, atol=1e-10)
    for r in results:
        assert r["fwd"][2] == 1 and r["bwd"][2] == 0  # one agreement, in the forward
    layout, heads = Layout.contiguous(lengths), Heads.of(h, hk)
    spans = any(make_plan(layout, (segs, rates), causal, heads, p).rounds
                for p in range(len(lengths)))
    if not spans:  # a purely local pattern set sends nothing
        assert all(r["fwd"][:2] == (0, 0) and r["bwd"][:2] == (0, 0) for r in results)
    else:
        assert sum(r["fwd"][0] for r in results) > 0


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_inputs_give_the_single_process_result(world):
    """NaN and infinities in q, k and v on several ranks: the exchange, Ulysses, the ring and
    its windows give every rank the single-process rows, NaN in the same places (the rule
    picks the queries that attend a bad row, wherever it lives) and equal elsewhere."""
    results = [r["nonfinite"] for r in _spawn(world)]
    want = _nonfinite_calls(None)
    for name in results[0]:
        got_out = torch.cat([r[name][0] for r in results], dim=1)
        got_lse = torch.cat([r[name][1] for r in results], dim=2)
        want_out, want_lse = want[name]
        assert torch.isnan(want_out).any() and not torch.isnan(want_out).all(), name
        torch.testing.assert_close(got_out, want_out, rtol=1e-9, atol=1e-10, equal_nan=True,
                                   msg=lambda m: f"{name} out: {m}")
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-9, atol=1e-10, equal_nan=True,
                                   msg=lambda m: f"{name} lse: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_stay_flat_as_n_grows(world):
    for rank, r in enumerate(_spawn(world)):
        for causal in (False, True):
            per_c = [r["bytes"][(c, causal)] for c in (1, 2, 5)]
            assert per_c[0] == per_c[1] == per_c[2], per_c
            (f_msgs, f_bytes, _), (b_msgs, b_bytes, _) = per_c[0]
            # pattern (8, 2), h = hk = 2, d = 4, b = 2, float64: a segment straddling a
            # boundary is 4 + 4 rows; each head reads 2 rows of the other half, so a
            # transfer is 2 heads x 2 rows of k and v = 2 * B * 4 * D * 8 bytes
            transfer = 2 * B * 4 * D * 8
            senders = (rank < world - 1) + (not causal and rank > 0)
            assert (f_msgs, f_bytes) == (senders, senders * transfer)
            # backward: the keys again, plus dK/dV home for every key received
            receivers = (rank > 0) + (not causal and rank < world - 1)
            assert (b_msgs, b_bytes) == (senders + receivers, (senders + receivers) * transfer)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_errors_raise_on_every_rank_within_seconds(world):
    results = _spawn(world)
    for rank, r in enumerate(results):
        msg, seconds = r["mismatch"]
        assert msg.startswith("ValueError") and "'is_causal'" in msg, msg
        assert seconds < 10
        msg, seconds = r["bad_input"]
        assert seconds < 10
        if rank == world - 1:
            assert msg.startswith("ValueError") and "must be 4-D" in msg, msg
        else:
            assert msg.startswith("ValueError") and f"rank {world - 1}" in msg, msg


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_inputs_are_checked_once_per_call(world):
    for r in _spawn(world):
        assert r["qkv_checks"] == {"dilated": 1, "ring": 1}


@pytest.mark.distributed
def test_subgroup():
    results = [r["subgroup"] for r in _spawn(3)[1:]]
    _assert_matches_single(results, ((5, 7), (4, 16), (2, 1), True, 4, 2), seed=7)
    assert "subgroup" not in _spawn(3)[0]


@pytest.mark.distributed
def test_dropout_replays_its_masks_in_backward():
    results = [r["dropout"] for r in _spawn(2)]
    for r in results:
        assert r["value"] == r["again"]  # same seed, same masks
        assert r["value"] != r["no_dropout"]
    difference = sum(r["difference"] for r in results)
    directional = sum(r["directional"] for r in results)
    assert difference == pytest.approx(directional, rel=1e-6)
    assert not torch.equal(results[0]["twin"], results[1]["twin"])


@pytest.mark.distributed
def test_float32_matches_single_process_tightly():
    results = [r["float32"] for r in _spawn(3)]
    _assert_matches_single(results, FLOAT32_CASE, seed=8, dtype=torch.float32, tol=1e-5)


# The exchange in bf16 where rank 0 receives no keys (causal: its queries never read rank 1)
# but sends its keys to rank 1: its dK/dV homes must be the accumulators' dtype (fp32).

Q4_LENGTHS = (8, 8)


def _q4_inputs():
    g = torch.Generator().manual_seed(0)
    n = sum(Q4_LENGTHS)
    return [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
            for _ in range(4)]


def _q4_rank(group):
    rank = comm.group_rank(group)
    lo = sum(Q4_LENGTHS[:rank])
    hi = lo + Q4_LENGTHS[rank]
    q, k, v, dout = _q4_inputs()
    q, k, v = (x[:, lo:hi].clone().requires_grad_() for x in (q, k, v))
    out = dilated_attention(q, k, v, (16,), (1,), is_causal=True, group=group,
                            strategy="exchange")
    (out.float() * dout[:, lo:hi].float()).sum().backward()
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.distributed
def test_exchange_in_bf16_when_a_rank_receives_no_keys():
    q, k, v, dout = _q4_inputs()
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = dilated_attention(q, k, v, (16,), (1,), is_causal=True)
    (out.float() * dout.float()).sum().backward()
    want = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    results = SPAWNS.results(2, _q4_rank)
    for rank, got in enumerate(results):
        lo = sum(Q4_LENGTHS[:rank])
        for name, ref in want.items():
            torch.testing.assert_close(got[name].float(), ref[:, lo:lo + Q4_LENGTHS[rank]].float(),
                                       rtol=3e-2, atol=3e-2)


# Frozen keys and values (q-only training): no rank differentiates k or v, so no dK/dV
# travels in backward, in the exchange, the ring and the halo exchange alike. One op each:
# (name, kwargs); lengths (7, 10), GQA, causal: the dilated segments span both ranks.
FROZEN_OPS = (
    ("exchange", dict(strategy="exchange")),
    ("ring", dict()),
    ("halo", dict(window_size=(3, 0))),
)
FROZEN_CASE = ((7, 10), (4, 8, 32), (1, 2, 3), True, 4, 2)


def _frozen_attend(op, q, k, v, **group):
    _, segs, rates, causal, _, _ = FROZEN_CASE
    kwargs = dict(FROZEN_OPS)[op]
    if op == "exchange":
        return dilated_attention(q, k, v, segs, rates, is_causal=causal, return_lse=True,
                                 **kwargs, **group)
    return ring_attention(q, k, v, is_causal=causal, return_lse=True, **kwargs, **group)


def _frozen_ranks(group):
    lengths, _, _, _, h, hk = FROZEN_CASE
    rank = comm.group_rank(group)
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    results = {}
    for op, _ in FROZEN_OPS:
        for requires in ((True, True, True), (True, False, False)):
            q, k, v, dout, dlse = _inputs(lengths, h, hk, 0)
            q, k, v = (x[:, lo:hi].clone().requires_grad_(r)
                       for x, r in zip((q, k, v), requires))
            with comm.count_communication() as fwd:
                out, lse = _frozen_attend(op, q, k, v, group=group)
            with comm.count_communication() as bwd:
                _loss(out, lse, dout[:, lo:hi], dlse[..., lo:hi]).backward()
            results[op, requires] = {
                "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "fwd": (fwd.messages, fwd.bytes_sent), "bwd": (bwd.messages, bwd.bytes_sent)}
    return results


@pytest.mark.distributed
def test_frozen_keys_and_values_send_no_dkv():
    """With k and v frozen on every rank, the backward of the exchange, the ring and the
    halo exchange sends what its forward sent (the key rows again, for dq) and no dK/dV;
    out and dq equal one process's (float64). With k and v trained, their float64 dK/dV
    (as many bytes as the key rows) go home too: each fetched part once (the exchange, the
    halos), every piece through every rank (the ring: P hops for dK/dV)."""
    lengths, _, _, _, h, hk = FROZEN_CASE
    outputs = SPAWNS.results(2, _frozen_ranks)
    for op, _ in FROZEN_OPS:
        q, k, v, dout, dlse = _inputs(lengths, h, hk, 0)
        q.requires_grad_()
        out, lse = _frozen_attend(op, q, k, v)
        _loss(out, lse, dout, dlse).backward()
        fetched = sum(results[op, (True, True, True)]["fwd"][1] for results in outputs)
        assert fetched > 0, op  # the case moves keys at all
        saved = []
        for rank, results in enumerate(outputs):
            lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
            full, frozen = results[op, (True, True, True)], results[op, (True, False, False)]
            for got in (full, frozen):
                torch.testing.assert_close(got["out"], out.detach()[:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=op)
                torch.testing.assert_close(got["dq"], q.grad[:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=op)
            assert frozen["dk"] is None and frozen["dv"] is None, op
            assert frozen["bwd"] == frozen["fwd"] == full["fwd"], (op, rank, frozen)
            saved.append(full["bwd"][1] - frozen["bwd"][1])
        if op == "ring":  # every piece's dK/dV pass through every rank
            assert saved == [fetched, fetched], (op, saved, fetched)
        else:  # each fetched part's dK/dV go home once
            assert sum(saved) == fetched, (op, saved, fetched)


# One spawn per world size for every rank function above, in this order on the same ranks
SPAWNS = SharedSpawn({
    2: [(_spawned_cases, 2), (_q4_rank,), (_frozen_ranks,)],
    3: [(_spawned_cases, 3)],
    4: [(_spawned_cases, 4)],
})
