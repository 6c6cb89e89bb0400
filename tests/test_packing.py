"""Packed documents (cu_seqlens) and key padding masks, against fp64 references.

A packed sequence equals the op applied to each document alone, concatenated
(outputs, lse, gradients); a masked call equals the masked reference; both on
one device, sequence-parallel over real spawned gloo ranks, and for the dense
ring. Also: what the op does with NaN/inf keys, rows no pattern reads, and
inputs that only some ranks mark as requiring grad.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Dict, List, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import dilated_attention, ring_attention
from dilated_attention.distributed import comm
from dist_harness import run_distributed
from reference import close, grads, reference_dilated_attention


def _inputs(b, n, h, hk, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return (randn(b, n, h, d), randn(b, n, hk, d), randn(b, n, hk, d), randn(b, n, h, d),
            randn(b, h, n))


def _cu(lengths: Sequence[int]) -> List[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@st.composite
def packed_cases(draw):
    docs = draw(st.lists(st.one_of(st.integers(0, 2), st.integers(0, 12), st.integers(13, 40)),
                         min_size=1, max_size=6))
    if sum(docs) == 0:
        docs.append(draw(st.integers(1, 9)))
    num = draw(st.integers(1, 3))
    segs = tuple(draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64])) for _ in range(num))
    rates = tuple(draw(st.integers(1, min(w, 4))) for w in segs)
    hk = draw(st.integers(1, 2))
    return dict(docs=docs, segs=segs, rates=rates, hk=hk, h=hk * draw(st.integers(1, 3)),
                causal=draw(st.booleans()), masked=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def _mask(b: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.rand(b, n, generator=gen) < 0.3


def _check_packed(case, backend: str = "cpu_flash") -> None:
    docs, segs, rates, h, hk, causal = (case[k] for k in
                                         ("docs", "segs", "rates", "h", "hk", "causal"))
    n, b, d = sum(docs), 2, 8
    q, k, v, dout, dlse = _inputs(b, n, h, hk, d, case["seed"])
    mask = _mask(b, n, case["seed"]) if case["masked"] else None
    cu = _cu(docs)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attention(*leaves, segs, rates, is_causal=causal, return_lse=True,
                                 cu_seqlens=cu, key_padding_mask=mask, backend=backend)
    got = grads([out, lse], [dout, dlse], leaves)
    # the reference: each document on its own, concatenated
    refs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_dilated_attention(*refs, segs, rates, causal=causal,
                                                   cu_seqlens=cu, key_padding_mask=mask)
    want = grads([ref_out, ref_lse], [dout, dlse], refs)
    close(out, ref_out, torch.float64, "out")
    close(lse, ref_lse, torch.float64, "lse")
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), f"d{name} not finite"
        close(g, w, torch.float64, f"d{name}")
    if mask is None:
        # packed equals calling the op per document (the op itself, not just the reference)
        for s, e in zip(cu[:-1], cu[1:]):
            if e > s:
                alone = dilated_attention(q[:, s:e], k[:, s:e], v[:, s:e], segs, rates,
                                          is_causal=causal)
                torch.testing.assert_close(out[:, s:e], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["cpu_flash", "blockwise"])
@settings(max_examples=60)
@given(case=packed_cases())
def test_packed_and_masked_match_reference(backend, case):
    _check_packed(case, backend)


def test_documents_restart_segments_and_offsets():
    """Corners: empty documents, one-row documents, a document shorter than every segment and
    one longer than the largest, a query whose keys are all masked (out 0, lse -inf)."""
    for docs in ([0, 5, 0, 1, 37, 2, 0], [1, 1, 1], [70]):
        for causal in (False, True):
            _check_packed(dict(docs=docs, segs=(4, 16), rates=(2, 4), h=4, hk=2, causal=causal,
                               masked=True, seed=sum(docs)))
    q, k, v, _, _ = _inputs(1, 6, 2, 2, 4, 0)
    mask = torch.tensor([[True, True, False, False, True, True]])
    out, lse = dilated_attention(q, k, v, [6], [1], is_causal=True, key_padding_mask=mask,
                                 return_lse=True)
    # rows 0 and 1 see only masked keys
    assert (out[:, :2] == 0).all() and (lse[:, :, :2] == -math.inf).all()
    assert torch.isfinite(out[:, 2:]).all()


def test_masked_values_change_nothing():
    """Values (and keys) at padded positions reach no output, on the op and the module."""
    from dilated_attention import MultiheadDilatedAttention

    q, k, v, _, _ = _inputs(2, 20, 4, 4, 8, 3)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, 15:] = True  # right padding
    mask[1, :4] = True  # left padding
    out = dilated_attention(q, k, v, [8, 20], [1, 2], key_padding_mask=mask)
    noisy_k, noisy_v = k.clone(), v.clone()
    noisy_k[mask] = 1e3
    noisy_v[mask] = -7.0
    again = dilated_attention(q, noisy_k, noisy_v, [8, 20], [1, 2], key_padding_mask=mask)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    mha = MultiheadDilatedAttention(32, 4, [8, 20], [1, 2], dtype=torch.float64)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y, _ = mha(x, x, x, key_padding_mask=mask, is_causal=True)
    x2 = x.clone()
    x2[mask] = 5.0  # padded tokens: their keys and values change, their own rows too
    y2, _ = mha(x2, x2, x2, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(y[~mask], y2[~mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_documents_and_mask_on_one_device(causal):
    q, k, v, dout, _ = _inputs(2, 30, 4, 2, 8, 5)
    mask = _mask(2, 30, 5)
    cu = [0, 7, 7, 19, 30]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*leaves, is_causal=causal, cu_seqlens=cu, key_padding_mask=mask)
    refs = [x.clone().requires_grad_() for x in (q, k, v)]
    # dense attention inside each document: one segment per document, rate 1
    ref, _ = reference_dilated_attention(*refs, [30], [1], causal=causal, cu_seqlens=cu,
                                         key_padding_mask=mask)
    close(out, ref, torch.float64, "out")
    for g, w in zip(grads([out], [dout], leaves), grads([ref], [dout], refs)):
        close(g, w, torch.float64, "grad")


@pytest.mark.parametrize("d", [4, 1])
@pytest.mark.parametrize("op", ["dilated", "ring"])
def test_nonfinite_values_reach_exactly_the_queries_that_attend_them(op, d):
    """A NaN value row: NaN out exactly where the reference attends it (causal: later rows of
    its segment), its lse exact (lse does not read v); an inf key likewise, and NaN lse
    there; finite and exact elsewhere. Head dim 1 too (the op's marker pass has one value
    column there). The NaN value row's logits underflow to a probability of 0 in some rows:
    still NaN there (a positive count, docs/spec.md)."""
    q, k, v, _, _ = _inputs(1, 24, 2, 2, d, 9)
    v[0, 5, 1, d - 1] = math.nan  # row 5, kv head 1
    k[0, 5, 1] *= 1e4  # its logits far from 0 both ways: a probability of exactly 0 in some rows
    k[0, 17, 0, 0] = math.inf  # row 17, kv head 0
    segs, rates = ([8, 24], [1, 2]) if op == "dilated" else ([24], [1])
    if op == "dilated":
        out, lse = dilated_attention(q, k, v, segs, rates, is_causal=True, return_lse=True)
    else:
        out, lse = ring_attention(q, k, v, is_causal=True, return_lse=True)
    from reference import dilated_counts

    counts = dilated_counts(24, 2, segs, rates, True)  # (h, n, n)
    attends_v = counts[1, :, 5] > 0  # head 1 reads kv head 1
    attends_k = counts[0, :, 17] > 0
    assert torch.equal(torch.isnan(out[0, :, 1]).any(-1), attends_v)
    assert torch.equal(torch.isnan(out[0, :, 0]).any(-1), attends_k)
    assert torch.equal(torch.isnan(lse[0, 0]), attends_k)
    assert not torch.isnan(lse[0, 1]).any()
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[0, 17, 0] = 0.0
    clean_v[0, 5, 1] = 0.0
    ref, ref_lse = reference_dilated_attention(q, clean_k, clean_v, segs, rates, causal=True)
    fine = ~torch.isnan(out)
    torch.testing.assert_close(out[fine], ref[fine], rtol=1e-9, atol=1e-9)
    fine = ~torch.isnan(lse)
    torch.testing.assert_close(lse[fine], ref_lse[fine], rtol=1e-9, atol=1e-9)


# the interpreter (triton) computes the non-finite rows in numpy, which warns about them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("backend", ["cpu_flash", "blockwise", "triton"])
def test_nonfinite_query_rows_are_nan(backend):
    """A q row holding a NaN or an infinity: its out and lse are NaN (docs/spec.md), on the
    launch paths as in the fused kernels (which apply the rule themselves); every other row
    is exact."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    q[0, 5, 1, 3] = math.nan
    q[0, 9, 0, 0] = math.inf
    out, lse = dilated_attention(q, k, v, [8], [1], return_lse=True, backend=backend)
    bad = torch.zeros(16, 2, dtype=torch.bool)
    bad[5, 1] = bad[9, 0] = True
    assert torch.equal(out[0].isnan().all(-1), bad)
    assert torch.equal(out[0].isnan().any(-1), bad)
    assert torch.equal(lse[0].isnan(), bad.T)
    ref, _ = reference_dilated_attention(q.double().nan_to_num(0, 0, 0), k.double(),
                                         v.double(), (8,), (1,))
    torch.testing.assert_close(out[0][~bad], ref[0][~bad].float(), rtol=1e-5, atol=1e-5)


