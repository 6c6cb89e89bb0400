"""Ring attention on real spawned gloo ranks == single-process dense attention.

Each rank computes its piece of out, lse and the gradients; the parent
compares them with the float64 brute-force reference of the whole sequence
cut to that rank's rows, and checks the exact traffic of every call.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from dilated_attention.distributed import comm
from dilated_attention import ring_attention
from dilated_attention.distributed.ring import RingAttentionFunction, RingSizes, ring_forward
from dilated_attention.distributed.sharding import piece_lengths
from dilated_attention.kernels import KernelOptions
from dist_harness import SharedSpawn, case_ranges, error_of, rows_of, subgroup
from reference import grads, reference_attention


def _case(seed, *, lengths=None, n=None, layout="contiguous", causal, h=4, hk=4, b=2, d=8,
          dtype=torch.float64, dlse=False, sizes: Optional[RingSizes] = None) -> Dict:
    """One call's setting; `sizes` forces the rows per K/V sub-piece and query chunk
    (Note [sub-pieces]), None takes the default bound as the public op does."""
    return dict(seed=seed, lengths=lengths, n=n, layout=layout, causal=causal, h=h, hk=hk, b=b,
                d=d, dtype=dtype, dlse=dlse, sizes=sizes)


def _cases(world: int) -> List[Dict]:
    uneven = {2: [3, 8], 3: [5, 0, 9], 4: [1, 6, 0, 7]}[world]
    return [
        _case(1, lengths=[6] * world, causal=False),
        _case(2, lengths=[6] * world, causal=True, hk=2, dlse=True),
        _case(3, lengths=uneven, causal=True, h=6, hk=2),
        _case(4, lengths=uneven, causal=False, hk=1, dlse=True),
        _case(5, n=4 * world, layout="zigzag", causal=True, hk=2, dlse=True),
        _case(6, n=6 * world, layout="zigzag", causal=False),
        _case(7, lengths=list(reversed(uneven)), causal=True, dtype=torch.float32),
        # forced sizes: several sub-pieces per piece (uneven ones, empty ones where a piece
        # is shorter than the sub-piece count) and several query chunks per launch
        _case(8, lengths=[6] * world, causal=False, hk=2, sizes=RingSizes(2, 4)),
        _case(9, lengths=uneven, causal=True, h=6, hk=2, dlse=True, sizes=RingSizes(2, 3)),
        _case(10, lengths=list(reversed(uneven)), causal=False, hk=1, b=1, dlse=True,
              sizes=RingSizes(3, 2)),
        # zigzag pieces of 8 rows cut into sub-pieces [0, 2) [2, 5) [5, 8): one straddles the
        # chunk boundary at 4, and queries chunked by 2 cut the diagonal squares
        _case(13, n=8 * world, layout="zigzag", causal=True, hk=2, dlse=True,
              sizes=RingSizes(3, 2)),
        _case(14, n=6 * world, layout="zigzag", causal=False, sizes=RingSizes(4, 5)),
        _case(15, n=8 * world, layout="zigzag", causal=True, b=1, dtype=torch.float32,
              sizes=RingSizes(2, 3)),
        _case(16, lengths=uneven, causal=True, hk=2, dtype=torch.bfloat16, sizes=RingSizes(2, 2)),
        # one sub-piece a piece and query chunks of 2: a diagonal square's later chunks (2 rows
        # each) stay causal
        _case(18, lengths=[6] * world, causal=True, hk=2, dlse=True, sizes=RingSizes(6, 2)),
        # the default bounds with pieces of 800 rows: forward sub-pieces of 512 rows (2 per
        # piece), backward ones of 256 (4 per piece), query chunks of 768 (2 per piece)
        _case(17, n=800 * world, layout="zigzag", causal=True, h=4, hk=2, b=1, d=4, dlse=True),
    ]


def _lengths(case: Dict, world: int) -> List[int]:
    """Every rank's piece length."""
    if case["layout"] == "zigzag":
        return piece_lengths(case["n"], world, "zigzag")
    return list(case["lengths"])


def _sub_pieces(case: Dict, world: int, *, backward: bool) -> int:
    """S: the sub-pieces every K/V piece travels in, in one pass (Note [sub-pieces])."""
    lengths = _lengths(case, world)
    sizes = case["sizes"] or RingSizes.bounded(max(lengths), case["h"], case["hk"],
                                               case["dtype"], backward=backward)
    return math.ceil(max(lengths) / sizes.kv_rows)


