"""Which rows each head reads under one dilation pattern, as index plans.

A pattern (segment length w, rate r) cuts a sequence into segments; head j
reads the rows of a segment whose local index t has ``t mod r == j mod r``.
Heads whose selections have the same length can share one kernel launch, so a
segment slice is described by a few ``HeadGroup``s, each a batch of heads with
equally many rows. Gathering a group turns a strided, per-head selection into
one dense ``(b * segments, rows, heads, d)`` block for a fast kernel.

Heads: a call holds query heads ``first .. first + h - 1`` of the model (all
of them, or a head-parallel rank's share); dilation offsets count *global*
heads, and each local query head names the local key/value head it reads
(``Heads``). GQA: a group lists each distinct (offset, kv head) pair once and
orders its query heads so that the kernel's own GQA broadcast maps them to
their pair: no K/V row is repeated.

Everything here costs what the heads need, never what the rate is: a rate
of 2^40 plans as fast as a rate of 2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

# A validated pattern set: (segment_lengths, dilation_rates), tuples of equal length.
Patterns = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclass(frozen=True)
class Heads:
    """The query heads a call computes, and the key/value head each one reads.

    first: the model's index of local query head 0 (0 unless a head-parallel
    rank holds a slice of the heads); head j's dilation offset is
    ``(first + j) mod r``. kv_of: per local query head, the index of its key/
    value head among the local ones.
    """

    first: int
    kv_of: Tuple[int, ...]

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, first: int = 0) -> "Heads":
        """All heads of a GQA layout: query head j reads kv head j // (h // hk)."""
        group = num_heads // num_kv_heads
        return cls(first, tuple(j // group for j in range(num_heads)))

    @property
    def count(self) -> int:
        return len(self.kv_of)

    @property
    def grouped(self) -> bool:
        """True when kv_of is the kernels' own GQA map j -> j // (h / hk) over every kv head."""
        hk = max(self.kv_of) + 1
        return self.count % hk == 0 and self.kv_of == Heads.of(self.count, hk).kv_of


class Stride(NamedTuple):
    """Columns of a selection as arithmetic, so that a strided view reads them: column i
    is head ``head + head_step * i`` at rows ``row + row_step * i + rate * t`` (t < rows)
    of each segment (rows relative to the slice start, like the index)."""

    head: int
    head_step: int
    row: int
    row_step: int
    rate: int

    def shifted(self, columns: int) -> "Stride":
        """The same selection from column `columns` on."""
        return self._replace(head=self.head + self.head_step * columns,
                             row=self.row + self.row_step * columns)


@dataclass(frozen=True)
class HeadGroup:
    """Heads of one pattern that read equally many rows of a segment slice.

    rows: rows read per head; q_heads (hq,) and q_index (rows, hq): the query
    heads and, per head, the rows it reads (relative to the slice start);
    kv_heads (hkv,) and kv_index (kv_rows, hkv) likewise for keys/values
    (kv_rows == rows unless the key slice differs from the query slice),
    with ``hq == hkv * (hq // hkv)`` in kernel GQA order. ``identity`` marks
    the group that reads every row of every head in order (rate 1, kernel
    GQA layout). ``q_stride``/``kv_stride``, when set, are the same
    selections as arithmetic: on a run of segments the group's gathers and
    writes are strided views, not copies (both set or neither). ``pairs``
    names the (offset, kv head) pair of each kv column: the wire format of
    sequence-parallel transfers is keyed by it.
    """

    rows: int
    q_heads: Tensor
    q_index: Tensor
    kv_heads: Tensor
    kv_index: Tensor
    identity: bool
    pairs: Tuple[Tuple[int, int], ...]
    q_stride: Optional[Stride] = None
    kv_stride: Optional[Stride] = None

    @property
    def strided(self) -> bool:
        return self.q_stride is not None


class Segments(NamedTuple):
    """`count` segments of `length` rows each, as local row numbers.

    A run (``starts`` None): segment i starts at ``start + i * length``, the
    rows of the run are contiguous and views of them are free. Otherwise
    segment i starts at ``starts[i]`` (an int64 tensor; packed documents put
    equal segments anywhere) and gathers copy.
    """

    start: int
    count: int
    length: int
    starts: Optional[Tensor] = None

    @property
    def rows(self) -> int:
        return self.count * self.length


def _offset_rows(lo: int, hi: int, offset: int, rate: int) -> Tuple[int, int]:
    """(first row of [lo, hi) with row mod rate == offset, how many such rows)."""
    first = lo + (offset - lo) % rate
    return first, max(0, -(-(hi - first) // rate))


# A selection that cuts into at most this many arithmetic runs launches as that many
# strided views (no copies); one that needs more is gathered as one group.
MAX_STRIDED_RUNS = 4

_DENSE = Stride(0, 1, 0, 0, 1)

# One kv column of a group: ((offset, kv head), first query row, first key row, query heads)
_Pair = Tuple[Tuple[int, int], int, int, List[int]]


@functools.lru_cache(maxsize=4096)
def cross_head_groups(
    q_lo: int, q_hi: int, k_lo: int, k_hi: int, rate: int, heads: Heads, device: str = "cpu",
    strided: bool = True,
) -> Tuple[HeadGroup, ...]:
    """Head groups for query rows ``[q_lo, q_hi)`` against key rows ``[k_lo, k_hi)``.

    Both slices lie in one segment (segment-local row numbers); a head reads
    the rows of its offset in each slice. ``q_index`` is relative to ``q_lo``
    and has ``rows`` rows; ``kv_index`` is relative to ``k_lo`` and has its own
    row count (``kv_index.shape[0]``). Heads with no query or no key row in
    their slice are absent. `strided`: cut the heads into arithmetic runs
    (``Stride``; at most MAX_STRIDED_RUNS per row count) that launch as strided
    views, for kernels that read any strides; else one gathered group per row
    count (the identity group is a view either way). Cached: plans are built
    once per shape.
    """
    q_rows, k_rows = q_hi - q_lo, k_hi - k_lo
    if q_rows <= 0 or k_rows <= 0:
        return ()
    # A rate at least every row and head index here selects, per head, the one row equal to
    # its head index: so does any smaller rate that is still that large. The bound keeps the
    # strides of views (rate x row stride) within int64 for any rate (up to 2^63 - 1).
    bound = max(q_hi, k_hi, heads.first + heads.count)
    if rate > bound:
        return cross_head_groups(q_lo, q_hi, k_lo, k_hi, bound, heads, device, strided)
    if device != "cpu":
        # index arithmetic is cheapest on the CPU (on meta it would run Python references)
        return tuple(
            replace(g, q_heads=g.q_heads.to(device), q_index=g.q_index.to(device),
                                kv_heads=g.kv_heads.to(device), kv_index=g.kv_index.to(device))
            for g in cross_head_groups(q_lo, q_hi, k_lo, k_hi, rate, heads, "cpu", strided)
        )
    if rate == 1 and heads.grouped:
        hk = max(heads.kv_of) + 1
        return (
            HeadGroup(
                q_rows,
                torch.arange(heads.count),
                torch.arange(q_rows)[:, None].expand(q_rows, heads.count),
                torch.arange(hk),
                torch.arange(k_rows)[:, None].expand(k_rows, hk),
                identity=True,
                pairs=tuple((0, kv) for kv in range(hk)),
                q_stride=_DENSE,
                kv_stride=_DENSE,
            ),
        )
    # (offset, kv head) -> query heads reading that pair; offsets of the heads only
    readers: Dict[Tuple[int, int], List[int]] = {}
    for j, kv in enumerate(heads.kv_of):
        readers.setdefault(((heads.first + j) % rate, kv), []).append(j)
    # (query rows, key rows, multiplicity) -> the pairs with those counts
    buckets: Dict[Tuple[int, int, int], List[_Pair]] = {}
    for (offset, kv), members in readers.items():
        q_first, q_count = _offset_rows(q_lo, q_hi, offset, rate)
        k_first, k_count = _offset_rows(k_lo, k_hi, offset, rate)
        if q_count and k_count:
            buckets.setdefault((q_count, k_count, len(members)), []).append(
                ((offset, kv), q_first - q_lo, k_first - k_lo, members))
    groups = []
    for (rows, kv_rows, _), pairs in sorted(buckets.items(), key=lambda kv: kv[0]):
        runs = _strided_runs(pairs, rate) if strided else None
        for run in runs or [pairs]:
            groups.append(_group(rows, kv_rows, rate, run, runs is not None))
    return tuple(groups)


def _columns(pairs: List[_Pair]) -> Tuple[List[int], List[int], List[int], List[int]]:
    """(query heads, their first rows, kv heads, their first rows) of `pairs`, column by
    column in kernel GQA order."""
    q_heads = [j for _, _, _, members in pairs for j in members]
    q_starts = [q_first for _, q_first, _, members in pairs for _ in members]
    kv_heads = [pair[1] for pair, _, _, _ in pairs]
    kv_starts = [k_first for _, _, k_first, _ in pairs]
    return q_heads, q_starts, kv_heads, kv_starts


def _group(rows: int, kv_rows: int, rate: int, pairs: List[_Pair], strided: bool) -> HeadGroup:
    """The group of `pairs` (equally many query heads each), with its strides if `strided`."""
    q_heads, q_starts, kv_heads, kv_starts = _columns(pairs)
    q_stride, kv_stride = _strides(pairs, rate) if strided else (None, None)
    # (rows, heads): head i reads rows start_i, start_i + rate, ...
    return HeadGroup(
        rows,
        torch.tensor(q_heads),
        torch.arange(rows)[:, None] * rate + torch.tensor(q_starts),
        torch.tensor(kv_heads),
        torch.arange(kv_rows)[:, None] * rate + torch.tensor(kv_starts),
        identity=False,
        pairs=tuple(pair for pair, _, _, _ in pairs),
        q_stride=q_stride,
        kv_stride=kv_stride,
    )


def _step(values: List[int]) -> Optional[int]:
    """The common difference of `values` (0 for one value) if there is one, not negative."""
    step = values[1] - values[0] if len(values) > 1 else 0
    if step < 0 or any(b - a != step for a, b in zip(values, values[1:])):
        return None
    return step


def _strides(pairs: List[_Pair], rate: int) -> Tuple[Optional[Stride], Optional[Stride]]:
    """(query, kv) strides of a group of `pairs`, or (None, None) if it is not arithmetic."""
    q_heads, q_starts, kv_heads, kv_starts = columns = _columns(pairs)
    steps = [_step(x) for x in columns]
    if None in steps:
        return None, None
    return (Stride(q_heads[0], steps[0], q_starts[0], steps[1], rate),
            Stride(kv_heads[0], steps[2], kv_starts[0], steps[3], rate))


def _strided_runs(pairs: List[_Pair], rate: int) -> Optional[List[List[_Pair]]]:
    """`pairs` cut into arithmetic runs, greedily, in head order or by offset (whichever
    makes fewer runs: heads j, j + 1, ... for rates above the head count, heads of one
    offset for rates below it); None if that takes more than MAX_STRIDED_RUNS."""
    best: Optional[List[List[_Pair]]] = None
    for order in (pairs, sorted(pairs, key=lambda p: p[0])):
        runs: List[List[_Pair]] = []
        for pair in order:
            if runs and _strides(runs[-1] + [pair], rate)[0] is not None:
                runs[-1].append(pair)
            else:
                runs.append([pair])
        if best is None or len(runs) < len(best):
            best = runs
    return best if len(best) <= MAX_STRIDED_RUNS else None


def head_groups(lo: int, hi: int, rate: int, heads: Heads, device: str = "cpu",
                strided: bool = True) -> Tuple[HeadGroup, ...]:
    """Head groups for rows ``[lo, hi)`` of a segment against themselves (indices from lo)."""
    return cross_head_groups(lo, hi, lo, hi, rate, heads, device, strided)


def split_heads(group: HeadGroup, max_entries: int) -> Tuple[HeadGroup, ...]:
    """`group` cut into groups of whole kv heads (each with its query heads) of at most
    `max_entries` query (row, head) entries, and at least one kv head each.

    The same work in smaller launches: a gathered launch copies its q, k, v and
    allocates its outputs, all in proportion to its heads.
    """
    hq, hkv = group.q_heads.numel(), group.kv_heads.numel()
    if group.rows * hq <= max_entries or hkv == 1:
        return (group,)
    per_kv = hq // hkv  # kernel GQA order: query heads [i * per_kv, (i + 1) * per_kv) read kv i
    step = max(1, max_entries // (group.rows * per_kv))
    return tuple(
        HeadGroup(group.rows, group.q_heads[i * per_kv:(i + step) * per_kv],
                  group.q_index[:, i * per_kv:(i + step) * per_kv], group.kv_heads[i:i + step],
                  group.kv_index[:, i:i + step], False, group.pairs[i:i + step],
                  group.q_stride and group.q_stride.shifted(i * per_kv),
                  group.kv_stride and group.kv_stride.shifted(i))
        for i in range(0, hkv, step)
    )


def selected_pairs(q_lo: int, q_hi: int, k_lo: int, k_hi: int, rate: int, heads: Heads) -> int:
    """How many (key row, kv head) pairs `cross_head_groups` reads: pure arithmetic.

    Equals ``sum(g.kv_index.numel() for g in cross_head_groups(...))`` without
    building any tensor, so a plan can size every rank's traffic cheaply. Which
    rows of a slice an offset selects depends only on the slice's start modulo
    the rate and its length, so equal parts of a long segment (every rank's
    part of LongNet's last segment) share one cached count.
    """
    if q_hi <= q_lo or k_hi <= k_lo:
        return 0
    return _selected_pairs(q_lo % rate, q_hi - q_lo, k_lo % rate, k_hi - k_lo, rate, heads)


@functools.lru_cache(maxsize=65536)
def _selected_pairs(q_start: int, q_rows: int, k_start: int, k_rows: int, rate: int,
                    heads: Heads) -> int:
    total = 0
    for offset, kv_heads in _offset_kv_heads(rate, heads):
        if _offset_rows(q_start, q_start + q_rows, offset, rate)[1]:
            total += kv_heads * _offset_rows(k_start, k_start + k_rows, offset, rate)[1]
    return total


@functools.lru_cache(maxsize=4096)
def _offset_kv_heads(rate: int, heads: Heads) -> Tuple[Tuple[int, int], ...]:
    """(offset, how many kv heads are read at it) over the heads' distinct (offset, kv) pairs."""
    used = {((heads.first + j) % rate, kv) for j, kv in enumerate(heads.kv_of)}
    counts: Dict[int, int] = {}
    for offset, _ in used:
        counts[offset] = counts.get(offset, 0) + 1
    return tuple(sorted(counts.items()))


# --------------------------------------------------------------------------
# Gathering selected rows into dense kernel batches, and back


def _rows_of(segs: Segments, index: Tensor) -> Tensor:
    """Local row numbers (count, *index.shape): segment start + index."""
    starts = segs.starts
    if starts is None:
        starts = segs.start + segs.length * torch.arange(segs.count, device=index.device)
    return starts.view((-1,) + (1,) * index.dim()) + index


def strided_view(x: Tensor, segs: Segments, stride: Stride, rows: int, columns: int) -> Tensor:
    """(b, n, h, ...) -> (b, count, rows, columns, ...): a run's rows a `stride` selects, a view."""
    # one as_strided on x's own strides, not on a view of the run (b, count, length, h, ...):
    # the same view without the slice and unflatten before it, 3.3 -> 2.3 us (18 such views
    # a tiny LongNetLM attention forward at 128 rows); one batch row gets the stride that
    # unflatten gave it, so that even the strides of size-1 dims are the same
    sb, sn, sh = x.stride()[:3]
    step = segs.length * sn
    return x.as_strided(
        (x.shape[0], segs.count, rows, columns) + x.shape[3:],
        (sb if x.shape[0] > 1 else segs.count * step, step, stride.rate * sn,
         stride.row_step * sn + stride.head_step * sh) + x.stride()[3:],
        x.storage_offset() + (segs.start + stride.row) * sn + stride.head * sh,
    )


def is_view(segs: Segments, stride: Optional[Stride]) -> bool:
    """Whether a selection is read and written as a view (a strided group on a run of
    segments), not through an advanced-indexing copy."""
    return segs.starts is None and stride is not None


def gather(x: Tensor, segs: Segments, heads: Tensor, index: Tensor,
           stride: Optional[Stride]) -> Tensor:
    """The rows `index` (rows, heads) of every segment for `heads`: (b * count, rows, heads, ...).

    x is (b, n, h, ...) (d, or nothing for lse-like tensors). A run read by
    a strided group is a view; anything else is one advanced-indexing copy.
    """
    if is_view(segs, stride):
        return strided_view(x, segs, stride, *index.shape).flatten(0, 1)
    # (b, n, h, ...) -> (b, s, rows, heads, ...) at rows starts[s] + index[:, i] of head i
    return x[selection(segs, heads, index)].flatten(0, 1)


def selection(segs: Segments, heads: Tensor, index: Tensor) -> tuple:
    """The advanced index of x (b, n, h, ...) that `gather` reads where it copies:
    (b, count, rows, heads, ...) entries, for writing back."""
    return (slice(None), _rows_of(segs, index), heads)


def scatter_add_(x: Tensor, segs: Segments, heads: Tensor, index: Tensor,
                 stride: Optional[Stride], y: Tensor, rows: slice = slice(None)) -> None:
    """The inverse of `gather`, accumulating, for rows `rows` of the selection:
    x[those rows of segs, heads] += y (b * count, rows, heads, ...)."""
    # (b * s, rows, heads, ...) -> (b, s, rows, heads, ...)
    y = y.unflatten(0, (x.shape[0], segs.count))
    every_row = rows == slice(None)  # then no [:, :, rows]: it dispatched an alias op
    if is_view(segs, stride):
        view = strided_view(x, segs, stride, *index.shape)
        (view if every_row else view[:, :, rows]).add_(y)
    else:
        # no (row, head) pair repeats within a group, so read-add-write is exact
        x[selection(segs, heads, index if every_row else index[rows])] += y