def test_finite_values_whose_sum_overflows_give_the_same_result():
    """The non-finite check is one sum per input (functional._all_finite): finite entries whose
    sum overflows take the exact path for non-finite rows, which finds none: the same out
    and lse as the plain path, finite."""
    from unittest import mock

    from dilated_attention import functional

    q, k, v, _, _ = _inputs(1, 24, 2, 2, 4, 9)
    q, k, v = (x.float() for x in (q, k, v))
    for d in range(4):
        v[0, 3 + d, 1, d] = 1e38  # finite, one per column (no output overflows); the sum does
    assert not functional._all_finite(q, k, v) and functional._all_finite(q, k)
    got = dilated_attention(q, k, v, [8, 24], [1, 2], return_lse=True)
    with mock.patch.object(functional, "_all_finite", lambda *tensors: True):
        want = dilated_attention(q, k, v, [8, 24], [1, 2], return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_unread_rows_warn_once_per_pattern_set():
    q, k, v, _, _ = _inputs(1, 40, 4, 4, 4, 2)
    with pytest.warns(UserWarning, match=r"segment_lengths \[16\] and dilation_rates \[8\]") \
            as record:
        out = dilated_attention(q, k, v, [16], [8])
    # shown at the caller's line (Python's default filter: once per place and pattern set)
    assert record[0].filename == __file__
    # 4 heads read offsets 0..3 of every 8 rows: rows 4..7 of each 8 are read by none
    assert (out[0, 4:8] == 0).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dilated_attention(q, k, v, [16, 4], [8, 1])  # a rate-1 pattern reads every row


def test_huge_rate_runs_fast_and_small():
    """A dilation rate of 2^40 (segment 2^41) with N = 64: milliseconds, and exact."""
    import resource

    q, k, v, _, _ = _inputs(1, 64, 4, 4, 8, 4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = dilated_attention(q, k, v, [2**41], [2**40])
    assert time.perf_counter() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    ref, _ = reference_dilated_attention(q, k, v, [2**41], [2**40])
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cu,error,match", [
    ([1, 5, 10], ValueError, "start at 0"),
    ([0, 6, 4, 10], ValueError, "non-decreasing"),
    ([0, 4, 9], ValueError, "end at the sequence length 10"),
    (torch.tensor([0.0, 10.0]), TypeError, "cu_seqlens must hold integers"),
    ([0, 4.5, 10], TypeError, r"cu_seqlens\[1\]"),
    ("0,10", TypeError, "cu_seqlens"),
    (torch.tensor([[0, 10]]), ValueError, "1-D"),
    (torch.tensor([0, 10], device="meta"), ValueError, "cu_seqlens must hold values.*meta"),
])
def test_bad_cu_seqlens(cu, error, match):
    q, k, v, _, _ = _inputs(1, 10, 2, 2, 4, 0)
    with pytest.raises(error, match=match):
        dilated_attention(q, k, v, [4], [1], cu_seqlens=cu)