def _full_inputs(case: Dict) -> Tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v, dout, dlse (same on every process)."""
    n = sum(case["lengths"]) if case["n"] is None else case["n"]
    gen = torch.Generator().manual_seed(case["seed"])
    b, h, hk, d, dtype = case["b"], case["h"], case["hk"], case["d"], case["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return (randn(b, n, h, d), randn(b, n, hk, d), randn(b, n, hk, d), randn(b, n, h, d),
            randn(b, h, n))


def _run_case(group, case: Dict) -> Dict:
    world, rank = comm.group_size(group), comm.group_rank(group)
    q, k, v, dout, dlse = _full_inputs(case)
    ranges = case_ranges(case, world, rank)
    q, k, v = (rows_of(x, ranges).requires_grad_() for x in (q, k, v))
    with comm.count_communication() as fwd:
        if case["sizes"] is None:
            out, lse = ring_attention(q, k, v, is_causal=case["causal"], group=group,
                                      return_lse=True, layout=case["layout"])
        else:
            # the op below the public one, which takes the ring sizes
            opts = KernelOptions(case["causal"], case["d"] ** -0.5, "cpu_flash")
            out, lse = RingAttentionFunction.apply(q, k, v, opts, group, case["layout"],
                                                   _lengths(case, world), case["sizes"])
            lse = lse.transpose(1, 2)  # (b, n, h) -> (b, h, n), as ring_attention returns
    upstream = [out, lse] if case["dlse"] else [out]
    grad_up = [rows_of(dout, ranges), rows_of(dlse, ranges, dim=2)][: len(upstream)]
    with comm.count_communication() as bwd:
        torch.autograd.backward(upstream, grad_up)
    return dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                fwd=(fwd.messages, fwd.bytes_sent, fwd.agreements),
                bwd=(bwd.messages, bwd.bytes_sent, bwd.agreements))


def _ring_cases(group, world_cases):
    world, rank = comm.group_size(group), comm.group_rank(group)
    results = {"cases": [_run_case(group, case) for case in world_cases]}
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    # ranks disagree on the configuration
    results["causal_mismatch"] = error_of(
        lambda: ring_attention(x, x, x, is_causal=rank == 1, group=group))
    results["scale_mismatch"] = error_of(
        lambda: ring_attention(x, x, x, scale=0.5 if rank == 0 else 0.25, group=group))
    # one rank's input is bad before the collective
    bad = x[..., :4] if rank == world - 1 else x
    results["bad_tensor"] = error_of(lambda: ring_attention(x, bad, x, group=group))
    results["zigzag_uneven"] = error_of(
        lambda: ring_attention(x[:, : 2 + 2 * (rank == 0)], x[:, : 2 + 2 * (rank == 0)],
                               x[:, : 2 + 2 * (rank == 0)], group=group, layout="zigzag"))
    # a subgroup of ranks 1..P-1: its ring runs over group ranks, not global ones
    if world >= 3:
        sub = subgroup(list(range(1, world)))
        if sub is not None:
            results["subgroup"] = [_run_case(sub, case) for case in _sub_cases(world - 1)]
    return results


def _sub_cases(world: int) -> List[Dict]:
    return [_case(11, lengths=[3 + r for r in range(world)], causal=True, hk=2, dlse=True),
            _case(12, n=4 * world, layout="zigzag", causal=True),
            _case(18, lengths=[3 + r for r in range(world)], causal=True, dlse=True,
                  sizes=RingSizes(2, 2))]


def _expected_traffic(case: Dict, world: int, rank: int):
    """(messages, bytes, agreements) of the forward and the backward on `rank`.

    Bytes: exactly P-1 K/V pieces forward; P-1 K/V pieces and P dK/dV
    pieces (fp32/fp64 accumulators) backward. Messages: each piece of L
    rows travels as its S sub-pieces (Note [sub-pieces]; S of the pass),
    min(L, S) of them non-empty, k and v (dk and dv) one message each.
    """
    lengths = _lengths(case, world)
    fwd_sub_pieces, bwd_sub_pieces = (_sub_pieces(case, world, backward=b)
                                      for b in (False, True))
    row = case["b"] * case["hk"] * case["d"]
    item = torch.empty(0, dtype=case["dtype"]).element_size()
    acc_item = 8 if case["dtype"] == torch.float64 else 4
    kv_pieces = [lengths[(rank - s) % world] for s in range(world - 1)]
    dkv_pieces = [lengths[(rank - s) % world] for s in range(world)]
    fwd = (2 * sum(min(m, fwd_sub_pieces) for m in kv_pieces), 2 * sum(kv_pieces) * row * item, 1)
    bwd = (2 * sum(min(m, bwd_sub_pieces) for m in kv_pieces + dkv_pieces),
           fwd[1] + 2 * sum(dkv_pieces) * row * acc_item, 0)
    if case["sizes"] is not None:
        fwd = fwd[:2] + (0,)  # called below ring_attention: no agreement
    return fwd, bwd


def _reference(case: Dict) -> Tuple[torch.Tensor, ...]:
    """The whole sequence's out, lse, dq, dk, dv in float64 (every rank checks its rows)."""
    q, k, v, dout, dlse = _full_inputs(case)
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=case["causal"])
    upstream = [out, lse] if case["dlse"] else [out]
    dq, dk, dv = grads(upstream, [dout.double(), dlse.double()][: len(upstream)], [q, k, v])
    return out.detach(), lse.detach(), dq, dk, dv


