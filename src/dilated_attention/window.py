"""Sliding-window attention over the rows one process holds: tiles, forward, backward.

Query t attends key u iff ``t - left <= u <= t + right`` and both lie in one
document (docs/spec.md, "Sliding windows"). Here ``left`` and ``right`` are
*reaches*: an unbounded side (-1 in the public ``window_size``) is the
sequence length, so every formula below is plain integer arithmetic.

Notation: b batch, n this process's rows, h query heads, hk key/value heads,
d head dim; "global" rows number the whole sequence, "local" rows this
process's tensors; B rows per tile row, S rows per stripe (accumulators).

Note [window tiles]
~~~~~~~~~~~~~~~~~~~
In the (query, key) plane the visible pairs form a band between two
diagonals. Cut the queries into *tile rows* of B <= left + right rows;
tile row [q0, q1) sees three kinds of key ranges, so no score outside the band is
computed and no mask is built:

        keys:  q0-left     q1-left               q0+right    q1+right
                  | anti      | full                | causal    |
    query q0      |###########|#####################|#..........|
                  |.##########|#####################|##.........|
    query q1-1    |..........#|#####################|###########|

- anti: keys [q0 - left, q1 - left); query i of the tile row sees key j iff
  j >= i. The kernels mask only the other triangle (causal), so this tile
  runs on its rows reversed, where it is the causal square;
- full: keys [q1 - left, q0 + right): every query sees every key;
- causal: keys [q0 + right, q1 + right): j <= i, the kernels' causal square.

(B <= left + right keeps the two triangles apart; a window of one row, left
= right = 0, has tile rows of one row and only the causal square.) The keys at
hand are an interval: a document's rows, this rank's rows or a received
halo (Note [halo exchange] in distributed/halo.py). Clipping a triangle to
an interval leaves a smaller triangle and at most one full rectangle
(``band_tiles``), so every visible pair is computed exactly once, whatever
cuts the keys. Interior tile rows have equal tiles: consecutive ones form a
*run*, one kernel call over a (b * count, rows, ...) batch of strided views
(tiny windows: thousands of tile rows, a few calls per stripe).

Work per query row: left + right - B keys in the middle plus two B-row
triangles, exactly the band's pairs; the kernels pay for the triangles a
little more than half a square (the CPU flash kernel skips only whole
512 keys at a time above its diagonal), hence tile rows far shorter than
the window (policy.WINDOW_TILE_ROWS).

Outputs merge into row *stripes* of about S rows (the accumulators of
launches.Blocks: the output itself for fp32, fp32 buffers otherwise), the
backward adds dq into its stripe and dK/dV into the stripes of their key
rows (pending until that stripe's turn, as for dilated launches).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

import torch
from torch import Tensor

from . import policy
from .kernels import (KernelOptions, attention_backward, attention_forward, lse_dtype,
                      save_for_backward, saved_for_backward)
from .launches import (BACKWARD_KINDS, FORWARD_KINDS, Blocks, Kind, gradient_accumulators,
                       output_accumulators, row_slices)
from .merge import merge_
from .layout import Chunk, Documents
from .validation import check_first_order

# A tile's mask: none, key j <= query i (the kernels' causal square), key j >= query i
# (the causal square of the rows reversed)
FULL, CAUSAL, ANTI = 0, 1, 2


def band_tiles(q0: int, q1: int, k0: int, k1: int, left: int,
               right: int) -> List[Tuple[int, int, int, int, int]]:
    """The pairs of queries [q0, q1) and keys [k0, k1) (global rows) inside the band
    ``t - left <= u <= t + right``, as tiles (query lo, hi, key lo, hi, kind): each pair in
    exactly one, a FULL tile any rectangle, CAUSAL and ANTI tiles squares (Note [window
    tiles]). Needs q1 - q0 <= max(1, left + right)."""
    rows = q1 - q0
    if rows > max(1, left + right):
        raise ValueError(f"a tile row of {rows} query rows is longer than the window "
                         f"{left} + {right}")
    tiles = []
    squares = [(q0 + right, CAUSAL)]
    if left + right > 0:
        squares.insert(0, (q0 - left, ANTI))
        lo, hi = max(q1 - left, k0), min(q0 + right, k1)
        if lo < hi:
            tiles.append((q0, q1, lo, hi, FULL))
    for start, kind in squares:
        # the square's keys [start, start + rows) clipped to [k0, k1): its rows [x, y)
        x, y = max(0, k0 - start), min(rows, k1 - start)
        if x >= y:
            continue
        tiles.append((q0 + x, q0 + y, start + x, start + y, FULL if y - x == 1 else kind))
        if kind == CAUSAL and y < rows:  # queries after the clipped triangle see all of it
            tiles.append((q0 + y, q1, start + x, start + y, FULL))
        if kind == ANTI and x > 0:  # queries before it likewise
            tiles.append((q0, q0 + x, start + x, start + y, FULL))
    return tiles


# --------------------------------------------------------------------------
# The plan


class Source(NamedTuple):
    """Key rows [start, stop) (global): this rank's own, from local row `local`, or a halo
    received in round `round` (local None; round -1 for own rows)."""

    start: int
    stop: int
    local: Optional[int]
    round: int


class Tile(NamedTuple):
    """`count` launches in one kernel call: launch i is query rows [q + i step, + rows)
    (local) against key rows [k + i step, + keys) of source `source`, masked by `kind`."""

    q: int
    rows: int
    source: int
    k: int
    keys: int
    kind: int
    count: int = 1
    step: int = 0

    @property
    def q_span(self) -> Tuple[int, int]:
        return self.q, self.q + (self.count - 1) * self.step + self.rows

    @property
    def k_span(self) -> Tuple[int, int]:
        return self.k, self.k + (self.count - 1) * self.step + self.keys


class Stripe(NamedTuple):
    """Local query rows [lo, hi) with one set of accumulators (a block of launches.Blocks):
    its tiles on this rank's own keys; entry_writes as plan.Block's."""

    index: int
    lo: int
    hi: int
    tiles: Tuple[Tile, ...]
    entry_writes: int


class WindowPlan(NamedTuple):
    """What one rank computes. blocks: its stripes in running order; sources: own rows
    first, then the received halos; rounds: per round of the exchange, the (stripe index,
    tile) pairs on its halos; homes: local rows [lo, hi) of each halo this rank sends (in
    the order the exchange sends them); launches: kernel calls of the forward."""

    blocks: Tuple[Stripe, ...]
    sources: Tuple[Source, ...]
    rounds: Tuple[Tuple[Tuple[int, Tile], ...], ...]
    homes: Tuple[Tuple[int, int], ...]
    launches: int


def _document_pieces(chunk: Chunk, documents: Documents,
                     total: int) -> List[Tuple[int, int, int, int]]:
    """(global lo, hi, document start, stop) of the chunk cut at document boundaries."""
    if documents is None:
        return [(chunk.start, chunk.stop, 0, total)]
    cuts = [x for x in documents if chunk.start < x < chunk.stop]
    bounds = [chunk.start] + cuts + [chunk.stop]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        d = bisect.bisect_right(documents, lo) - 1
        out.append((lo, hi, documents[d], documents[d + 1]))
    return out


@functools.lru_cache(maxsize=64)
def window_plan(chunks: Tuple[Chunk, ...], received: Tuple[Tuple[int, int, int], ...],
                sent: Tuple[Tuple[int, int], ...], rounds: int, left: int, right: int,
                total: int, documents: Documents, device_type: str,
                backward: bool) -> WindowPlan:
    """The plan of a rank holding `chunks` (local order) that receives halos `received`
    ((global start, stop, round)) and sends the local rows `sent` ((lo, hi)) in an
    exchange of `rounds` rounds; reaches `left`, `right` (an unbounded side is `total`).
    One device: one chunk, no halos, no rounds. The forward and the `backward` may cut
    their tile rows differently (policy.WINDOW_TILE_ROWS): each reruns every visible pair
    once."""
    b_rows = policy.window_tile_rows(left, right, device_type, backward)
    s_rows = policy.window_stripe_rows(b_rows, device_type)
    launch_rows = max(b_rows, policy.rows_per_launch(device_type, s_rows))
    sources = tuple([Source(c.start, c.stop, c.local, -1) for c in chunks]
                    + [Source(a, z, None, r) for a, z, r in received])
    # the tile rows of each chunk's documents (global lo, hi, document start, stop, local
    # shift), grouped into stripes of at most s_rows consecutive local rows
    stripes: List[List[Tuple[int, int, int, int, int]]] = []
    spans: List[Tuple[int, int]] = []
    for c in chunks:
        shift = c.local - c.start
        for lo, hi, ds, de in _document_pieces(c, documents, total):
            for q0 in range(lo, hi, b_rows):
                q1 = min(q0 + b_rows, hi)
                if not spans or spans[-1][1] != q0 + shift or \
                        spans[-1][1] + q1 - q0 - spans[-1][0] > s_rows:
                    stripes.append([])
                    spans.append((q0 + shift, q0 + shift))
                stripes[-1].append((q0, q1, ds, de, shift))
                spans[-1] = (spans[-1][0], q1 + shift)
    starts = [lo for lo, _ in spans]

    def stripe_of(row: int) -> int:
        return bisect.bisect_right(starts, row) - 1

    own: List[List[Tile]] = []
    remote: Dict[int, List[Tuple[int, Tile]]] = {}
    for index, tile_rows in enumerate(stripes):
        tiles = _stripe_tiles(tile_rows, sources, left, right, b_rows, launch_rows, stripe_of)
        own.append([t for t in tiles if sources[t.source].round < 0])
        for t in tiles:
            if sources[t.source].round >= 0:
                remote.setdefault(sources[t.source].round, []).append((index, t))
    every = [t for ts in own for t in ts] + [t for ts in remote.values() for _, t in ts]
    writes = _entry_writes(spans, every, sources, sent, stripe_of)
    # stripes that halos write run last: the exchange overlaps the others
    late = {i for tiles in remote.values() for i, _ in tiles}
    order = sorted(range(len(spans)), key=lambda i: i in late)
    blocks = tuple(Stripe(i, spans[i][0], spans[i][1], _cover_first(own[i], spans[i]), writes[i])
                   for i in order)
    return WindowPlan(blocks, sources, tuple(tuple(remote.get(r, ())) for r in range(rounds)),
                      sent, len(every))


def _stripe_tiles(tile_rows, sources, left, right, b_rows, launch_rows,
                  stripe_of) -> List[Tile]:
    """The tiles of one stripe's tile rows against every source, consecutive equal ones as
    runs."""
    runs: List[Tile] = []
    open_runs: Dict[tuple, int] = {}  # a tile's signature relative to its row -> its run
    previous = None  # the previous tile row's (q0, shift)
    for q0, q1, ds, de, shift in tile_rows:
        contiguous = previous == (q0 - b_rows, shift) and q1 - q0 == b_rows
        still_open = {}
        for index, s in enumerate(sources):
            k0, k1 = max(s.start, ds, q0 - left), min(s.stop, de, q1 + right)
            if k0 >= k1:
                continue
            for a, z, ka, kz, kind in band_tiles(q0, q1, k0, k1, left, right):
                tile = Tile(a + shift, z - a, index, ka - s.start, kz - ka, kind)
                signature = (index, kind, a - q0, z - a, ka - q0, kz - ka)
                at = open_runs.get(signature) if contiguous else None
                if at is not None and _extends(runs[at], tile, b_rows, launch_rows, s,
                                               stripe_of):
                    runs[at] = runs[at]._replace(count=runs[at].count + 1, step=b_rows)
                    still_open[signature] = at
                else:
                    still_open[signature] = len(runs)
                    runs.append(tile)
        open_runs, previous = still_open, (q0, shift)
    return runs


def _extends(run: Tile, tile: Tile, step: int, launch_rows: int, source: Source,
             stripe_of) -> bool:
    """Whether `tile` can join `run` as its next launch: the rows of the run's launches do
    not overlap (dK/dV add through one strided view), the call stays within `launch_rows`
    query rows, and own keys stay in one stripe (their dK/dV accumulators)."""
    if tile.keys > step or (run.count + 1) * run.rows > launch_rows:
        return False
    if source.local is None:
        return True
    first = source.local + run.k
    last = source.local + tile.k + tile.keys - 1
    return stripe_of(first) == stripe_of(last)


def _cover_first(tiles: List[Tile], span: Tuple[int, int]) -> Tuple[Tile, ...]:
    """The tiles, one that writes every row of the stripe first (it stores, no merge)."""
    for i, t in enumerate(tiles):
        if _covers(t, span):
            return (t,) + tuple(tiles[:i]) + tuple(tiles[i + 1:])
    return tuple(tiles)


def _covers(tile: Tile, span: Tuple[int, int]) -> bool:
    return tile.q == span[0] and tile.count * tile.rows == span[1] - span[0] and \
        (tile.count == 1 or tile.step == tile.rows)


def _entry_writes(spans, tiles, sources, sent, stripe_of) -> List[int]:
    """Per stripe, at most how many writes one entry of its out, dq, dK or dV gets: tiles
    over its query rows, and over its key rows tiles on own keys and halos sent home."""
    queries: List[List[Tuple[int, int]]] = [[] for _ in spans]
    keys: List[List[Tuple[int, int]]] = [[] for _ in spans]

    def add(events, lo: int, hi: int) -> None:
        # a run writes each row once: its span counts as one interval
        while lo < hi:
            i = stripe_of(lo)
            end = min(hi, spans[i][1])
            events[i] += [(lo, 1), (end, -1)]
            lo = end

    for t in tiles:
        add(queries, *t.q_span)
        local = sources[t.source].local
        if local is not None:
            lo, hi = t.k_span
            add(keys, local + lo, local + hi)
    for lo, hi in sent:
        add(keys, lo, hi)
    return [max(_max_cover(q), _max_cover(k)) for q, k in zip(queries, keys)]


def _max_cover(events: List[Tuple[int, int]]) -> int:
    """The most intervals over one row, from their (row, +1 / -1) end points."""
    most = count = 0
    for _, change in sorted(events):
        count += change
        most = max(most, count)
    return most


# --------------------------------------------------------------------------
# Running a plan


class Halos(Protocol):
    """How a sequence-parallel rank moves its halos (distributed/halo.py).

    ``post()`` starts round 0 (before any launch, so that it overlaps them);
    ``rounds()`` yields, round by round, (round, [(source index, k, v, mask)])
    with k, v (b, rows, hk, d) and mask (b, rows) bool or None;
    ``send_home(round, grads)`` (backward) sends the (2, b, rows, hk, d) dK/dV
    of that round's received halos to their owners and returns ours, one
    (2, b, rows, hk, d) tensor per entry of ``plan.homes`` sent in that round,
    as [(index into plan.homes, grad)]; it is not called where ``kv_grad`` is False
    (no rank differentiates k or v: the same on every rank).
    """

    kv_grad: bool

    def post(self) -> None: ...

    def rounds(self) -> Iterator[Tuple[int, List[Tuple[int, Tensor, Tensor, Optional[Tensor]]]]]:
        ...

    def send_home(self, round_index: int,
                  grads: List[Tensor]) -> List[Tuple[int, Tensor]]: ...


def _rows(x: Tensor, start: int, count: int, length: int, step: int) -> Tensor:
    """x (b, n, ...) -> (b, count, length, ...): rows start + i step + j, a view."""
    if count == 1:
        return x[:, start:start + length].unsqueeze(1)
    size = (x.shape[0], count, length) + tuple(x.shape[2:])
    stride = (x.stride(0), step * x.stride(1)) + tuple(x.stride()[1:])
    return x.as_strided(size, stride, x.storage_offset() + start * x.stride(1))


def _launch_input(x: Tensor, start: int, tile: Tile, length: int) -> Tensor:
    """A tile's rows of x (b, n, ...) for the kernel: (b * count, length, ...), each launch's
    rows reversed for an ANTI tile (a copy; else a view where one can be)."""
    y = _rows(x, start, tile.count, length, tile.step)
    if tile.kind == ANTI:
        y = y.flip(2)
    return y.flatten(0, 1)


def _launch_output(y: Tensor, tile: Tile, batch: int) -> Tensor:
    """A kernel output (b * count, length, ...) -> (b, count, length, ...) in row order."""
    y = y.unflatten(0, (batch, tile.count))
    return y.flip(2) if tile.kind == ANTI else y


def _tile_opts(opts: KernelOptions, tile: Tile) -> KernelOptions:
    return dataclasses.replace(opts, causal=tile.kind != FULL)


def _kernel_mask(mask: Optional[Tensor], tile: Tile, kv_heads: int) -> Optional[Tensor]:
    """The tile's keys' padding mask (b * count, keys, hk), True = ignore; or None."""
    if mask is None:
        return None
    # (b, m) -> (b, m, hk): one flag per key row, broadcast over the kv heads
    return _launch_input(mask[:, :, None].expand(-1, -1, kv_heads), tile.k, tile, tile.keys)


class _Stripes:
    """Local rows -> stripes (plan.blocks by position), for writes that cross stripes."""

    def __init__(self, plan: WindowPlan) -> None:
        self.spans = sorted((s.lo, s.hi, s.index) for s in plan.blocks)
        self.starts = [lo for lo, _, _ in self.spans]

    def pieces(self, lo: int, hi: int) -> List[Tuple[int, int, int, int]]:
        """(stripe index, its first row, lo, hi) of local rows [lo, hi), stripe by stripe."""
        out = []
        while lo < hi:
            s_lo, s_hi, index = self.spans[bisect.bisect_right(self.starts, lo) - 1]
            end = min(hi, s_hi)
            out.append((index, s_lo, lo, end))
            lo = end
        return out


def _writers(plan: WindowPlan, stripes: _Stripes, backward: bool,
             homes: bool = True) -> Dict[Tuple[int, Kind], int]:
    """How many writes each (stripe, kind) gets (as launches.count_writers)."""
    counts: Dict[Tuple[int, Kind], int] = {}

    def add(index: int, kinds) -> None:
        for kind in kinds:
            counts[(index, kind)] = counts.get((index, kind), 0) + 1

    tiles = [(s.index, t) for s in plan.blocks for t in s.tiles]
    tiles += [pair for rnd in plan.rounds for pair in rnd]
    for index, t in tiles:
        add(index, (Kind.DQ if backward else Kind.OUT,))
        local = plan.sources[t.source].local
        if backward and local is not None:
            lo, hi = t.k_span
            for piece in stripes.pieces(local + lo, local + hi):
                add(piece[0], (Kind.DK, Kind.DV))
    if backward and homes:
        for lo, hi in plan.homes:
            for piece in stripes.pieces(lo, hi):
                add(piece[0], (Kind.DK, Kind.DV))
    return counts


def window_forward(q: Tensor, k: Tensor, v: Tensor, plan: WindowPlan, opts: KernelOptions, *,
                   key_mask: Optional[Tensor] = None,
                   halos: Optional[Halos] = None) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32 (fp64)."""
    out, lse, *accumulators = output_accumulators(q)
    stripes = _Stripes(plan)
    blocks = Blocks(plan, FORWARD_KINDS, *accumulators, _writers(plan, stripes, backward=False))
    sources = _own_sources(plan, k, v, key_mask)
    if halos is not None:
        halos.post()
    for stripe in plan.blocks:
        blocks.turn(stripe.index)
        for tile in stripe.tiles:
            _forward_tile(q, sources[tile.source], tile, stripe, opts, blocks)
        blocks.end_turn(stripe.index)
    for round_index, received in (halos.rounds() if halos is not None else ()):
        for index, *buffers in received:
            sources[index] = tuple(buffers)
        for stripe_index, tile in plan.rounds[round_index]:
            _forward_tile(q, sources[tile.source], tile, blocks.by_index[stripe_index], opts,
                          blocks)
        for index, *_ in received:
            sources[index] = None  # free the round's halos
        del received
    blocks.finish_all()
    return out, lse


