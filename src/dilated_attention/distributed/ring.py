"""Ring attention: exact dense attention over a sequence spread across ranks.

Notation: b batch, n this rank's query rows, m a K/V sub-piece's rows, r a
launch's query rows, h query heads, hk key/value heads, d head dim, P
ranks, S sub-pieces per piece; layout (b, n, h, d). A rank's rows are its
*piece*; pieces travel around the ring in *sub-pieces*.

Every rank holds its piece of q, k, v. The K/V pieces travel around the
ring (rank p sends to p+1, receives from p-1): at step s rank p holds the
piece of rank (p - s) mod P. Pieces travel in sub-pieces (Note [sub-pieces]): the
transfer of the next sub-piece is posted before the current one's compute, so
communication overlaps compute while a rank holds two sub-pieces, not two
pieces. The partial results are merged with
``merge.merge_`` in fp32 (the output itself is the accumulator for fp32
and fp64 inputs).

The backward runs the ring again with the final merged ``out``/``lse``
(``kernels.attention_backward`` then recomputes each launch's share of the
global softmax exactly): dq accumulates locally, and each sub-piece's fp32
dK/dV accumulator travels with it, gaining every rank's contribution, until
one last transfer brings it home (where some rank differentiates k or v;
otherwise only the K/V travel, for dq).

Pieces may differ in length and be empty; ranks agree on every length in
the one agreement collective before the ring starts, so receive buffers
have the right shapes.

Note [zigzag]
~~~~~~~~~~~~~
With causal attention and contiguous pieces, rank P-1 computes P pieces and
rank 0 one: the ring is as slow as its busiest rank. The zigzag layout cuts
the sequence into 2P chunks of c rows and gives rank p chunks p and
2P-1-p, concatenated (local rows [0, c) are chunk p, [c, 2c) chunk 2P-1-p).
P = 2, chunks 0..3:

    sequence:  | 0 | 1 | 2 | 3 |        rank 0 holds [0 | 3]
                                        rank 1 holds [1 | 2]

Local order is global order on each rank, so for the piece of rank src
seen by rank p (every rank does 2c*c units of work at every step):

    src == p   square causal over all 2c rows (the usual triangle)
    src <  p   all 2c queries see the piece's first chunk (chunk src < p)
               fully and its second chunk (2P-1-src > 2P-1-p) not at all
    src >  p   the first query chunk (p < src) sees nothing; the second
               (2P-1-p) sees both chunks of the piece fully

           keys of rank src
            [src | 2P-1-src]
    src<p:   ###   ...        q rows [0, 2c)  x  k rows [0, c)
    src>p:   ###   ###        q rows [c, 2c)  x  k rows [0, 2c)

A sub-piece (Note [sub-pieces]) meets the rows of this plan that its key rows fall
in; on the diagonal (src == p) sub-piece [lo, hi) is a causal
square over queries [lo, hi) plus a full rectangle for the queries below.

Note [sub-pieces]
~~~~~~~~~~~~~~~~~
Whole pieces in flight would add two K/V pieces to a rank's memory (the
one computed on, the next arriving), each as large as its own k and v.
Instead every piece is cut into S sub-pieces of nearly equal rows (sub-piece j of a
piece of L rows is rows [j L // S,
(j+1) L // S), empty when L < S) and the ring runs once per sub-piece:
sub-ring j carries sub-piece j of every piece through the P steps. Every rank
walks the same units in the same order, sub-piece-major:

    unit (j, s): hold sub-piece j of piece (p - s); post sending it to p+1 and
                 receiving sub-piece j of piece (p - s - 1) from p-1; compute;
                 wait (the last step of a sub-ring sends and receives none)

Sub-piece-major, because what rank p forwards at one unit is what p+1 needs at
its next unit; step-major would keep a whole piece arriving. The query
rows are cut too: a launch covers at most r query rows, so a kernel's
output lives r h d s bytes until it is merged.

Memory (s bytes per element, a per fp32 accumulator element, n the longest
piece): `RingSizes.bounded` keeps the ring buffers of a pass within half a
q shard (n h d s / 2) and a launch's output within an eighth. The backward
runs its own ring with its own sub-pieces, cut smaller: they carry fp32 dK/dV
(the one sent, the one arriving, this unit's own) as well as K/V.

    forward   K/V sub-pieces in flight   4 m hk d s          <= n h d s / 2  ->  m = n h / (8 hk)
    backward  those, 3 fp32 dK/dV ones   (4 s + 6 a) m hk d  <= n h d s / 2  ->  m = n h / (20 hk)
    both      one launch's output        r h d s             <= n h d s / 8  ->  r = n / 8

(the backward's m for fp32; n h / (32 hk) for bf16).

A forward sub-piece has at least 512 rows: every sub-piece costs a merge
over all n query rows (measured at n = 4096, 4 ranks, CPU time on a loaded
machine: whole pieces 1.0, 512-row sub-pieces 1.02 to 1.06, 256-row
sub-pieces 1.25); a backward sub-piece (no merges: dq adds once per launch)
at least 256. A launch has at least 768 query rows, where the CPU flash
kernel still tiles queries by 256 rows (by 64 below). For short pieces the
minimums win over the bound. A rank runs about S P n / r
launches per pass: S <= 8 hk / h + 1 sub-pieces forward, n / r <= 8.

At P = 4, N = 16384, 12 heads x 64, fp32 (forward m = 512, r = 768) a
rank's forward holds q, k, v, out (4 shards, 50.3 MB) plus 6.3 MB of sub-pieces
and 2.4 MB of launch output, against 4 full tensors (201 MB) at P = 1:
0.29x; its backward (m = 256) adds to its 8 shards 3.1 MB of K/V sub-pieces,
4.7 MB of dK/dV sub-pieces and one launch's gradients (BENCHMARKS.md has the
measured peaks). With bf16 inputs the output's fp32 accumulator (n h d a)
stays whole.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..kernels import KernelOptions, attention_backward, attention_forward, lse_dtype
from ..kernels import save_for_backward, saved_for_backward
from ..merge import empty_accumulators, merge_
from ..layout import Layout
from ..validation import check_first_order
from . import comm

# RingComm tag bases, so K/V and dK/dV transfers between the same two ranks
# never pair up with each other.
_KV_TAG, _DKV_TAG = 0, 2

# The fewest rows of a default forward sub-piece, backward sub-piece and launch's queries
# (Note [sub-pieces]: merge cost, no merges, the CPU flash kernel's query tiles).
MIN_FORWARD_SUB_PIECE_ROWS, MIN_BACKWARD_SUB_PIECE_ROWS, MIN_LAUNCH_ROWS = 512, 256, 768


@dataclasses.dataclass(frozen=True)
class RingSizes:
    """Rows per K/V sub-piece and query rows per launch of a ring call (Note [sub-pieces]).

    `kv_rows` bounds the received K/V and the travelling dK/dV buffers, and
    fixes the number of sub-rings, so every rank of a call must use the
    same value; `q_rows` bounds each launch's output before its merge.
    """

    kv_rows: int
    q_rows: int

    def __post_init__(self) -> None:
        for name in ("kv_rows", "q_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RingSizes {name} must be a positive int, got {value!r}")

    @classmethod
    def bounded(cls, longest: int, heads: int, kv_heads: int, dtype: torch.dtype, *,
                backward: bool) -> "RingSizes":
        """The default for one pass over pieces of at most `longest` rows (Note [sub-pieces]).

        The pass's ring buffers stay within half a q shard, a launch's
        output within an eighth, unless the minimum rows are more.
        """
        s = torch.empty(0, dtype=dtype).element_size()
        a = torch.empty(0, dtype=lse_dtype(dtype)).element_size()
        # bytes per sub-piece row and head dim of the ring buffers: two K/V sub-pieces in
        # flight, in backward also three fp32 dK/dV sub-pieces
        per_row = kv_heads * (4 * s + (6 * a if backward else 0))
        fewest = MIN_BACKWARD_SUB_PIECE_ROWS if backward else MIN_FORWARD_SUB_PIECE_ROWS
        return cls(kv_rows=max(fewest, longest * heads * s // (2 * per_row)),
                   q_rows=max(MIN_LAUNCH_ROWS, longest // 8))

    def sub_pieces(self, lengths: Sequence[int]) -> int:
        """S: the sub-pieces every piece is cut into (one sub-ring each)."""
        return max(1, -(-max(lengths) // self.kv_rows))


def _sub_piece_rows(length: int, sub_pieces: int, j: int) -> Tuple[int, int]:
    """Rows [lo, hi) of sub-piece `j` of a piece of `length` rows cut into `sub_pieces`."""
    return j * length // sub_pieces, (j + 1) * length // sub_pieces


class _Unit(NamedTuple):
    """One unit of the ring: sub-piece `sub_piece` (rows [lo, hi)) of rank `src`'s piece, at
    `step`."""

    sub_piece: int
    step: int
    src: int
    lo: int
    hi: int


class _Rotation:
    """The K/V sub-pieces moving around the ring (Note [sub-pieces]), one unit at a time.

    Iterating yields this rank's units; during a unit ``self.k``/``self.v``
    (b, hi - lo, hk, d) hold the unit's sub-piece, and the next unit's transfer is
    in flight. The sub-pieces live on this object, not in the caller's locals, so
    a sub-piece is freed as soon as the ring moves past it.
    """

    def __init__(self, group, k: Tensor, v: Tensor, lengths: Sequence[int],
                 sub_pieces: int) -> None:
        self.ring = comm.RingComm(group, tag=_KV_TAG)
        self.own = (k, v)
        self.lengths = list(lengths)
        self.sub_pieces = sub_pieces
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def __iter__(self) -> Iterator[_Unit]:
        size, rank = self.ring.size, self.ring.rank
        for j in range(self.sub_pieces):
            lo, hi = _sub_piece_rows(self.lengths[rank], self.sub_pieces, j)
            # (b, n, hk, d) -> (b, hi - lo, hk, d): this rank's own sub-piece, a view
            self.k, self.v = (x[:, lo:hi] for x in self.own)
            for step in range(size):
                src = (rank - step) % size
                last = step == size - 1
                if not last:
                    # post the next sub-piece's transfer before this sub-piece's compute
                    previous = self.lengths[(src - 1) % size]
                    rows = _rows(_sub_piece_rows(previous, self.sub_pieces, j))
                    arriving = _pass_on(self.ring, rows, self.k, self.v)
                yield _Unit(j, step, src, *_sub_piece_rows(self.lengths[src], self.sub_pieces, j))
                if not last:
                    self.ring.wait()
                    (self.k, self.v), arriving = arriving, []
        self.k = self.v = None


def _rows(span: Tuple[int, int]) -> int:
    return span[1] - span[0]


def _pass_on(ring: comm.RingComm, rows: int, *sub_pieces: Tensor) -> List[Tensor]:
    """Post sending `sub_pieces` to the next rank and receiving the previous rank's (`rows`
    rows)."""
    received = [
        # (b, m, hk, d) -> (b, rows, hk, d): the previous rank's sub-piece may differ
        # in length
        ring.send_recv(x, x.new_empty((x.shape[0], rows) + tuple(x.shape[2:])))
        for x in sub_pieces
    ]
    ring.commit()
    return received


def _piece_plan(layout: Layout, causal: bool, rank: int,
                src: int) -> Optional[Tuple[int, int, int, int, bool]]:
    """Which query rows [q0, q1) meet which key rows [k0, k1) of rank `src`'s piece, and whether
    as a causal square (q0 == k0, q1 == k1: local order is global order; Note [zigzag]).

    None when the piece contributes nothing to this rank's queries.
    """
    n_q, n_k = layout.rows_of(rank), layout.rows_of(src)
    if n_q == 0 or n_k == 0:
        return None  # the kernels need at least one key; nothing to do
    if not causal:
        return 0, n_q, 0, n_k, False
    if src == rank:
        return 0, n_q, 0, n_k, True
    # another rank's chunk is wholly before a query chunk or wholly after it (Note [zigzag])
    seen = [(q, k) for q in layout.of_rank(rank) for k in layout.of_rank(src)
            if k.stop <= q.start]
    if not seen:
        return None
    return (min(q.local for q, _ in seen), max(q.local + q.stop - q.start for q, _ in seen),
            min(k.local for _, k in seen), max(k.local + k.stop - k.start for _, k in seen),
            False)


def _launches(plan, lo: int, hi: int, q_rows: int) -> List[Tuple[slice, slice, bool]]:
    """The kernel launches of `plan` with key rows [lo, hi) of its piece (Note [sub-pieces]).

    Each is (query rows, key rows counted from `lo`, causal), at most
    `q_rows` query rows; a causal launch is a square, as the kernels need.
    """
    if plan is None:
        return []
    q0, q1, k0, k1, causal = plan
    k0, k1 = max(k0, lo), min(k1, hi)
    if k0 >= k1:
        return []
    keys = slice(k0 - lo, k1 - lo)
    if not causal:
        return [(slice(c, min(c + q_rows, q1)), keys, False) for c in range(q0, q1, q_rows)]
    # query i sees key j <= i: queries [k0, k1) see the keys as a triangle, cut into
    # squares with the keys left of them in full; queries after k1 see every key
    found = []
    for c in range(k0, k1, q_rows):
        c1 = min(c + q_rows, k1)
        if c > k0:
            found.append((slice(c, c1), slice(k0 - lo, c - lo), False))
        found.append((slice(c, c1), slice(c - lo, c1 - lo), True))
    found += [(slice(c, min(c + q_rows, q1)), keys, False) for c in range(k1, q1, q_rows)]
    return found


def _lengths(group, n: int, lengths: Optional[Sequence[int]]) -> List[int]:
    size = comm.group_size(group)
    lengths = [n] * size if lengths is None else list(lengths)
    if len(lengths) != size or lengths[comm.group_rank(group)] != n:
        raise ValueError(
            f"lengths {lengths} must give {size} piece lengths including this rank's ({n})"
        )
    return lengths


def _sizes(sizes: Optional[RingSizes], lengths: Sequence[int], q: Tensor, k: Tensor, *,
           backward: bool) -> RingSizes:
    """`sizes`, checked, or the pass's default bound."""
    if sizes is None:
        return RingSizes.bounded(max(lengths), q.shape[2], k.shape[2], q.dtype,
                                 backward=backward)
    if not isinstance(sizes, RingSizes):
        raise TypeError(f"sizes must be a RingSizes or None, got {sizes!r}")
    return sizes


