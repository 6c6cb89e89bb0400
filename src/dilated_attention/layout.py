"""Where the rows are: a sequence's chunks over ranks, and the segments of a pattern over them.

A ``Layout`` cuts the N global rows into chunks, each held by one rank at
some local rows: one chunk for a single device; one per rank, contiguous;
or two per rank, zigzag (Note [zigzag] in distributed/ring.py). It is the
one place the layouts are computed: the plan, the sharding helpers and the
ring read it. Documents (``cu_seqlens``) cut the sequence into independent
sequences, and each pattern (w, r) cuts every document into segments of W
= min(w, document length) rows (``segments_between``).
"""

from __future__ import annotations

import bisect
import functools
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .patterns import Patterns

Documents = Optional[Tuple[int, ...]]
# What the public ops take as cu_seqlens: boundaries [0, c1, ..., N] (a tensor on the host
# read once), checked into Documents.
CuSeqlens = Optional[Union[Sequence[int], Tensor]]


class Chunk(NamedTuple):
    """Global rows [start, stop) held by `rank` at local rows [local, local + stop - start)."""

    start: int
    stop: int
    rank: int
    local: int


class Layout(NamedTuple):
    """A sequence of `total` rows cut into non-empty chunks, in global order."""

    chunks: Tuple[Chunk, ...]
    total: int
    ranks: int

    @classmethod
    def contiguous(cls, lengths: Sequence[int]) -> "Layout":
        """Rank p holds global rows [S_p, S_p + N_p), S_p = N_0 + ... + N_(p-1)."""
        chunks, start = [], 0
        for rank, n in enumerate(lengths):
            if n:
                chunks.append(Chunk(start, start + n, rank, 0))
            start += n
        return cls(tuple(chunks), start, len(lengths))

    @classmethod
    def zigzag(cls, lengths: Sequence[int]) -> "Layout":
        """2P equal chunks; rank p holds chunks p and 2P-1-p, in that local order."""
        p = len(lengths)
        c = lengths[0] // 2
        chunks = [Chunk(i * c, (i + 1) * c, i if i < p else 2 * p - 1 - i, 0 if i < p else c)
                  for i in range(2 * p)]
        return cls(tuple(chunks), 2 * p * c, p)

    @classmethod
    def named(cls, layout: str, lengths: Sequence[int]) -> "Layout":
        """The layout called `layout` ("contiguous" or "zigzag") of pieces of these lengths."""
        return cls.zigzag(lengths) if layout == "zigzag" else cls.contiguous(lengths)

    def of_rank(self, rank: int) -> List[Chunk]:
        """This rank's chunks in local order."""
        return sorted((c for c in self.chunks if c.rank == rank), key=lambda c: c.local)

    def rows_of(self, rank: int) -> int:
        return sum(c.stop - c.start for c in self.chunks if c.rank == rank)

    def split(self, start: int, stop: int) -> List[Chunk]:
        """Global rows [start, stop) cut by chunk, as chunks of those rows."""
        first = bisect.bisect_right([c.start for c in self.chunks], start) - 1
        out = []
        for c in self.chunks[max(first, 0):]:
            if c.start >= stop:
                break
            lo, hi = max(start, c.start), min(stop, c.stop)
            if hi > lo:
                out.append(Chunk(lo, hi, c.rank, c.local + lo - c.start))
        return out


def segments_between(x: int, y: int, w: int, documents: Documents,
                     total: int) -> Tuple[Tensor, Tensor]:
    """(starts, lengths), int64, of the pattern-w segments that meet global rows [x, y).

    Vectorised over documents: no Python loop over them. Documents are
    ``cu_seqlens`` [0, c1, ..., N] (None: one document of `total` rows).
    """
    cu = torch.tensor(documents if documents is not None else (0, total), dtype=torch.int64)
    # documents [i0, i1) meet [x, y)
    i0 = max(int(torch.searchsorted(cu, x, right=True)) - 1, 0)
    i1 = min(int(torch.searchsorted(cu, y, right=False)), cu.numel() - 1)
    if i1 <= i0 or y <= x:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    doc_start, doc_stop = cu[i0:i1], cu[i0 + 1 : i1 + 1]
    length = doc_stop - doc_start
    keep = length > 0
    doc_start, doc_stop, length = doc_start[keep], doc_stop[keep], length[keep]
    seg = torch.clamp(length, max=w)  # W = min(w, document length)
    # segments k of each document that meet [x, y): from (x - start) // W to ceil((y - start) / W)
    k_lo = torch.clamp((x - doc_start) // seg, min=0)
    k_hi = torch.minimum(-((doc_start - y) // seg), -(-length // seg))
    count = torch.clamp(k_hi - k_lo, min=0)
    doc = torch.repeat_interleave(torch.arange(doc_start.numel()), count)
    # k = k_lo of its document + its rank among that document's segments
    first = torch.cumsum(count, 0) - count
    k = k_lo[doc] + torch.arange(doc.numel()) - first[doc]
    starts = doc_start[doc] + k * seg[doc]
    lengths = torch.minimum(seg[doc], doc_stop[doc] - starts)
    return starts, lengths


# Sequences longer than this are checked for unread rows on their first rows only.
UNREAD_CHECK_ROWS = 1 << 22


@functools.lru_cache(maxsize=256)
def unread_rows(n: int, patterns: Patterns, heads: int, documents: Documents) -> int:
    """How many (row, head) pairs of an n-row sequence no pattern reads (0 when a rate is 1).

    Head j reads the rows of its offset j mod r in each pattern; with no rate
    1 some rows can be read by no head's pattern, and their outputs are 0.
    """
    if 1 in patterns[1] or n == 0:
        return 0
    rows = min(n, UNREAD_CHECK_ROWS)
    read = torch.zeros(rows, heads, dtype=torch.bool)
    offsets = torch.arange(heads)
    for w, r in zip(*patterns):
        starts, lengths = segments_between(0, rows, w, documents, n)
        # (rows,) each row's index inside its segment
        local = torch.arange(rows) - torch.repeat_interleave(starts, lengths)[:rows]
        read |= (local[:, None] % r) == (offsets % r)[None, :]
    return int((~read).sum())
