"""The fused kernel's plan against the count matrix, with no kernel (runs without triton).

A plan (fused_plan.py, Note [fused kernel]) is expanded here into what the
kernels do with it: every tile's rows, against every span's elements, each
counted the span's times x (1 + matching extras) times (2^log2(times) on the
logits, the extras' count on the probabilities), under the causal mask the
kernels apply.
That must equal the count matrix c(t, u) of tests/reference.py for every
(head, row, key), and every (row, head) must belong to exactly one tile.

Notation: n rows, h query heads, hk key/value heads; counts (h, n, n) [j, t, u].
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention.fused_occupancy import occupancy
from dilated_attention.fused_plan import TilePlan, dense_plan, tile_plan, tile_work
from dilated_attention.patterns import Heads
from reference import dilated_counts


def expand(plan: TilePlan, n: int, m: int, heads: Heads, num_kv_heads: int, causal: bool,
           keys: bool, num_patterns: int = 1
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts (h, n, m) [j, t, u] the plan makes the kernels visit, writes (tile heads, rows),
    by_pattern (P, h, n, m): the visits that name pattern i in their bits, the spans' and
    their extras'; each element's bits name as many patterns as it counts).

    Also checks the table invariants the kernels rely on: launches that cover the tiles,
    widest first, of block_m rows halved zero or more times; at most a launch's rows per
    tile, ascending, spans of the right heads, every element inside the sequence.
    """
    rows, spans, extras = (x.long() for x in plan[1:4])
    heights = [height for height, _ in plan.heights]
    assert sum(count for _, count in plan.heights) == plan.tiles.shape[0]
    assert heights == sorted(set(heights), reverse=True)
    assert set(heights) <= {plan.block_m >> i for i in range(plan.block_m.bit_length())}
    h = heads.count
    counts = torch.zeros(h, n, m, dtype=torch.int64)
    by_pattern = torch.zeros(num_patterns, h, n, m, dtype=torch.int64)
    writes = torch.zeros(num_kv_heads if keys else h, m if keys else n, dtype=torch.int64)
    tiles = [(height, tile) for launch, height in plan.launches()
             for tile in launch.long().tolist()]
    for height, (cell, lo, count, head, span_lo, span_hi) in tiles:
        assert 1 <= count <= height
        r = cell + rows[lo:lo + count]
        assert bool((r[1:] > r[:-1]).all()), "tile rows ascend"
        writes[head, r] += 1
        for other, start, stride, elements, times, extra_lo, extra_hi, bits in \
                spans[span_lo:span_hi].tolist():
            assert elements > 0 and stride > 0 and times >= 1
            assert times == 1 or extra_lo == extra_hi, "a span with extras has times 1"
            idx = torch.arange(elements)
            e = cell + start + stride * idx  # the span's keys (queries, for key tiles)
            assert 0 <= int(e.min()) and int(e.max()) < (n if keys else m)
            mult = torch.full((elements,), times, dtype=torch.int64)
            mask = torch.full((elements,), bits, dtype=torch.int64)
            for period, phase, pattern in extras[extra_lo:extra_hi].tolist():
                # as the kernels take it: a bit mask where the plan says every period is a
                # power of two (a wrong claim miscounts here)
                hit = ((idx & (period - 1)) if plan.pow2_periods else idx % period) == phase
                mult += hit.long()
                assert not (mask & (1 << pattern)).any(), "a pattern once per element"
                mask |= hit.long() << pattern
            assert [bin(x).count("1") for x in mask.tolist()] == mult.tolist()
            # (rows, elements): what one program adds, under the kernels' causal mask
            visits = mult.expand(count, -1)
            if keys:
                assert heads.kv_of[other] == head
                if causal:
                    visits = visits * (r[:, None] <= e[None, :])
                at = (e[None, :].expand(count, -1), r[:, None].expand(-1, elements))
                counts[other][at] += visits
                for i in range(num_patterns):
                    by_pattern[i, other][at] += (visits > 0) * (mask >> i & 1)
            else:
                assert heads.kv_of[head] == other
                if causal:
                    visits = visits * (e[None, :] <= r[:, None])
                at = (r[:, None].expand(-1, elements), e[None, :].expand(count, -1))
                counts[head][at] += visits
                for i in range(num_patterns):
                    by_pattern[i, head][at] += (visits > 0) * (mask >> i & 1)
    return counts, writes, by_pattern