def ring_forward(
    group,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    opts: KernelOptions,
    *,
    layout: str = "contiguous",
    lengths: Optional[Sequence[int]] = None,
    sizes: Optional[RingSizes] = None,
) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32.

    `lengths`: every rank's piece length (default: all equal to this one's).
    `sizes`: rows per K/V sub-piece and query rows per launch (default
    `RingSizes.bounded` for the forward: Note [sub-pieces]). Every rank of
    `group` must call this with agreed arguments.
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    n = q.shape[1]
    lengths = _lengths(group, n, lengths)
    if size == 1:
        # one piece: the kernel's own result, with no fp32 accumulator and no merge
        return attention_forward(q, k, v, opts)
    sizes = _sizes(sizes, lengths, q, k, backward=False)
    # fp32 (fp64) accumulators: for fp32 (fp64) inputs acc_out is the output itself
    acc_out, acc_lse = empty_accumulators(q.shape, q.dtype, q.device)
    rotation = _Rotation(group, k, v, lengths, sizes.sub_pieces(lengths))
    held = Layout.named(layout, lengths)
    for unit in rotation:
        plan = _piece_plan(held, opts.causal, rank, unit.src)
        for rows, keys, causal in _launches(plan, unit.lo, unit.hi, sizes.q_rows):
            # merged at once: a launch's output is freed before the next one runs
            merge_(acc_out[:, rows], acc_lse[:, rows], *attention_forward(
                q[:, rows], rotation.k[:, keys], rotation.v[:, keys],
                dataclasses.replace(opts, causal=causal)))
    return acc_out.to(q.dtype), acc_lse


