"""Head-parallel (Ulysses) and 2-D mesh sequence parallelism on real spawned gloo ranks.

Every case runs `dilated_attention` (or `ring_attention`) on each rank's piece with
strategy="ulysses" on a one-dimensional group, or over a 2-D DeviceMesh (head-parallel x
sequence-parallel: the rank at (u, s) holds piece s * U + u), and compares out, lse, dq,
dk, dv with the single-process op on the whole sequence in float64; the all-to-alls are
counted exactly.
"""

from __future__ import annotations


import pytest
import torch

from dilated_attention import dilated_attention, ring_attention
from dilated_attention.distributed import comm
from dilated_attention.tools import launch
from dilated_attention.distributed import strategy as strategies
from dilated_attention.distributed.ulysses import HeadSplit
from dilated_attention.plan import Layout
from dist_harness import SharedSpawn

B, D = 2, 4

# (lengths, segment_lengths, dilation_rates, causal, h, hk); the lengths set P
ULYSSES_CASES = {
    2: [
        ((7, 10), (4, 8, 32), (1, 2, 3), True, 4, 2),
        ((0, 9), (4, 2), (2, 1), False, 2, 1),  # an empty piece; MQA
        ((5, 6), (11,), (1,), True, 4, 4),  # dense
    ],
    3: [
        ((5, 6, 7), (4, 8), (1, 2), True, 6, 2),  # kv head 0 and 1 both read by rank 1
        ((3, 0, 11), (32, 5), (3, 1), False, 3, 3),
        ((9, 2, 4), (6, 3), (2, 3), True, 6, 6),
    ],
    4: [
        ((6, 1, 2, 9), (7, 3, 20), (2, 3, 4), True, 4, 2),  # 1 query head per rank, kv x2
        ((4, 4, 4, 4), (16,), (1,), False, 8, 2),
        ((3, 0, 7, 4), (32, 5, 2), (3, 1, 2), False, 4, 4),
    ],
}

# cases on a 2 x 2 mesh (U = 2 head-parallel, S = 2 sequence-parallel); lengths by piece
MESH_CASES = [
    ((5, 3, 6, 4), (4, 8, 32), (1, 2, 3), True, 4, 2),
    ((0, 7, 2, 9), (6, 3), (2, 3), False, 6, 3),  # kv heads split unevenly over U
    ((4, 4, 4, 4), (16,), (1,), True, 2, 1),  # dense: the exchange over S rotates
]


