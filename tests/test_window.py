"""Sliding-window attention (``ring_attention(window_size=...)``) against the fp64 reference.

The tiles partition the band exactly; one device and spawned gloo ranks (the halo
exchange, Note [halo exchange]) give out, lse, dq, dk and dv of the brute-force window
reference, and every rank's traffic is counted exactly: the bytes a rank sends are
its rows that other ranks' windows read, whatever N is.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Dict, List, Tuple
from unittest import mock

import pytest
import torch

from dilated_attention import dilated_attention, ring_attention
from dilated_attention import policy
from dilated_attention import window as windows
from dilated_attention.distributed import comm
from dilated_attention.tools import launch
from dilated_attention.distributed.sharding import piece_lengths
from dilated_attention.plan import Chunk
from dist_harness import case_ranges, error_of, rows_of, run_distributed
from reference import close, grads, reference_window_attention, window_counts


@contextlib.contextmanager
def small_sizes(tile_rows: int, stripe: int, launch: int):
    """Tile rows of `tile_rows` rows, stripes of `stripe`, runs of `launch` rows: many tile
    rows, runs and stripes at test sizes."""
    windows.window_plan.cache_clear()
    try:
        with mock.patch.dict(policy.WINDOW_TILE_ROWS, {"cpu": (tile_rows, tile_rows)}), \
                mock.patch.dict(policy.ROWS_PER_BLOCK, {"cpu": stripe}), \
                mock.patch.dict(policy.ROWS_PER_LAUNCH, {"cpu": launch}):
            yield
    finally:
        windows.window_plan.cache_clear()


# --------------------------------------------------------------------------
# Tiles


def _tile_mask(rows: int, keys: int, kind: int) -> torch.Tensor:
    i, j = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    if kind == windows.FULL:
        return torch.ones(rows, keys, dtype=torch.long)
    assert rows == keys, "a triangle tile is a square"
    return ((j <= i) if kind == windows.CAUSAL else (j >= i)).long()


def test_band_tiles_cover_each_visible_pair_once():
    for left, right in itertools.product(range(6), range(6)):
        size = max(1, left + right)
        for rows in range(1, size + 1):
            q0, q1 = 7, 7 + rows
            for k0, k1 in itertools.product(range(0, 20, 3), range(0, 24, 4)):
                cover = torch.zeros(q1, 24, dtype=torch.long)
                for a, z, ka, kz, kind in windows.band_tiles(q0, q1, k0, k1, left, right):
                    assert a < z and ka < kz
                    cover[a:z, ka:kz] += _tile_mask(z - a, kz - ka, kind)
                t, u = torch.arange(q1)[:, None], torch.arange(24)[None, :]
                want = (u >= t - left) & (u <= t + right) & (u >= k0) & (u < k1) & (t >= q0)
                assert torch.equal(cover, want.long()), (left, right, rows, k0, k1)
    with pytest.raises(ValueError, match="longer than the window"):
        windows.band_tiles(0, 5, 0, 9, 2, 2)


def _work(plan: windows.WindowPlan) -> int:
    """Score entries the forward computes: rows x keys per launch, half a square plus its
    diagonal for a triangle."""
    tiles = [t for s in plan.blocks for t in s.tiles] + [t for r in plan.rounds for _, t in r]
    return sum(t.count * (t.rows * t.keys if t.kind == windows.FULL
                          else t.rows * (t.rows + 1) // 2) for t in tiles)


@pytest.mark.parametrize("window,documents", [((64, 0), None), ((100, 37), None),
                                              ((5, 5), (0, 300, 301, 1000, 4096)),
                                              ((0, 0), None), ((-1, 3), (0, 1500, 4096))])
def test_plan_computes_exactly_the_visible_pairs(window, documents):
    """O(n * window): the forward's score entries are the band's pairs, no more."""
    n = 4096
    left, right = windows.reaches(window, n)
    plan = windows.window_plan((Chunk(0, n, 0, 0),), (), (), 0, left, right, n, documents,
                               "cpu", False)
    counts = window_counts(n, window, cu_seqlens=documents)
    assert _work(plan) == int(counts.sum())
    if window == (64, 0):
        # tile rows of 64 rows (B = left + right), two triangles each, in runs over a stripe
        # of 2048 rows: two calls per stripe, and one anti triangle whose keys lie in the
        # stripe before (its dK/dV go there) on its own
        assert plan.launches == 2 * n // 2048 + 1


# --------------------------------------------------------------------------
# One device


def _inputs(n: int, h: int, hk: int, b: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return randn(b, n, h, 8), randn(b, n, hk, 8), randn(b, n, hk, 8), randn(b, n, h, 8), \
        randn(b, h, n)


def _reference(q, k, v, dout, dlse, window, causal, documents, mask, with_lse, scale=None):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = reference_window_attention(q, k, v, window, causal, scale, documents, mask)
    upstream = [out, lse] if with_lse else [out]
    return (out, lse) + grads(upstream, [dout.double(), dlse.double()][:len(upstream)],
                              [q, k, v])


LOCAL_CASES = [
    # n, window, causal, documents, padded, h, hk, b, dtype, with_lse, backend
    (40, (5, 0), True, None, False, 4, 2, 2, torch.float64, True, "auto"),
    (40, (3, 6), False, None, True, 4, 1, 1, torch.float64, False, "auto"),
    (37, (-1, 2), False, [0, 11, 12, 37], False, 2, 2, 2, torch.float64, True, "auto"),
    (30, (7, -1), False, [0, 20, 30], True, 6, 3, 2, torch.float32, True, "auto"),
    (25, (0, 0), False, None, False, 2, 1, 1, torch.float64, True, "auto"),
    (33, (4, 4), False, [0, 3, 3, 30, 33], True, 4, 2, 2, torch.float64, True, "blockwise"),
    (48, (6, 0), True, None, True, 4, 2, 2, torch.bfloat16, True, "auto"),
]


@pytest.mark.parametrize("sizes", [(1024, 2048, 2048), (3, 8, 6)])
@pytest.mark.parametrize("case", LOCAL_CASES)
def test_one_device_equals_reference(case, sizes):
    n, window, causal, documents, padded, h, hk, b, dtype, with_lse, backend = case
    q, k, v, dout, dlse = _inputs(n, h, hk, b, dtype, seed=n)
    mask = None
    if padded:
        mask = torch.rand(b, n, generator=torch.Generator().manual_seed(1)) < 0.3
        mask[0, :9] = True  # queries whose whole window is padding: zeros, lse -inf
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with small_sizes(*sizes):
        out, lse = ring_attention(q, k, v, is_causal=causal, window_size=window, return_lse=True,
                                  cu_seqlens=documents, key_padding_mask=mask, backend=backend)
        upstream = [out, lse] if with_lse else [out]
        got = grads(upstream, [dout, dlse][:len(upstream)], [q, k, v])
    want = _reference(q, k, v, dout, dlse, window, causal, documents, mask, with_lse)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + got, want):
        close(x, y.detach(), dtype, name)
    assert out.dtype == dtype


def test_scale_and_a_window_as_long_as_the_sequence():
    q, k, v, _, _ = _inputs(20, 2, 2, 1, torch.float64, seed=3)
    out, lse = ring_attention(q, k, v, window_size=(3, 1), scale=0.3, return_lse=True)
    want_out, want_lse = reference_window_attention(q, k, v, (3, 1), scale=0.3)
    close(out, want_out, torch.float64, "out")
    close(lse, want_lse, torch.float64, "lse")
    # reaching the whole sequence on both sides is dense (causal: on the left) attention
    for window, causal in (((19, 40), False), ((100, 0), True), ((-1, 0), False)):
        got = ring_attention(q, k, v, window_size=window, is_causal=causal)
        assert torch.equal(got, ring_attention(q, k, v, is_causal=causal or window[1] == 0))


def test_window_input_errors():
    x = torch.randn(1, 6, 2, 4)
    for bad in ((3,), (1, 2, 3), (-2, 0), (1.0, 2), (True, 1), "ab", None, 4):
        with pytest.raises(ValueError, match="window_size"):
            ring_attention(x, x, x, window_size=bad)
    with pytest.raises(ValueError, match=r"window_size = \(3, 2\).*is_causal=True"):
        ring_attention(x, x, x, window_size=(3, 2), is_causal=True)
    with pytest.raises(ValueError, match="window_size.*dilated_attention takes no sliding"):
        dilated_attention(x, x, x, [4], [1], window_size=(3, 0))
    # -1 on the right with is_causal is the causal window
    ring_attention(x, x, x, window_size=(2, -1), is_causal=True)


# --------------------------------------------------------------------------
# Sequence parallel: the halo exchange on spawned ranks


def _case(seed, *, window, causal=False, lengths=None, n=None, layout="contiguous", h=4, hk=2,
          b=2, dtype=torch.float64, documents=None, padded=False, with_lse=True,
          sizes=None) -> Dict:
    return dict(seed=seed, window=window, causal=causal, lengths=lengths, n=n, layout=layout,
                h=h, hk=hk, b=b, dtype=dtype, documents=documents, padded=padded,
                with_lse=with_lse, sizes=sizes)


def _cases(world: int) -> List[Dict]:
    uneven = {2: [3, 9], 3: [5, 0, 9], 4: [1, 6, 0, 7]}[world]
    return [
        _case(1, window=(3, 0), causal=True, lengths=[6] * world),
        _case(2, window=(4, 2), lengths=uneven, hk=1, with_lse=False),
        # a window longer than the pieces: halos from several ranks away
        _case(3, window=(7, 5), lengths={2: [2, 12], 3: [2, 3, 12], 4: [2, 3, 1, 12]}[world],
              hk=4),
        _case(4, window=(5, 0), causal=True, n=8 * world, layout="zigzag"),
        _case(5, window=(3, 4), n=6 * world, layout="zigzag", hk=1),
        # documents spanning ranks, padding
        _case(6, window=(4, 3), lengths=uneven, documents=[0, 2, 9, sum(uneven)], padded=True),
        # small tile rows, stripes and runs
        _case(7, window=(6, 2), lengths=[9] * world, dtype=torch.float32, sizes=(2, 4, 4)),
        _case(8, window=(5, 0), causal=True, n=8 * world, layout="zigzag", dtype=torch.bfloat16,
              sizes=(3, 6, 6)),
        # an unbounded side: halos in rounds, one chunk distance each
        _case(9, window=(-1, 2), lengths=uneven, documents=[0, 4, sum(uneven)]),
        _case(12, window=(-1, 2), n=8 * world, layout="zigzag", padded=True),
        # the same window over twice the rows: the same bytes (cases 10, 11)
        _case(10, window=(2, 1), lengths=[5] * world),
        _case(11, window=(2, 1), lengths=[10] * world),
    ]


def _lengths(case: Dict, world: int) -> List[int]:
    if case["layout"] == "zigzag":
        return piece_lengths(case["n"], world, "zigzag")
    return list(case["lengths"])


def _full(case: Dict, world: int):
    n = sum(_lengths(case, world))
    q, k, v, dout, dlse = _inputs(n, case["h"], case["hk"], case["b"], case["dtype"],
                                  case["seed"])
    mask = None
    if case["padded"]:
        mask = torch.rand(case["b"], n, generator=torch.Generator().manual_seed(2)) < 0.3
    return q, k, v, dout, dlse, mask


def _run_case(group, case: Dict) -> Dict:
    world, rank = comm.group_size(group), comm.group_rank(group)
    q, k, v, dout, dlse, mask = _full(case, world)
    ranges = case_ranges(case, world, rank)
    q, k, v = (rows_of(x, ranges).requires_grad_() for x in (q, k, v))
    sizes = small_sizes(*case["sizes"]) if case["sizes"] else contextlib.nullcontext()
    with sizes:
        with comm.count_communication() as fwd:
            out, lse = ring_attention(
                q, k, v, is_causal=case["causal"], window_size=case["window"], group=group,
                return_lse=True, layout=case["layout"], cu_seqlens=case["documents"],
                key_padding_mask=None if mask is None else rows_of(mask, ranges))
        upstream = [out, lse] if case["with_lse"] else [out]
        with comm.count_communication() as bwd:
            torch.autograd.backward(upstream, [rows_of(dout, ranges),
                                               rows_of(dlse, ranges, dim=2)][:len(upstream)])
    return dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                fwd=(fwd.messages, fwd.bytes_sent, fwd.agreements),
                bwd=(bwd.messages, bwd.bytes_sent, bwd.agreements))


# 2 x 2 mesh cases (Ulysses over the heads, then the halo exchange): lengths by piece
MESH_CASES = [
    _case(21, window=(3, 2), lengths=[5, 3, 6, 4], h=4, hk=2, documents=[0, 7, 18],
          padded=True),
    _case(22, window=(4, 0), causal=True, lengths=[0, 7, 2, 9], h=6, hk=3),
]


def _mesh_case(mesh, piece: int, case: Dict) -> Dict:
    q, k, v, dout, dlse, mask = _full(case, 4)
    ranges = case_ranges(case, 4, piece)
    q, k, v = (rows_of(x, ranges).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, is_causal=case["causal"], window_size=case["window"],
                              group=mesh, return_lse=True, cu_seqlens=case["documents"],
                              key_padding_mask=None if mask is None else rows_of(mask, ranges))
    torch.autograd.backward([out, lse], [rows_of(dout, ranges), rows_of(dlse, ranges, dim=2)])
    return dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def _window_ranks(group, cases):
    rank = comm.group_rank(group)
    results = {"cases": [_run_case(group, case) for case in cases]}
    if comm.group_size(group) == 4:
        mesh = launch.init_device_mesh((2, 2))
        u, s = mesh.get_coordinate()
        results["mesh"] = (s * 2 + u, [_mesh_case(mesh, s * 2 + u, c) for c in MESH_CASES])
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    results["mismatch"] = error_of(
        lambda: ring_attention(x, x, x, window_size=(2, rank), group=group))
    results["bad"] = error_of(
        lambda: ring_attention(x, x, x, window_size=(2, -3) if rank == 1 else (2, 0),
                               group=group))
    results["causal_right"] = error_of(
        lambda: ring_attention(x, x, x, window_size=(2, 1), is_causal=True, group=group))
    results["dilated"] = error_of(
        lambda: dilated_attention(x, x, x, [4], [1], window_size=(1, 0) if rank == 0
                                  else (-1, -1), group=group))
    return results


def _expected_traffic(case: Dict, world: int, rank: int):
    """(messages, bytes, agreements) of the forward and the backward on `rank`, brute force
    from the reference's mask: it sends each other rank the rows of its chunks that the
    other's queries read, one message per run of them (k and v together; with padding the
    mask rows as a second), fetches its own halos again in backward and sends their dK/dV
    (fp32, fp64 for fp64) back, one message per run."""
    n = sum(_lengths(case, world))
    counts = window_counts(n, case["window"], case["causal"], case["documents"])
    owner = torch.empty(n, dtype=torch.long)
    for r in range(world):
        for a, z in case_ranges(case, world, r):
            owner[a:z] = r

    def halos(src: int, dst: int) -> Tuple[int, int]:
        """(runs, rows) of src's rows that dst's queries read."""
        read = counts[owner == dst].sum(0) > 0
        chunks = [read[a:z] for a, z in case_ranges(case, world, src)]
        return sum(_runs(c) for c in chunks), sum(int(c.sum()) for c in chunks)

    row = case["b"] * case["hk"] * 8  # one key row of all kv heads, in elements
    item = torch.empty(0, dtype=case["dtype"]).element_size()
    acc_item = 8 if case["dtype"] == torch.float64 else 4
    sent = [halos(rank, dst) for dst in range(world) if dst != rank]
    received = [halos(src, rank) for src in range(world) if src != rank]
    runs, rows = sum(r for r, _ in sent), sum(x for _, x in sent)
    per_halo = 2 if case["padded"] else 1
    fwd_bytes = 2 * rows * row * item + (rows * case["b"] if case["padded"] else 0)
    fwd = (per_halo * runs, fwd_bytes, 1)
    bwd = (per_halo * runs + sum(r for r, _ in received),
           fwd_bytes + 2 * sum(x for _, x in received) * row * acc_item, 0)
    return fwd, bwd


def _runs(flags: torch.Tensor) -> int:
    """Maximal runs of True."""
    f = torch.cat([torch.zeros(1, dtype=torch.long), flags.long()])
    return int(((f[1:] - f[:-1]) == 1).sum())


def _want(case: Dict, world: int):
    """The whole sequence's reference out, lse, dq, dk, dv (every rank checks its rows)."""
    q, k, v, dout, dlse, mask = _full(case, world)
    return _reference(q, k, v, dout, dlse, case["window"], case["causal"], case["documents"],
                      mask, case["with_lse"])