@pytest.mark.parametrize("mask,error,match", [
    (torch.zeros(1, 10), TypeError, "bool"),
    (torch.zeros(1, 9, dtype=torch.bool), ValueError, r"\(batch, seq_len\) = \(1, 10\)"),
    ([[False] * 10], TypeError, "key_padding_mask"),
])
def test_bad_key_padding_mask(mask, error, match):
    q, k, v, _, _ = _inputs(1, 10, 2, 2, 4, 0)
    with pytest.raises(error, match=match):
        dilated_attention(q, k, v, [4], [1], key_padding_mask=mask)
    with pytest.raises(error, match=match):
        ring_attention(q, k, v, key_padding_mask=mask)


def test_masked_calls_refuse_kernels_without_masks():
    q, k, v, _, _ = _inputs(1, 10, 2, 2, 4, 0)
    with pytest.raises(ValueError, match="key padding mask"):
        dilated_attention(q, k, v, [4], [1], key_padding_mask=torch.zeros(1, 10, dtype=bool),
                          backend="cuda_flash")


# --------------------------------------------------------------------------
# Sequence parallel: real spawned gloo ranks


SP_CASES = {
    # world: (pieces, documents, segments, rates, causal, h, hk, masked)
    2: [((9, 14), [0, 3, 3, 17, 23], (4, 8), (1, 2), True, 4, 2, True),
        ((12, 5), [0, 16, 17], (32,), (1,), False, 2, 1, False)],
    3: [((5, 0, 13), [0, 2, 11, 18], (3, 16), (1, 3), True, 3, 1, True),
        ((7, 7, 7), [0, 1, 20, 21], (4, 64), (2, 2), False, 4, 4, True)],
    4: [((6, 1, 2, 9), [0, 5, 5, 12, 13, 18], (7, 3, 20), (2, 3, 4), True, 4, 2, True),
        ((4, 4, 4, 4), [0, 3, 16], (16,), (1,), True, 2, 1, False)],
}