def _inputs(lengths, h, hk, seed):
    """Full-sequence q, k, v, dout, dlse (b, h, n), float64, deterministic."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return (randn(B, n, h, D), randn(B, n, hk, D), randn(B, n, hk, D), randn(B, n, h, D),
            randn(B, h, n))


def _loss(out, lse, dout, dlse, with_lse=True):
    """<out, dout> + <lse, dlse>; only the first with `with_lse` False (lse gets no gradient)."""
    loss = (out * dout).sum()
    return loss + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum() if with_lse else loss


def _attend(op, q, k, v, case, **kwargs):
    _, segs, rates, causal, _, _ = case
    if op == "ring":
        return ring_attention(q, k, v, is_causal=causal, return_lse=True, **kwargs)
    return dilated_attention(q, k, v, segs, rates, is_causal=causal, return_lse=True, **kwargs)


def _single(op, case, seed, with_lse=True, **kwargs):
    lengths, _, _, _, h, hk = case
    q, k, v, dout, dlse = _inputs(lengths, h, hk, seed)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = _attend(op, q, k, v, case, **kwargs)
    _loss(out, lse, dout, dlse, with_lse).backward()
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _sharded(op, group, piece, case, seed, with_lse=True, requires=(True, True, True),
             **kwargs):
    """This rank's piece (number `piece`) through the op, its gradients (of the inputs that
    `requires` marks) and its traffic."""
    lengths, _, _, _, h, hk = case
    lo = sum(lengths[:piece])
    hi = lo + lengths[piece]
    q, k, v, dout, dlse = _inputs(lengths, h, hk, seed)
    q, k, v = (x[:, lo:hi].clone().requires_grad_(r) for x, r in zip((q, k, v), requires))
    local = {key: val[:, lo:hi] for key, val in kwargs.items() if key == "key_padding_mask"}
    rest = {key: val for key, val in kwargs.items() if key != "key_padding_mask"}
    with comm.count_communication() as fwd:
        out, lse = _attend(op, q, k, v, case, group=group, **local, **rest)
    with comm.count_communication() as bwd:
        _loss(out, lse, dout[:, lo:hi], dlse[:, :, lo:hi], with_lse).backward()
    counts = {name: (s.messages_of("all_to_all"), s.messages_of("all_gather"), s.agreements,
                     s.messages)
              for name, s in (("fwd", fwd), ("bwd", bwd))}
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, **counts,
            "bwd_bytes": bwd.bytes_sent,
            "sent": [s.bytes_of("send") for s in (fwd, bwd)]}  # point to point


def _extras(case):
    """Documents crossing pieces and a padding mask, for the same case."""
    lengths = case[0]
    n = sum(lengths)
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[0, n // 3] = mask[1, -2:] = True
    return {"cu_seqlens": [0, n // 2 + 1, n], "key_padding_mask": mask}


def _ulysses_ranks(group, world):
    results = []
    for i, case in enumerate(ULYSSES_CASES[world]):
        for j, extra in enumerate(({}, _extras(case))):
            results.append(_sharded("dilated", group, comm.group_rank(group), case, 10 * i + j,
                                    strategy="ulysses", **extra))
    # the loss reads only out: the lse's gradient all-to-all is skipped on every rank
    results.append(_sharded("dilated", group, comm.group_rank(group), ULYSSES_CASES[world][0],
                            0, strategy="ulysses", with_lse=False))
    # ranks that differentiate different inputs (only whether any is agreed): rank 0 q,
    # the others k and v, then q, k and v
    for others in ((False, True, True), (True, True, True)):
        requires = (True, False, False) if comm.group_rank(group) == 0 else others
        results.append(_sharded("dilated", group, comm.group_rank(group),
                                ULYSSES_CASES[world][0], 0, strategy="ulysses",
                                requires=requires))
    # the loss reads lse on rank 0 only: the other ranks send its gradient as zeros
    results.append(_sharded("dilated", group, comm.group_rank(group), ULYSSES_CASES[world][0],
                            0, strategy="ulysses", with_lse=comm.group_rank(group) == 0))
    # a configuration that differs across ranks, heads that do not split: errors everywhere
    errors = []
    case = ULYSSES_CASES[world][0]
    mine = "ulysses" if comm.group_rank(group) == 0 else "exchange"
    for bad, strategy in ((case, mine), (case[:4] + (world + 1, 1), "ulysses")):
        try:
            _sharded("dilated", group, comm.group_rank(group), bad, 0, strategy=strategy)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return results, errors


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_equals_one_process(world: int) -> None:
    outputs = SPAWNS.results(world, _ulysses_ranks, world)
    cases = [(case, extra) for case in ULYSSES_CASES[world]
             for extra in ({}, _extras(case))]
    for index, (case, extra) in enumerate(cases):
        want = _single("dilated", case, 10 * (index // 2) + index % 2, **extra)
        lengths = case[0]
        for rank, (results, _) in enumerate(outputs):
            got = results[index]
            lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
            for name in ("out", "dq", "dk", "dv"):
                torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=f"{case} {extra.keys()} {name}")
            torch.testing.assert_close(got["lse"], want["lse"][..., lo:hi], rtol=1e-10,
                                       atol=1e-10)
            masked = "key_padding_mask" in extra
            # forward: q, k+v, out, lse all-to-alls (+ the mask's all-gather); backward the
            # same four in reverse and one all-reduce (which gradients reach out and lse);
            # one agreement each way at most, nothing else
            assert got["fwd"] == (4, int(masked), 1, 4 + int(masked)), (case, got["fwd"])
            assert got["bwd"] == (4, 0, 0, 5), (case, got["bwd"])
    case = ULYSSES_CASES[world][0]
    want = _single("dilated", case, 0, with_lse=False)
    for rank, (results, _) in enumerate(outputs):
        got = results[len(cases)]
        lo, hi = sum(case[0][:rank]), sum(case[0][:rank + 1])
        for name in ("dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10, atol=1e-10)
        assert got["bwd"] == (3, 0, 0, 4), got["bwd"]
    want = _single("dilated", case, 0)
    for i in (1, 2):
        for rank, (results, _) in enumerate(outputs):
            got = results[len(cases) + i]
            lo, hi = sum(case[0][:rank]), sum(case[0][:rank + 1])
            present = [name for name in ("dq", "dk", "dv") if got[name] is not None]
            assert present == (["dq"] if rank == 0 else ["dk", "dv"] if i == 1
                               else ["dq", "dk", "dv"])
            for name in present:
                torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=f"mixed {i}, rank {rank}, {name}")
    # lse in rank 0's loss only: one process's gradients with dlse zero past rank 0's rows
    lengths, _, _, _, h, hk = case
    q, k, v, dout, dlse = _inputs(lengths, h, hk, 0)
    dlse[..., lengths[0]:] = 0
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = _attend("dilated", q, k, v, case)
    _loss(out, lse, dout, dlse).backward()
    for rank, (results, _) in enumerate(outputs):
        got = results[len(cases) + 3]
        lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
        for name, want in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(got[name], want[:, lo:hi], rtol=1e-10, atol=1e-10,
                                       msg=f"lse on rank 0 only, rank {rank}, {name}")
    for _, errors in outputs:
        assert "ranks disagree on 'strategy'" in errors[0]
        assert f"cannot be split over {world} head-parallel ranks" in errors[1]


# which of q, k, v every rank differentiates: all; q only (k and v frozen); k and v only;
# q and k (v frozen: k and v travel together, so their gradient still does)
FROZEN = ((True, True, True), (True, False, False), (False, True, True), (True, True, False))


def _frozen_ranks(group):
    case = ULYSSES_CASES[2][0]
    return [_sharded("dilated", group, comm.group_rank(group), case, 0, strategy="ulysses",
                     requires=requires) for requires in FROZEN]


@pytest.mark.distributed
def test_ulysses_sends_no_gradient_that_no_rank_needs() -> None:
    """A gradient that no rank differentiates (frozen k and v, or a frozen q) has no
    all-to-all in backward; the gradients asked for equal one process's."""
    case = ULYSSES_CASES[2][0]
    lengths, _, _, _, h, hk = case
    want = _single("dilated", case, 0)
    outputs = SPAWNS.results(2, _frozen_ranks)
    for rank, results in enumerate(outputs):
        lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
        for requires, got in zip(FROZEN, results):
            torch.testing.assert_close(got["out"], want["out"][:, lo:hi], rtol=1e-10,
                                       atol=1e-10)
            torch.testing.assert_close(got["lse"], want["lse"][..., lo:hi], rtol=1e-10,
                                       atol=1e-10)
            for name, asked in zip(("dq", "dk", "dv"), requires):
                if not asked:
                    assert got[name] is None, (requires, name)
                    continue
                torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=f"{requires} rank {rank} {name}")
            # out's and lse's gradients, one all-reduce, and dq's and dK/dV's all-to-alls
            # where some rank needs them
            wanted = 2 + requires[0] + (requires[1] or requires[2])
            assert got["bwd"] == (wanted, 0, 0, wanted + 1), (requires, got["bwd"])
        # the bytes saved are the gradient's all-to-all: a rank sends the other rank's rows
        # of its own heads (float64; k and v: two per kv head)
        row = B * D * 8 * lengths[1 - rank]
        split = HeadSplit.of(2, h, hk)
        full = results[0]["bwd_bytes"]
        assert full - results[1]["bwd_bytes"] == row * 2 * len(split.kv(rank))
        assert full - results[2]["bwd_bytes"] == row * len(split.query(rank))
        assert full == results[3]["bwd_bytes"]


