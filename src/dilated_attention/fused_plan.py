"""The fused kernel's plan: tiles of rows that share their key spans, as int32 tables.

Pure PyTorch (no Triton): the kernels in ``triton_kernels`` read these tables,
``fused`` launches them, and the tests check them against the count matrix
without a kernel.

Note [fused kernel]
~~~~~~~~~~~~~~~~~~~
Merging the patterns by their softmax denominators is ONE softmax over the
union of the keys the patterns select for a query, a key that m patterns
select counting m times (logit s + log m; docs/spec.md, "Merging the
patterns"). So one online-softmax pass per query row, over the keys every
selecting pattern reads, each with its multiplicity, is exact: no gathers,
no per-pattern outputs, no merges.

Cells. The segment starts of every pattern (they restart at each document)
cut the sequence into *cells*; inside a cell each pattern's segment
[a_i, b_i) is fixed. Pattern i selects row t for query head j when
(t - a_i) mod r_i == (first + j) mod r_i, so the set S of patterns that
select a row depends on its residues only, and the rows of a cell fall into
a few *classes* of equal S:

    one cell of LongNet's [2048, 4096] / [1, 2], head 0, cell = first half
    of a 4096-segment:
      rows:     0  1  2  3  4  5 ...  2047
      S:        AB A  AB A  AB A ...  A        (A: w 2048 r 1, B: w 4096 r 2)
      class AB: rows 0, 2, 4, ...   keys: [0, 2048) every key (A), the even
                ones counting twice (A and B), and [2048, 4096) at stride 2 (B)
      class A:  rows 1, 3, 5, ...   keys: [0, 2048)

Rows of one class share their keys exactly (all of them are congruent to
a_i + offset mod r_i for each i in S, so pattern i reads the same keys
for each): the key side of a class is a short list of *spans* (start,
stride, count). Where several patterns' segments overlap, a span of the
pattern with the smallest rate holds the keys of every pattern whose rate
it divides (their keys are a sub-progression of its own: they share the
class's residue), and carries those patterns as *extras* (period, phase):
key i of the span counts 1 + #{extras with i mod period == phase} times
(the kernels multiply its exp by that count, the same as a log m bias on
its logit). So a key two patterns select is loaded and
multiplied once, not twice: in the example class AB reads 3072 keys, not
4096 (0.833 of the per-pattern work for LongNet's setting, computed by
``fused_occupancy``). Rates that do not divide each other (3 and 5) get a span
each, whose counts add up.

Split spans. A count per key costs the kernels' inner loop about a sixth of
its instructions (the extras' tests per key, a product per pair: sm_90 SASS
of the unmasked chunk loops, Triton 3.9, LongNet's bf16 heads of 64: forward
673 against 560, dq 620 against 491, dK/dV 498 against 407). But a span's
counts repeat with the period L = lcm of its extras' periods, so the span is
also L spans of stride * L whose keys each count the same, `times` (1 + the
extras that hit that phase), which the kernels add as log2(times) to the
logits of the whole span, at no cost per pair. Cutting a span into L spans
costs a span's loop start (its loads' pipeline refills) and a partial last
chunk per piece, and saves nothing while any span of the plan keeps an extra
(the kernels then compute counts for every span). So a plan's spans are cut
where every piece of every one keeps `split_keys` elements
(``fused.TileSizes.split_chunks`` chunks), and its kernels compile without
counts: LongNet's [2048, 4096] / [1, 2] (pieces of 1024 keys), not its
billion-token schedule (periods up to 2^18). Extras of period 1 (a duplicate
pattern) always fold into `times` where they are a span's only extras. In
the example class AB's first span becomes the even keys of [0, 2048) with
times 2 and the odd ones with times 1. A plan that keeps its extras still
pays little where every period divides the kernels' chunk size (periods up
to 32 in the geometric schedule 2048..65536 / 1..32; ``period_lcm``): a
span's counts are then the same in each of its chunks, computed once per
span, and what is left per pair is the product by them (sm_90, Triton 3.9,
three extras: forward 801 -> 623 instructions per chunk, dq 748 -> 563,
dK/dV 563 -> 442).

Tiles. Classes are cut into tiles of at most BLOCK_M rows (a table of rows,
ascending), and one program computes one tile for one batch row: it loads
its q rows in place and runs the online softmax over its spans, BLOCK_N
keys at a time (strided loads), with the causal mask and the key padding
mask per element. Rows no pattern selects form classes
with no span: their tiles write out 0 and lse -inf, so every (row, head) is
written exactly once and nothing is zero-filled first.

Narrow tiles. A class can hold fewer rows than a tile: the geometric
schedule's rows that every pattern selects, and those that all but the last
do, are 64 per cell of 2048 (rates up to 32), and their tiles of 128 rows
would be half empty, an eighth of the plan's work padding (they are its
heaviest tiles: they read every pattern's keys). The kernels' BLOCK_M is a
compile-time constant, so such tiles are launched apart at a smaller one: a
plan holds its tiles widest launch first (``TilePlan.heights``), halving
BLOCK_M down to ``narrowest`` (``fused.TileSizes``: tl.dot's least, 16) while
the tiles that fit save at least NARROW_SAVING (1/16) of the plan's work,
rows padded to the launch's height times the tile's keys. The height is a
template's (the tiles of a geometry), chosen before the cells take theirs.
Each launch costs a kernel launch, and its own last partial wave of
programs, hence the threshold (arithmetic, not timed). The geometric schedule's query and key
plans of 128-row tiles then compute 0.754 of the per-pattern floor's pairs,
not 0.857 (``fused_occupancy``); LongNet's setting fills its tiles and launches
once.

Tile order. A GPU starts a launch's programs roughly in order as earlier ones
finish, so the launch ends with its last wave, and a wave of programs of
unequal work ends with its heaviest: tiles cell by cell end a causal launch on
tiles that read a whole segment (the diagonal's last rows), beside idle SMs.
With ``order_window`` (``fused.TileSizes``) each launch's tiles go heaviest
first (the keys each one loops over, causal bounds included) within windows of
that many tiles counted from its last tile: the lightest run last, and
programs that run at once still come from nearby cells, whose keys they share
in L2 (a sort over a whole launch would scatter them). Only the tiles table is
permuted; rows, spans and results are the plan's. A simulation of the launches
as waves of 264 programs (an H100's 132 SMs, two programs each; arithmetic:
benchmarks/tile_order_waves.py, BENCHMARKS.md "Tile order") puts LongNet's
causal forward at 8K tokens at 1.06 of its work's time instead of 1.48
(non-causal: 1.09 instead of 1.22); launches of more waves lose less either
way. What L2 makes of it is untimed, so the CUDA tables keep 0 (cell by cell)
until a GPU times it (tune_tiles.py --order-windows). The interpreter's tiles
use windows of 3: every CPU test runs permuted plans.

Why classes and a row table, not one arithmetic progression per residue mod
L = lcm(rates): a class unites every residue of equal pattern set (head 0 of
the geometric schedule 2048..65536 / 1..32: the 16 odd residues mod 32 are
one class of 1024 rows per cell, not 16 of 64), so tiles are full where a
residue alone would half-fill a 128-row tile, and under a causal mask a
tile's rows lie close together, where a residue's rows spread over the
whole cell and every tile would reach the cell's last key. A class is not
always a progression (rates 2 and 3: {t = 0 mod 2, t != 0 mod 3}), hence the
table; it costs one int32 per (row, head) of each distinct cell geometry,
and a load of BLOCK_M int32 per tile.

Templates. Cells with the same geometry (length, and each pattern's segment
relative to the cell) have the same classes and spans, relative to the cell
start: the tables hold each geometry once and a tile names its cell start.
A long regular sequence has a handful of geometries (LongNet's setting 2,
the geometric schedule 2048..65536 / 1..32 32), so the plan costs what its
distinct cells cost, not n; many packed documents of distinct lengths cost
about n rows of vectorised work. The classes depend only on a geometry's
*kind*: its length and its patterns' segment starts modulo their rates. So
the row table holds each kind's classes once, and a tile unit is a
(geometry, class of its kind). A pattern that selects none of a cell's rows
for any head (a long rate over a short cell) is left out of both. LongNet's
billion-token schedule (segments 2048 .. 2^30, w / r = 2048) cuts a rank's
8M rows into 4,096 cells of 2,304 geometries (the long segments' bounds
differ from cell to cell) but 5 kinds: 123K row entries for 12 heads, not
101M (benchmarks/bench_plan.py --fused).

dK/dV (``keys=True``). The relation "t reads u" is symmetric but for the
causal mask, so the same construction with key rows as tiles and query
rows as spans gives the transposed plan: a tile holds key rows of one
key/value head whose classes agree for every query head of its GQA group,
and lists, per query head, the spans of queries that read them (u <= t when
causal). A program accumulates dK/dV of its rows over all of them in
registers and writes them once: no atomics.

Causal. A span's keys beyond the cell's last row are dropped here (the
transposed plan: queries before its first); inside the cell the kernel
bounds each span by its tile's last (first) row and masks per element.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .patterns import Heads, Patterns
from .layout import Documents, segments_between

# Columns of the tables (the kernels read them by these positions).
TILE_COLUMNS = ("cell", "row_lo", "rows", "head", "span_lo", "span_hi")
SPAN_COLUMNS = ("head", "start", "stride", "count", "times", "extra_lo", "extra_hi",
                "patterns")
EXTRA_COLUMNS = ("period", "phase", "pattern")
# The most patterns a span's bit mask holds (int32, sign bit clear): the fused kernels'
# dropout draws per pattern (Note [fused dropout] in fused.py).
MAX_MASK_PATTERNS = 31

# Bits of a class key packed per int64 word (the sign bit stays clear).
_WORD_BITS = 62
_BIG = 1 << 62


class TilePlan(NamedTuple):
    """What the kernels loop over, as int32 tables (on the device they run on).

    tiles (T, 6) (T = 0 only for an empty sequence): cell start (absolute row), first
    entry in ``rows``, row count (1..BLOCK_M), head of the rows (query head; key/value
    head in a ``keys`` plan), first span, span end. rows (R,): rows relative to their
    cell start, ascending within a tile. spans (S, 8): the other side's head (key/value
    head; query head in a ``keys`` plan), start relative to the cell, stride, count,
    times (how many patterns select every element; 1 for a span with extras), first
    extra, extra end, and which patterns (bit i: pattern i; those of `times`, or the
    leader of a span with extras) select every element. extras (E, 3): period, phase and
    pattern of each extra count (Note [fused kernel]). The pattern bits hold the first
    MAX_MASK_PATTERNS patterns (later ones are left out: only dropout reads them). Tables
    never empty: an unused one holds a row of zeros, so the
    kernels get a valid pointer. max_extras: the most extras of one span, which the
    kernels unroll (a loop inside their key loop would keep Triton from pipelining the
    key loads). pow2_periods: every extra's period is a power of two (rates 1, 2, 4, ...),
    so the kernels take it modulo with a bit mask, not a division. period_lcm: the lcm of
    every extra's period: where it divides a kernel's chunk size, a span's counts are the
    same in each of its chunks (they start lo + chunk * BLOCK_N), and the kernels compute
    them once per span. heights ((BLOCK_M, tiles), ...): the launches of a kernel over the
    plan, widest first, each over the next `tiles` rows of ``tiles`` (Note [fused kernel],
    "Narrow tiles"); () for an empty plan.
    """

    tiles: Tensor
    rows: Tensor
    spans: Tensor
    extras: Tensor
    block_m: int
    max_extras: int
    pow2_periods: bool = True
    period_lcm: int = 1
    heights: Tuple[Tuple[int, int], ...] = ()

    def to(self, device) -> "TilePlan":
        return self._replace(**{name: getattr(self, name).to(device)
                                for name in ("tiles", "rows", "spans", "extras")})

    def launches(self) -> List[Tuple[Tensor, int]]:
        """(tiles (T_i, 6), a view of ``tiles``; its BLOCK_M) of each launch."""
        if len(self.heights) == 1:  # no view to make (a slice is a torch call: 2 us of host)
            return [(self.tiles, self.heights[0][0])]
        bounds = itertools.accumulate([count for _, count in self.heights], initial=0)
        return [(self.tiles[lo:lo + count], height)
                for (height, count), lo in zip(self.heights, bounds)]


def tile_plan(n: int, patterns: Patterns, heads: Heads, num_kv_heads: int, causal: bool,
              documents: Documents, block_m: int, keys: bool, device: str = "cpu",
              window: Optional[Tuple[int, int]] = None,
              split_keys: Optional[int] = None, narrowest: Optional[int] = None,
              order_window: int = 0) -> TilePlan:
    """The query tiles (``keys=False``: forward and dq) or key tiles (dK/dV) of a call.

    window (lo, hi): only the rows [lo, hi) of the n-row sequence, queries and keys
    alike (a sequence-parallel rank's piece: its rows against its own keys; the keys
    of the other ranks are not in the plan). Its rows are numbered from lo (the tensors
    hold the piece); segments, documents and head offsets stay those of the whole
    sequence. None: every row.

    split_keys: a span with extras is cut into spans without (Note [fused kernel], "Split
    spans") where each piece keeps at least this many elements; None: only extras of
    period 1 fold into `times`.

    narrowest: tiles of few rows may launch apart at a smaller BLOCK_M, down to this one
    (Note [fused kernel], "Narrow tiles"); None: one launch of block_m rows.

    order_window: each launch's tiles heaviest first within windows of this many tiles,
    counted from its last tile (Note [fused kernel], "Tile order"); 0: cell by cell.

    Cached per shape and device: a training step's forward and backward, and
    every step of equal shape, build it once.
    """
    window = (0, n) if window is None else tuple(window)
    if device != "cpu":
        return _device_plan(n, patterns, heads, num_kv_heads, causal, documents, block_m, keys,
                            window, split_keys, narrowest, order_window, device)
    return _tile_plan(n, patterns, heads, num_kv_heads, causal, documents, block_m, keys, window,
                      split_keys, narrowest, order_window)


@functools.lru_cache(maxsize=64)
def _device_plan(n, patterns, heads, num_kv_heads, causal, documents, block_m, keys, window,
                 split_keys, narrowest, order_window, device) -> TilePlan:
    return _tile_plan(n, patterns, heads, num_kv_heads, causal, documents, block_m,
                      keys, window, split_keys, narrowest, order_window).to(device)


def dense_plan(n: int, m: int, heads: Heads, num_kv_heads: int, block_m: int, keys: bool,
               device: str = "cpu", causal: bool = False, order_window: int = 0) -> TilePlan:
    """Plain attention of n query rows against m key rows, as a plan (kernels.py's
    per-launch kernel): tiles of consecutive rows, one span of all the other side's
    rows per head; causal (n == m): the square's lower triangle, which only
    `order_window` reads (tile_plan's)."""
    return _dense_plan(n, m, heads, num_kv_heads, block_m, keys, device, causal, order_window)


@functools.lru_cache(maxsize=64)
def _dense_plan(n, m, heads, num_kv_heads, block_m, keys, device, causal, order_window
                ) -> TilePlan:
    groups = _groups(heads, num_kv_heads, keys)
    rows = m if keys else n
    other = n if keys else m
    tiles, spans = [], []
    for row_head, _, span_heads in groups:
        span_lo = len(spans)
        spans += [(head, 0, 1, other, 1, 0, 0, 1) for head in span_heads]
        for lo in range(0, rows, block_m):
            tiles.append((0, lo, min(block_m, rows - lo), row_head, span_lo, len(spans)))
    table = torch.tensor(tiles, dtype=torch.int64).reshape(-1, len(TILE_COLUMNS))
    row_table = torch.arange(rows)
    span_table = torch.tensor(spans, dtype=torch.int64).reshape(-1, len(SPAN_COLUMNS))
    heights = ((block_m, len(tiles)),) if tiles else ()
    if order_window:
        table = _heaviest_first(table, tile_work(table, row_table, span_table, causal, keys),
                                heights, order_window)
    return TilePlan(_int32(table), _int32(_nonempty(row_table)), _int32(_nonempty(span_table)),
                    _table([], len(EXTRA_COLUMNS)), block_m, 0, heights=heights).to(device)


def _table(entries: Sequence[Tuple[int, ...]], width: int) -> Tensor:
    return _nonempty(torch.tensor(entries, dtype=torch.int32).reshape(-1, width))


def _groups(heads: Heads, num_kv_heads: int, keys: bool
            ) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
    """(head of the tile rows, query heads whose selections define its classes, the span
    head of each): per query head for query tiles, per key/value head (its GQA group of
    query heads) for key tiles."""
    if not keys:
        return [(j, (j,), (kv,)) for j, kv in enumerate(heads.kv_of)]
    groups = []
    for kv in range(num_kv_heads):
        members = tuple(j for j, of in enumerate(heads.kv_of) if of == kv)
        groups.append((kv, members, members))
    return groups


# --------------------------------------------------------------------------
# Cells and their geometries


class _Cells(NamedTuple):
    """starts (C,): each cell's first row; shape (C,): its geometry's index;
    length (U,), seg_lo (U, P), seg_hi (U, P): each geometry's length and every
    pattern's segment relative to the cell start, cut to the window (seg_lo <= 0 <
    length <= seg_hi); phase (U, P): the segment's true start relative to the cell
    start modulo its rate (its rows' residues count from there)."""

    starts: Tensor
    shape: Tensor
    length: Tensor
    seg_lo: Tensor
    seg_hi: Tensor
    phase: Tensor  # `rate` for a pattern that selects none of the cell's rows

    def kinds(self) -> Tuple[Tensor, Tensor, Tensor]:
        """(kind (U,), length (V,), phase (V, P)): geometries of equal length and phases
        have the same rows in the same classes (only their spans differ), so the classes
        are found once per kind."""
        key = torch.cat([self.length[:, None], self.phase], dim=1)
        unique, kind = torch.unique(key, dim=0, return_inverse=True)
        return kind, unique[:, 0], unique[:, 1:]


def _cells(n: int, patterns: Patterns, documents: Documents, window: Tuple[int, int],
           heads: Heads) -> _Cells:
    lo, hi = window
    segments = [segments_between(lo, hi, w, documents, n) for w in patterns[0]]
    # every segment start in the window (they include every non-empty document's start),
    # the window's start when a segment straddles it, and its end
    bounds = torch.unique(torch.cat([torch.clamp(starts, min=lo) for starts, _ in segments]
                                    + [torch.tensor([hi], dtype=torch.int64)]))
    starts, stops = bounds[:-1], bounds[1:]
    geometry = [stops - starts]
    seg_lo, seg_hi, phase = [], [], []
    for (seg_starts, seg_lengths), rate in zip(segments, patterns[1]):
        # the segment holding each cell: the last one starting at or before it
        i = torch.searchsorted(seg_starts, starts, right=True) - 1
        cell_phase = (seg_starts[i] - starts) % rate
        # A pattern that selects no row of a cell for any head (a long rate's segment over a
        # short cell: head offset o selects rows phase + o + k rate) is no part of its
        # geometry: its phase becomes `rate` (no row's residue) and its segment the cell,
        # so that cells differing only there share their kind and geometry.
        reads = torch.zeros_like(cell_phase, dtype=torch.bool)
        for offset in sorted({(heads.first + j) % rate for j in range(heads.count)}):
            reads |= (cell_phase + offset) % rate < geometry[0]
        seg_lo.append(torch.where(reads, torch.maximum(seg_starts[i], torch.tensor(lo)) - starts,
                                  0))
        seg_hi.append(torch.where(
            reads, torch.minimum(seg_starts[i] + seg_lengths[i], torch.tensor(hi)) - starts,
            geometry[0]))
        phase.append(torch.where(reads, cell_phase, rate))
    # (C, 1 + 3P): length, segment starts, segment ends, phases; equal rows = equal geometry
    key = torch.stack(geometry + seg_lo + seg_hi + phase, dim=1)
    unique, shape = torch.unique(key, dim=0, return_inverse=True)
    p = len(patterns[0])
    return _Cells(starts, shape, unique[:, 0], unique[:, 1:1 + p], unique[:, 1 + p:1 + 2 * p],
                  unique[:, 1 + 2 * p:])


# --------------------------------------------------------------------------
# Classes: rows of a cell (and group of heads) that the same patterns select


class _Classes(NamedTuple):
    """Rows of every geometry sorted by class, one group of heads.

    rows (R,): row relative to its cell, sorted by (class, row); size (K,):
    rows per class; shape (K,), first (K,): each class's geometry and first
    row; selected (K, m, P): which patterns select the class for each member.
    """

    rows: Tensor
    size: Tensor
    shape: Tensor
    first: Tensor
    selected: Tensor


class _Rows(NamedTuple):
    """Every row of every geometry: shape (R,) its geometry, row (R,) its row relative to
    the cell, residue (R, P) its index in each pattern's segment modulo the rate."""

    shape: Tensor
    row: Tensor
    residue: Tensor

    @classmethod
    def of(cls, length: Tensor, phase: Tensor, rates: Tensor) -> "_Rows":
        """Rows of geometries (or kinds) of `length` (G,) and `phase` (G, P)."""
        shape = torch.repeat_interleave(torch.arange(length.numel()), length)
        row = _within(length)
        # a phase of `rate`: a pattern that selects no row there (_cells), residue -1
        residue = torch.where(phase[shape] < rates, (row[:, None] - phase[shape]) % rates, -1)
        return cls(shape, row, residue)


def _equal_rows(bits: Tensor, ids: Optional[Tensor] = None, ordered: bool = True) -> Tensor:
    """(R, B) bool -> (R,) dense ids, equal for rows of equal bits (and equal `ids`, (R,),
    which they refine), numbered in (ids, bits) order if `ordered` (else in any order,
    faster). By bit codes of _WORD_BITS columns at a time and 1-D uniques: a row-wise
    torch.unique(dim=0), which sorts whole rows, is far slower."""
    for w0 in range(0, bits.shape[1], _WORD_BITS):
        chunk = bits[:, w0:w0 + _WORD_BITS].long()
        _, word = torch.unique((chunk << torch.arange(chunk.shape[1])).sum(1),
                               sorted=ordered, return_inverse=True)
        # (id so far, word) -> one dense id
        ids = word if ids is None else torch.unique(ids * bits.shape[0] + word,
                                                    sorted=ordered, return_inverse=True)[1]
    return torch.zeros(bits.shape[0], dtype=torch.int64) if ids is None else ids


def _classes(rows: _Rows, offsets: Tensor) -> _Classes:
    """offsets (m, P): each member head's offset per pattern (m may be 0)."""
    shape, row = rows.shape, rows.row
    # (R, 1, P) vs (1, m, P) -> (R, m, P): pattern i selects the row for member j
    selected = rows.residue[:, None, :] == offsets[None]
    cls = _equal_rows(selected.flatten(1), shape)
    # classes are numbered in (geometry, bits) order; rows stay ascending inside a class
    order = torch.sort(cls, stable=True).indices
    size = torch.bincount(cls)
    first = order[torch.cumsum(size, 0) - size]
    return _Classes(row[order], size, shape[first], row[first], selected[first])


# --------------------------------------------------------------------------
# Spans: the keys (queries, for key tiles) each class reads, per member head


class _Spans(NamedTuple):
    """reader (S,): which (class, member) reader a span belongs to, ascending; table
    (S, 8) int64 and extras (E, 3) int64 in the layout of TilePlan."""

    reader: Tensor
    table: Tensor
    extras: Tensor


def _spans(selected: Tensor, first: Tensor, seg_lo: Tensor, seg_hi: Tensor, length: Tensor,
           rates: Tensor, heads: Tensor, causal: bool, keys: bool) -> _Spans:
    """The spans of `D` readers: selected (D, P) the patterns selecting the reader's rows,
    first (D,) one of its rows, seg_lo/seg_hi (D, P) the segments, length (D,) the cell's
    rows, heads (D,) the span head; all relative to the cell start."""
    d, p = selected.shape
    # Intervals of the other axis between consecutive segment bounds of the selecting
    # patterns (and the causal limit): inside one, a fixed set of patterns reads.
    if not causal:
        limit = torch.full((d, 1), _BIG)
    elif keys:
        limit = torch.zeros(d, 1, dtype=torch.int64)  # key tiles: no query before the cell
    else:
        limit = length[:, None]  # query tiles: no key after the cell
    cuts = torch.cat([torch.where(selected, seg_lo, _BIG), torch.where(selected, seg_hi, _BIG),
                      limit], dim=1).sort(dim=1).values
    lo, hi = cuts[:, :-1], cuts[:, 1:]  # (D, I)
    # the V non-empty intervals (most are empty at a billion tokens), by reader, then position
    nonempty = lo < hi
    if causal:
        nonempty &= (lo >= 0) if keys else (hi <= length[:, None])
    owner_of = nonempty.nonzero(as_tuple=True)[0]  # (V,) the interval's reader
    lo, hi = lo[nonempty], hi[nonempty]  # (V,)
    # (V, P): pattern i reads interval [lo, hi)
    active = (selected[owner_of] & (seg_lo[owner_of] <= lo[:, None])
              & (hi[:, None] <= seg_hi[owner_of]))
    leader = _leaders(active, rates)  # (V, P)
    leads = active & (leader == torch.arange(p))
    interval, pattern = leads.nonzero(as_tuple=True)
    reader = owner_of[interval]
    stride = rates[pattern]
    lo_s = lo[interval]
    start = lo_s + (first[reader] - lo_s) % stride
    count = torch.clamp(-((start - hi[interval]) // stride), min=0)
    keep = count > 0
    span_id = torch.full(leads.shape, -1, dtype=torch.int64)
    span_id[interval[keep], pattern[keep]] = torch.arange(int(keep.sum()))
    reader, pattern, start, stride, count = (x[keep] for x in (reader, pattern, start, stride,
                                                               count))
    # extras: (interval, i) active but led by another pattern, on their leader's span
    e_interval, e_pattern = (active & ~leads).nonzero(as_tuple=True)
    owner = span_id[e_interval, leader[e_interval, e_pattern]]
    e_keep = owner >= 0
    owner, e_pattern = owner[e_keep], e_pattern[e_keep]
    period = rates[e_pattern] // stride[owner]
    # key idx of the span (key start + stride * idx) is the pattern's when it is congruent
    # to the reader's rows modulo its rate (start already is, modulo the leader's)
    phase = ((first[reader[owner]] - start[owner]) // stride[owner]) % period
    order = torch.sort(owner, stable=True).indices
    per_span = torch.bincount(owner, minlength=start.numel())
    extra_hi = torch.cumsum(per_span, 0)
    table = torch.stack([heads[reader], start, stride, count, torch.ones_like(count),
                         extra_hi - per_span, extra_hi, _bit(pattern)], dim=1)
    return _Spans(reader, table,
                  torch.stack([period[order], phase[order], e_pattern[order]], dim=1))


def _bit(pattern: Tensor) -> Tensor:
    """Pattern i's bit in a span's mask (0 past MAX_MASK_PATTERNS)."""
    return torch.where(pattern < MAX_MASK_PATTERNS, 1 << pattern.clamp(max=30), 0)


def _split(spans: _Spans, split_keys: Optional[int]) -> _Spans:
    """Each span whose extras repeat every L elements (L the lcm of their periods) as L
    spans of stride * L without extras, each of whose elements counts `times` = 1 + the
    extras that hit its phase: spans with L = 1 always; the others if each piece of every
    one of them keeps at least `split_keys` elements (and one; None: never), since a plan
    with any extra left compiles the counts for every span (Note [fused kernel], "Split
    spans"). Vectorised, and at once where nothing is cut: a rank's piece of a billion
    tokens has some 600,000 spans."""
    table, extras = spans.table, spans.extras
    count, extra_lo, extra_hi = table[:, 3], table[:, 5], table[:, 6]
    per_span = extra_hi - extra_lo
    owner = torch.repeat_interleave(torch.arange(table.shape[0]), per_span)  # (E,)
    period = torch.ones_like(count)  # (S,) L
    if _powers_of_two(extras[:, 0]):
        period.scatter_reduce_(0, owner, extras[:, 0], "amax")  # their lcm: the largest
    else:
        nth = _within(per_span)  # each extra's place in its span
        for j in range(int(per_span.max())):
            at = owner[nth == j]
            period[at] = torch.lcm(period[at], extras[nth == j, 0])
    cut = period == 1  # no extras, or only a duplicate's: nothing to lose by cutting
    if split_keys is not None and bool((cut | (count >= period * max(split_keys, 1))).all()):
        cut[:] = True
    cut &= per_span > 0
    if not bool(cut.any()):
        return spans
    # (S',) pieces: piece q of span `span` (q = 0 alone for a span left whole)
    pieces = torch.where(cut, period, 1)
    span = torch.repeat_interleave(torch.arange(table.shape[0]), pieces)
    q = _within(pieces)
    piece_of = pieces[span]
    new = table[span]
    new[:, 1] += q * new[:, 2]
    new[:, 2] *= piece_of
    new[:, 3] = (new[:, 3] - q + piece_of - 1) // piece_of
    # times: 1 + the extras of a cut span that hit the piece, over (extra, piece) pairs
    cut_extras = cut[owner].nonzero(as_tuple=True)[0]
    reps = pieces[owner[cut_extras]]
    e, e_q = torch.repeat_interleave(cut_extras, reps), _within(reps)
    hit = e_q % extras[e, 0] == extras[e, 1]
    first_piece = torch.cumsum(pieces, 0) - pieces
    new[:, 4].index_add_(0, (first_piece[owner[e]] + e_q)[hit], torch.ones_like(e_q[hit]))
    # and their patterns' bits (each pattern is one span's extra at most once: a sum is an or)
    new[:, 7].index_add_(0, (first_piece[owner[e]] + e_q)[hit], _bit(extras[e[hit], 2]))
    # a span left whole keeps its extras, which stay in span order
    kept = torch.where(cut, 0, per_span)[span]
    new[:, 6] = torch.cumsum(kept, 0)
    new[:, 5] = new[:, 6] - kept
    return _Spans(spans.reader[span], new, extras[~cut[owner]])


def _powers_of_two(x: Tensor) -> bool:
    """Every element of the int tensor x (periods, >= 1) is a power of two (True if none)."""
    return bool((x & (x - 1) == 0).all())


def _within(lengths: Tensor) -> Tensor:
    """(G,) group lengths -> (sum,) each element's index inside its group: 0, 1, .. per group."""
    return torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths
                                                ).repeat_interleave(lengths)


def _leaders(active: Tensor, rates: Tensor) -> Tensor:
    """(..., P) -> (..., P): each active pattern's leader, the active pattern of least rate
    (then index) that divides its rate. Leaders make spans; the others are extra counts on
    their leader's. Computed once per distinct set of active patterns (few, against
    hundreds of thousands of intervals in a rank's piece at a billion tokens): the (P, P)
    choice per interval was most of the piece plans' time there."""
    p = rates.numel()
    flat = active.reshape(-1, p)
    which = _equal_rows(flat, ordered=False)  # (R,): the set of each row, numbered from 0
    sets = flat.new_zeros(int(which.max()) + 1 if which.numel() else 0, p)  # (U, P)
    sets[which] = flat  # the rows of one set are equal: any of them writes it
    divides = rates[:, None] % rates[None, :] == 0  # (P_i, P_k): r_k divides r_i
    rank = rates * p + torch.arange(p)  # (P,) least rate first, then index
    candidate = sets[:, None, :] & divides  # (U, P_i, P_k)
    leader = torch.where(candidate, rank, _BIG).argmin(-1)  # (U, P)
    return leader[which].reshape(active.shape)


# --------------------------------------------------------------------------
# The plan


@functools.lru_cache(maxsize=64)
def _tile_plan(n: int, patterns: Patterns, heads: Heads, num_kv_heads: int, causal: bool,
               documents: Documents, block_m: int, keys: bool,
               window: Tuple[int, int], split_keys: Optional[int] = None,
               narrowest: Optional[int] = None, order_window: int = 0) -> TilePlan:
    cells = _cells(n, patterns, documents, window, heads)
    rates = torch.tensor(patterns[1], dtype=torch.int64)
    kind, kind_length, kind_phase = cells.kinds()
    every_row = _Rows.of(kind_length, kind_phase, rates)
    by_offsets = {}  # heads of equal offsets (LongNet's rates 1, 2: two kinds) share classes
    # Per group of heads: its classes (per kind of geometry); then the spans of every
    # (geometry, class of its kind, member) at once. A tile unit is a (geometry, class)
    # pair: the class's rows (one row table entry per kind) against the geometry's spans.
    rows: List[Tensor] = []
    row_base = 0
    unit_shape, unit_size, unit_row_lo, unit_head, unit_members = [], [], [], [], []
    readers: List[Tuple[Tensor, ...]] = []
    for row_head, members, span_heads in _groups(heads, num_kv_heads, keys):
        offsets = tuple(tuple((heads.first + j) % r for r in patterns[1]) for j in members)
        if offsets not in by_offsets:
            by_offsets[offsets] = _classes(every_row, torch.tensor(
                offsets, dtype=torch.int64).reshape(len(members), len(patterns[1])))
        classes = by_offsets[offsets]
        rows.append(classes.rows)
        # classes are numbered kind-major: those of kind c are [first_of[c], + per_kind[c])
        per_kind = torch.bincount(classes.shape, minlength=kind_length.numel())
        first_of = torch.cumsum(per_kind, 0) - per_kind
        count = per_kind[kind]  # (U,) classes of each geometry
        shape = torch.repeat_interleave(torch.arange(kind.numel()), count)
        k = first_of[kind][shape] + _within(count)
        m = len(members)
        unit_shape.append(shape)
        unit_size.append(classes.size[k])
        unit_row_lo.append(row_base + (torch.cumsum(classes.size, 0) - classes.size)[k])
        unit_head.append(torch.full_like(shape, row_head))
        unit_members.append(torch.full_like(shape, m))
        row_base += classes.rows.numel()
        # (units, m) readers, unit-major
        readers.append((classes.selected[k].flatten(0, 1), classes.first[k].repeat_interleave(m),
                        shape.repeat_interleave(m),
                        torch.tensor(span_heads, dtype=torch.int64).repeat(k.numel())))
    selected, first, shape, span_heads = (torch.cat(x) for x in zip(*readers))
    spans = _split(_spans(selected, first, cells.seg_lo[shape], cells.seg_hi[shape],
                          cells.length[shape], rates, span_heads, causal, keys), split_keys)

    # span range of each unit: its readers' spans (readers, and so spans, are unit-major)
    size = torch.cat(unit_size)
    unit_of_reader = torch.repeat_interleave(torch.arange(size.numel()),
                                             torch.cat(unit_members))
    per_unit = torch.bincount(unit_of_reader[spans.reader], minlength=size.numel())
    class_span_hi = torch.cumsum(per_unit, 0)
    class_span_lo = class_span_hi - per_unit

    # template tiles: each unit cut into tiles of at most block_m rows
    class_shape, class_head = torch.cat(unit_shape), torch.cat(unit_head)
    class_row_lo = torch.cat(unit_row_lo)
    tiles_per_class = -(-size // block_m)
    cls = torch.repeat_interleave(torch.arange(size.numel()), tiles_per_class)
    index = _within(tiles_per_class)
    row_lo = class_row_lo[cls] + index * block_m
    template = torch.stack([row_lo, torch.clamp(size[cls] - index * block_m, max=block_m),
                            class_head[cls], class_span_lo[cls], class_span_hi[cls]], dim=1)
    # templates by geometry (then head and class), then each cell takes its geometry's, in
    # one launch per tile height (widest first)
    by_shape = torch.sort(class_shape[cls], stable=True)
    template, template_shape = template[by_shape.indices], by_shape.values
    uses = torch.bincount(cells.shape, minlength=cells.length.numel())[template_shape]
    height, levels = _heights(template, spans.table, uses, block_m, narrowest or block_m)
    parts = [(template, template_shape)] if len(levels) == 1 else [
        (template[height == level], template_shape[height == level]) for level in levels]
    tiles = [_cell_tiles(part, shape, cells, window) for part, shape in parts]
    heights = tuple((level, t.shape[0]) for level, t in zip(levels, tiles) if t.shape[0])
    tiles, row_table = torch.cat(tiles), torch.cat(rows)
    if order_window:
        tiles = _heaviest_first(tiles, tile_work(tiles, row_table, spans.table, causal, keys),
                                heights, order_window)
    per_span = spans.table[:, 6] - spans.table[:, 5]
    period = spans.extras[:, 0]
    return TilePlan(_int32(tiles), _int32(_nonempty(row_table)),
                    _int32(_nonempty(spans.table)), _int32(_nonempty(spans.extras)), block_m,
                    int(per_span.max()) if per_span.numel() else 0,
                    _powers_of_two(period),
                    math.lcm(*torch.unique(period).tolist()), heights)


# A narrower launch pays where it saves this share of the plan's work (Note [fused kernel],
# "Narrow tiles").
NARROW_SAVING = 1 / 16


def _heights(template: Tensor, spans: Tensor, uses: Tensor, block_m: int, narrowest: int
             ) -> Tuple[Tensor, List[int]]:
    """template (U, 5) tiles of a geometry (row_lo, rows, head, span_lo, span_hi), spans
    (S, 8), uses (U,) the cells that take each -> each one's launch height, and the heights
    launched, widest first: block_m, halved down to `narrowest` while the tiles that fit save
    NARROW_SAVING of the plan's work (rows padded to the launch's height, times the tile's
    keys; causal bounds not counted)."""
    ends = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), spans[:, 3]]), 0)
    keys = (ends[template[:, 4]] - ends[template[:, 3]]) * uses  # of every cell's tile
    height = torch.full_like(keys, block_m)
    total = int(keys.sum()) * block_m
    levels = [block_m]
    narrower = block_m // 2
    while narrower >= narrowest:
        fits = template[:, 1] <= narrower
        # every tile that fits is at the narrowest height kept so far
        if (levels[-1] - narrower) * int(keys[fits].sum()) >= NARROW_SAVING * total:
            levels.append(narrower)
            height[fits] = narrower
        narrower //= 2
    return height, levels


def span_reach(tiles: Tensor, rows: Tensor, spans: Tensor, causal: bool, keys: bool
           ) -> Tuple[Tensor, Tensor]:
    """tiles (T, 6), rows (R,), spans (S, 8) -> per (tile, span) pair: its tile and how
    many of the span's elements the kernel reaches from that tile (triton_kernels' _span:
    causal query tiles read keys up to their last row, key tiles are read by queries from
    their first row on)."""
    per_tile = tiles[:, 5] - tiles[:, 4]
    tile = torch.repeat_interleave(torch.arange(tiles.shape[0]), per_tile)
    span = _within(per_tile) + tiles[tile, 4]
    count = spans[span, 3]
    if causal:
        start, stride = spans[span, 1], spans[span, 2]
        if keys:
            reach = rows[tiles[tile, 1]] - start  # from the tile's first key on
            skipped = torch.where(reach > 0, -(-reach // stride), 0)
            count = torch.clamp(count - skipped, min=0)
        else:
            reach = rows[tiles[tile, 1] + tiles[tile, 2] - 1] - start  # up to its last row
            count = torch.minimum(count, torch.where(reach >= 0, reach // stride + 1, 0))
    return tile, count


def tile_work(tiles: Tensor, rows: Tensor, spans: Tensor, causal: bool, keys: bool) -> Tensor:
    """(T,): the elements each tile's programs loop over, its spans' together."""
    tile, count = span_reach(tiles.long(), rows.long(), spans.long(), causal, keys)
    return torch.zeros(tiles.shape[0], dtype=torch.int64).index_add_(0, tile, count)


def _heaviest_first(tiles: Tensor, work: Tensor, heights: Tuple[Tuple[int, int], ...],
                    window: int) -> Tensor:
    """tiles (T, 6) in launches of `heights` -> the same tiles, each launch's cut into windows
    of `window` tiles from its end (the first one partial), each window's heaviest first
    (ties in plan order)."""
    order, lo = [], 0
    for _, count in heights:
        window_of = (torch.arange(count) + (-count) % window) // window
        launch_work = work[lo:lo + count]
        most = int(launch_work.max())
        # window-major, then heaviest first: one stable sort of one int64 key
        key = window_of * (most + 1) + (most - launch_work)
        order.append(lo + torch.sort(key, stable=True).indices)
        lo += count
    return tiles[torch.cat(order)] if order else tiles


def _cell_tiles(template: Tensor, shape: Tensor, cells: _Cells, window: Tuple[int, int]
                ) -> Tensor:
    """template (U, 5) sorted by geometry, shape (U,) its geometry -> tiles (T, 6): each
    cell's geometry's templates, cell by cell, the cell start (in the window's rows) first."""
    per_shape = torch.bincount(shape, minlength=cells.length.numel())
    shape_lo = torch.cumsum(per_shape, 0) - per_shape
    count = per_shape[cells.shape]
    cell = torch.repeat_interleave(torch.arange(cells.starts.numel()), count)
    within = _within(count)
    return torch.cat([cells.starts[cell, None] - window[0],
                      template[shape_lo[cells.shape][cell] + within]], dim=1)


def _nonempty(table: Tensor) -> Tensor:
    """`table`, or one row of zeros in its place if it has none (a valid kernel pointer)."""
    return table if table.shape[0] else torch.zeros((1,) + table.shape[1:], dtype=table.dtype)


def _int32(x: Tensor) -> Tensor:
    largest = int(x.abs().max()) if x.numel() else 0
    if largest >= 2**31:
        raise ValueError(f"a fused-kernel plan needs indices below 2^31 in magnitude, got "
                         f"{largest}")
    return x.to(torch.int32)