def _sharded_case(group, pieces, cu, segs, rates, causal, h, hk, masked, seed, ring=False):
    rank = comm.group_rank(group)
    n = sum(pieces)
    lo, hi = sum(pieces[:rank]), sum(pieces[: rank + 1])
    q, k, v, dout, dlse = _inputs(2, n, h, hk, 8, seed)
    mask = _mask(2, n, seed) if masked else None
    leaves = [x[:, lo:hi].clone().requires_grad_() for x in (q, k, v)]
    local_mask = None if mask is None else mask[:, lo:hi]
    with comm.count_communication() as stats:
        if ring:
            out, lse = ring_attention(*leaves, is_causal=causal, group=group, return_lse=True,
                                      cu_seqlens=torch.tensor(cu), key_padding_mask=local_mask)
        else:
            out, lse = dilated_attention(*leaves, segs, rates, is_causal=causal, group=group,
                                         return_lse=True, cu_seqlens=cu,
                                         key_padding_mask=local_mask)
        loss = (out * dout[:, lo:hi]).sum() + (lse * dlse[:, :, lo:hi]).sum()
        loss.backward()
    return {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
            "dv": leaves[2].grad, "messages": stats.messages, "bytes": stats.bytes_sent}


# Two ranks of 12 rows; segments of 4 and 8 with rates 1 and 2. Without documents the 8-row
# segment [8, 16) spans the border at 12 and costs traffic; with a document starting at row 4
# (inside rank 0) the segments restart there, [4, 12) ends at the border, and nothing is sent.
NO_TRAFFIC = ((12, 12), [0, 4, 24], (4, 8), (1, 2), False, 4, 2, False)