def _mesh_ranks(group):
    mesh = launch.init_device_mesh((2, 2))
    u, s = mesh.get_coordinate()
    piece = s * 2 + u
    results = []
    for i, case in enumerate(MESH_CASES):
        for op in ("dilated", "ring"):
            for j, extra in enumerate(({}, _extras(case))):
                results.append(_sharded(op, mesh, piece, case, 10 * i + j, **extra))
    # k and v frozen: neither the heads' all-to-all nor the sequence dimension's exchange or
    # ring sends dK/dV
    for op in ("dilated", "ring"):
        results.append(_sharded(op, mesh, piece, MESH_CASES[0], 0,
                                requires=(True, False, False)))
    return piece, results


@pytest.mark.distributed
def test_two_dimensional_mesh_equals_one_process() -> None:
    outputs = SPAWNS.results(4, _mesh_ranks)
    index = 0
    for i, case in enumerate(MESH_CASES):
        for op in ("dilated", "ring"):
            for j, extra in enumerate(({}, _extras(case))):
                want = _single(op, case, 10 * i + j, **extra)
                lengths = case[0]
                for piece, results in outputs:
                    got = results[index]
                    lo, hi = sum(lengths[:piece]), sum(lengths[:piece + 1])
                    for name in ("out", "dq", "dk", "dv"):
                        torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10,
                                                   atol=1e-10, msg=f"{op} {case} {name}")
                    torch.testing.assert_close(got["lse"], want["lse"][..., lo:hi],
                                               rtol=1e-10, atol=1e-10)
                    # four all-to-alls over the heads dimension each way; two agreements
                    # (heads, then sequence dimension) before the forward
                    assert got["fwd"][:3] == (4, int("key_padding_mask" in extra), 2)
                    assert got["bwd"][:3] == (4, 0, 0)
                index += 1
    case = MESH_CASES[0]
    lengths = case[0]
    for op in ("dilated", "ring"):
        want = _single(op, case, 0)
        for piece, results in outputs:
            got = results[index]
            lo, hi = sum(lengths[:piece]), sum(lengths[:piece + 1])
            for name in ("out", "dq"):
                torch.testing.assert_close(got[name], want[name][:, lo:hi], rtol=1e-10,
                                           atol=1e-10, msg=f"{op} frozen k, v: {name}")
            assert got["dk"] is None and got["dv"] is None
            # no dK/dV all-to-all; the sequence dimension fetches the keys again, no more
            assert got["bwd"][:3] == (3, 0, 0), (op, got["bwd"])
            assert got["sent"][1] == got["sent"][0], (op, got["sent"])
            assert got["sent"][0] > 0 or op == "dilated", got["sent"]  # the ring sends
        index += 1


