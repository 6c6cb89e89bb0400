"""Sliding-window attention (``ring_attention(window_size=...)``) against the fp64 reference.

The tiles partition the band exactly; one device gives out, lse, dq, dk and dv of the
brute-force window reference.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from dilated_attention import dilated_attention, ring_attention
from dilated_attention import window as windows
from dilated_attention.plan import Chunk
from reference import close, grads, reference_window_attention, window_counts


@contextlib.contextmanager
def small_sizes(block: int, stripe: int, launch: int):
    """Blocks of `block` rows, stripes of `stripe`, runs of `launch` rows: many blocks,
    runs and stripes at test sizes."""
    saved = (dict(windows.BLOCK_ROWS), dict(windows.ROWS_PER_BLOCK),
             dict(windows.ROWS_PER_LAUNCH))
    windows.BLOCK_ROWS["cpu"], windows.ROWS_PER_BLOCK["cpu"] = (block, block), stripe
    windows.ROWS_PER_LAUNCH["cpu"] = launch
    windows.window_plan.cache_clear()
    try:
        yield
    finally:
        for table, old in zip((windows.BLOCK_ROWS, windows.ROWS_PER_BLOCK,
                               windows.ROWS_PER_LAUNCH), saved):
            table.clear()
            table.update(old)
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
        # blocks of 64 rows (B = left + right), two triangles each, in runs over a stripe
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


def test_cuda_plan_on_meta_tensors():
    """The CUDA sizes (blocks of up to 4096 rows; launches of a whole stripe) plan and run."""
    q = torch.empty(1, 3000, 4, 8, device="meta")
    left, right = windows.reaches((1000, 0), 3000)
    plan = windows.window_plan((Chunk(0, 3000, 0, 0),), (), (), 0, left, right, 3000, None,
                               "cuda", False)
    assert _work(plan) == int(window_counts(3000, (1000, 0)).sum())
    out = ring_attention(q, q, q, is_causal=True, window_size=(1000, 0))
    assert out.shape == q.shape
