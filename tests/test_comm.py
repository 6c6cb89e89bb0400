"""comm.py on real spawned gloo ranks: counts, agreement, p2p, collectives, subgroups."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch

from dilated_attention.distributed import comm
from dilated_attention.distributed.comm import counting
from dist_harness import RankFailure, SharedSpawn, run_distributed, subgroup


def test_local_group_is_size_one():
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    assert not comm.is_distributed(None)
    assert comm.agree(None, {"a": 1}) == [{"a": 1}]
    with pytest.raises(TypeError, match="bad input"):
        comm.agree(None, lambda: (_ for _ in ()).throw(TypeError("bad input")))
    x = torch.arange(4.0)
    assert comm.all_gather(x, None) is x and comm.all_reduce_(x, None) is x


def test_counters_nest_and_are_separate_per_block():
    with comm.count_communication() as outer:
        counting.record("send", 1, 10)
        with comm.count_communication() as inner:
            counting.record("all_gather", 1, 5)
            counting.record("agree", 1, 99)
        counting.record("send", 2, 20)
    assert (inner.messages, inner.bytes_sent, inner.agreements) == (1, 5, 1)
    assert (outer.messages, outer.bytes_sent, outer.agreements) == (4, 35, 1)
    assert outer.messages_of("send") == 3 and outer.bytes_of("send") == 30
    counting.record("send", 1, 1)  # outside any block: counted nowhere
    assert outer.messages == 4


def _raises(fn, *args, **kwargs):
    """Run fn; return the exception type name and message, or None."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _comm_cases(group):
    rank, size = comm.group_rank(group), comm.group_size(group)
    res = {}

    # agree: equal configs, per-rank facts
    infos = comm.agree(group, {"causal": True, "dtype": torch.float64, "n": 10 + rank},
                       per_rank=("n",))
    res["agree_ns"] = [i["n"] for i in infos]
    # agree: a mismatch raises on every rank, naming the key
    t0 = time.monotonic()
    res["mismatch"] = _raises(comm.agree, group, {"causal": rank == 1, "scale": 0.5})
    # agree: a rank failing before the collective makes every rank raise

    def build():
        if rank == size - 1:
            raise TypeError("q must be a torch.Tensor, got list")
        return {"causal": False}
    res["early_failure"] = _raises(comm.agree, group, build)
    res["agree_seconds"] = time.monotonic() - t0

    # ring: uneven blocks, receive buffers sized by the agreed lengths
    ring = comm.RingComm(group)
    lens = [2 + r for r in range(size)]
    mine = torch.full((lens[rank], 3), float(rank), dtype=torch.float64)
    prev = (rank - 1) % size
    with comm.count_communication() as stats:
        buf = ring.send_recv(mine, torch.empty(lens[prev], 3, dtype=torch.float64))
        buf2 = ring.send_recv(mine[:, :1], torch.empty(lens[prev], 1, dtype=torch.float64))
        ring.commit()
        ring.wait()
    res["ring"] = (buf, buf2)
    res["ring_stats"] = (stats.messages, stats.bytes_sent)

    # exchange: every pair, lists per peer, sizes depending on both ends
    sends, recvs = {}, {}
    for peer in range(size):
        sends[peer] = [torch.full((rank + 1, peer + 1), 10.0 * rank + peer), torch.tensor([rank])]
        recvs[peer] = [torch.empty(peer + 1, rank + 1), torch.empty(1, dtype=torch.int64)]
    with comm.count_communication() as stats:
        comm.exchange(sends, recvs, group)
    res["exchange"] = recvs
    res["exchange_stats"] = (stats.messages, stats.bytes_sent)

    # a finished exchange lets its send buffers go: a request that is waited on but kept
    # (a handle alive while received keys are used) once held them (issue 27.12)
    sent = torch.ones(1000)
    gone = weakref.ref(sent)
    handle = comm.post_exchange({(rank + 1) % size: sent}, {(rank - 1) % size: torch.empty(1000)},
                                group)
    del sent
    comm.wait_exchange(handle)
    res["send_released"] = gone() is None
    del handle

    # empty tensors are skipped on both sides
    with comm.count_communication() as stats:
        comm.exchange({(rank + 1) % size: torch.empty(0, 4)},
                      {(rank - 1) % size: torch.empty(0, 4)}, group)
    res["empty_stats"] = stats.messages

    # collectives
    piece = torch.arange(lens[rank] * 2, dtype=torch.float32).reshape(1, lens[rank], 2) + 100 * rank
    with comm.count_communication() as stats:
        res["all_gather"] = comm.all_gather(piece, group, dim=1, sizes=lens)
    res["all_gather_stats"] = (stats.messages, stats.bytes_sent)
    full = torch.arange(sum(lens) * 2, dtype=torch.float64).reshape(sum(lens), 2) * (rank + 1)
    res["reduce_scatter"] = comm.reduce_scatter(full, group, dim=0, sizes=lens)
    res["all_reduce"] = comm.all_reduce_(torch.tensor([1.0 + rank, -rank]), group)
    res["all_reduce_max"] = comm.all_reduce_(torch.tensor([1.0 + rank]), group, op="max")
    res["all_reduce_avg"] = comm.all_reduce_(torch.tensor([1.0 + rank]), group, op="avg")
    res["broadcast"] = comm.broadcast_(torch.tensor([float(rank)]), size - 1, group)

    # subgroup of the last two ranks: group ranks map to global ranks
    sub = subgroup([size - 2, size - 1])
    if sub is not None:
        srank = comm.group_rank(sub)
        sring = comm.RingComm(sub)
        got = sring.send_recv(torch.tensor([float(rank)]))
        sring.commit()
        sring.wait()
        res["sub_ring"] = (srank, got)
        res["sub_agree"] = [i["g"] for i in comm.agree(sub, {"g": rank}, per_rank=("g",))]
        res["sub_gather"] = comm.all_gather(torch.tensor([float(rank)]), sub)
        res["sub_mismatch"] = _raises(comm.agree, sub, {"x": rank})
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_comm_on_gloo(world):
    results = SPAWNS.results(world, _comm_cases)
    lens = [2 + r for r in range(world)]
    for rank, res in enumerate(results):
        assert res["agree_ns"] == [10 + r for r in range(world)]
        assert "causal" in res["mismatch"] and "rank 1: True" in res["mismatch"]
        assert res["mismatch"].startswith("ValueError")
        bad = world - 1
        if rank == bad:
            assert res["early_failure"] == "TypeError: q must be a torch.Tensor, got list"
        else:
            assert res["early_failure"].startswith("ValueError")
            assert f"rank {bad}: TypeError: q must be a torch.Tensor" in res["early_failure"]
        assert res["agree_seconds"] < 10

        prev = (rank - 1) % world
        buf, buf2 = res["ring"]
        f64 = torch.float64
        torch.testing.assert_close(buf, torch.full((lens[prev], 3), float(prev), dtype=f64))
        torch.testing.assert_close(buf2, torch.full((lens[prev], 1), float(prev), dtype=f64))
        assert res["ring_stats"] == (2, lens[rank] * 4 * 8)

        for peer in range(world):
            got, got_rank = res["exchange"][peer]
            torch.testing.assert_close(got, torch.full((peer + 1, rank + 1), 10.0 * peer + rank))
            assert got_rank.item() == peer
        sent_bytes = sum((rank + 1) * (p + 1) * 4 + 8 for p in range(world) if p != rank)
        assert res["exchange_stats"] == (2 * (world - 1), sent_bytes)
        assert res["empty_stats"] == 0
        assert res["send_released"]

        expect = torch.cat([
            torch.arange(n * 2, dtype=torch.float32).reshape(1, n, 2) + 100 * r
            for r, n in enumerate(lens)
        ], dim=1)
        torch.testing.assert_close(res["all_gather"], expect)
        assert res["all_gather_stats"] == (1, (world - 1) * max(lens) * 2 * 4)
        total = torch.arange(sum(lens) * 2, dtype=torch.float64).reshape(sum(lens), 2)
        total = total * sum(r + 1 for r in range(world))
        start = sum(lens[:rank])
        torch.testing.assert_close(res["reduce_scatter"], total[start : start + lens[rank]])
        ones_plus = sum(1.0 + r for r in range(world))
        expect = torch.tensor([ones_plus, -sum(range(world))], dtype=torch.float32)
        torch.testing.assert_close(res["all_reduce"], expect)
        assert res["all_reduce_max"].item() == world
        assert res["all_reduce_avg"].item() == pytest.approx(ones_plus / world)
        assert res["broadcast"].item() == world - 1

        if rank >= world - 2:
            srank, got = res["sub_ring"]
            assert srank == rank - (world - 2)
            assert got.item() == (world - 1 if rank == world - 2 else world - 2)
            assert res["sub_agree"] == [world - 2, world - 1]
            assert res["sub_gather"].tolist() == [world - 2.0, world - 1.0]
            assert res["sub_mismatch"].startswith("ValueError") and "'x'" in res["sub_mismatch"]
        else:
            assert "sub_ring" not in res


