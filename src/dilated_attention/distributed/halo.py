"""Sequence-parallel sliding-window attention: each rank fetches only its halo.

Notation: P ranks, N global rows, b batch, hk key/value heads, d head dim;
(left, right) the window's reaches (an unbounded side is N), rows global.

Note [halo exchange]
~~~~~~~~~~~~~~~~~~~~
Query t reads keys [t - left, t + right] of its own document, so the rows a
rank's piece [c0, c1) reads beyond its own are its *halo*: the `left` rows
before c0 and the `right` rows after c1, clipped to the documents of c0 and
c1 - 1 (a row of another document is never fetched). Window (4, 2), pieces
of 6, 3 and 9 rows:

    rows      0 1 2 3 4 5 6 7 8 9 ...                 17
    rank 0   [a a a a a a]
    rank 1               [b b b]
    rank 2                     [c c c c c c c c c]

    rank 1 reads [6 - 4, 9 + 2) = rows 2-5 of rank 0 and rows 9-10 of rank 2;
    rank 2 reads [9 - 4, 9) = row 5 of rank 0 (two ranks away) and rows 6-8
    of rank 1; rank 0 reads rows 6-7 of rank 1.

Every rank derives every transfer from the agreed layout (``halo_schedule``,
pure arithmetic, the same on all ranks): who sends which rows to whom, in
which round. A rank posts its sends and receives of round 0 before any
launch, computes the tiles on its own rows meanwhile, then the tiles on the
halos (window.py: a halo is one more interval of keys, and the tiles clip
to it). Traffic per rank is its halo rows' k and v, whatever N is; no ring
rotation runs. The zigzag layout works the same way: a rank's two chunks
each get their own halo (rows a rank holds itself are never sent).

Rounds: when no rank receives more rows than the longest piece (the window
is shorter than the pieces, the usual case), everything goes in one round.
Otherwise (a window spanning many ranks, or an unbounded side) a transfer
goes in round i - 1 for chunks i apart in the sequence: a rank then holds
about two chunks' halos at a time, not its whole reach.

Backward fetches the halos again (nothing but the inputs is saved), adds dq
into its own rows, and sends the fp32 dK/dV of each halo back to its owner
after the round's tiles, which adds them into its dK/dV; so the backward's
traffic is the forward's twice plus the dK/dV of the halos.
"""

from __future__ import annotations

import bisect
import functools
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

from torch import Tensor

from ..kernels import KernelOptions
from ..layout import Documents, Layout
from ..window import WindowAttentionFunction, reaches, window_plan
from . import comm
from .key_rounds import KeyRounds


class Halo(NamedTuple):
    """Global rows [start, stop) of rank `src` (its local rows from `local`) that rank `dst`
    reads, sent in round `round`."""

    src: int
    dst: int
    start: int
    stop: int
    local: int
    round: int


def _document(row: int, documents: Documents, total: int) -> Tuple[int, int]:
    """[start, stop) of the document holding global `row`."""
    if documents is None:
        return 0, total
    i = bisect.bisect_right(documents, row) - 1
    return documents[i], documents[i + 1]


@functools.lru_cache(maxsize=64)
def halo_schedule(layout: Layout, left: int, right: int, documents: Documents
                  ) -> Tuple[Halo, ...]:
    """Every halo of every rank (Note [halo exchange]), in the order both sides post them."""
    starts = [c.start for c in layout.chunks]
    wanted: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
    for i, c in enumerate(layout.chunks):
        lo = max(c.start - left, _document(c.start, documents, layout.total)[0])
        hi = min(c.stop + right, _document(c.stop - 1, documents, layout.total)[1])
        for part in layout.split(lo, hi):
            if part.rank != c.rank:
                j = bisect.bisect_right(starts, part.start) - 1  # the chunk it lies in
                wanted.setdefault((j, c.rank), []).append((part.start, part.stop, abs(i - j)))
    halos = []
    for (j, dst), intervals in wanted.items():
        src = layout.chunks[j]
        for start, stop, distance in _union(intervals):
            halos.append(Halo(src.rank, dst, start, stop, src.local + start - src.start,
                              distance - 1))
    received = [0] * layout.ranks
    for h in halos:
        received[h.dst] += h.stop - h.start
    if max(received, default=0) <= max(layout.rows_of(p) for p in range(layout.ranks)):
        halos = [h._replace(round=0) for h in halos]  # the usual case: one round
    return tuple(sorted(halos, key=lambda h: (h.round, h.src, h.dst, h.start)))