def test_head_split_replicates_only_the_kv_heads_a_rank_reads() -> None:
    split = HeadSplit.of(3, 6, 2)  # query heads 2u, 2u + 1; g = 3
    assert [list(split.kv(u)) for u in range(3)] == [[0], [0, 1], [1]]
    assert split.local_heads(1).first == 2 and split.local_heads(1).kv_of == (0, 1)
    split = HeadSplit.of(4, 8, 2)
    assert [list(split.kv(u)) for u in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(ValueError, match="6 query heads cannot be split over 4"):
        HeadSplit.of(4, 6, 2)


def _shape(lengths, segs, rates, h=8, hk=8):
    return strategies.Shape(tuple(lengths), (tuple(segs), tuple(rates)), False, h, hk, 64, 1,
                            2, 4, None)


def test_auto_picks_the_strategy_with_less_traffic() -> None:
    # LongNet's segments inside 16K-row pieces: the exchange sends nothing
    local = _shape([16384] * 4, [2048, 4096], [1, 2])
    assert max(strategies.traffic("exchange", local, (1, 4))) == 0
    assert strategies.auto_choice(local) == "exchange"
    # dense attention over 4 ranks: the exchange moves every rank's k and v to every
    # other, Ulysses q, k, v and out once
    dense = _shape([4096] * 4, [16384], [1])
    exchange = max(strategies.traffic("exchange", dense, (1, 4)))
    ulysses = max(strategies.traffic("ulysses", dense, (4, 1)))
    assert exchange == 3 * 4096 * 2 * 8 * 64 * 2  # three other ranks' k and v
    # q, k, v of 3/4 of the heads out; out (+ fp32 lse) of the others' rows in
    assert ulysses == 4096 * 64 * 2 * 3 * (2 + 2 + 2) + 3 * 4096 * 2 * (64 * 2 + 4)
    assert strategies.auto_choice(dense) == "ulysses"
    # the LongNet geometric schedule whose last segment spans all ranks: w / r rows per
    # pattern cross each border, far less than Ulysses' whole q, k, v, out
    geometric = _shape([1 << 16] * 4, [2048, 16384, 131072, 1 << 18], [1, 8, 64, 128])
    assert strategies.auto_choice(geometric) == "exchange"
    # a tie keeps the exchange
    tie = strategies.Shape((4, 4, 4, 4), ((16,), (1,)), False, 8, 4, 1, 1, 4, 4, None)
    assert max(strategies.traffic("exchange", tie, (1, 4))) \
        == max(strategies.traffic("ulysses", tie, (4, 1)))
    assert strategies.auto_choice(tie) == "exchange"
    # a 2 x 2 grid: the heads' all-to-all and the sequence exchange of the halved heads
    grid = strategies.traffic("ulysses", dense, (2, 2))
    half = _shape([8192] * 2, [16384], [1], h=4, hk=4)
    assert grid[0] == (strategies.ulysses_bytes(dense, [4096, 4096])[0]
                       + strategies.exchange_bytes(half, Layout.contiguous([8192] * 2))[0])


def test_auto_choice_work_grows_linearly_with_ranks(monkeypatch) -> None:
    # issue 27.3: the Ulysses traffic of every rank is one formula over the head split,
    # not a sum over the other ranks per rank (O(P^3) head lookups: 17 s at P = 256)
    calls = []
    query = HeadSplit.query
    monkeypatch.setattr(HeadSplit, "query", lambda self, rank: calls.append(rank) or
                        query(self, rank))
    for p in (64, 256):
        calls.clear()
        shape = _shape([4096] * p, [2048, 4096], [1, 2], h=p, hk=p)
        assert strategies.auto_choice(shape) == "exchange"
        assert len(calls) <= 4 * p, (p, len(calls))
    # a grid: one all-to-all formula per sequence block, one exchange per head rank
    calls.clear()
    strategies.traffic("ulysses", _shape([4096] * 64, [16384], [1], h=8, hk=8), (8, 8))
    assert len(calls) <= 4 * 64


def _models_on_a_mesh(group, shape):
    """LongNetLM / LongNet training steps with process_group a DeviceMesh == one process."""
    from test_models import PACKED, _data, _perturb, _step, small_config

    from dilated_attention import LongNet, LongNetLM

    mesh = launch.init_device_mesh(shape)
    # heads that split over the mesh's head dimension: 6 over 2, or 4 over 4 (with one kv
    # head read by two ranks)
    heads = dict(num_heads=6) if shape[0] == 2 else dict(num_heads=4)
    done = []
    for kind, strategy, overrides, n in (
        ("lm", "auto", dict(num_kv_heads=heads["num_heads"] // 2), 37),  # uneven pieces
        ("lm", "ulysses", dict(), 37),
        ("encdec", "auto", dict(num_kv_heads=2), 26),
        ("packed", "auto", dict(), 37),
    ):
        config = small_config(**heads, **overrides)
        models = []
        for g in (None, mesh):
            torch.manual_seed(0)
            cls = LongNet if kind == "encdec" else LongNetLM
            models.append(cls(config, dtype=torch.float64, process_group=g, strategy=strategy))
            _perturb(models[-1])
        tokens, targets = _data(2, n, config.vocab_size, seed=n)
        extra = () if kind != "encdec" else (_data(2, n + 5, config.vocab_size, seed=1)[0],)
        docs = dict(cu_seqlens=PACKED) if kind == "packed" else {}
        ref_loss, ref_grads = _step(models[0], None, tokens, targets, *extra, **docs)
        loss, grads = _step(models[1], mesh, tokens, targets, *extra, **docs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-12, msg=f"{kind} {name}")
        done.append(kind)
    return done


@pytest.mark.distributed
@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_models_on_a_device_mesh_equal_one_process(shape) -> None:
    results = SPAWNS.results(4, _models_on_a_mesh, shape)
    assert all(r == ["lm", "lm", "encdec", "packed"] for r in results)


# A 2-D mesh with a dimension of size 1 is the other dimension's group ("a mesh dimension of
# size 1 does nothing", comm/groups.py): the (1, 2) mesh resolves to the sequence group, and a
# call over (1, 2) or (2, 1) agrees once, as over a plain group, with the one-process result.

GR4_N = 16


def _gr4_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, GR4_N, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def _gr4_rank(group):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for shape in ((1, 2), (2, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("heads", "sequence"))
        resolved = comm.resolve_group(mesh)
        piece = comm.group_rank(resolved)
        rows = slice(piece * GR4_N // 2, (piece + 1) * GR4_N // 2)
        q, k, v = (x[:, rows].requires_grad_() for x in _gr4_inputs())
        with comm.count_communication() as counted:
            o = dilated_attention(q, k, v, [8, 16], [1, 2], is_causal=True, group=mesh)
        out[shape] = (isinstance(resolved, comm.Grid), piece, o, counted.agreements)
    return out


@pytest.mark.distributed
def test_a_mesh_dimension_of_one_rank_is_dropped():
    want = dilated_attention(*_gr4_inputs(), [8, 16], [1, 2], is_causal=True)
    for res in SPAWNS.results(2, _gr4_rank):
        for shape, (is_grid, piece, out, agreements) in res.items():
            assert is_grid == (shape == (2, 1)), shape  # (1, 2): the sequence group itself
            assert agreements == 1, (shape, agreements)
            rows = slice(piece * GR4_N // 2, (piece + 1) * GR4_N // 2)
            torch.testing.assert_close(out, want[:, rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)])
def test_grid_traffic_is_each_ranks_heads_and_sequence_share(grid):
    """A U x S mesh (global rank t * U + u holds head share u of sequence block t):
    its forward bytes are its Ulysses all-to-all within block t plus the exchange its heads
    u send between blocks. Unequal blocks make every rank's share differ."""
    from dilated_attention.distributed import strategy as strategies
    from dilated_attention.distributed.ulysses import HeadSplit
    from dilated_attention.layout import Layout

    u_size, s_size = grid
    lengths = tuple(range(8, 8 + 4 * u_size * s_size, 4))  # every rank's rows differ
    shape = strategies.Shape(lengths, ((16, 64), (1, 2)), False, 6, 6, 8, 1, 2, 4, None)
    got = strategies.traffic("ulysses", shape, grid)
    blocks = [lengths[t * u_size:(t + 1) * u_size] for t in range(s_size)]
    layout = Layout.contiguous([sum(b) for b in blocks])
    split = HeadSplit.of(u_size, 6, 6)
    for t in range(s_size):
        for u in range(u_size):
            heads = strategies.ulysses_bytes(shape, blocks[t])[u]
            sequence = strategies.exchange_bytes(shape, layout, split.local_heads(u))[t]
            assert got[t * u_size + u] == heads + sequence, (t, u)


@pytest.mark.parametrize("h,hk", [(3, 3), (5, 1)])
def test_auto_keeps_the_exchange_when_the_heads_do_not_split(h, hk):
    """"auto" over 2 ranks with an odd head count: Ulysses cannot split the heads, so
    the exchange, even where Ulysses' traffic would be smaller (dense attention), no error."""
    from dilated_attention.distributed import strategy as strategies

    shape = strategies.Shape((64, 64), ((128,), (1,)), False, h, hk, 8, 1, 2, 4, None)
    assert strategies.auto_choice(shape) == "exchange"


# sum_across_ranks, all_reduce_gradients' agreement and a 2-D mesh's refusal of the
# exchange: the three tests below read one rank function's results


def _contracts_rank(group):
    from dilated_attention import all_reduce_gradients
    from dilated_attention.distributed import comm
    from dilated_attention.distributed.gradients import sum_across_ranks
    from dilated_attention.tools import launch

    rank = comm.group_rank(group)
    out = {}
    # the sum leaves its input alone (a caller's partial loss, still used afterwards)
    leaf = (torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)).requires_grad_()
    partial = leaf * 1.0
    total = sum_across_ranks(partial, group)
    out["partial_after"] = partial.detach().clone()
    out["summed"] = total.detach().clone()
    # its backward: P times the incoming gradient (Note [gradients across ranks])
    (total * torch.tensor([1.0, 3.0], dtype=torch.float64)).sum().backward()
    out["grad"] = leaf.grad.clone()
    # the ranks' parameters differ in dtype only: an error on every rank, not an
    # all-reduce of a float32 buffer against a float64 one
    model = torch.nn.Linear(2, 2, bias=False)
    if rank == 1:
        model = model.double()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    try:
        all_reduce_gradients(model, group)
        out["dtype"] = "ok"
    except ValueError as exc:
        out["dtype"] = f"ValueError: {exc}"
    # strategy="exchange" on a 2-D mesh: refused, not run as Ulysses
    mesh = launch.init_device_mesh((2, 2))
    x = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    try:
        dilated_attention(x, x, x, [16], [1], group=mesh, strategy="exchange")
        out["mesh_exchange"] = "ok"
    except ValueError as exc:
        out["mesh_exchange"] = f"ValueError: {exc}"
    return out


def _contracts():
    return SPAWNS.results(4, _contracts_rank)


@pytest.mark.distributed
def test_sum_across_ranks_leaves_its_input_and_scales_the_gradient():
    """sum_across_ranks: the sum on every rank, the input unchanged, gradient P x."""
    for rank, result in enumerate(_contracts()):
        mine = torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)
        torch.testing.assert_close(result["partial_after"], mine, rtol=0, atol=0)
        torch.testing.assert_close(result["summed"], torch.tensor([10.0, 20.0],
                                   dtype=torch.float64), rtol=0, atol=0)
        torch.testing.assert_close(result["grad"], torch.tensor([4.0, 12.0],
                                   dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.distributed
def test_all_reduce_gradients_refuses_parameters_of_another_dtype():
    """Same names and shapes, rank 1's in float64: every rank raises, naming both."""
    for result in _contracts():
        message = result["dtype"]
        assert message.startswith("ValueError") and "different parameters" in message, message
        assert "float32" in message and "float64" in message, message


@pytest.mark.distributed
def test_exchange_on_a_two_dimensional_mesh_is_refused():
    """strategy='exchange' names a 1-D strategy; a 2-D mesh is refused on every rank."""
    for result in _contracts():
        message = result["mesh_exchange"]
        assert message.startswith("ValueError") and "one-dimensional group" in message, message


# One spawn per world size for every rank function above, in this order on the same ranks
SPAWNS = SharedSpawn({
    2: [(_ulysses_ranks, 2), (_frozen_ranks,), (_gr4_rank,)],
    3: [(_ulysses_ranks, 3)],
    4: [(_ulysses_ranks, 4), (_mesh_ranks,), (_models_on_a_mesh, (2, 2)),
        (_models_on_a_mesh, (4, 1)), (_contracts_rank,)],
})