def _check_case(case: Dict, world: int, rank: int, got: Dict, want,
                traffic: bool = True) -> None:
    ranges = case_ranges(case, world, rank)
    where = f"case {case['seed']} rank {rank}"
    for name, x, dim in zip(("out", "lse", "dq", "dk", "dv"), want, (1, 2, 1, 1, 1)):
        close(got[name], rows_of(x.detach(), ranges, dim), case["dtype"], f"{where} {name}")
    if traffic:
        # (messages, bytes, agreements) of the forward and of the backward
        expected = _expected_traffic(case, world, rank)
        assert (got["fwd"], got["bwd"]) == expected, f"{where}: traffic != {expected}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_exchange_equals_one_process(world):
    cases = _cases(world)
    results = run_distributed(_window_ranks, world, cases, timeout=240)
    wants = [_want(case, world) for case in cases]  # once per case, not per rank
    mesh_wants = [_want(case, 4) for case in MESH_CASES] if world == 4 else []
    for rank, res in enumerate(results):
        for case, got, want in zip(cases, res["cases"], wants):
            _check_case(case, world, rank, got, want)
        # the same window over twice the rows sends the same bytes
        assert res["cases"][-1]["fwd"] == res["cases"][-2]["fwd"]
        msg, secs = res["mismatch"]
        assert msg.startswith("ValueError") and "window_size" in msg and secs < 10, msg
        msg, secs = res["bad"]
        assert msg.startswith("ValueError") and "window_size" in msg and secs < 10, msg
        if rank != 1:
            assert "rank 1" in msg
        msg, _ = res["causal_right"]
        assert msg.startswith("ValueError") and "window_size" in msg, msg
        msg, _ = res["dilated"]
        assert msg.startswith("ValueError") and "window_size" in msg, msg
        if world == 4:
            piece, mesh_results = res["mesh"]
            for case, got, want in zip(MESH_CASES, mesh_results, mesh_wants):
                _check_case(case, 4, piece, got, want, traffic=False)