def ring_backward(
    group,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    opts: KernelOptions,
    *,
    layout: str = "contiguous",
    lengths: Optional[Sequence[int]] = None,
    dlse: Optional[Tensor] = None,
    sizes: Optional[RingSizes] = None,
    kv_grad: bool = True,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients (dq, dk, dv) of this rank's piece, given the final out and lse of `ring_forward`.

    ``dlse`` (b, n, h), when given, is the gradient flowing into ``lse``.
    `sizes` as for `ring_forward` (default: the backward's own bound,
    smaller sub-pieces); it need not be what the forward used, only the same on
    every rank. `kv_grad` False (the same on every rank: no rank differentiates k
    or v): no dK/dV is accumulated or sent, and dk, dv are None.
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    n = q.shape[1]
    lengths = _lengths(group, n, lengths)
    if size == 1:
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, opts, dlse=dlse,
                                        kv_grad=kv_grad)
        return (dq, dk, dv) if kv_grad else (dq, None, None)
    sizes = _sizes(sizes, lengths, q, k, backward=True)
    sub_pieces = sizes.sub_pieces(lengths)
    acc = lse_dtype(q.dtype)
    # for fp32 (fp64) inputs dq is its own accumulator, and dk/dv receive their
    # sub-pieces' accumulators in place when the rows are contiguous
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    rotation = _Rotation(group, k, v, lengths, sub_pieces)
    held = Layout.named(layout, lengths)
    if not kv_grad:  # K/V travel for dq alone: no dK/dV ring behind them
        for unit in rotation:
            plan = _piece_plan(held, opts.causal, rank, unit.src)
            _unit_backward(_launches(plan, unit.lo, unit.hi, sizes.q_rows), rotation.k,
                           rotation.v, dout, q, out, lse, dlse, dq, opts, kv_grad=False)
        return dq.to(q.dtype), None, None
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkv_ring = comm.RingComm(group, tag=_DKV_TAG)
    arriving: Optional[List[Tensor]] = None  # the dK/dV posted after the previous unit
    home: Optional[Tuple[int, int]] = None  # their rows in dk/dv when they are this rank's own
    for unit in rotation:
        plan = _piece_plan(held, opts.causal, rank, unit.src)
        grads = _unit_backward(
            _launches(plan, unit.lo, unit.hi, sizes.q_rows), rotation.k, rotation.v, dout, q, out,
            lse, dlse, dq, opts)
        dkv_ring.wait()  # the accumulators posted after the previous unit have arrived
        if home is not None:
            _deliver(arriving, dk, dv, home)
        elif arriving is not None:  # this sub-piece's accumulators from the ranks before
            grads = arriving if grads is None else [g.add_(a) for g, a in zip(grads, arriving)]
        if grads is None:  # step 0 of a sub-piece no query here sees
            grads = [x.new_zeros(x.shape, dtype=acc) for x in (rotation.k, rotation.v)]
        # this sub-piece's dK/dV go to the next rank, which holds the sub-piece at the next
        # step; after the last step that rank is the sub-piece's home, and what arrives
        # here is this rank's own sub-piece's complete dK/dV
        if unit.step < size - 1:
            home = None
            previous = lengths[(unit.src - 1) % size]
            rows = _rows(_sub_piece_rows(previous, sub_pieces, unit.sub_piece))
            buffers = [g.new_empty((g.shape[0], rows) + tuple(g.shape[2:])) for g in grads]
        else:
            home = _sub_piece_rows(n, sub_pieces, unit.sub_piece)
            buffers = [_home_buffer(x, home, acc) for x in (dk, dv)]
        arriving = [dkv_ring.send_recv(g, buf) for g, buf in zip(grads, buffers)]
        dkv_ring.commit()
        del grads, buffers  # sent from here on; only `arriving` stays
    dkv_ring.wait()
    _deliver(arriving, dk, dv, home)
    return dq.to(q.dtype), dk, dv