def _fails_on_rank_one(group):
    if comm.group_rank(group) == 1:
        raise RuntimeError("boom on rank one")
    return "fine"


@pytest.mark.distributed
def test_harness_reports_a_failing_rank_without_hanging():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="boom on rank one") as info:
        run_distributed(_fails_on_rank_one, 2, timeout=60, grace=2)
    assert "rank 1" in str(info.value)
    assert time.monotonic() - t0 < 30


_FAKE_SCRIPT = textwrap.dedent(
    """
    import torch
    from dilated_attention.distributed import comm
    from dilated_attention.tools.launch import fake_world
    g = fake_world(3, 8)
    assert comm.group_size(g) == 8 and comm.group_rank(g) == 3
    infos = comm.agree(g, {"n": 5}, per_rank=("n",))
    assert len(infos) == 8
    ring = comm.RingComm(g)
    with comm.count_communication() as s:
        buf = ring.send_recv(torch.empty(4, 1024, device="meta"))
        ring.commit(); ring.wait()
        comm.exchange({1: torch.empty(3, device="meta")}, {1: torch.empty(3, device="meta")}, g)
        out = comm.all_gather(torch.empty(2, 5, device="meta"), g, dim=1, sizes=[5] * 8)
    assert buf.is_meta and tuple(out.shape) == (2, 40), out.shape
    assert s.messages == 3 and s.bytes_sent == 4 * 1024 * 4 + 12 + 7 * 2 * 5 * 4, s
    print("ok")
    """
)