_FAKE_SCRIPT = """
import torch
from dilated_attention import ring_attention
from dilated_attention.distributed import comm
from dilated_attention.tools.launch import fake_world
world = fake_world(rank=1, world_size=4)  # "fake" alone has no backend for meta tensors
W, hk, d = 64, 2, 16
row = 2 * hk * d * 4  # one key row and one value row, fp32
sent = []
for n in (2048, 8192):
    q = torch.empty(1, n // 4, 8, d, device="meta", requires_grad=True)
    k, v = (torch.empty(1, n // 4, hk, d, device="meta", requires_grad=True) for _ in range(2))
    with comm.count_communication() as fwd:
        out = ring_attention(q, k, v, is_causal=True, window_size=(W, 0), group=world)
    with comm.count_communication() as bwd:
        out.sum().backward()
    assert out.is_meta and k.grad.shape == k.shape
    # rank 1 sends its last W rows to rank 2 (one message), again in backward, and the
    # fp32 dK/dV of the W rows it read of rank 0 back to it
    assert (fwd.messages, fwd.bytes_sent) == (1, W * row), fwd
    assert (bwd.messages, bwd.bytes_sent) == (2, 2 * W * row), bwd
    assert fwd.messages_of("all_gather") == 0
print("ok")
"""


def test_halo_bytes_follow_the_window_not_n():
    """The dry-run path: 4 fake ranks on meta tensors, N = 2K and 8K, window 64."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FAKE_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_cuda_plan_on_meta_tensors():
    """The CUDA sizes (tile rows of up to 4096 rows; launches of a whole stripe) plan and run."""
    q = torch.empty(1, 3000, 4, 8, device="meta")
    left, right = windows.reaches((1000, 0), 3000)
    plan = windows.window_plan((Chunk(0, 3000, 0, 0),), (), (), 0, left, right, 3000, None,
                               "cuda", False)
    assert _work(plan) == int(window_counts(3000, (1000, 0)).sum())
    out = ring_attention(q, q, q, is_causal=True, window_size=(1000, 0))
    assert out.shape == q.shape


# --------------------------------------------------------------------------
# window.py: a stripe's entry_writes bounds every write of its out, dq, dK and dV
# (kills win-writes-keys and win-sent-writes)


def _true_writes(plan: windows.WindowPlan, rows: int):
    """Per local row: writes to out/dq (tiles over it as a query row) and to dK/dV (tiles
    on own keys over it as a key row, and halos sent home), launch by launch."""
    queries = torch.zeros(rows, dtype=torch.long)
    keys = torch.zeros(rows, dtype=torch.long)
    tiles = [t for s in plan.blocks for t in s.tiles] + [t for r in plan.rounds for _, t in r]
    for t in tiles:
        local = plan.sources[t.source].local
        for i in range(t.count):
            queries[t.q + i * t.step:t.q + i * t.step + t.rows] += 1
            if local is not None:
                lo = local + t.k + i * t.step
                keys[lo:lo + t.keys] += 1
    for lo, hi in plan.homes:
        keys[lo:hi] += 1
    return queries, keys


# (chunks, received, sent, rounds, window, total, documents): one device, and ranks that
# receive halos and send their rows home
RANKS = [
    ((Chunk(0, 48, 0, 0),), (), (), 0, (-1, 2), 48, None),
    ((Chunk(0, 48, 0, 0),), (), (), 0, (3, 6), 48, None),
    ((Chunk(0, 48, 0, 0),), (), (), 0, (6, 0), 48, (0, 20, 48)),
    # rank 1 of [0, 8), [8, 20), [20, 32), window (4, 2): it receives [4, 8) and [20, 22),
    # and sends its local rows [0, 2) (read by rank 0) and [8, 12) (read by rank 2)
    ((Chunk(8, 20, 1, 0),), ((4, 8, 0), (20, 22, 0)), ((0, 2), (8, 12)), 1, (4, 2), 32, None),
    ((Chunk(8, 20, 1, 0),), ((2, 8, 0), (20, 21, 0)), ((0, 1), (6, 12)), 1, (6, 1), 32, None),
]


@pytest.mark.parametrize("sizes", [(3, 8, 6), (2, 4, 4), None])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("rank", RANKS)
def test_window_entry_writes_bound_every_write(rank, backward, sizes):
    chunks, received, sent, rounds, window, total, documents = rank
    left, right = windows.reaches(window, total)
    with small_sizes(*sizes) if sizes else contextlib.nullcontext():
        plan = windows.window_plan(chunks, received, sent, rounds, left, right, total,
                                   documents, "cpu", backward)
    rows = sum(c.stop - c.start for c in chunks)
    queries, keys = _true_writes(plan, rows)
    for s in plan.blocks:
        most = int(max(queries[s.lo:s.hi].max(), keys[s.lo:s.hi].max()))
        assert s.entry_writes >= most, (s.index, s.entry_writes, most)


@pytest.mark.parametrize("window,sizes", [((-1, 2), (3, 8, 6)), ((3, 6), None)])
def test_window_half_precision_in_output_equals_fp32_accumulators(window, sizes):
    """bf16 sliding window: out and every gradient bit for bit what fp32 accumulators give
    (policy.in_output only where no entry of out, dq, dK or dV gets a third write)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 48, 4, 8, generator=gen).to(torch.bfloat16)
                     for _ in range(4))

    def run():
        windows.window_plan.cache_clear()
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = ring_attention(*leaves, window_size=window)
        return (out,) + grads([out], [dout], leaves)

    with small_sizes(*sizes) if sizes else contextlib.nullcontext():
        got = run()
        with mock.patch.object(policy, "in_output", lambda writes, dtype: False):
            want = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------