def _check_case(case: Dict, world: int, rank: int, got: Dict,
                reference: Tuple[torch.Tensor, ...]) -> None:
    out, lse, dq, dk, dv = reference
    ranges = case_ranges(case, world, rank)
    tol = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5),
           torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[case["dtype"]]
    where = f"case {case['seed']} rank {rank}"
    for name, want, dim in (("out", out, 1), ("lse", lse, 2), ("dq", dq, 1), ("dk", dk, 1),
                            ("dv", dv, 1)):
        have = got[name].double()
        torch.testing.assert_close(have, rows_of(want, ranges, dim), **tol,
                                   msg=lambda m: f"{where} {name}: {m}")
    assert got["out"].dtype == case["dtype"]
    fwd, bwd = _expected_traffic(case, world, rank)
    assert got["fwd"] == fwd, f"{where}: forward traffic {got['fwd']} != {fwd}"
    assert got["bwd"] == bwd, f"{where}: backward traffic {got['bwd']} != {bwd}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process(world):
    cases = _cases(world)
    results = SPAWNS.results(world, _ring_cases, cases)
    # once per case, not per rank: the longest case's takes seconds
    references = [_reference(case) for case in cases]
    sub_references = [_reference(case) for case in _sub_cases(world - 1)] if world >= 3 else []
    for rank, res in enumerate(results):
        for case, got, reference in zip(cases, res["cases"], references):
            _check_case(case, world, rank, got, reference)
        msg, secs = res["causal_mismatch"]
        assert msg.startswith("ValueError") and "is_causal" in msg and secs < 10, msg
        msg, secs = res["scale_mismatch"]
        assert msg.startswith("ValueError") and "scale" in msg and secs < 10, msg
        msg, secs = res["bad_tensor"]
        assert msg.startswith("ValueError") and "head_dim" in msg and secs < 10, msg
        if rank != world - 1:
            assert f"rank {world - 1}" in msg
        msg, _ = res["zigzag_uneven"]
        assert msg.startswith("ValueError") and "zigzag" in msg, msg
        if world >= 3:
            if rank == 0:
                assert "subgroup" not in res
            else:
                for case, got, reference in zip(_sub_cases(world - 1), res["subgroup"],
                                                 sub_references):
                    _check_case(case, world - 1, rank - 1, got, reference)


# ----------------------------------------------------------------------------
# Local (no group): plain attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_local_ring_is_plain_attention(causal, layout):
    case = _case(21, lengths=[10], causal=causal, h=6, hk=3, dlse=True, dtype=torch.float32)
    q, k, v, dout, dlse = _full_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, is_causal=causal, return_lse=True, layout=layout)
    got = grads([out, lse], [dout, dlse], [q, k, v])
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, causal=causal)
    want = grads([ref_out, ref_lse], [dout.double(), dlse.double()], [q64, k64, v64])
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), ref_out.detach(), **tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **tol)


def test_default_ring_sizes_follow_the_memory_bound():
    """Note [sub-pieces]: a pass's sub-pieces in flight within half a q shard, a launch's output
    within an eighth, unless the minimum rows (512 forward, 256 backward, 768) are more."""
    f32, bf16 = torch.float32, torch.bfloat16
    # 16384 rows over 4 ranks, 12 heads, fp32: forward 4 m hk d s = 4096 h d s / 2
    assert RingSizes.bounded(4096, 12, 12, f32, backward=False) == RingSizes(512, 768)
    assert RingSizes(512, 768).sub_pieces([4096] * 4) == 8
    # backward, (4 s + 6 a) m hk d <= 4096 h d s / 2: 204 rows, raised to 256
    assert RingSizes.bounded(4096, 12, 12, f32, backward=True) == RingSizes(256, 768)
    # a longer piece: the bounds decide (fp32: n / 8, n / 20, n / 8)
    assert RingSizes.bounded(40960, 12, 12, f32, backward=False) == RingSizes(5120, 5120)
    assert RingSizes.bounded(40960, 12, 12, f32, backward=True) == RingSizes(2048, 5120)
    # bf16: K/V rows as fp32 forward; backward's fp32 dK/dV weigh twice as much
    assert RingSizes.bounded(40960, 12, 12, bf16, backward=True) == RingSizes(1280, 5120)
    # GQA: k and v are 4x smaller per row, so sub-pieces are 4x longer
    assert RingSizes.bounded(40960, 32, 8, f32, backward=False) == RingSizes(20480, 5120)
    # short pieces: the minimums, one sub-piece
    assert RingSizes.bounded(100, 12, 12, f32, backward=False) == RingSizes(512, 768)
    assert RingSizes(512, 768).sub_pieces([100, 0, 37]) == 1
    with pytest.raises(ValueError, match="kv_rows must be a positive int, got 0"):
        RingSizes(0, 4)
    with pytest.raises(ValueError, match="q_rows must be a positive int, got 2.5"):
        RingSizes(4, 2.5)