def test_fake_group_on_meta_tensors():
    proc = subprocess.run([sys.executable, "-c", _FAKE_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("bad", ["world", 0, 1.5, object()])
def test_a_group_of_the_wrong_type_is_a_type_error_naming_group(bad):
    from dilated_attention import dilated_attention, ring_attention

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(TypeError, match=r"group must be None, a torch.distributed.ProcessGroup"):
        dilated_attention(q, q, q, [4], [1], group=bad)
    with pytest.raises(TypeError, match=r"group must be None"):
        ring_attention(q, q, q, group=bad)


def _outside_the_group(group):
    """Rank 1 passes the handle torch.distributed.new_group([0]) returned to it."""
    import torch.distributed as dist

    from dilated_attention import dilated_attention, ring_attention

    handle = dist.new_group([0])
    if comm.group_rank(group) == 0:
        return None
    q = torch.randn(1, 8, 2, 4)
    return [_raises(op, q, q, q, *args, group=handle)
            for op, args in ((dilated_attention, ([4], [1])), (ring_attention, ()))]


@pytest.mark.distributed
def test_a_rank_outside_the_group_raises_naming_group():
    _, errors = SPAWNS.results(2, _outside_the_group)
    for error in errors:
        assert error.startswith("ValueError: group: this rank (global rank 1) is not a member")


def _agree_types(group):
    rank = comm.group_rank(group)
    out = []
    for mine in ({"x": 1 if rank == 0 else 1.0}, {"flag": True if rank == 0 else 1}):
        try:
            comm.agree(group, mine)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


@pytest.mark.distributed
def test_agree_tells_equal_values_of_different_types_apart():
    for res in SPAWNS.results(2, _agree_types):
        assert "ranks disagree on 'x'" in res[0], res
        assert "ranks disagree on 'flag'" in res[1], res


def _agree_payloads(group):
    """Per case: the all-gathers one agreement ran, and what it returned or raised."""
    from dilated_attention.distributed.comm import agreement

    rank, slot = comm.group_rank(group), agreement.AGREEMENT_SLOT_BYTES
    # a string whose payload fills the slot exactly (its 8 length bytes included)
    fill = next(n for n in range(slot) if len(pickle.dumps(
        {"config": {"s": "x" * n}, "error": None})) == slot - 8)
    real, calls = agreement.all_gather_flat, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    agreement.all_gather_flat = counted
    out = []
    try:
        for mine in ({"s": "x" * (10 + rank)},  # short payloads
                     {"s": "x" * (fill + rank)},  # rank 0's fills its slot, rank 1's is 1 over
                     {"s": "x" * (3 * slot * rank)},  # only rank 1's is long
                     {"s": "x" * (3 * slot)}):  # every rank's is long
            calls.clear()
            got = [info["s"] for info in comm.agree(group, mine, per_rank=("s",))]
            out.append((len(calls), [len(s) for s in got], set("".join(got))))
        calls.clear()

        def long_error():
            if rank == 1:
                raise ValueError("bad " + "y" * (2 * slot))
            return {"s": "x"}
        out.append((_raises(comm.agree, group, long_error), len(calls)))
    finally:
        agreement.all_gather_flat = real
    return out, fill


@pytest.mark.distributed
def test_an_agreement_is_one_all_gather_unless_a_payload_outgrows_its_slot():
    for res, fill in SPAWNS.results(2, _agree_payloads):
        slot = 4096
        assert res[0] == (1, [10, 11], {"x"})
        assert res[1] == (2, [fill, fill + 1], {"x"})
        assert res[2] == (2, [0, 3 * slot], {"x"})
        assert res[3] == (2, [3 * slot, 3 * slot], {"x"})
        error, calls = res[4]
        assert calls == 2 and error.startswith("ValueError: "), res[4]
        assert "bad yyy" in error


def _all_reduce_bytes(group):
    with comm.count_communication() as s:
        comm.all_reduce_(torch.ones(1000), group)
    return s.bytes_of("all_reduce")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_counts_the_ring_algorithms_bytes(world):
    for got in SPAWNS.results(world, _all_reduce_bytes):
        assert got == 2 * (world - 1) * 4000 // world


def _fails_at_once_or_sleeps(group):
    if comm.group_rank(group) == 0:
        raise RuntimeError("boom on rank zero")
    time.sleep(40)
    return "late"


@pytest.mark.distributed
def test_spawn_kills_the_other_ranks_after_the_grace():
    from dilated_attention.tools import launch

    t0 = time.monotonic()
    with pytest.raises(launch.LaunchFailed, match="boom on rank zero"):
        launch.spawn(_fails_at_once_or_sleeps, 2, timeout=90, grace=2)
    assert time.monotonic() - t0 < 25


# One spawn per world size for the rank functions above that return (the harness's own
# failure tests spawn alone), in this order on the same ranks
SPAWNS = SharedSpawn({
    2: [(_comm_cases,), (_outside_the_group,), (_agree_types,), (_agree_payloads,),
        (_all_reduce_bytes,)],
    3: [(_comm_cases,), (_all_reduce_bytes,)],
})