# window.py: a run's launches never overlap in query or key rows (kills win-extends-keys;
# on CPU the overlapping add happens to be exact, on a GPU it races)


@pytest.mark.parametrize("backward", [False, True])
def test_window_runs_do_not_overlap(backward):
    for sizes, n, (left, right) in itertools.product(
            [(3, 24, 12), (3, 2048, 2048), (2, 8, 8), (4, 32, 16)], (40, 64),
            [(7, 0), (0, 7), (4, 3), (5, 0), (9, 0), (6, 3), (2, 2)]):
        with small_sizes(*sizes):
            plan = windows.window_plan((Chunk(0, n, 0, 0),), (), (), 0, left, right, n,
                                       None, "cpu", backward)
        for stripe_plan in plan.blocks:
            for t in stripe_plan.tiles:
                if t.count > 1:
                    assert t.rows <= t.step and t.keys <= t.step, (left, right, t)


@pytest.mark.parametrize("window", [(3, -1), (0, -1), (-1, -1)])
def test_causal_window_unbounded_on_the_right_attends_no_later_key(window):
    """is_causal=True with right = -1 (unbounded) is right = 0: the reference with the
    window and causal mask, fp64."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    out = ring_attention(q, k, v, is_causal=True, window_size=window)
    ref, _ = reference_window_attention(q, k, v, (window[0], 0), causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lengths", [[8, 0, 8], [8, 8, 0], [0, 8, 8]])
def test_a_rank_without_rows_holds_no_chunk_and_gets_no_halo(lengths):
    """Layout.contiguous holds non-empty chunks only: a rank with no rows has none, and
    a sliding window's halo exchange (3 back, 1 ahead) neither sends to it nor from it."""
    from dilated_attention.distributed.halo import halo_schedule
    from dilated_attention.layout import Layout

    layout = Layout.contiguous(lengths)
    empty = lengths.index(0)
    assert all(c.stop > c.start for c in layout.chunks)
    assert layout.of_rank(empty) == []
    halos = halo_schedule(layout, 3, 1, None)
    assert len(halos) == 2 and all(empty not in (h.src, h.dst) for h in halos), halos