def test_local_validation_errors():
    x = torch.randn(1, 5, 2, 4)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(x, x, x, layout="spiral")
    with pytest.raises(ValueError, match="zigzag"):
        ring_attention(x, x, x, layout="zigzag")  # 5 rows: not two equal chunks
    with pytest.raises(TypeError, match="is_causal"):
        ring_attention(x, x, x, is_causal=1)
    with pytest.raises(ValueError, match="seq_len"):
        ring_attention(x[:, :0], x[:, :0], x[:, :0])
    with pytest.raises(ValueError, match="scale"):
        ring_attention(x, x, x, scale=-1.0)


_FAKE_SCRIPT = """
import torch, torch.distributed as dist
from dilated_attention import ring_attention
from dilated_attention.distributed import comm
from dilated_attention.tools.launch import fake_world
fake_world(5, 16)
P = 16
# (rows, forward sub-pieces, backward sub-pieces) per piece (Note [sub-pieces]): 64
# rows, one sub-piece; 1024 rows, 8 heads over 2 kv heads, fp32: forward sub-pieces of
# 1024 * 8 * 4 // (2 * 2 * 16) = 512 rows, backward ones of
# max(256, 1024 * 8 * 4 // (2 * 2 * 40)) = 256
for n, fwd_sub_pieces, bwd_sub_pieces in ((64, 1, 1), (1024, 2, 4)):
    q = torch.empty(1, n, 8, 16, device="meta", requires_grad=True)
    k, v = (torch.empty(1, n, 2, 16, device="meta", requires_grad=True) for _ in range(2))
    with comm.count_communication() as s:
        out = ring_attention(q, k, v, is_causal=True, group=dist.group.WORLD, layout="zigzag")
        out.sum().backward()
    piece = n * 2 * 16 * 4
    assert out.is_meta and q.grad.shape == q.shape and k.grad.shape == k.shape
    # forward and backward: P-1 K/V pieces each; backward: P dK/dV pieces; k and v apart
    messages = 2 * (fwd_sub_pieces * (P - 1) + bwd_sub_pieces * ((P - 1) + P))
    assert (s.messages, s.bytes_sent) == (messages, ((P - 1) + (P - 1) + P) * 2 * piece), s
print("ok")
"""


def test_ring_runs_on_meta_tensors_with_a_fake_group():
    """The CLI's dry-run estimate runs the real ring this way: 16 fake ranks, meta tensors."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FAKE_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# The op below ring_attention checks its own `lengths` and `sizes` (ring_attention agrees them,
# RingAttentionFunction / ring_forward callers pass them): a clear error on every rank, never
# a ring that runs with receive buffers of the wrong rows.

def _ring_arguments_checked(group):
    opts = KernelOptions(False, 0.5, "cpu_flash")
    x = torch.randn(1, 4, 2, 4, dtype=torch.float64)
    return {
        # every rank holds 4 rows but says its piece has 6
        "lengths": error_of(lambda: ring_forward(group, x, x, x, opts, lengths=[6, 6])),
        "sizes": error_of(lambda: RingAttentionFunction.apply(
            x, x, x, opts, group, "contiguous", [4, 4], (2, 2))),
    }


@pytest.mark.distributed
def test_ring_checks_its_lengths_and_sizes_on_every_rank():
    for result in SPAWNS.results(2, _ring_arguments_checked):
        msg, secs = result["lengths"]
        assert msg.startswith("ValueError") and "lengths [6, 6]" in msg and secs < 10, msg
        msg, secs = result["sizes"]
        assert msg.startswith("TypeError") and "sizes must be a RingSizes" in msg, msg


# One spawn per world size for the rank functions above, in this order on the same ranks
SPAWNS = SharedSpawn({
    2: [(_ring_cases, _cases(2)), (_ring_arguments_checked,)],
    3: [(_ring_cases, _cases(3))],
    4: [(_ring_cases, _cases(4))],
})