def _union(intervals: List[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """Overlapping or touching [start, stop) intervals (two chunks of one rank reading one
    chunk) joined; each keeps the smallest distance."""
    out: List[List[int]] = []
    for start, stop, distance in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
            out[-1][2] = min(out[-1][2], distance)
        else:
            out.append([start, stop, distance])
    return [tuple(x) for x in out]


class HaloExchange(KeyRounds):
    """This rank's halos over `group` (window.Halos), round by round, in KeyRounds' wire
    format: a halo's k and v are its rows, (rows, hk, d)."""

    def __init__(self, schedule: Tuple[Halo, ...], rank: int, own_sources: int, k: Tensor,
                 v: Tensor, key_mask: Optional[Tensor], group: Any, kv_grad: bool = True) -> None:
        hk, d = k.shape[2], k.shape[3]
        count = max((h.round for h in schedule), default=-1) + 1
        # each round's halos, in schedule order: (index among this rank's, halo)
        self.recvs = [[(i, h) for i, h in enumerate(h for h in schedule if h.dst == rank)
                       if h.round == r] for r in range(count)]
        self.sends = [[(i, h) for i, h in enumerate(h for h in schedule if h.src == rank)
                       if h.round == r] for r in range(count)]
        self.first = own_sources  # plan.sources: own rows, then the received halos in order
        super().__init__(
            k, v, key_mask, group,
            sent=[[(h.dst, (h.stop - h.start, hk, d)) for _, h in r] for r in self.sends],
            received=[[(h.src, (h.stop - h.start, hk, d)) for _, h in r] for r in self.recvs],
            kv_grad=kv_grad)

    def parcels(self, index: int) -> List[List[Tensor]]:
        out = []
        for _, h in self.sends[index]:
            rows = slice(h.local, h.local + h.stop - h.start)
            out.append(self.wire(self.k[:, rows], self.v[:, rows],
                                 None if self.key_mask is None else self.key_mask[:, rows]))
        return out

    def rounds(self) -> Iterator[Tuple[int, List[Tuple[int, Tensor, Tensor, Optional[Tensor]]]]]:
        for index, received in self.arrivals():
            yield index, [(self.first + i, buf[0], buf[1], mask)
                          for (i, _), (buf, mask) in zip(self.recvs[index], received)]
            del received

    def send_home(self, round_index: int, grads: List[Tensor]) -> List[Tuple[int, Tensor]]:
        """The round's halos' dK/dV go home; ours come back from their readers."""
        return [(i, home) for (i, _), home in zip(self.sends[round_index],
                                                   self.homes(round_index, grads))]


def halo_attention(q: Tensor, k: Tensor, v: Tensor, window: Tuple[int, int],
                   opts: KernelOptions, group: Any, layout: Layout, *,
                   documents: Documents = None, key_mask: Optional[Tensor] = None,
                   kv_grad: bool = True) -> Tuple[Tensor, Tensor]:
    """Sliding-window attention over the sequence spread across `group` (differentiable).

    Each rank passes its own rows in `layout`: q (b, n_p, h, d), k/v (b, n_p, hk, d),
    key_mask (b, n_p) or None; `window` as the public ``window_size``. Returns this
    rank's rows of out (b, n_p, h, d) and lse (b, n_p, h). The call must already be
    agreed on every rank (functional.ring_attention), and every rank must run the
    backward. `kv_grad`: whether some rank differentiates k or v (agreed: the backward
    sends no halo's dK/dV home otherwise).
    """
    rank = comm.group_rank(group)
    left, right = reaches(window, layout.total)
    schedule = halo_schedule(layout, left, right, documents)
    chunks = tuple(layout.of_rank(rank))
    received = tuple((h.start, h.stop, h.round) for h in schedule if h.dst == rank)
    sent = tuple((h.local, h.local + h.stop - h.start) for h in schedule if h.src == rank)
    rounds = max((h.round for h in schedule), default=-1) + 1
    plan = functools.partial(window_plan, chunks, received, sent, rounds, left, right,
                             layout.total, documents, q.device.type)

    def halos(k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> HaloExchange:
        return HaloExchange(schedule, rank, len(chunks), k, v, key_mask, group, kv_grad)

    return WindowAttentionFunction.apply(q, k, v, plan, opts, key_mask, halos)
