"""shard_sequence / unshard_sequence: piece lengths, round trips, gradients, zigzag ring."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.distributed import comm
from dilated_attention import ring_attention
from dilated_attention.distributed.sharding import (
    piece_lengths,
    piece_ranges,
    shard_sequence,
    unshard_sequence,
)
from dist_harness import run_distributed
from reference import reference_attention


def test_piece_lengths_and_ranges():
    assert piece_lengths(10, 3) == [4, 3, 3]
    assert piece_lengths(2, 4) == [1, 1, 0, 0]
    assert piece_lengths(0, 2) == [0, 0]
    assert piece_lengths(12, 3, "zigzag") == [4, 4, 4]
    assert piece_ranges(10, 3, 1) == [(4, 7)]
    # chunks of 2 rows: rank 0 holds chunks 0 and 5, rank 2 chunks 2 and 3
    assert piece_ranges(12, 3, 0, "zigzag") == [(0, 2), (10, 12)]
    assert piece_ranges(12, 3, 2, "zigzag") == [(4, 6), (6, 8)]
    with pytest.raises(ValueError, match="divisible by 2 \\* world size = 6"):
        piece_lengths(10, 3, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        piece_lengths(10, 3, "striped")
    with pytest.raises(ValueError, match="world_size"):
        piece_lengths(10, 0)


def test_every_row_lands_on_exactly_one_rank():
    for layout, n, world in (("contiguous", 11, 4), ("zigzag", 24, 4), ("zigzag", 6, 1)):
        rows = sorted(
            t for r in range(world) for a, b in piece_ranges(n, world, r, layout)
            for t in range(a, b)
        )
        assert rows == list(range(n)), (layout, n, world)


def test_local_group_is_the_identity():
    x = torch.randn(2, 6, 3, 4, requires_grad=True)
    for layout in ("contiguous", "zigzag"):
        assert torch.equal(shard_sequence(x, None, layout=layout), x)
        assert torch.equal(unshard_sequence(x, None, layout=layout), x)
    unshard_sequence(x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="dim"):
        shard_sequence(x, None, dim=4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        shard_sequence([1, 2], None)


def _sharding_cases(group):
    world, rank = comm.group_size(group), comm.group_rank(group)
    full = torch.arange(2 * 12 * 3, dtype=torch.float64).reshape(2, 12, 3)
    res = {}
    for layout in ("contiguous", "zigzag"):
        piece = shard_sequence(full, group, layout=layout)
        res[layout] = (piece, unshard_sequence(piece, group, layout=layout))
    # uneven user pieces, one empty, along dim 0
    lengths = [3, 0, 5, 2][:world]
    mine = torch.full((lengths[rank], 2), float(rank))
    res["uneven"] = unshard_sequence(mine, group, dim=0)
    # gradient: every rank's loss sees the full tensor; d/dpiece sums all ranks' weights
    for layout in ("contiguous", "zigzag"):
        piece = shard_sequence(full, group, layout=layout).detach().requires_grad_()
        weight = torch.arange(full.numel(), dtype=torch.float64).reshape(full.shape) * (rank + 1)
        (unshard_sequence(piece, group, layout=layout) * weight).sum().backward()
        res[f"grad_{layout}"] = piece.grad
    # the zigzag ring end to end: shard full tensors, attend causally, unshard
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4 * world, 2, 8, generator=gen, dtype=torch.float64)
               for _ in range(3))
    q_, k_, v_ = (shard_sequence(x, group, layout="zigzag") for x in (q, k, v))
    out = ring_attention(q_, k_, v_, is_causal=True, group=group, layout="zigzag")
    res["ring_out"] = unshard_sequence(out, group, layout="zigzag")
    # a bad dim on one rank raises everywhere
    try:
        unshard_sequence(full, group, dim=5 if rank == 0 else 1)
    except ValueError as exc:
        res["bad_dim"] = str(exc)
    # a piece that requires grad on rank 0 only: its backward's reduce-scatter would wait for
    # the other ranks until the timeout; the agreement refuses the call on every rank
    try:
        back = unshard_sequence(full[:, :2].clone().requires_grad_(rank == 0), group)
        if back.requires_grad:
            back.sum().backward()
    except ValueError as exc:
        res["one_rank_grad"] = str(exc)
    return res


@pytest.mark.distributed
def test_sharding_on_gloo():
    world = 3
    results = run_distributed(_sharding_cases, world, timeout=120)
    full = torch.arange(2 * 12 * 3, dtype=torch.float64).reshape(2, 12, 3)
    weight_sum = torch.arange(full.numel(), dtype=torch.float64).reshape(full.shape) * 6
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4 * world, 2, 8, generator=gen, dtype=torch.float64)
               for _ in range(3))
    ref_out, _ = reference_attention(q, k, v, causal=True)
    for rank, res in enumerate(results):
        for layout in ("contiguous", "zigzag"):
            piece, back = res[layout]
            ranges = piece_ranges(12, world, rank, layout)
            want = torch.cat([full[:, a:b] for a, b in ranges], dim=1)
            assert torch.equal(piece, want), (layout, rank)
            assert torch.equal(back, full), (layout, rank)
            got_grad = res[f"grad_{layout}"]
            assert torch.equal(got_grad, torch.cat([weight_sum[:, a:b] for a, b in ranges], 1))
        want = torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate([3, 0, 5])])
        assert torch.equal(res["uneven"], want)
        torch.testing.assert_close(res["ring_out"], ref_out, atol=1e-12, rtol=1e-12)
        assert "dim must index" in res["bad_dim"]
        assert "ranks disagree on 'requires_grad'" in res["one_rank_grad"], res