def _spawned(group, world):
    res: Dict[str, object] = {}
    for i, case in enumerate(SP_CASES[world]):
        res[f"case{i}"] = _sharded_case(group, *case, seed=30 + i)
        res[f"ring{i}"] = _sharded_case(group, *case, seed=40 + i, ring=True)
    if world == 2:
        for causal in (False, True):
            case = NO_TRAFFIC[:4] + (causal,) + NO_TRAFFIC[5:]
            res[f"no_traffic_causal{causal}"] = _sharded_case(group, *case, seed=50)
            whole = (case[0], [0, 24]) + case[2:]  # the same rows as one document
            res[f"one_document_causal{causal}"] = _sharded_case(group, *whole, seed=50)
    # the zigzag layout (causal balance) for dilated attention: rank p holds chunks p, 2P-1-p
    res["zigzag"] = _zigzag_case(group)
    # a rank whose bad boundaries differ: every rank raises, fast
    rank = comm.group_rank(group)
    x = torch.randn(1, 4, 2, 4, dtype=torch.float64)
    t0 = time.monotonic()
    try:
        dilated_attention(x, x, x, [4], [1], group=group,
                          cu_seqlens=[0, 2, 4 * world] if rank == 0 else [0, 3, 4 * world])
        res["mismatch"] = None
    except ValueError as exc:
        res["mismatch"] = (str(exc), time.monotonic() - t0)
    # requires_grad on one rank only: every rank raises instead of hanging in backward
    y = x.clone().requires_grad_(rank == 0)
    t0 = time.monotonic()
    try:
        dilated_attention(y, y, y, [4], [1], group=group)
        res["requires_grad"] = None
    except ValueError as exc:
        res["requires_grad"] = (str(exc), time.monotonic() - t0)
    # a NaN value on the last rank: the same rows as one device are NaN
    nan_v = torch.randn(1, 4 * world, 2, 4, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(3))
    nan_v[0, 4 * world - 3, 0] = math.nan
    mine = nan_v[:, 4 * rank : 4 * rank + 4]
    res["nan"] = dilated_attention(mine, mine, mine, [4 * world], [1], is_causal=True,
                                   group=group)
    # an empty sequence: the same error as one device
    e = torch.empty(1, 0, 2, 4, dtype=torch.float64)
    try:
        dilated_attention(e, e, e, [4], [1], group=group)
        res["empty"] = None
    except ValueError as exc:
        res["empty"] = str(exc)
    return res


def _zigzag_case(group):
    from dilated_attention import shard_sequence

    world = comm.group_size(group)
    n = 8 * world
    q, k, v, dout, _ = _inputs(2, n, 4, 2, 8, 77)
    mask = _mask(2, n, 77)
    leaves = [shard_sequence(x, group, layout="zigzag").clone().requires_grad_()
              for x in (q, k, v)]
    out = dilated_attention(*leaves, [4, 16], [1, 2], is_causal=True, group=group,
                            layout="zigzag", key_padding_mask=shard_sequence(
                                mask, group, layout="zigzag"), cu_seqlens=[0, 5, n])
    (out * shard_sequence(dout, group, layout="zigzag")).sum().backward()
    # one segment over every rank and heads that split: strategy="auto" would pick Ulysses
    # by traffic, which takes contiguous pieces only, so zigzag runs the exchange
    dense = [shard_sequence(x, group, layout="zigzag") for x in _inputs(1, n, 4, 4, 8, 78)[:3]]
    dense_out = dilated_attention(*dense, [n], [1], is_causal=True, group=group,
                                  layout="zigzag")
    return {"out": out, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad,
            "dense": dense_out}


@functools.lru_cache(maxsize=None)
def _spawn(world):
    return run_distributed(_spawned, world, world, timeout=240)


