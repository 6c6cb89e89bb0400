"""Which rows each head reads under one dilation pattern, as index plans.

A pattern (segment length w, rate r) cuts the sequence into segments; head j
reads the rows of a segment whose local index t has ``t mod r == j mod r``.
Heads whose selections have the same length can share one kernel launch, so a
segment slice is described by a few ``HeadGroup``s, each a batch of heads with
equally many rows. Gathering a group turns a strided, per-head selection into
one dense ``(b * segments, rows, heads, d)`` block for a fast kernel.

GQA: query head j reads key/value head ``j // (h // hk)``. A group lists each
distinct (offset, kv head) pair once and orders its query heads so that the
kernel's own GQA broadcast maps them to their pair: no K/V row is repeated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Tuple

import torch
from torch import Tensor


# A validated pattern set: (segment_lengths, dilation_rates), tuples of equal length.
Patterns = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclass(frozen=True)
class HeadGroup:
    """Heads of one pattern that read equally many rows of a segment slice.

    rows: rows read per head; q_heads (hq,) and q_index (rows, hq): the query
    heads and, per head, the rows it reads (relative to the slice start);
    kv_heads (hkv,) and kv_index (kv_rows, hkv) likewise for keys/values
    (kv_rows == rows except for `cross_head_groups`), with
    ``hq == hkv * (hq // hkv)`` in kernel GQA order. ``identity`` marks the
    group that reads every row of every head in order (rate 1): its gather
    is a free view.
    """

    rows: int
    q_heads: Tensor
    q_index: Tensor
    kv_heads: Tensor
    kv_index: Tensor
    identity: bool


@dataclass(frozen=True)
class Region:
    """``num_segments`` equal segments of ``seg_len`` rows starting at ``start``."""

    start: int
    num_segments: int
    seg_len: int

    @property
    def stop(self) -> int:
        return self.start + self.num_segments * self.seg_len


def regions(n: int, segment_length: int) -> List[Region]:
    """The segments of a length-n sequence: full ones, then the shorter tail."""
    w = min(segment_length, n)
    full, tail = divmod(n, w)
    out = [Region(0, full, w)]
    if tail:
        out.append(Region(full * w, 1, tail))
    return out


@functools.lru_cache(maxsize=256)
def head_groups(
    lo: int, hi: int, rate: int, num_heads: int, num_kv_heads: int, device: str = "cpu"
) -> Tuple[HeadGroup, ...]:
    """Head groups for rows ``[lo, hi)`` of a segment (local indices).

    Row t is read by head j when ``t mod rate == j mod rate``. Indices in the
    result are relative to ``lo``. Heads that read nothing in the slice are
    absent. Cached: plans are built once per shape.
    """
    return cross_head_groups(lo, hi, lo, hi, rate, num_heads, num_kv_heads, device)


def _first_and_count(lo: int, hi: int, rate: int) -> Tuple[List[int], List[int]]:
    """Per offset o: the first row of ``[lo, hi)`` with ``t mod rate == o``, and how many."""
    first = [lo + ((o - lo) % rate) for o in range(rate)]
    count = [max(0, -(-(hi - f) // rate)) for f in first]
    return first, count


@functools.lru_cache(maxsize=1024)
def cross_head_groups(
    q_lo: int,
    q_hi: int,
    k_lo: int,
    k_hi: int,
    rate: int,
    num_heads: int,
    num_kv_heads: int,
    device: str = "cpu",
) -> Tuple[HeadGroup, ...]:
    """Head groups for query rows ``[q_lo, q_hi)`` against key rows ``[k_lo, k_hi)``.

    Both slices lie in one segment (local indices); a head reads the rows of
    its offset in each slice. ``q_index`` is relative to ``q_lo`` and has
    ``rows`` rows; ``kv_index`` is relative to ``k_lo`` and has its own row
    count (``kv_index.shape[0]``). Heads with no query or no key row in
    their slice are absent. With equal slices this is `head_groups`.
    """
    q_rows, k_rows = q_hi - q_lo, k_hi - k_lo
    if rate == 1:
        if q_rows <= 0 or k_rows <= 0:
            return ()
        heads = torch.arange(num_heads, device=device)
        kv_heads = torch.arange(num_kv_heads, device=device)
        return (
            HeadGroup(
                q_rows,
                heads,
                torch.arange(q_rows, device=device)[:, None].expand(q_rows, num_heads),
                kv_heads,
                torch.arange(k_rows, device=device)[:, None].expand(k_rows, num_kv_heads),
                identity=True,
            ),
        )
    group_size = num_heads // num_kv_heads
    q_first, q_count = _first_and_count(q_lo, q_hi, rate)
    k_first, k_count = _first_and_count(k_lo, k_hi, rate)
    # (query rows, key rows, multiplicity) -> {(offset, kv head): [query heads]}
    buckets: dict = {}
    pairs: dict = {}
    for j in range(num_heads):
        o = j % rate
        if q_count[o] == 0 or k_count[o] == 0:
            continue
        pairs.setdefault((q_count[o], k_count[o], o, j // group_size), []).append(j)
    for (rows, kv_rows, o, kvh), heads in pairs.items():
        buckets.setdefault((rows, kv_rows, len(heads)), []).append((o, kvh, heads))
    groups = []
    for (rows, _, _), members in sorted(buckets.items(), key=lambda kv: kv[0]):
        q_heads: List[int] = []
        q_cols: List[Tensor] = []
        kv_heads: List[int] = []
        kv_cols: List[Tensor] = []
        for o, kvh, heads in members:
            kv_heads.append(kvh)
            kv_cols.append(torch.arange(k_first[o] - k_lo, k_rows, rate))
            q_heads.extend(heads)
            q_cols.extend([torch.arange(q_first[o] - q_lo, q_rows, rate)] * len(heads))
        groups.append(
            HeadGroup(
                rows,
                torch.tensor(q_heads, device=device),
                torch.stack(q_cols, 1).to(device),
                torch.tensor(kv_heads, device=device),
                torch.stack(kv_cols, 1).to(device),
                identity=False,
            )
        )
    return tuple(groups)


def segments_view(x: Tensor, region: Region) -> Tensor:
    """(b, n, h, d) -> (b, segments, seg_len, h, d), a view of the region."""
    return x[:, region.start : region.stop].unflatten(1, (region.num_segments, region.seg_len))


def gather(x: Tensor, region: Region, heads: Tensor, index: Tensor, identity: bool) -> Tensor:
    """Rows of every segment of `region` for `heads`: (b * segments, rows, heads, d)."""
    seg = segments_view(x, region)
    if not identity:
        # (b, s, w, h, d) -> (b, s, rows, heads, d): head i takes rows index[:, i]
        seg = seg[:, :, index, heads]
    return seg.flatten(0, 1)


def scatter_add_(
    x: Tensor, region: Region, heads: Tensor, index: Tensor, identity: bool, y: Tensor
) -> None:
    """The inverse of `gather`, accumulating: x[rows of region, heads] += y."""
    seg = segments_view(x, region)
    # (b * s, rows, heads, ...) -> (b, s, rows, heads, ...)
    y = y.unflatten(0, seg.shape[:2])
    if identity:
        seg.add_(y)
    else:
        # no (row, head) pair repeats within a group, so read-add-write is exact
        seg[:, :, index, heads] += y


@functools.lru_cache(maxsize=4096)
def selected_pairs(
    q_lo: int, q_hi: int, k_lo: int, k_hi: int, rate: int, num_heads: int, num_kv_heads: int
) -> int:
    """How many (key row, kv head) pairs `cross_head_groups` reads: pure arithmetic.

    Equals ``sum(g.kv_index.numel() for g in cross_head_groups(...))`` without
    building any tensor, so a plan can size every rank's traffic cheaply.
    """
    group_size = num_heads // num_kv_heads
    _, q_count = _first_and_count(q_lo, q_hi, rate)
    _, k_count = _first_and_count(k_lo, k_hi, rate)
    # each distinct (offset, kv head) pair with rows on both sides is read once
    used = {(j % rate, j // group_size) for j in range(num_heads)}
    return sum(k_count[o] for o, _ in used if q_count[o] > 0)
