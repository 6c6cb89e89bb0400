"""What one rank computes: documents and segments, row blocks, launches, transfers.

Notation: N global rows, n this rank's rows, h query heads (``Heads``), a
pattern (w, r); "global" rows number the whole sequence, "local" rows this
rank's tensors; a *part* is the rows of a segment that one chunk holds.

Note [plan]
~~~~~~~~~~~
The sequence is cut into chunks held by ranks (``Layout``: one chunk for a
single device; one per rank, contiguous; or two per rank, zigzag). Documents
(``cu_seqlens``) cut it into independent sequences, and each pattern cuts
every document into segments of W = min(w, document length) rows (the last
one shorter). A rank computes the query rows it holds, in *row blocks* of a
bounded size, so that its fp32 accumulators stay a small fraction of its
rows whatever n is:

    rank's rows:   |--- block 0 ---|--- block 1 ---|--- block 2 ---|
    segments:      [ A ][ B ][ C ][ D ][ E ][ F ][ G ][ H ][ I ][ J ]   (one pattern)
                    inside        straddles       inside ...

- Segments inside one block (A, B, ...) are batched by length into launches
  of one head group each: queries and keys are the same rows (square,
  causal when the op is).
- A segment that crosses a block or chunk border (D, H, or one spanning
  ranks) is cut into parts. Each part of it held by this rank is a query
  part: against itself (square, causal when the op is), against the
  segment's other parts on this rank (local *cross launches*: full blocks,
  no mask; with causal only parts before it), and against its parts on
  other ranks (*transfers*: the selected key/value rows, fetched).

A *sparse* part, whose heads read fewer than policy.MIN_ROWS_PER_BLOCK_PART rows in
a block's share but at most a launch's rows in all (LongNet's long patterns,
w / r = 2048, over blocks of a large rank), is not cut by blocks: one launch
per head group covers it, and its outputs are split over the blocks they
land in (``Split``). Cutting it would make launches of a few rows each, one
per pair of blocks.

Blocks run in an order that puts the blocks touched by transfers last, so
the exchange (posted first) overlaps the other blocks' work. A launch that
writes rows of two blocks (a cross launch: dq of its query block, dK/dV of
its key block) runs with the earlier of the two in that order; its output
for the other block goes to that block's accumulators, which then start
early. With blocks aligned to the largest segment that fits, only segments
that really cross a border make cross launches.

Transfers go in rounds (one exchange each). In a segment with parts on L
ranks the transfer from part i to part j is step (j - i) mod L.
- gather: every transfer of the gather-mode patterns goes in round 0. A
  pattern is gather-mode when no rank sends or receives more (row, kv head)
  pairs than the largest rank holds (kv heads x max n): the LongNet regime.
- rotate: otherwise (dense-like patterns over many ranks): one round per
  step, so a rank holds one received part per spanning segment at a time.

Wire format of a transfer: for k then v, the selected rows of each (offset,
kv head) pair the query part reads, pair after pair (pair-major), in the
order of ``cross_head_groups(query part, key part)``: (2, b, columns, d).
Both sides derive it from the agreed layout, so nothing but the selected
rows travels, and the receiver cuts kernel-ready blocks (per row block of
its query part) out of the buffer, by pair.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import policy
from .layout import Chunk, Documents, Layout, segments_between
from .patterns import HeadGroup, Heads, Patterns, Segments, cross_head_groups
from .patterns import selected_pairs, split_heads

# --------------------------------------------------------------------------
# The plan's parts


class Split(NamedTuple):
    """The entries of a one-segment launch's (b, rows, heads, ...) output in one block.

    index (e,): positions in the output's flattened (rows * heads) entries;
    rows (e,): their rows relative to the block; heads (e,): their heads.
    """

    block: int
    index: Tensor
    rows: Tensor
    heads: Tensor


class Launch(NamedTuple):
    """One kernel call on this rank's rows: head group `heads` over query segments against key
    segments.

    `queries` and `keys` hold the same number of segments (local rows);
    ``causal`` applies the square causal mask (queries and keys the same
    rows). q_block/k_block: the row blocks its dq and dK/dV rows lie in; a
    launch over a sparse segment part that crosses blocks lists instead, in
    q_split/k_split, which of its output entries go to which block.
    `id` numbers the launches of one call on one rank (dropout seeds).
    """

    id: int
    queries: Segments
    keys: Segments
    heads: HeadGroup
    causal: bool
    q_block: int
    k_block: int
    q_split: Tuple[Split, ...] = ()
    k_split: Tuple[Split, ...] = ()

    @property
    def q_blocks(self) -> Tuple[int, ...]:
        return tuple(x.block for x in self.q_split) or (self.q_block,)

    @property
    def k_blocks(self) -> Tuple[int, ...]:
        return tuple(x.block for x in self.k_split) or (self.k_block,)


class RemoteLaunch(NamedTuple):
    """A kernel call of this rank's query rows against the keys of a received transfer.

    `columns` (a slice, or an index tensor (hkv * kv_rows,)) cuts the head
    group's key block out of the transfer's (2, b, columns, d) buffer, pair-major.
    """

    id: int
    queries: Segments
    heads: HeadGroup
    columns: Union[slice, Tensor]
    q_block: int
    q_split: Tuple[Split, ...] = ()

    @property
    def q_blocks(self) -> Tuple[int, ...]:
        return tuple(x.block for x in self.q_split) or (self.q_block,)


class Transfer(NamedTuple):
    """The selected key/value rows of part `keys` that the queries of part `queries` read.

    groups: ``cross_head_groups(query part, key part)``, whose kv columns, pair
    after pair, are the wire format; columns: their total. launches: the
    receiver's kernel calls on the buffer (empty on the sending rank).
    homes: on the sending rank, where the dK/dV that come back go: per
    block, (block index, local rows (e,), kv heads (e,), buffer columns (e,)).
    """

    keys: Chunk
    queries: Chunk
    pattern: int  # which pattern's segment
    segment: int  # the segment's global start (its parts' rows count from there)
    groups: Tuple[HeadGroup, ...]
    columns: int
    launches: Tuple[RemoteLaunch, ...]
    homes: Tuple[Tuple[int, Tensor, Tensor, Tensor], ...]


class Round(NamedTuple):
    """One exchange: this rank's key parts out, other ranks' key parts in.

    packed: per send, the index of the first send with the same wire content
    (the same key rows and columns, e.g. one part that every other rank
    reads whole): one packed buffer goes to all of them.
    """

    sends: Tuple[Transfer, ...]
    recvs: Tuple[Transfer, ...]
    packed: Tuple[int, ...]

    @property
    def distinct_sends(self) -> Tuple[Transfer, ...]:
        """The sends that are packed (the others reuse one of their buffers)."""
        return tuple(t for i, t in enumerate(self.sends) if self.packed[i] == i)


def _same_wire(a: Transfer, b: Transfer) -> bool:
    """Whether two sends carry the same columns of the same key rows.

    The wire is the groups' (offset, kv head) pairs in order, each pair's rows
    of the key part; which rows a pair selects follows from the part, the
    segment's start and the pattern's rate, not from the reading queries.
    """
    def wire(t: Transfer) -> tuple:
        return (t.keys.start, t.keys.stop, t.pattern, t.segment,
                tuple(pair for g in t.groups for pair in g.pairs))

    return wire(a) == wire(b)


def _packed(sends: Sequence[Transfer]) -> Tuple[int, ...]:
    """Round.packed of `sends`."""
    firsts: List[int] = []
    packed = []
    for i, t in enumerate(sends):
        first = next((j for j in firsts if _same_wire(sends[j], t)), None)
        if first is None:
            firsts.append(i)
            first = i
        packed.append(first)
    return tuple(packed)


class Block(NamedTuple):
    """Local rows [lo, hi), computed with one set of fp32 accumulators.

    forward: the local launches whose queries lie here; backward: the local
    launches run when this block's turn comes (see Note [plan]); remote:
    True when transfers write rows here (it runs after the exchange).
    entry_writes: at most this many launches write any one (row, head) entry
    of the block's out, dq, dK or dV; 0 when unbounded (a part of a cut
    segment is written by a launch per key part). A block that only whole
    segments write gets at most one write per pattern and entry.
    """

    index: int
    lo: int
    hi: int
    forward: Tuple[Launch, ...]
    backward: Tuple[Launch, ...]
    remote: bool
    entry_writes: int


class Plan(NamedTuple):
    """Everything one rank computes and exchanges for all patterns.

    blocks: in the order they run; rounds: the exchanges; modes: per pattern
    "local" (no transfer), "gather" or "rotate"; launches: how many kernel
    calls (local and remote) the forward makes.
    """

    rows: int
    blocks: Tuple[Block, ...]
    rounds: Tuple[Round, ...]
    modes: Tuple[str, ...]
    launches: int


# --------------------------------------------------------------------------
# Building a plan


def _blocks_of(chunks: List[Chunk], rows: int) -> List[Tuple[int, int, int]]:
    """(global lo, global hi, local lo) of this rank's blocks, chunk by chunk, on the global grid."""
    out = []
    for c in chunks:
        lo = c.start
        while lo < c.stop:
            hi = min(c.stop, (lo // rows + 1) * rows)
            out.append((lo, hi, c.local + lo - c.start))
            lo = hi
    return out


def _segment_at(row: int, w: int, documents: Documents, total: int) -> List[Tuple[int, int]]:
    """[(start, length)] of the pattern-w segment holding global `row` (empty in an empty
    sequence); one document is plain arithmetic, no tensors (a schedule asks per border)."""
    if documents is not None:
        starts, lengths = segments_between(row, row + 1, w, documents, total)
        return list(zip(starts.tolist(), lengths.tolist()))
    seg = min(w, total)  # W = min(w, document length)
    a = row // seg * seg
    return [(a, min(seg, total - a))]


@functools.lru_cache(maxsize=256)
def _schedule(layout: Layout, w: int, r: int, causal: bool, heads: Heads, documents: Documents
              ) -> Tuple[str, Tuple[Tuple[int, int, Chunk, Chunk, int], ...]]:
    """Every transfer of one pattern on every rank:
    (mode, ((round, segment start, keys, queries, (row, kv head) pairs), ...)).

    Pure arithmetic on the layout (no tensors), shared by all ranks' plans.
    """
    starts = [c.start for c in layout.chunks]
    moves: List[Tuple[int, int, Chunk, Chunk, int]] = []
    sent: Counter = Counter()
    received: Counter = Counter()
    seen = set()
    for border in starts[1:]:
        for a, length in _segment_at(border - 1, w, documents, layout.total):
            if a + length <= border or a in seen:
                continue  # the border is this segment's end: nothing spans it
            seen.add(a)
            parts = layout.split(a, a + length)
            for i, src in enumerate(parts):
                for j, dst in enumerate(parts):
                    if src.rank == dst.rank or (causal and i > j):
                        continue
                    pairs = selected_pairs(dst.start - a, dst.stop - a, src.start - a,
                                           src.stop - a, r, heads)
                    if pairs:
                        moves.append(((j - i) % len(parts), a, src, dst, pairs))
                        sent[src.rank] += pairs
                        received[dst.rank] += pairs
    if not moves:
        return "local", ()
    budget = max(heads.kv_of, default=0) + 1
    budget *= max(layout.rows_of(p) for p in range(layout.ranks))
    if max(list(sent.values()) + list(received.values())) <= budget:
        return "gather", tuple((0,) + move[1:] for move in moves)
    return "rotate", tuple(moves)


class RankTransfers(NamedTuple):
    """What one rank's forward exchange moves, all patterns: the (key row, kv head) pairs it
    sends and receives (k and v each), and in how many transfers (one message each)."""

    sent: int
    received: int
    sends: int
    receives: int


def transfer_counts(layout: Layout, patterns: Patterns, causal: bool, heads: Heads,
                    documents: Documents) -> List[RankTransfers]:
    """Per rank, what its forward exchange moves (``RankTransfers``).

    Arithmetic on the layout only: what a strategy choice or an estimate needs
    to know of the exchange's traffic without building any rank's plan.
    """
    sent, received, sends, receives = ([0] * layout.ranks for _ in range(4))
    for w, r in zip(*patterns):
        for _, _, src, dst, pairs in _schedule(layout, w, r, causal, heads, documents)[1]:
            sent[src.rank] += pairs
            sends[src.rank] += 1
            received[dst.rank] += pairs
            receives[dst.rank] += 1
    return [RankTransfers(*x) for x in zip(sent, received, sends, receives)]


def _columns(groups: Tuple[HeadGroup, ...]) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(offset, kv head) -> (first column, rows) in a transfer's pair-major wire format."""
    out, col = {}, 0
    for g in groups:
        kv_rows = g.kv_index.shape[0]
        for pair in g.pairs:
            out[pair] = (col, kv_rows)
            col += kv_rows
    return out


def _cut(directory: Dict[Tuple[int, int], Tuple[int, int]], group: HeadGroup,
         device: str) -> Union[slice, Tensor]:
    """The buffer columns of `group`'s kv block, pair after pair: a slice when contiguous."""
    spans = [directory[p] for p in group.pairs]
    kv_rows = group.kv_index.shape[0]
    if all(spans[i][0] + kv_rows == spans[i + 1][0] for i in range(len(spans) - 1)):
        return slice(spans[0][0], spans[0][0] + kv_rows * len(spans))
    return torch.cat([torch.arange(c, c + kv_rows, device=device) for c, _ in spans])


def make_plan(layout: Layout, patterns: Patterns, causal: bool, heads: Heads, rank: int,
              device: str = "cpu", documents: Documents = None, *,
              device_type: Optional[str] = None) -> Plan:
    """The plan of `rank` (see Note [plan]); equal arguments on every rank of a call.

    Index tensors live on `device`; block and launch sizes are those of
    `device_type` (default: `device`'s type). The op never passes it: it is
    how ``estimate --device cuda`` runs a CUDA rank's plan on meta tensors
    without a GPU (a plan's sizes follow its device, and meta is none). Plans
    are cached: a call with the same shapes reuses its plan.
    """
    kind = device_type or torch.device(device).type
    rows = policy.block_rows(layout.rows_of(rank), patterns[0], kind)
    return _make_plan(layout, patterns, causal, heads, rank, device, documents, rows,
                      policy.rows_per_launch(kind, rows), policy.min_rows_per_block_part(kind),
                      policy.strided_views(kind))


@functools.lru_cache(maxsize=64)
def _make_plan(layout: Layout, patterns: Patterns, causal: bool, heads: Heads, rank: int,
               device: str, documents: Documents, rows: int, launch_rows: int, min_part: int,
               strided: bool) -> Plan:
    build = _PlanBuilder(layout, causal, heads, rank, device, documents, rows, launch_rows,
                         min_part, strided)
    modes = []
    for pattern, (w, r) in enumerate(zip(*patterns)):
        for lo, hi, local_lo in build.grid:
            build.block_launches(pattern, w, r, lo, hi, local_lo)
        mode, moves = _schedule(layout, w, r, causal, heads, documents)
        modes.append(mode)
        for step, a, src, dst, _ in moves:
            if rank in (src.rank, dst.rank):
                build.transfer(pattern, step, a, src, dst, r)
    # whole segments of each pattern cover an entry once: one write per pattern
    writes = {i: 0 if i in build.cut or i in build.remote_blocks else len(modes)
              for i in range(len(build.grid))}
    return _assemble(build.grid, build.launches, build.rounds_by_step, modes,
                     build.remote_blocks, writes, layout.rows_of(rank))


class _PlanBuilder:
    """One rank's plan as it is built: its row blocks, and the launches and transfers found so
    far, pattern by pattern (``_make_plan``; Note [plan]).

    grid: this rank's blocks, (global lo, global hi, local lo) by index; launches:
    the local launches (ids are given in ``_assemble``); rounds_by_step: per
    exchange step, (sends, receives); cut: the blocks that parts of cut
    segments write; remote_blocks: those that transfers write or read.
    """

    def __init__(self, layout: Layout, causal: bool, heads: Heads, rank: int, device: str,
                 documents: Documents, rows: int, launch_rows: int, min_part: int,
                 strided: bool) -> None:
        self.layout, self.causal, self.heads, self.rank = layout, causal, heads, rank
        self.device, self.documents, self.strided = device, documents, strided
        self.rows, self.launch_rows, self.min_part = rows, launch_rows, min_part
        self.grid = _blocks_of(layout.of_rank(rank), rows)
        # blocks by global start (a rank's chunks need not be in global order: zigzag)
        self._by_start = sorted(range(len(self.grid)), key=lambda i: self.grid[i][0])
        self._block_starts = [self.grid[i][0] for i in self._by_start]
        self._local_spans = [(local_lo, local_lo + hi - lo) for lo, hi, local_lo in self.grid]
        # (pattern span, rate, entries, run) -> the launch groups (see `groups`)
        self._groups: Dict[Tuple[Tuple[int, ...], int, int, bool], Tuple[HeadGroup, ...]] = {}
        self._sparse_done: set = set()
        self.launches: List[Launch] = []
        self.rounds_by_step: Dict[int, Tuple[List[Transfer], List[Transfer]]] = {}
        self.cut: set = set()
        self.remote_blocks: set = set()

    # ---- where rows are

    def block_of(self, pos: int) -> int:
        """The block (index into grid) holding global row `pos` of this rank."""
        return self._by_start[bisect.bisect_right(self._block_starts, pos) - 1]

    def local(self, pos: int) -> int:
        """This rank's local row of global row `pos`."""
        lo, _, local_lo = self.grid[self.block_of(pos)]
        return local_lo + pos - lo

    def splits(self, start: int, index: Tensor, head_ids: Tensor) -> Tuple[Split, ...]:
        return _splits(start, index, head_ids, self._local_spans, self.device)

    def groups(self, span: Tuple[int, ...], rate: int, count: int = 1,
               run: bool = True) -> Tuple[HeadGroup, ...]:
        """The launch groups of segment rows `span` ((lo, hi) against themselves, or (q_lo,
        q_hi, k_lo, k_hi)) over `count` segments: gathered groups cut by heads to a launch's
        share of entries (once per span: thousands of segments share a few); strided groups
        on a `run` of segments are views, and the identity group stays whole."""
        entries = max(1, self.launch_rows * self.heads.count // policy.GATHERED_SHARE // count)
        key = (span, rate, entries, run)
        if key not in self._groups:
            span4 = span if len(span) == 4 else span + span
            out: List[HeadGroup] = []
            for g in cross_head_groups(*span4, rate, self.heads, self.device, self.strided):
                whole = g.identity or (g.strided and run)
                out.extend((g,) if whole else split_heads(g, entries))
            self._groups[key] = tuple(out)
        return self._groups[key]

    # ---- local launches

    def block_launches(self, pattern: int, w: int, r: int, lo: int, hi: int,
                       local_lo: int) -> None:
        """The launches of pattern (w, r) whose queries lie in the block of global rows
        [lo, hi): its whole segments, and its part of each segment crossing its border."""
        starts, lengths = segments_between(lo, hi, w, self.documents, self.layout.total)
        inside = (starts >= lo) & (starts + lengths <= hi)
        b = self.block_of(lo)
        # whole segments inside the block: batches of one length, launch_rows at most
        for length in torch.unique(lengths[inside]).tolist():
            local_starts = starts[inside & (lengths == length)] - lo + local_lo
            for s in local_starts.split(max(1, self.launch_rows // length)):
                regular = s.numel() == 1 or bool((s[1:] - s[:-1] == length).all())
                segs = (Segments(int(s[0]), s.numel(), length) if regular
                        else Segments(0, s.numel(), length, s.to(self.device)))
                for g in self.groups((0, length), r, s.numel(), regular):
                    self.launches.append(Launch(-1, segs, segs, g, self.causal, b, b))
        for a, length in zip(starts[~inside].tolist(), lengths[~inside].tolist()):
            self.crossing_segment(pattern, a, length, r, lo, hi, b)

    def crossing_segment(self, pattern: int, a: int, length: int, r: int, lo: int, hi: int,
                         b: int) -> None:
        """The launches of block `b` (global rows [lo, hi)) for its part of the segment [a,
        a + length) that crosses its border: against this rank's other key parts of it."""
        # this block's chunk's part of the segment
        (part,) = [c for c in self.layout.split(a, a + length)
                   if c.rank == self.rank and max(c.start, lo) < min(c.stop, hi)]
        if _sparse(part, r, self.launch_rows, self.rows, self.min_part):
            # few rows per head: the chunk's whole part in one launch per group, its
            # outputs split over the blocks it crosses (once, not per block)
            if (pattern, a, part.start) not in self._sparse_done:
                self._sparse_done.add((pattern, a, part.start))
                self.sparse_launches(a, length, part, r)
            return
        qa, qb = max(a, lo), min(a + length, hi)
        q_segs = Segments(self.local(qa), 1, qb - qa)
        self.cut.add(b)
        for g in self.groups((qa - a, qb - a), r):
            self.launches.append(Launch(-1, q_segs, q_segs, g, self.causal, b, b))
        for key_part in self.layout.split(a, a + length):
            if key_part.rank != self.rank:
                continue  # another rank's keys: a transfer
            for ka, kb in _own_key_ranges(key_part, self.grid, qa, qb, self.causal):
                k_segs = Segments(self.local(ka), 1, kb - ka)
                k_block = self.block_of(ka)
                self.cut.add(k_block)
                for g in self.groups((qa - a, qb - a, ka - a, kb - a), r):
                    self.launches.append(Launch(-1, q_segs, k_segs, g, False, b, k_block))

    def sparse_launches(self, a: int, length: int, part: Chunk, r: int) -> None:
        """The launches of a sparse part's queries: against itself, and against the
        segment's other parts on this rank (zigzag chunks), each output split over its
        blocks."""
        qa, qb = part.start, part.stop
        q_segs = Segments(self.local(qa), 1, qb - qa)
        for other in self.layout.split(a, a + length):
            if other.rank != self.rank or (self.causal and other.start > qa):
                continue
            k_segs = Segments(self.local(other.start), 1, other.stop - other.start)
            own = other.start == qa
            span = (qa - a, qb - a, other.start - a, other.stop - a)
            for g, cpu in zip(cross_head_groups(*span, r, self.heads, self.device, self.strided),
                              cross_head_groups(*span, r, self.heads, "cpu", self.strided)):
                q_split = self.splits(q_segs.start, cpu.q_index, cpu.q_heads)
                k_split = self.splits(k_segs.start, cpu.kv_index, cpu.kv_heads)
                self.cut.update(x.block for x in q_split + k_split)
                self.launches.append(Launch(-1, q_segs, k_segs, g, self.causal and own,
                                            q_split[0].block, k_split[0].block, q_split,
                                            k_split))

    # ---- the exchange

    def transfer(self, pattern: int, step: int, a: int, src: Chunk, dst: Chunk, r: int) -> None:
        """This rank's side of one move of `_schedule`: a send of key part `src` (with where
        its dK/dV come home), or a receive with the launches on it."""
        groups = cross_head_groups(dst.start - a, dst.stop - a, src.start - a, src.stop - a,
                                   r, self.heads, self.device, self.strided)
        columns = sum(g.kv_index.numel() for g in groups)
        sends, recvs = self.rounds_by_step.setdefault(step, ([], []))
        if src.rank == self.rank:
            homes = _homes(src, a, r, groups, self.grid, self.device)
            self.remote_blocks.update(index for index, _, _, _ in homes)
            sends.append(Transfer(src, dst, pattern, a, groups, columns, (), homes))
            return
        launches = self.remote_launches(a, src, dst, r, groups)
        recvs.append(Transfer(src, dst, pattern, a, groups, columns, launches, ()))

    def remote_launches(self, a: int, src: Chunk, dst: Chunk, r: int,
                        groups: Tuple[HeadGroup, ...]) -> Tuple[RemoteLaunch, ...]:
        """The launches of this rank's query part `dst` on a received key part `src` (ids
        are given in ``_assemble``)."""
        directory = _columns(groups)
        if _sparse(dst, r, self.launch_rows, self.rows, self.min_part):
            # the whole query part at once, its outputs split over its blocks
            q_segs = Segments(self.local(dst.start), 1, dst.stop - dst.start)
            cpu_groups = cross_head_groups(dst.start - a, dst.stop - a, src.start - a,
                                           src.stop - a, r, self.heads, "cpu", self.strided)
            out = []
            for g, cpu in zip(groups, cpu_groups):
                split = self.splits(q_segs.start, cpu.q_index, cpu.q_heads)
                self.remote_blocks.update(x.block for x in split)
                out.append(RemoteLaunch(-1, q_segs, g, _cut(directory, g, self.device),
                                        split[0].block, split))
            if out:
                return tuple(out)
        out = []
        for lo, hi, _ in self.grid:
            qa, qb = max(lo, dst.start), min(hi, dst.stop)
            if qb <= qa:
                continue
            block = self.block_of(qa)
            self.remote_blocks.add(block)
            for g in cross_head_groups(qa - a, qb - a, src.start - a, src.stop - a, r,
                                       self.heads, self.device, self.strided):
                out.append(RemoteLaunch(-1, Segments(self.local(qa), 1, qb - qa), g,
                                        _cut(directory, g, self.device), block))
        return tuple(out)


def _sparse(part: Chunk, rate: int, launch_rows: int, block_rows: int, min_part: int) -> bool:
    """A segment part that crosses blocks, whose heads read fewer than `min_part` rows per
    block but at most a launch's rows in all: one launch (per head group) covers it,
    instead of one per pair of blocks (LongNet's long patterns, w / r = 2048)."""
    length = part.stop - part.start
    crosses = part.start // block_rows != (part.stop - 1) // block_rows
    return (crosses and block_rows // rate < min_part and -(-length // rate) <= launch_rows)


def _by_block(values: Tensor, los: Sequence[int]) -> Tuple[Tensor, Tensor, Dict[int, slice]]:
    """(perm, offsets, {block: slice}) for values (rows) in blocks starting at `los` (by
    index, in any order; every value lies in some block): `values[perm][slice]` are a
    block's values in their original order, `offsets` each value minus its block's start.

    One sort instead of a mask per block (a plan splits thousands of entries over up to
    MAX_BLOCKS blocks, hundreds of times); the caller moves the permuted tensors to the
    device once and takes each block's entries as a slice (a view: no op per block, which
    on meta tensors would run Python decompositions and on a GPU launch kernels)."""
    order = sorted(range(len(los)), key=los.__getitem__)
    # the block of each value: the last start at or before it, in sorted order
    sorted_los = torch.tensor([los[i] for i in order])
    which = torch.bucketize(values, sorted_los, right=True) - 1
    perm = torch.argsort(which, stable=True)
    offsets = values - sorted_los[which]
    spans, start = {}, 0
    for j, count in enumerate(torch.bincount(which, minlength=len(order)).tolist()):
        if count:
            spans[order[j]] = slice(start, start + count)
        start += count
    return perm, offsets, spans


def _splits(start: int, index: Tensor, head_ids: Tensor, blocks: List[Tuple[int, int]],
            device: str) -> Tuple[Split, ...]:
    """Split a one-segment launch's output entries (rows start + index (R, H), heads
    head_ids (H,); CPU tensors) over the blocks ((local lo, hi) by index) they land in."""
    # (R, H) -> (R * H,): entry e is row e // H of head e % H
    rows = (start + index).reshape(-1)
    perm, offsets, spans = _by_block(rows, [lo for lo, _ in blocks])
    entries, rows, heads = (x.to(device) for x in (perm, offsets[perm],
                                                   head_ids[perm % index.shape[1]]))
    return tuple(Split(block, entries[sl], rows[sl], heads[sl])
                 for block, sl in sorted(spans.items(), key=lambda kv: kv[0]))


def _homes(src: Chunk, a: int, rate: int, groups: Tuple[HeadGroup, ...], grid,
           device: str) -> Tuple[Tuple[int, Tensor, Tensor, Tensor], ...]:
    """Where the wire-format columns of a sent key part land, block by block (arithmetic)."""
    rows_of, heads_of = [], []
    for g in groups:
        kv_rows = g.kv_index.shape[0]
        offsets, kv_heads = torch.tensor(g.pairs).reshape(-1, 2).unbind(1)
        # (hkv, kv_rows): a pair's keys start at the first row of its offset, every rate;
        # its wire columns follow the pairs in order, kv_rows each
        first = src.start + (offsets - (src.start - a)) % rate
        rows_of.append((first[:, None] + rate * torch.arange(kv_rows)).reshape(-1))
        heads_of.append(kv_heads.repeat_interleave(kv_rows))
    perm, offsets, spans = _by_block(torch.cat(rows_of), [lo for lo, _, _ in grid])
    # rows relative to their block (they index its accumulators); the wire columns are
    # the entries' positions, so a block's columns are its slice of perm
    rows, heads, cols = (x.to(device) for x in (offsets[perm], torch.cat(heads_of)[perm], perm))
    out = []
    for index, (lo, hi, _) in enumerate(grid):
        if hi <= src.start or lo >= src.stop:
            continue
        sl = spans.get(index, slice(0, 0))
        out.append((index, rows[sl], heads[sl], cols[sl]))
    return tuple(out)


def work(plan: Plan) -> int:
    """The attention work of a plan: score entries its forward computes (query row x key row
    x head; half the square for causal launches), local and remote launches alike."""
    total = 0
    for block in plan.blocks:
        for launch in block.forward:
            rows, keys = launch.heads.rows, launch.heads.kv_index.shape[0]
            heads = launch.heads.q_heads.numel()
            square = rows * (rows + 1) // 2 if launch.causal else rows * keys
            total += launch.queries.count * square * heads
    for rnd in plan.rounds:
        for t in rnd.recvs:
            for launch in t.launches:
                heads = launch.heads
                total += launch.queries.count * heads.rows * heads.kv_index.shape[0] * \
                    heads.q_heads.numel()
    return total


def _own_key_ranges(part: Chunk, grid, qa: int, qb: int, causal: bool) -> List[Tuple[int, int]]:
    """This rank's key ranges of a segment part, cut by block, other than the query part
    [qa, qb) itself (and, when causal, only those before it)."""
    out = []
    for lo, hi, _ in grid:
        ka, kb = max(lo, part.start), min(hi, part.stop)
        if kb <= ka or (ka == qa and kb == qb):
            continue
        if causal and ka >= qb:
            continue
        out.append((ka, kb))
    return out


def _assemble(grid, launches, rounds_by_step, modes, remote_blocks, writes, n) -> Plan:
    """Number the launches, order the blocks (remote ones last), assign backward launches."""
    order = [i for i in range(len(grid)) if i not in remote_blocks]
    order += [i for i in range(len(grid)) if i in remote_blocks]
    position = {b: k for k, b in enumerate(order)}
    numbered = [launch._replace(id=i) for i, launch in enumerate(launches)]
    forward: Dict[int, List[Launch]] = {}
    backward: Dict[int, List[Launch]] = {}
    for launch in numbered:
        forward.setdefault(min(launch.q_blocks, key=position.__getitem__), []).append(launch)
        first = min(launch.q_blocks + launch.k_blocks, key=position.__getitem__)
        backward.setdefault(first, []).append(launch)
    # dense launches first: those that tile their block store into the accumulators
    # instead of merging into zeros (launches.stored_launches)
    for todo in forward.values():
        todo.sort(key=lambda launch: not launch.heads.identity)
    for here, todo in backward.items():
        # within a block: launches of its own rows, then those whose keys are here (they
        # complete its dK/dV), then those whose queries are here: accumulators end early
        todo.sort(key=lambda launch: (launch.q_blocks + launch.k_blocks != (here, here),
                                      here not in launch.k_blocks, not launch.heads.identity))
    next_id = len(numbered)
    rounds = []
    for step in sorted(rounds_by_step):
        sends, recvs = rounds_by_step[step]
        numbered_recvs = []
        for t in recvs:
            remote = tuple(launch._replace(id=next_id + i)
                           for i, launch in enumerate(t.launches))
            next_id += len(remote)
            numbered_recvs.append(t._replace(launches=remote))
        rounds.append(Round(tuple(sends), tuple(numbered_recvs), _packed(sends)))
    blocks = tuple(
        Block(i, grid[i][2], grid[i][2] + grid[i][1] - grid[i][0], tuple(forward.get(i, ())),
              tuple(backward.get(i, ())), i in remote_blocks, writes[i])
        for i in order
    )
    return Plan(n, blocks, tuple(rounds), tuple(modes), next_id)