def _own_sources(plan: WindowPlan, k: Tensor, v: Tensor,
                 key_mask: Optional[Tensor]) -> List[Optional[Tuple]]:
    """(k, v, mask) views of this rank's own sources; None for halos (not yet received)."""
    out: List[Optional[Tuple]] = []
    for s in plan.sources:
        if s.local is None:
            out.append(None)
            continue
        rows = slice(s.local, s.local + s.stop - s.start)
        out.append((k[:, rows], v[:, rows], None if key_mask is None else key_mask[:, rows]))
    return out


def _forward_tile(q: Tensor, source, tile: Tile, stripe: Stripe, opts: KernelOptions,
                  blocks: Blocks) -> None:
    """One tile's launches, merged into (or stored as the first write of) its stripe."""
    k, v, mask = source
    out_t, lse_t = attention_forward(
        _launch_input(q, tile.q, tile, tile.rows), _launch_input(k, tile.k, tile, tile.keys),
        _launch_input(v, tile.k, tile, tile.keys), _tile_opts(opts, tile),
        key_mask=_kernel_mask(mask, tile, k.shape[2]))
    out_t, lse_t = (_launch_output(y, tile, q.shape[0]) for y in (out_t, lse_t))
    at = tile.q - stripe.lo

    def apply(accs: Tuple[Tensor, Tensor]) -> None:
        acc_out, acc_lse = (_rows(a, at, tile.count, tile.rows, tile.step) for a in accs)
        for rows in row_slices(tile.rows, out_t[:, :, 0].numel(), out_t.device):
            merge_(acc_out[:, :, rows], acc_lse[:, :, rows], out_t[:, :, rows],
                   lse_t[:, :, rows])

    def assign(accs: Tuple[Tensor, Tensor]) -> None:
        for a, y in zip(accs, (out_t, lse_t)):
            _rows(a, at, tile.count, tile.rows, tile.step).copy_(y)

    whole = _covers(tile, (stripe.lo, stripe.hi))
    blocks.add(stripe.index, Kind.OUT, apply, out_t.nbytes + lse_t.nbytes,
               assign if whole else None)