def _single(pieces, cu, segs, rates, causal, h, hk, masked, seed, ring=False):
    n = sum(pieces)
    q, k, v, dout, dlse = _inputs(2, n, h, hk, 8, seed)
    mask = _mask(2, n, seed) if masked else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if ring:
        out, lse = ring_attention(*leaves, is_causal=causal, return_lse=True, cu_seqlens=cu,
                                  key_padding_mask=mask)
    else:
        out, lse = dilated_attention(*leaves, segs, rates, is_causal=causal, return_lse=True,
                                     cu_seqlens=cu, key_padding_mask=mask)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    ref_out, ref_lse = reference_dilated_attention(
        q, k, v, (n,) if ring else segs, (1,) if ring else rates, causal=causal, cu_seqlens=cu,
        key_padding_mask=mask)
    close(out, ref_out, torch.float64, "single-device out")
    return {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
            "dv": leaves[2].grad}


@pytest.mark.distributed
@pytest.mark.parametrize("world,i,ring", [(w, i, ring) for w in SP_CASES
                                          for i in range(len(SP_CASES[w]))
                                          for ring in (False, True)])
def test_sharded_documents_and_masks_equal_one_process(world, i, ring):
    results = [r[f"{'ring' if ring else 'case'}{i}"] for r in _spawn(world)]
    case = SP_CASES[world][i]
    want = _single(*case, seed=(40 if ring else 30) + i, ring=ring)
    for key in ("out", "lse", "dq", "dk", "dv"):
        dim = 2 if key == "lse" else 1
        got = torch.cat([r[key] for r in results], dim=dim)
        torch.testing.assert_close(got, want[key], rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_errors_and_edge_cases(world):
    results = _spawn(world)
    for r in results:
        msg, seconds = r["mismatch"]
        assert "cu_seqlens" in msg and seconds < 10
        msg, seconds = r["requires_grad"]
        assert "requires_grad" in msg and seconds < 10
        assert "empty on every rank" in r["empty"]
    nan_v = torch.randn(1, 4 * world, 2, 4, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3))
    nan_v[0, 4 * world - 3, 0] = math.nan
    single = dilated_attention(nan_v, nan_v, nan_v, [4 * world], [1], is_causal=True)
    got = torch.cat([r["nan"] for r in results], dim=1)
    assert torch.equal(torch.isnan(got), torch.isnan(single))
    torch.testing.assert_close(got.nan_to_num(), single.nan_to_num(), rtol=1e-9, atol=1e-9)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_dilated_equals_one_process(world):
    from dilated_attention.distributed.sharding import piece_ranges

    n = 8 * world
    q, k, v, dout, _ = _inputs(2, n, 4, 2, 8, 77)
    mask = _mask(2, n, 77)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = dilated_attention(*leaves, [4, 16], [1, 2], is_causal=True, key_padding_mask=mask,
                            cu_seqlens=[0, 5, n])
    (out * dout).sum().backward()
    want = {"out": out, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    want["dense"] = dilated_attention(*_inputs(1, n, 4, 4, 8, 78)[:3], [n], [1], is_causal=True)
    for rank, r in enumerate(_spawn(world)):
        rows = torch.cat([torch.arange(a, b) for a, b in piece_ranges(n, world, rank, "zigzag")])
        for key, value in want.items():
            torch.testing.assert_close(r["zigzag"][key], value[:, rows], rtol=1e-9, atol=1e-9)


@pytest.mark.distributed
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ending_at_a_document_boundary_inside_a_rank_sends_nothing(causal):
    """Issue 10: a document boundary inside a rank cuts the segments there, so none spans the
    rank border: forward and backward send no message and no byte (the agreement aside),
    where the same rows as one document do; results still equal one process."""
    results = _spawn(2)
    case = NO_TRAFFIC[:4] + (causal,) + NO_TRAFFIC[5:]
    want = _single(*case, seed=50)
    for r in results:
        packed, whole = r[f"no_traffic_causal{causal}"], r[f"one_document_causal{causal}"]
        assert (packed["messages"], packed["bytes"]) == (0, 0)
        assert whole["messages"] > 0 and whole["bytes"] > 0  # the geometry would cost traffic
    for key in ("out", "lse", "dq", "dk", "dv"):
        got = torch.cat([r[f"no_traffic_causal{causal}"][key] for r in results],
                        dim=2 if key == "lse" else 1)
        torch.testing.assert_close(got, want[key], rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"{key}: {m}")