def _unit_backward(launches, k: Tensor, v: Tensor, dout: Tensor, q: Tensor, out: Tensor,
                   lse: Tensor, dlse: Optional[Tensor], dq: Tensor,
                   opts: KernelOptions, kv_grad: bool = True) -> Optional[List[Tensor]]:
    """Run one unit's backward launches: add into `dq`; return the sub-piece's (dk, dv) in fp32.

    None when no launch runs, or without `kv_grad` (dK/dV are dropped). Each launch's
    gradients are freed before the next launch allocates its own.
    """
    if not launches:
        return None
    acc = dq.dtype
    # (b, m, hk, d) fp32: this unit's contribution to the sub-piece's dK/dV
    dk_sub_piece, dv_sub_piece = (torch.zeros(x.shape, dtype=acc, device=x.device)
                                  if kv_grad else None for x in (k, v))
    for rows, keys, causal in launches:
        dq_b, dk_b, dv_b = attention_backward(
            dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, rows],
            dataclasses.replace(opts, causal=causal),
            dlse=None if dlse is None else dlse[:, rows], kv_grad=kv_grad,
        )
        dq[:, rows] += dq_b
        if kv_grad:
            dk_sub_piece[:, keys] += dk_b
            dv_sub_piece[:, keys] += dv_b
        del dq_b, dk_b, dv_b  # freed before the next launch allocates its own
    return [dk_sub_piece, dv_sub_piece] if kv_grad else None