@st.composite
def plan_cases(draw):
    n = draw(st.integers(1, 60))
    num_patterns = draw(st.integers(1, 4))
    segs = tuple(draw(st.one_of(st.integers(1, 12), st.integers(1, 80)))
                 for _ in range(num_patterns))
    # small rates (the interesting overlaps), any rate up to w, and repeats
    rates = tuple(draw(st.one_of(st.integers(1, min(w, 6)), st.integers(1, w))) for w in segs)
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    documents = draw(st.sampled_from([None, tuple([0] + cuts + [n])]))
    return dict(n=n, patterns=(segs, rates), h=h, hk=hk, first=draw(st.integers(0, 7)),
                causal=draw(st.booleans()), documents=documents,
                block_m=draw(st.sampled_from([1, 3, 4, 16, 32, 64])),
                split_keys=draw(st.sampled_from([None, 0, 1, 2, 5])),
                narrowest=draw(st.sampled_from([None, 1, 2, 16])),
                order_window=draw(st.sampled_from([0, 1, 2, 5])))


def check_plan(n: int, patterns, h: int, hk: int, first: int, causal: bool,
               documents: Optional[Tuple[int, ...]], block_m: int,
               kv_of: Optional[Tuple[int, ...]] = None,
               window: Optional[Tuple[int, int]] = None,
               split_keys: Optional[int] = None, narrowest: Optional[int] = None,
               order_window: int = 0) -> None:
    """The plan visits the count matrix; with a `window` (lo, hi), its rows against its
    keys (numbered from lo), and every (row, head) of it in one tile; split_keys: spans
    split into spans without extras where each piece keeps that many elements; narrowest:
    no launch of fewer rows; order_window: the plan's tiles in that order (check_order)."""
    heads = Heads(first, kv_of) if kv_of else Heads.of(h, hk, first)
    want = dilated_counts(n, h, patterns[0], patterns[1], causal, documents, first_head=first)
    lo, hi = window or (0, n)
    want = want[:, lo:hi, lo:hi]
    for keys in (False, True):
        plan = tile_plan(n, patterns, heads, hk, causal, documents, block_m, keys,
                         window=window, split_keys=split_keys, narrowest=narrowest,
                         order_window=order_window)
        assert all(h >= (narrowest or block_m) or h == block_m for h, _ in plan.heights)
        if order_window:
            check_order(tile_plan(n, patterns, heads, hk, causal, documents, block_m, keys,
                                  window=window, split_keys=split_keys, narrowest=narrowest),
                        plan, order_window, causal, keys)
        got, writes, by_pattern = expand(plan, hi - lo, hi - lo, heads, hk, causal, keys,
                                         len(patterns[0]))
        assert bool((writes == 1).all()), f"keys={keys}: every (row, head) in one tile"
        mismatch = (got != want).nonzero()
        assert not mismatch.numel(), (
            f"keys={keys}: (head, row, key) {mismatch[0].tolist()} visited "
            f"{int(got[tuple(mismatch[0])])} times, counted {int(want[tuple(mismatch[0])])}")
        # each pattern's pairs visited once under its own bit (the fused dropout's draws)
        for i, (w, r) in enumerate(zip(*patterns)):
            alone = dilated_counts(n, h, [w], [r], causal, documents, first_head=first)
            assert torch.equal(by_pattern[i], alone[:, lo:hi, lo:hi]), (keys, i)
        if split_keys is not None:
            whole = tile_plan(n, patterns, heads, hk, causal, documents, block_m, keys,
                              window=window)
            assert (plan.max_extras == 0) == can_split(whole, split_keys), f"keys={keys}"


def work_per_tile(plan: TilePlan, causal: bool, keys: bool) -> List[int]:
    """Per tile, the span elements its programs loop over (triton_kernels._span's causal
    bound: a query tile's keys up to its last row, a key tile's queries from its first)."""
    rows, spans, work = plan.rows.tolist(), plan.spans.tolist(), []
    for _, first, count, _, span_lo, span_hi in plan.tiles.tolist():
        total = 0
        for _, start, stride, elements, *_ in spans[span_lo:span_hi]:
            at = [start + stride * i for i in range(elements)]
            if causal:
                bound = rows[first] if keys else rows[first + count - 1]
                at = [t for t in at if (t >= bound if keys else t <= bound)]
            total += len(at)
        work.append(total)
    return work