def window_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    plan: WindowPlan, opts: KernelOptions, *, dlse: Optional[Tensor] = None,
                    key_mask: Optional[Tensor] = None, halos: Optional[Halos] = None,
                    kv_grad: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `window_forward`, given its final out and lse. Without
    `kv_grad` (no rank differentiates k or v) the fused kernel's launches compute dq alone
    and dk, dv are not computed (the caller drops them)."""
    grads, *accumulators = gradient_accumulators(q, k, v)
    stripes = _Stripes(plan)
    # without kv_grad no dK/dV accumulator is made (dk and dv stay unwritten)
    blocks = Blocks(plan, BACKWARD_KINDS if kv_grad else (Kind.DQ,), *accumulators, _writers(
        plan, stripes, backward=True, homes=halos is None or halos.kv_grad))
    sources = _own_sources(plan, k, v, key_mask)
    saved = (dout, q, out, lse, dlse)
    acc = lse_dtype(q.dtype)
    if halos is not None:
        halos.post()
    for stripe in plan.blocks:
        blocks.turn(stripe.index)
        for tile in stripe.tiles:
            _backward_tile(saved, sources[tile.source], plan.sources[tile.source], tile,
                           stripe, opts, blocks, stripes, None, kv_grad)
        blocks.end_turn(stripe.index)
    for round_index, received in (halos.rounds() if halos is not None else ()):
        sent_back = {}
        for index, k_h, v_h, mask in received:
            sources[index] = (k_h, v_h, mask)
            # dK/dV of the halo (2, b, rows, hk, d), in the accumulator dtype
            sent_back[index] = (torch.zeros((2,) + tuple(k_h.shape), dtype=acc, device=k.device)
                                if kv_grad else None)
        for stripe_index, tile in plan.rounds[round_index]:
            _backward_tile(saved, sources[tile.source], plan.sources[tile.source], tile,
                           blocks.by_index[stripe_index], opts, blocks, stripes,
                           sent_back[tile.source], kv_grad)
        order = [index for index, *_ in received]
        for index in order:
            sources[index] = None
        del received
        # without kv_grad no rank needs the halos' dK/dV: they stay here, and are dropped
        for home, grad in (halos.send_home(round_index, [sent_back[i] for i in order])
                           if halos.kv_grad else ()):
            lo, _ = plan.homes[home]
            for which, kind in enumerate((Kind.DK, Kind.DV)):
                _add_own(blocks, stripes, kind, lo, 1, grad.shape[2], 0, grad[which, :, None])
        del sent_back
    blocks.finish_all()
    return grads


def _backward_tile(saved, source, where: Source, tile: Tile, stripe: Stripe,
                   opts: KernelOptions, blocks: Blocks, stripes: _Stripes,
                   halo_grad: Optional[Tensor], kv_grad: bool = True) -> None:
    """One tile's backward launches: dq into its stripe, dK/dV (with `kv_grad`) into the
    stripes of own key rows, or into `halo_grad` (2, b, rows, hk, d) for a received halo."""
    dout, q, out, lse, dlse = saved
    k, v, mask = source

    def rows_of(x: Tensor) -> Tensor:
        return _launch_input(x, tile.q, tile, tile.rows)

    dq_t, dk_t, dv_t = attention_backward(
        rows_of(dout), rows_of(q), _launch_input(k, tile.k, tile, tile.keys),
        _launch_input(v, tile.k, tile, tile.keys), rows_of(out), rows_of(lse),
        _tile_opts(opts, tile), dlse=None if dlse is None else rows_of(dlse),
        key_mask=_kernel_mask(mask, tile, k.shape[2]), kv_grad=kv_grad)
    b = q.shape[0]
    dq_t = _launch_output(dq_t, tile, b)
    at = tile.q - stripe.lo
    blocks.add(stripe.index, Kind.DQ,
               lambda a: _rows(a, at, tile.count, tile.rows, tile.step).add_(dq_t), dq_t.nbytes)
    if not kv_grad:
        return
    for which, (kind, grad) in enumerate(((Kind.DK, _launch_output(dk_t, tile, b)),
                                          (Kind.DV, _launch_output(dv_t, tile, b)))):
        if halo_grad is None:
            _add_own(blocks, stripes, kind, where.local + tile.k, tile.count, tile.keys,
                     tile.step, grad)
        else:
            _rows(halo_grad[which], tile.k, tile.count, tile.keys, tile.step).add_(grad)


def _add_own(blocks: Blocks, stripes: _Stripes, kind: Kind, lo: int, count: int, length: int,
             step: int, grad: Tensor) -> None:
    """Add grad (b, count, length, hk, d) into the dK or dV (`kind`) of local rows
    lo + i step + j, stripe by stripe (a run's rows lie in one stripe)."""
    hi = lo + (count - 1) * step + length
    for index, first, a, z in stripes.pieces(lo, hi):
        if count > 1:  # one piece
            rows_grad = grad

            def apply(acc: Tensor, at=a - first, rows_grad=rows_grad) -> None:
                _rows(acc, at, count, length, step).add_(rows_grad)
        else:
            rows_grad = grad[:, 0, a - lo:z - lo]

            def apply(acc: Tensor, at=a - first, rows_grad=rows_grad) -> None:
                acc[:, at:at + rows_grad.shape[1]].add_(rows_grad)

        blocks.add(index, kind, apply, rows_grad.nbytes)


# --------------------------------------------------------------------------
# Autograd


class WindowAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward runs the tiles again with the final out and lse.

    `plan(backward)` gives the plan of each pass (``window_plan`` with the rank's
    arguments). `halos`: None on one process, else a callable (k, v, key_mask) -> Halos
    that builds the exchange of a sequence-parallel rank (each pass fetches the halos
    again: nothing but the inputs is saved).
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, opts, key_mask, halos):
        result = window_forward(q, k, v, plan(False), opts, key_mask=key_mask,
                                halos=None if halos is None else halos(k, v, key_mask))
        return save_for_backward(ctx, q, k, v, result, (plan, opts, key_mask, halos))

    @staticmethod
    def backward(ctx, dout, dlse):
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        plan, opts, key_mask, halos = ctx.args
        if halos is not None:
            check_first_order("sequence-parallel sliding-window attention")
        exchange = None if halos is None else halos(k, v, key_mask)
        # whether some rank differentiates k or v (agreed), or, on one device, this call
        kv_grad = (ctx.needs_input_grad[1] or ctx.needs_input_grad[2] if exchange is None
                   else exchange.kv_grad)
        dq, dk, dv = window_backward(dout, q, k, v, out, lse, plan(True), opts, dlse=dlse,
                                     key_mask=key_mask, halos=exchange, kv_grad=kv_grad)
        if not kv_grad:  # not computed: nothing needs them
            dk = dv = None
        return dq, dk, dv, None, None, None, None