def _arrives_in_place(x: Tensor, rows: Tuple[int, int], acc: torch.dtype) -> bool:
    """Whether rows [lo, hi) of `x` can receive an accumulator directly (same dtype, contiguous)."""
    return x.dtype == acc and x[:, rows[0]:rows[1]].is_contiguous()


def _home_buffer(x: Tensor, rows: Tuple[int, int], acc: torch.dtype) -> Tensor:
    """Where a sub-piece of this rank's own dK (or dV) arrives: in place when `x` can take it."""
    view = x[:, rows[0]:rows[1]]
    if _arrives_in_place(x, rows, acc):
        return view
    # (b, n, hk, d) -> (b, hi - lo, hk, d) in the accumulator dtype
    return torch.empty(view.shape, dtype=acc, device=x.device)


def _deliver(arrived: Sequence[Tensor], dk: Tensor, dv: Tensor, rows: Tuple[int, int]) -> None:
    """Put this rank's own sub-piece's complete dK/dV into rows [lo, hi) of dk/dv (cast if
    needed)."""
    for buf, x in zip(arrived, (dk, dv)):
        if not _arrives_in_place(x, rows, buf.dtype):
            x[:, rows[0]:rows[1]].copy_(buf)


class RingAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `ring_backward` (a collective: every rank runs it).

    `sizes` (optional) overrides the default sizes of Note [sub-pieces] in both
    passes; every rank must pass the same. `kv_grad` (optional, last): whether some
    rank differentiates k or v (agreed; see `ring_backward`).
    """

    @staticmethod
    def forward(ctx, q, k, v, opts, group, layout, lengths, sizes=None, kv_grad=True):
        result = ring_forward(group, q, k, v, opts, layout=layout, lengths=lengths,
                              sizes=sizes)
        return save_for_backward(ctx, q, k, v, result,
                                 (opts, group, layout, lengths, sizes, kv_grad))

    @staticmethod
    def backward(ctx, dout, dlse):
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        opts, group, layout, lengths, sizes, kv_grad = ctx.args
        if comm.is_distributed(group):
            check_first_order("ring_attention with a group of several ranks")
        dq, dk, dv = ring_backward(group, dout, q, k, v, out, lse, opts, layout=layout,
                                   lengths=lengths, dlse=dlse, sizes=sizes, kv_grad=kv_grad)
        return dq, dk, dv, None, None, None, None, None, None