def check_order(plain: TilePlan, ordered: TilePlan, window: int, causal: bool,
                keys: bool) -> None:
    """Note [fused kernel], "Tile order": the same tables and launches, each launch's tiles
    cut into windows of `window` from its end, each window's tiles those of the plain
    plan's, heaviest first, ties in the plain plan's order."""
    for name in ("rows", "spans", "extras"):
        assert torch.equal(getattr(plain, name), getattr(ordered, name)), name
    assert plain.heights == ordered.heights
    want, got = plain.tiles.tolist(), ordered.tiles.tolist()
    work = work_per_tile(plain, causal, keys)
    assert tile_work(plain.tiles, plain.rows, plain.spans, causal, keys).tolist() == work
    lo = 0
    for _, count in plain.heights:
        edges = sorted({lo, lo + count} | set(range(lo + count, lo, -window)))
        for a, b in zip(edges, edges[1:]):
            expected = sorted(range(a, b), key=lambda i: -work[i])  # stable: ties in order
            assert got[a:b] == [want[i] for i in expected], (keys, a, b)
        lo += count


def can_split(plan: TilePlan, split_keys: int) -> bool:
    """Note [fused kernel], "Split spans": every span whose extras repeat with a period L > 1
    keeps L * split_keys elements (and L), so the plan's spans are all cut; spans with no
    extras, or only a duplicate's (period 1), do not stand in the way."""
    spans, extras = plan.spans.long(), plan.extras.long()
    for count, extra_lo, extra_hi in spans[:, [3, 5, 6]].tolist():
        period = math.lcm(*extras[extra_lo:extra_hi, 0].tolist())
        if period > 1 and count < period * max(split_keys, 1):
            return False
    return True


@settings(max_examples=300)
@given(case=plan_cases())
def test_plan_visits_the_count_matrix(case) -> None:
    check_plan(**case)


@settings(max_examples=300)
@given(case=plan_cases(), data=st.data())
def test_a_window_visits_its_rows_against_its_keys(case, data) -> None:
    """A sequence-parallel rank's piece (rows [lo, hi), possibly empty): its own block of
    the count matrix, segments and documents cut by the piece's ends."""
    lo = data.draw(st.integers(0, case["n"]))
    check_plan(**case, window=(lo, data.draw(st.integers(lo, case["n"]))))


PLAN_CORNERS = [
    # LongNet-like, n not a multiple of the segments
    dict(n=50, patterns=((8, 16, 32), (1, 2, 4)), h=4, hk=2, first=0, causal=True),
    # rates without 1 (unread rows: tiles with no span), heads of a Ulysses rank (first 5)
    dict(n=40, patterns=((8,), (4,)), h=3, hk=1, first=5, causal=False),
    # lcm not a power of two, rates that divide each other and rates that do not
    dict(n=60, patterns=((9, 18, 30), (3, 6, 5)), h=6, hk=3, first=0, causal=True),
    # duplicates, and a segment longer than n
    dict(n=33, patterns=((6, 6, 100), (2, 2, 3)), h=4, hk=4, first=1, causal=False),
    # documents, one of them empty, one shorter than every segment
    dict(n=45, patterns=((8, 20), (1, 4)), h=4, hk=1, first=0, causal=True,
         documents=(0, 3, 3, 30, 45)),
]


@pytest.mark.parametrize("split_keys", [None, 0, 4])
@pytest.mark.parametrize("block_m", [2, 64])
@pytest.mark.parametrize("case", PLAN_CORNERS)
def test_plan_corners(case, block_m: int, split_keys) -> None:
    check_plan(**{"documents": None, **case}, block_m=block_m, split_keys=split_keys)