def _local_plan(n: int, window: Tuple[int, int], documents: Documents,
                device_type: str) -> Callable[[bool], WindowPlan]:
    """`plan(backward)` of one device's n rows (``WindowAttentionFunction``)."""
    return functools.partial(window_plan, (Chunk(0, n, 0, 0),), (), (), 0,
                             *reaches(window, n), n, documents, device_type)


def window_attention_local(q: Tensor, k: Tensor, v: Tensor, window: Tuple[int, int],
                           opts: KernelOptions, *, documents: Documents = None,
                           key_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Sliding-window attention on one device, differentiable: out (b, n, h, d), lse (b, n, h).

    `window` (left, right) as the public ``window_size`` (-1 unbounded); the call is
    already validated (``functional.ring_attention``). Under torch.compile a custom op
    pair, as the dilated op (dilated.py): the planning runs inside it, at run time.
    """
    if torch.compiler.is_compiling():
        return _forward_op(q, k, v, list(window), opts.causal, opts.scale, opts.backend,
                           None if documents is None else list(documents), key_mask)
    plan = _local_plan(q.shape[1], window, documents, q.device.type)
    return WindowAttentionFunction.apply(q, k, v, plan, opts, key_mask, None)


# The compiled form: the call flattened to the types custom ops take (window, the options,
# the document boundaries), key_mask last.

def _forward_flat(q: Tensor, k: Tensor, v: Tensor, window: List[int], causal: bool,
                  scale: float, backend: str, documents: Optional[List[int]],
                  key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    plan = _local_plan(q.shape[1], tuple(window), _documents(documents), q.device.type)
    return window_forward(q, k, v, plan(False), KernelOptions(causal, scale, backend),
                          key_mask=key_mask)


def _backward_flat(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dlse: Optional[Tensor], window: List[int], causal: bool, scale: float,
                   backend: str, documents: Optional[List[int]],
                   key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    plan = _local_plan(q.shape[1], tuple(window), _documents(documents), q.device.type)
    return window_backward(dout, q, k, v, out, lse, plan(True),
                           KernelOptions(causal, scale, backend), dlse=dlse, key_mask=key_mask)


def _documents(documents: Optional[List[int]]) -> Documents:
    return None if documents is None else tuple(documents)


_forward_op = torch.library.custom_op("dilated_attention::window_forward", _forward_flat,
                                      mutates_args=())
_backward_op = torch.library.custom_op("dilated_attention::window_backward", _backward_flat,
                                       mutates_args=())


@_forward_op.register_fake
def _forward_shapes(q, k, v, *args):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@_backward_op.register_fake
def _backward_shapes(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *call = inputs
    save_for_backward(ctx, q, k, v, output, call)


def _op_backward(ctx, dout, dlse):
    # create_graph=True: the backward's Python, which autograd records (the op has no
    # derivative)
    backward = _backward_flat if torch.is_grad_enabled() else _backward_op
    grads = backward(*saved_for_backward(ctx, dout), dlse, *ctx.args)
    return tuple(grads) + (None,) * len(ctx.args)


torch.library.register_autograd("dilated_attention::window_forward", _op_backward,
                                setup_context=_setup_context)


def reaches(window: Tuple[int, int], total: int) -> Tuple[int, int]:
    """(left, right) of a ``window_size`` with an unbounded side (-1) as `total` rows."""
    return tuple(total if side < 0 else min(side, total) for side in window)