def test_plan_of_uneven_head_slices() -> None:
    """A head-parallel rank's heads: query heads reading kv heads unevenly (kv_of not the
    j // g map), and a kv head no query head reads (its dK/dV tiles: zero spans)."""
    check_plan(30, ((6, 12), (1, 3)), 3, 3, 2, True, None, 4, kv_of=(1, 1, 0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,m", [(7, 7), (40, 40), (5, 13), (13, 5)])
def test_dense_plan(n: int, m: int, causal: bool) -> None:
    if causal and n != m:
        pytest.skip("causal blocks are square")
    heads = Heads.of(6, 2)
    want = torch.ones(6, n, m, dtype=torch.int64)
    if causal:
        want = torch.tril(want)
    for keys in (False, True):
        plan = dense_plan(n, m, heads, 2, 16, keys)
        got, writes, _ = expand(plan, n, m, heads, 2, causal, keys)
        assert bool((writes == 1).all())
        assert torch.equal(got, want)
        # tiles of 4 rows, heaviest first in windows of 3 (a causal square's work varies)
        plain = dense_plan(n, m, heads, 2, 4, keys, causal=causal)
        ordered = dense_plan(n, m, heads, 2, 4, keys, causal=causal, order_window=3)
        check_order(plain, ordered, 3, causal, keys)
        got, writes, _ = expand(ordered, n, m, heads, 2, causal, keys)
        assert bool((writes == 1).all()) and torch.equal(got, want)


def test_periods_are_powers_of_two_where_the_rates_ratios_are() -> None:
    """The kernels' bit-mask modulo (POW2_PERIODS) is taken where every extra's period is a
    power of two: rates 1, 2, 4 (and repeats, period 1); not rates 1 and 3."""
    heads = Heads.of(2, 1)
    for rates, pow2 in (((1, 2, 4), True), ((2, 2), True), ((1, 3), False), ((3, 6), True)):
        plan = tile_plan(48, ((12, 24, 48)[:len(rates)], rates), heads, 1, False, None, 16,
                         False)
        assert int(plan.extras[:, 0].max()) > 1 or rates == (2, 2)
        assert plan.pow2_periods == pow2, rates


def test_spans_split_where_each_piece_keeps_split_keys_elements() -> None:
    """Note [fused kernel], "Split spans": LongNet's [2048, 4096] / [1, 2] at 8K with a
    GPU's split (8 chunks of 64 keys) has no extras left, so its kernels compile without
    counts: the rate-1 span of the rows both patterns select becomes its even keys (times
    2) and its odd ones (times 1), 1024 each. With pieces that would be shorter, or
    split_keys None, the span keeps its extra; so does every span of a plan where one
    span's pieces would be (the kernels would compute counts anyway); a duplicate
    pattern's extra (period 1) always becomes times."""
    heads = Heads.of(2, 2)
    longnet = ((2048, 4096), (1, 2))
    for keys in (False, True):
        split = tile_plan(8192, longnet, heads, 2, False, None, 128, keys, split_keys=512)
        assert split.max_extras == 0
        spans = split.spans.long()
        # (stride, count, times): the rows rate 1 alone selects read every key of their
        # 2048; the others the even and the odd keys there, and 1024 at stride 2 beyond
        assert {tuple(x) for x in spans[:, 2:5].tolist()} == {
            (1, 2048, 1), (2, 1024, 1), (2, 1024, 2)}
        for split_keys in (None, 1025):
            whole = tile_plan(8192, longnet, heads, 2, False, None, 128, keys,
                              split_keys=split_keys)
            assert whole.max_extras == 1 and int(whole.spans[:, 4].max()) == 1
    # spans with no extras stand in no one's way, short as they are (check_plan's can_split)
    check_plan(249, ((66, 100), (1, 4)), 2, 2, 0, False, None, 16, split_keys=8)
    assert tile_plan(249, ((66, 100), (1, 4)), heads, 2, False, None, 16, False,
                     split_keys=8).max_extras == 0
    duplicate = tile_plan(64, ((16, 16), (2, 2)), heads, 2, False, None, 16, False)
    assert duplicate.max_extras == 0 and set(duplicate.spans[:, 4].tolist()) == {2}
    # the spans with a rate-4 extra would be pieces of 2 keys (rate 2's 4 in a segment of 8,
    # halved): none is split, but the duplicate's extra alone still becomes times 2
    mixed = tile_plan(64, ((8, 8, 32), (2, 2, 4)), heads, 2, False, None, 16, False,
                      split_keys=4)
    assert mixed.max_extras == 2 and set(mixed.spans[:, 4].tolist()) == {1, 2}


def test_occupancy_below_the_per_pattern_floor() -> None:
    """A key that two patterns select is computed once (Note [fused kernel]): LongNet's
    setting at 64K computes 5/6 of the per-pattern floor's pairs; the geometric schedule
    (2048..65536 / 1..32) 0.754 with 64-row tiles, or 128 with narrow tiles. Pure
    arithmetic on the plan."""
    heads = Heads.of(12, 12)
    for split_keys in (None, 512):  # its split pieces fill their chunks: the same work
        longnet = occupancy(65536, ((2048, 4096), (1, 2)), heads, False, None, 128, 64,
                            split_keys)
        assert longnet.computed * 6 == longnet.floor * 5
    geometric = ((2048, 4096, 8192, 16384, 32768, 65536), (1, 2, 4, 8, 16, 32))
    for block_m in (64, 128):  # 128: its 64-row classes launch apart (narrow tiles)
        ratio = occupancy(65536, geometric, heads, False, None, block_m, 64, narrowest=16).ratio
        assert 0.75 < ratio < 0.76
    # in one launch of 128-row tiles they would half-fill theirs
    assert 0.85 < occupancy(65536, geometric, heads, False, None, 128, 64).ratio < 0.86
    causal = occupancy(65536, ((2048, 4096), (1, 2)), heads, True, None, 64, 64)
    assert causal.ratio < 0.9


def test_narrow_tiles_launch_apart_where_they_save_work() -> None:
    """Note [fused kernel], "Narrow tiles": the geometric schedule's classes of 64 rows per
    cell (rows every pattern selects, and every one but the last) half-fill 128-row tiles,
    an eighth of the plan's work, so they get a launch of 64-row tiles, query and key plans
    alike; LongNet's setting has none, and 24 tail tiles of 64 rows in 8,256 rows save
    too little (under NARROW_SAVING) to launch apart."""
    heads = Heads.of(12, 12)
    geometric = ((2048, 4096, 8192, 16384, 32768, 65536), (1, 2, 4, 8, 16, 32))
    for keys in (False, True):
        assert tile_plan(65536, geometric, heads, 12, False, None, 128, keys).heights == \
            ((128, 6528),)  # narrowest None: one launch
        plan = tile_plan(65536, geometric, heads, 12, False, None, 128, keys, narrowest=16)
        assert plan.heights == ((128, 5760), (64, 768))
        (wide, _), (narrow, _) = plan.launches()
        assert int(wide[:, 2].min()) == 128 and int(narrow[:, 2].max()) == 64
        assert tile_plan(65536, geometric, heads, 12, False, None, 64, keys,
                         narrowest=16).heights == ((64, 12288),)
    assert tile_plan(65536, ((2048, 4096), (1, 2)), heads, 12, False, None, 128, False,
                     narrowest=16).heights == ((128, 6144),)
    tail = tile_plan(8256, ((2048, 4096), (1, 2)), heads, 12, False, None, 128, False,
                     narrowest=16)
    assert tail.heights == ((128, 792),) and int((tail.tiles[:, 2] <= 64).sum()) == 24
    assert dense_plan(100, 100, heads, 12, 64, False).heights == ((64, 24),)
    assert tile_plan(0, ((4,), (1,)), heads, 12, False, None, 64, False).heights == ()


# occupancy's numbers exactly, on plans small enough to count by hand: one dense segment of n
# rows, one head, 16 x 16 tiles. Causal: the floor is the triangle with its diagonal,
# n (n + 1) / 2; n = 100 (not a multiple of 16): the spans are padded to whole 16-key chunks.

def test_occupancy_counts_small_plans_exactly():
    one = Heads.of(1, 1)
    causal = occupancy(64, ((64,), (1,)), one, True, None, 16, 16)
    assert causal.floor == 64 * 65 // 2
    dense = occupancy(64, ((64,), (1,)), one, False, None, 16, 16)
    assert (dense.computed, dense.visited, dense.floor) == (64 * 64,) * 3
    ragged = occupancy(100, ((100,), (1,)), one, False, None, 16, 16)
    # 7 tiles of 16 rows (112) times 7 chunks of 16 keys (112)
    assert (ragged.computed, ragged.visited, ragged.floor) == (112 * 112, 100 * 100, 100 * 100)
