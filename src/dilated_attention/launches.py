"""Running a plan: kernel launches over row blocks, with bounded fp32 accumulators.

A launch gathers the selected rows of its query and key segments into dense
``(b * segments, rows, heads, d)`` batches (a free view for rate 1), calls the
kernel, and merges the result into its block's fp32 accumulators with the
log-sum-exp merge. The backward runs the same launches with the final merged
out/lse, adding dq (query rows) and dK/dV (key rows) into block accumulators
the same way. Which launch runs when: Note [plan] in plan.py.

Note [block accumulators]
~~~~~~~~~~~~~~~~~~~~~~~~~
Blocks take turns. The block whose turn it is holds fp32 accumulators (for
fp32 inputs: views of the outputs themselves; also in half precision where
no entry gets more than two writes, ``policy.in_output``). A launch output for another
block (a cross launch's dK/dV, a remote launch's rows) is kept as it is,
compact, and applied when that block's accumulators are made; if a block's
pending outputs grow as large as its accumulators, these are made at once.
An accumulator is written into the output, in its dtype, and freed after
its last writer (``count_writers``). So a rank holds about one block of fp32
accumulators, plus the compact outputs that straddling or remote segments
send ahead, whatever n is.

A block's first launches, when they are dense launches of whole segments
that together tile it (LongNet's rate-1 segments), store their results in
the accumulator, made without its identity fill, instead of merging into
zeros and -inf (``stored_launches``): the same values (a merge into the
identity multiplies by 1), without the fill and one merge pass per launch
over their rows.

A rank of a sequence-parallel call also attends key rows of other ranks;
the distributed op passes a ``RemoteKeys`` that moves them, and the launches
on them run here like the local ones. ``forward_beside``/``backward_beside``
run them beside outputs that already hold the rank's own pairs (the fused
kernel's): the accumulators of the blocks they write start from those.

Notation: b batch, n this rank's rows, h query heads, hk key/value heads,
d head dim.
"""

from __future__ import annotations

import enum
from typing import (Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple)

import torch
from torch import Tensor

from . import policy
from .kernels import KernelOptions, attention_backward, attention_forward, lse_dtype
from .merge import merge_, merge_selected_
from .patterns import (HeadGroup, Segments, Stride, gather, is_view, scatter_add_, selection,
                       strided_view)
from .plan import Block, Launch, Plan, RemoteLaunch, Transfer


def _kernel_input(x: Tensor, segs: Segments, heads: Tensor, index: Tensor,
                  stride: Optional[Stride]) -> Tensor:
    """`gather` for a local forward launch's kernel: dense where policy.DENSE_KERNEL_INPUTS
    says."""
    y = gather(x, segs, heads, index, stride)
    return y.contiguous() if policy.dense_kernel_inputs(x.device.type) else y


class RemoteKeys(Protocol):
    """How a sequence-parallel rank moves the key rows of its plan's transfers.

    ``post()`` starts the first exchange (called before any local work, so
    that it overlaps it). ``keys()`` yields, round by round, every received
    transfer with its buffers: k and v ``(2, b, columns, d)`` and the key
    padding mask ``(b, columns)`` or None. ``send_home(index, grads)``
    (backward, once per round, after its keys) sends the dK/dV
    ``(2, b, columns, d)`` of every received transfer back and returns ours,
    one per sent transfer; it is not called where ``kv_grad`` is False (no rank
    differentiates k or v: the same on every rank).
    """

    kv_grad: bool

    def post(self) -> None: ...

    def keys(self) -> Iterator[Tuple[int, List[Tuple[Transfer, Tensor, Optional[Tensor]]]]]: ...

    def send_home(self, round_index: int, grads: List[Tensor]) -> List[Tuple[Transfer, Tensor]]: ...


# --------------------------------------------------------------------------
# Block accumulators (Note [block accumulators])


class Kind(enum.IntEnum):
    """Which accumulator of a block: the forward's (out, lse) together, or one of the
    backward's gradients dq, dK, dV."""

    OUT = 0
    DQ = 1
    DK = 2
    DV = 3


FORWARD_KINDS = (Kind.OUT,)
BACKWARD_KINDS = (Kind.DQ, Kind.DK, Kind.DV)


class Blocks:
    """This rank's block accumulators: made on demand, pending outputs, freed after the last write.

    ``make(block, kind, init)`` builds accumulator `kind` (a ``Kind`` of `kinds`) of a
    plan ``Block`` (a
    tensor, or a tuple for the forward's (out, lse)), holding the merge's
    identity if `init`, else uninitialised for writes that store every entry
    (``add``'s `assign`); ``write(block, kind, acc)`` stores a finished one in
    the output; ``nbytes(block, kind)`` is its size, for the pending
    threshold; ``writers`` counts the writes each (block, kind) will get.
    """

    def __init__(self, plan: Plan, kinds: Tuple[Kind, ...], make: Callable, write: Callable,
                 nbytes: Callable, writers: Dict[Tuple[int, Kind], int],
                 unwritten: bool = True) -> None:
        self.by_index = {block.index: block for block in plan.blocks}
        self.spans = {block.index: (block.lo, block.hi) for block in plan.blocks}
        self.order = [block.index for block in plan.blocks]
        self.kinds, self.make, self.write, self.nbytes = kinds, make, write, nbytes
        self.writers = dict(writers)
        self.live: Dict[Tuple[int, int], object] = {}
        self.pending: Dict[Tuple[int, int], List[Callable]] = {}
        self.pending_bytes: Dict[Tuple[int, int], int] = {}
        self.finished: set = set()
        # accumulators made uninitialised, still taking the stores that tile them
        self.storing: set = set()
        self.current: Optional[int] = None
        # whether finish_all makes (the identity) and writes out accumulators that no
        # write reached; not where the outputs already hold a part (forward_beside)
        self.unwritten = unwritten

    def turn(self, index: int) -> None:
        """Block `index` runs now: outputs for it are applied at once."""
        self.current = index

    def acc(self, index: int, kind: Kind):
        """The accumulator, made now (with every pending output applied) if need be."""
        key = (index, kind)
        if key not in self.live:
            self.live[key] = self.make(self.by_index[index], kind, True)
            for apply in self.pending.pop(key, ()):
                apply(self.live[key])
            self.pending_bytes.pop(key, None)
        return self.live[key]

    def add(self, index: int, kind: Kind, apply: Callable, nbytes: int,
            assign: Optional[Callable] = None, tiling: bool = False) -> None:
        """One write `apply(acc)` into (block, kind): now, or pending until the block's turn.

        `assign(acc)` stores the write's entries instead of merging them, if it is
        the block's first write: the accumulator is made without its identity fill
        (the same values: a merge into the identity multiplies by 1). With
        `tiling`, the write is one of a run of writes whose entries are disjoint
        and together cover the block (``stored_launches``): each stores while
        only the run's earlier writes have written the accumulator. Otherwise
        (a write came first, or is pending) it merges like any write.
        """
        key = (index, kind)
        first = (key not in self.live and key not in self.pending
                 and key not in self.finished)
        if assign is not None and index == self.current and (
                first or (tiling and key in self.storing)):
            if first:
                self.live[key] = self.make(self.by_index[index], kind, False)
                if tiling:
                    self.storing.add(key)
            assign(self.live[key])
        elif key in self.live or index == self.current:
            self.storing.discard(key)
            apply(self.acc(index, kind))
        else:
            self.pending.setdefault(key, []).append(apply)
            self.pending_bytes[key] = self.pending_bytes.get(key, 0) + nbytes
            if self.pending_bytes[key] >= self.nbytes(self.by_index[index], kind):
                self.acc(index, kind)  # the accumulator is no larger than what waits
        self.writers[key] -= 1
        if self.writers[key] == 0 and (key in self.live or index == self.current):
            self._finish(key)

    def _finish(self, key: Tuple[int, Kind]) -> None:
        self.storing.discard(key)
        acc = self.acc(*key)
        self.write(self.by_index[key[0]], key[1], acc)
        del self.live[key]
        self.finished.add(key)

    def end_turn(self, index: int) -> None:
        """Finish the block's accumulators that have had all their writes."""
        for kind in self.kinds:
            key = (index, kind)
            if key not in self.finished and self.writers.get(key, 0) == 0:
                self._finish(key)
        self.current = None

    def finish_all(self) -> None:
        for index in self.order:
            for kind in self.kinds:
                key = (index, kind)
                if key not in self.finished and (self.unwritten or key in self.writers):
                    self._finish(key)

    def relative(self, index: int, segs: Segments) -> Segments:
        """`segs` in rows of block `index` (its accumulators' rows)."""
        by = -self.spans[index][0]
        if segs.starts is None:
            return segs._replace(start=segs.start + by)
        return segs._replace(starts=segs.starts + by)


def output_accumulators(q: Tensor, own: Optional[Tuple[Tensor, Tensor]] = None
                        ) -> Tuple[Tensor, Tensor, Callable, Callable, Callable]:
    """The forward's outputs out (b, n, h, d) and lse (b, n, h), uninitialised, and the
    ``make``, ``write`` and ``nbytes`` of their block accumulators (`Blocks`, of
    FORWARD_KINDS: (out, lse)). `own`: outputs that already hold a part of the result
    (``forward_beside``), which the accumulators start from instead of the identity."""
    b, n, h, d = q.shape
    acc = lse_dtype(q.dtype)
    if own is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((b, n, h), dtype=acc, device=q.device)
    else:
        out, lse = own

    def make(block: Block, kind: Kind, init: bool) -> Tuple[Tensor, Tensor]:
        # the merge's identity (0, -inf); lse is written in place, out too where it can
        lo, hi = block.lo, block.hi
        in_output = policy.in_output(block.entry_writes, out.dtype)
        if own is not None:
            return (out[:, lo:hi] if in_output else out[:, lo:hi].to(acc)), lse[:, lo:hi]
        acc_out = (out[:, lo:hi] if in_output
                   else torch.empty((b, hi - lo, h, d), dtype=acc, device=q.device))
        acc_lse = lse[:, lo:hi]
        if init:
            acc_out.zero_()
            acc_lse.fill_(-float("inf"))
        return acc_out, acc_lse

    def write(block: Block, kind: Kind, accs: Tuple[Tensor, Tensor]) -> None:
        if not policy.in_output(block.entry_writes, out.dtype):
            out[:, block.lo:block.hi] = accs[0]

    def nbytes(block: Block, kind: Kind) -> int:
        if policy.in_output(block.entry_writes, out.dtype):
            return 0
        return b * (block.hi - block.lo) * h * d * torch.finfo(acc).bits // 8

    return out, lse, make, write, nbytes


def gradient_accumulators(*inputs: Tensor, own: Optional[Tuple[Tensor, ...]] = None
                          ) -> Tuple[Tuple[Tensor, ...], Callable, Callable, Callable]:
    """The backward's gradients, one per input (dq, dK, dV: BACKWARD_KINDS), uninitialised,
    and the ``make``, ``write`` and ``nbytes`` of their block accumulators (`Blocks`).
    `own`: gradients that already hold a part (``backward_beside``), which the
    accumulators start from instead of zeros."""
    acc = lse_dtype(inputs[0].dtype)
    grads = own or tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs)
    of_kind = dict(zip(BACKWARD_KINDS, grads))

    def make(block: Block, kind: Kind, init: bool) -> Tensor:
        g, lo, hi = of_kind[kind], block.lo, block.hi
        in_output = policy.in_output(block.entry_writes, g.dtype)
        if own is not None:
            return g[:, lo:hi] if in_output else g[:, lo:hi].to(acc)
        if in_output:
            return g[:, lo:hi].zero_() if init else g[:, lo:hi]
        new = torch.zeros if init else torch.empty
        return new((g.shape[0], hi - lo) + g.shape[2:], dtype=acc, device=g.device)

    def write(block: Block, kind: Kind, block_acc: Tensor) -> None:
        if not policy.in_output(block.entry_writes, of_kind[kind].dtype):
            of_kind[kind][:, block.lo:block.hi] = block_acc

    def nbytes(block: Block, kind: Kind) -> int:
        g = of_kind[kind]
        per_row = g[:, :1].numel() * torch.finfo(acc).bits // 8
        if policy.in_output(block.entry_writes, g.dtype):
            return 0
        return (block.hi - block.lo) * per_row

    return grads, make, write, nbytes


def count_writers(plan: Plan, backward: bool, local: Optional[Sequence[Launch]] = None,
                  homes: bool = True) -> Dict[Tuple[int, Kind], int]:
    """How many writes each (block, kind) gets: the `local` launches (None: every one of
    the plan), remote launches, dK/dV home (unless not `homes`: none is sent)."""
    counts: Dict[Tuple[int, Kind], int] = {}
    queries = Kind.DQ if backward else Kind.OUT

    def add(index: int, kind: Kind) -> None:
        counts[(index, kind)] = counts.get((index, kind), 0) + 1

    if local is None:
        local = [launch for block in plan.blocks for launch in block.forward]
    for launch in local:
        for index in launch.q_blocks:
            add(index, queries)
        if backward:
            for index in launch.k_blocks:
                add(index, Kind.DK)
                add(index, Kind.DV)
    for rnd in plan.rounds:
        for t in rnd.recvs:
            for launch in t.launches:
                for index in launch.q_blocks:
                    add(index, queries)
        if backward and homes:
            for t in rnd.sends:
                for index, _, _, _ in t.homes:
                    add(index, Kind.DK)
                    add(index, Kind.DV)
    return counts


def _key_mask(key_mask: Optional[Tensor], segs: Segments, group: HeadGroup) -> Optional[Tensor]:
    """The launch's keys' padding mask (b * count, kv_rows, hkv), True = ignore; or None."""
    if key_mask is None:
        return None
    # (b, n) -> (b, n, 1) broadcast over kv heads, gathered like k
    # (the kv heads from `pairs`, host values: group.kv_heads may live on the device, or on
    # meta)
    expanded = key_mask[:, :, None].expand(-1, -1, max(kv for _, kv in group.pairs) + 1)
    return gather(expanded, segs, group.kv_heads, group.kv_index, group.kv_stride)


def stored_launches(launches, span: Tuple[int, int], heads: int, keys: bool = False) -> int:
    """How many of a block's first `launches` store their results (Note [block
    accumulators]): dense launches of whole segments, all `heads`, one after another from
    the block's first row, that together tile the block `span` (and, `keys`, whose keys
    are their own rows, so that their dK/dV tile it too); 0 when they do not tile it."""
    lo, hi = span
    row, count = lo, 0
    for launch in launches:
        g, segs = launch.heads, launch.queries
        if row == hi or not (g.identity and segs.starts is None and segs.start == row
                             and g.rows == segs.length and g.q_heads.numel() == heads
                             and launch.q_block == launch.k_block):
            break
        if keys and not (launch.keys == segs and g.kv_index.shape[0] == segs.length):
            break
        row, count = row + segs.rows, count + 1
    return count if row == hi else 0


def _assign(acc: Tensor, segs: Segments, y: Tensor) -> None:
    """acc[:, rows of segs] <- y (b * count, w, heads, ...): a run of segments (rows relative
    to the block, ``Blocks.relative``), in order."""
    rows = acc[:, segs.start:segs.start + segs.rows]
    # (b, count * w, ...) -> (b, count, w, ...) and (b * count, w, ...) -> (b, count, w, ...)
    rows.unflatten(1, (segs.count, segs.length)).copy_(y.unflatten(0, (acc.shape[0], -1)))


def row_slices(rows: int, per_row: int, device: torch.device) -> List[slice]:
    step = max(1, policy.slice_elements(device.type) // max(per_row, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _row_slices_of(y: Tensor, dim: int) -> List[slice]:
    """`row_slices` of y's rows along `dim`, each row the entries of the other dims (counted
    without indexing a row: that was a select op per merge or scatter)."""
    rows = y.shape[dim]
    return row_slices(rows, y.numel() // max(rows, 1), y.device)


def merge_rows(acc_out: Tensor, acc_lse: Tensor, segs: Segments, group: HeadGroup,
               out_g: Tensor, lse_g: Tensor) -> None:
    """Merge a launch's (b * count, rows, hq, ...) results into (b, n, h, ...) accumulators."""
    # (b * s, rows, heads, ...) -> (b, s, rows, heads, ...)
    out_g = out_g.unflatten(0, (acc_out.shape[0], segs.count))
    lse_g = lse_g.unflatten(0, (acc_out.shape[0], segs.count))
    view = is_view(segs, group.q_stride)
    if view:
        # (b, n, h, ...) -> (b, s, rows, hq, ...): the entries the launch computed
        acc_out, acc_lse = (strided_view(x, segs, group.q_stride, *group.q_index.shape)
                            for x in (acc_out, acc_lse))
    slices = _row_slices_of(out_g, 2)
    if view and len(slices) == 1:
        # every row in one merge (a short call's): the views themselves, not [:, :, rows] of
        # each, which dispatched four alias ops a merge
        merge_(acc_out, acc_lse, out_g, lse_g)
        return
    for rows in slices:
        if view:
            merge_(acc_out[:, :, rows], acc_lse[:, :, rows], out_g[:, :, rows], lse_g[:, :, rows])
        else:
            merge_selected_(acc_out, acc_lse, selection(segs, group.q_heads, group.q_index[rows]),
                            out_g[:, :, rows], lse_g[:, :, rows])


def _scatter(acc: Tensor, segs: Segments, heads: Tensor, index: Tensor, stride: Optional[Stride],
             y: Tensor) -> None:
    """acc[rows of segs, heads] += y (b * count, rows, heads, d), in slices of rows."""
    slices = _row_slices_of(y, 1)
    if len(slices) == 1:
        # every row at once (a short call's): y as it is, not unflattened, cut and flattened
        scatter_add_(acc, segs, heads, index, stride, y)
        return
    # (b * s, rows, heads, d) -> (b, s, rows, heads, d)
    y = y.unflatten(0, (acc.shape[0], segs.count))
    for rows in slices:
        scatter_add_(acc, segs, heads, index, stride, y[:, :, rows].flatten(0, 1), rows=rows)


def _remote_block(buf: Tensor, launch: RemoteLaunch) -> Tensor:
    """The launch's kv block (b, kv_rows, hkv, ...) from a pair-major (b, columns, ...) buffer."""
    g = launch.heads
    hkv, kv_rows = g.kv_heads.numel(), g.kv_index.shape[0]
    # (b, hkv * kv_rows, ...) -> (b, hkv, kv_rows, ...) -> (b, kv_rows, hkv, ...)
    return buf[:, launch.columns].unflatten(1, (hkv, kv_rows)).transpose(1, 2)


# --------------------------------------------------------------------------
# Forward


def forward(q: Tensor, k: Tensor, v: Tensor, plan: Plan, opts: KernelOptions, *,
            key_mask: Optional[Tensor] = None,
            remote: Optional[RemoteKeys] = None) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32 (fp64)."""
    only = _only_launch(plan, q.shape[2], backward=False) if remote is None else None
    if only is not None:
        out_g, lse_g = _launch_forward(q, k, v, only, opts, key_mask)
        return (_as_rows(out_g, q.shape[0]).to(q.dtype).contiguous(),
                _as_rows(lse_g, q.shape[0]).to(lse_dtype(q.dtype)).contiguous())
    out, lse, *accumulators = output_accumulators(q)
    blocks = Blocks(plan, FORWARD_KINDS, *accumulators, count_writers(plan, backward=False))
    if remote is not None:
        remote.post()
    for block in plan.blocks:
        if block.remote and remote is not None:
            _forward_remote(q, remote, blocks, opts)
            remote = None  # every round is done
        blocks.turn(block.index)
        stores = stored_launches(block.forward, blocks.spans[block.index], q.shape[2])
        for i, launch in enumerate(block.forward):
            _forward_local(q, k, v, launch, blocks, opts, key_mask, store=i < stores)
        blocks.end_turn(block.index)
    blocks.finish_all()
    return out, lse


def _forward_local(q: Tensor, k: Tensor, v: Tensor, launch: Launch, blocks: Blocks,
                   opts: KernelOptions, key_mask: Optional[Tensor], store: bool = False) -> None:
    """One launch on this rank's own keys, merged into (or pending for) its query block."""
    out_g, lse_g = _launch_forward(q, k, v, launch, opts, key_mask)
    _merge_into(blocks, launch, out_g, lse_g, store=store)


def _launch_forward(q: Tensor, k: Tensor, v: Tensor, launch: Launch, opts: KernelOptions,
                    key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """One launch on this rank's own keys: its (b * count, rows, heads, ...) out and lse."""
    g = launch.heads
    q_g = _kernel_input(q, launch.queries, g.q_heads, g.q_index, g.q_stride)
    k_g = _kernel_input(k, launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
    v_g = _kernel_input(v, launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
    return attention_forward(
        q_g, k_g, v_g, opts.for_launch(launch.id, causal=launch.causal),
        key_mask=_key_mask(key_mask, launch.keys, g),
    )


def _as_rows(y: Tensor, b: int) -> Tensor:
    """The only launch's result (b * count, w, heads, ...) as the rows (b, count * w, heads,
    ...) of the output it tiles, segment after segment (a view where its strides allow)."""
    # (b * count, w, ...) -> (b, count, w, ...) -> (b, count * w, ...)
    return y.unflatten(0, (b, -1)).flatten(1, 2)


def _only_launch(plan: Plan, heads: int, backward: bool) -> Optional[Launch]:
    """The plan's launch when it alone computes every entry of the outputs (or, `backward`,
    of dq, dK and dV), else None: one block of every row, no exchange, and one launch of
    whole segments that would store its results there (``stored_launches``). Its results
    are then the outputs, returned as they are instead of copied into accumulators (the
    same values: a stored launch's copy; a copy of out at 512 x 12 x 64 cost about as
    much as a quarter of the CPU kernel)."""
    if len(plan.blocks) != 1 or plan.rounds:
        return None
    block = plan.blocks[0]
    launches = block.backward if backward else block.forward
    if len(launches) != 1 or (block.lo, block.hi) != (0, plan.rows):
        return None
    return launches[0] if stored_launches(launches, (0, plan.rows), heads, keys=backward) else None


class OwnKeys(NamedTuple):
    """Launches on a rank's own keys that the fused kernel's `own()` leaves out (a zigzag
    rank's pairs across its two chunks: ``sequence_parallel.FusedPiece``), and what they
    read: k, v (b, n, hk, d) and the key padding mask (b, n) or None."""

    k: Tensor
    v: Tensor
    key_mask: Optional[Tensor]
    launches: Tuple[Launch, ...] = ()


def forward_beside(q: Tensor, plan: Plan, opts: KernelOptions,
                   own: Callable[[], Tuple[Tensor, Tensor]],
                   remote: RemoteKeys, local: Optional[OwnKeys] = None) -> Tuple[Tensor, Tensor]:
    """`forward` with the plan's local launches replaced by `own()`: out (b, n, h, d) and
    lse (b, n, h) of this rank's rows over its own keys (the fused kernel's piece), all but
    the pairs of the `local` launches, computed while the first exchange is in flight. The
    `local` launches and those on received keys merge into those outputs through block
    accumulators that start from them (in the output where ``policy.in_output`` allows,
    else fp32 copies of the blocks they write)."""
    remote.post()
    out, lse, *accumulators = output_accumulators(q, own())
    blocks = _beside_blocks(plan, FORWARD_KINDS, accumulators, False, local)
    for launch in local.launches if local else ():
        _forward_local(q, local.k, local.v, launch, blocks, opts, local.key_mask)
    _forward_remote(q, remote, blocks, opts)
    blocks.finish_all()
    return out, lse


def _beside_blocks(plan: Plan, kinds: Tuple[Kind, ...], accumulators, backward: bool,
                   local: Optional[OwnKeys], homes: bool = True) -> Blocks:
    """Accumulators of the blocks that launches on received keys, the `local` launches and
    dK/dV sent home (`homes`) write, for ``forward_beside``/``backward_beside``: every other
    one is final already (``unwritten=False``: never made nor written out)."""
    writers = count_writers(plan, backward, local=local.launches if local else (),
                            homes=homes)
    return Blocks(plan, kinds, *accumulators, writers, unwritten=False)


def _merge_into(blocks: Blocks, launch, out_g: Tensor, lse_g: Tensor,
                store: bool = False) -> None:
    """Merge a launch's results into its query block's accumulators (now or pending), or
    `store` them there (``stored_launches``); a launch split over blocks merges each
    block's entries there."""
    group = launch.heads
    if not launch.q_split:
        rel = blocks.relative(launch.q_block, launch.queries)

        def apply(accs: Tuple[Tensor, Tensor]) -> None:
            merge_rows(accs[0], accs[1], rel, group, out_g, lse_g)

        def assign(accs: Tuple[Tensor, Tensor]) -> None:
            _assign(accs[0], rel, out_g)
            _assign(accs[1], rel, lse_g)

        blocks.add(launch.q_block, Kind.OUT, apply, out_g.nbytes + lse_g.nbytes,
                   assign if store else None, tiling=store)
        return
    # one segment: (b, rows, hq, ...) -> (b, rows * hq, ...), the entries in each block
    flat_out, flat_lse = out_g.flatten(1, 2), lse_g.flatten(1, 2)
    for split in launch.q_split:
        part_out, part_lse = flat_out[:, split.index], flat_lse[:, split.index]

        def apply(accs, split=split, part_out=part_out, part_lse=part_lse) -> None:
            for e in row_slices(split.index.numel(), part_out[:, :1].numel(),
                                 part_out.device):
                merge_selected_(accs[0], accs[1], (slice(None), split.rows[e], split.heads[e]),
                                part_out[:, e], part_lse[:, e])

        blocks.add(split.block, Kind.OUT, apply, part_out.nbytes + part_lse.nbytes)


def _forward_remote(q: Tensor, remote: RemoteKeys, blocks: Blocks, opts: KernelOptions) -> None:
    """Every launch on received keys, merged into (or pending for) its query block."""
    for _, received in remote.keys():
        for transfer, buf, mask in received:
            for launch in transfer.launches:
                g = launch.heads
                q_g = gather(q, launch.queries, g.q_heads, g.q_index, g.q_stride)
                # remote keys are all earlier (causal) or all visible: no causal mask
                out_g, lse_g = attention_forward(
                    q_g, _remote_block(buf[0], launch), _remote_block(buf[1], launch),
                    opts.for_launch(launch.id, causal=False),
                    key_mask=None if mask is None else _remote_block(mask, launch),
                )
                _merge_into(blocks, launch, out_g, lse_g)
                del q_g, out_g, lse_g
            del buf, mask


# --------------------------------------------------------------------------
# Backward


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: Plan,
             opts: KernelOptions, *, dlse: Optional[Tensor] = None,
             key_mask: Optional[Tensor] = None,
             remote: Optional[RemoteKeys] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `forward`, given its final out (b, n, h, d) and lse (b, n, h)."""
    only = _only_launch(plan, q.shape[2], backward=True) if remote is None else None
    if only is not None:
        grads = _launch_backward((dout, q, out, lse, dlse), k, v, only, opts, key_mask)
        return tuple(_as_rows(g, q.shape[0]).to(x.dtype).contiguous()
                     for g, x in zip(grads, (q, k, v)))
    grads, *accumulators = gradient_accumulators(q, k, v)
    blocks = Blocks(plan, BACKWARD_KINDS, *accumulators, count_writers(
        plan, backward=True, homes=remote is None or remote.kv_grad))
    saved = (dout, q, out, lse, dlse)
    if remote is not None:
        remote.post()
    for block in plan.blocks:
        if block.remote and remote is not None:
            _backward_remote(saved, remote, blocks, opts)
            remote = None
        blocks.turn(block.index)
        stores = stored_launches(block.backward, blocks.spans[block.index], q.shape[2],
                                 keys=True)
        for i, launch in enumerate(block.backward):
            _backward_local(saved, k, v, launch, blocks, opts, key_mask, store=i < stores)
        blocks.end_turn(block.index)
    blocks.finish_all()
    return grads


def _backward_local(saved, k: Tensor, v: Tensor, launch: Launch, blocks: Blocks,
                    opts: KernelOptions, key_mask: Optional[Tensor], store: bool = False
                    ) -> None:
    """One launch's gradients on this rank's own keys: dq into its query block, dK/dV into
    its key block (now or pending)."""
    g = launch.heads
    q_sel = (launch.queries, g.q_heads, g.q_index, g.q_stride)
    kv_sel = (launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
    dq_g, dk_g, dv_g = _launch_backward(saved, k, v, launch, opts, key_mask)
    _scatter_into(blocks, launch.q_block, launch.q_split, Kind.DQ, q_sel, dq_g, store)
    _scatter_into(blocks, launch.k_block, launch.k_split, Kind.DK, kv_sel, dk_g, store)
    _scatter_into(blocks, launch.k_block, launch.k_split, Kind.DV, kv_sel, dv_g, store)


def _launch_backward(saved, k: Tensor, v: Tensor, launch: Launch, opts: KernelOptions,
                     key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """One launch's (b * count, rows, heads, d) dq, dK and dV on this rank's own keys."""
    dout, q, out, lse, dlse = saved
    g = launch.heads
    q_sel = (launch.queries, g.q_heads, g.q_index, g.q_stride)
    kv_sel = (launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
    return attention_backward(
        gather(dout, *q_sel), gather(q, *q_sel), gather(k, *kv_sel), gather(v, *kv_sel),
        gather(out, *q_sel), gather(lse, *q_sel),
        opts.for_launch(launch.id, causal=launch.causal),
        dlse=None if dlse is None else gather(dlse, *q_sel),
        key_mask=_key_mask(key_mask, launch.keys, g),
    )


def backward_beside(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, plan: Plan,
                    opts: KernelOptions, own: Callable[[], Tuple[Tensor, Tensor, Tensor]],
                    remote: RemoteKeys, dlse: Optional[Tensor] = None,
                    local: Optional[OwnKeys] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of `forward_beside`: `own()` gives dq, dk, dv of this rank's pairs (rows
    and keys its own, but the `local` launches', from the final out and lse), computed
    while the first exchange is in flight; the `local` launches and those on received keys
    add theirs, and the dK/dV that readers send home, through block accumulators that start
    from them."""
    remote.post()
    grads, *accumulators = gradient_accumulators(q, own=own())
    blocks = _beside_blocks(plan, BACKWARD_KINDS, accumulators, True, local, remote.kv_grad)
    saved = (dout, q, out, lse, dlse)
    for launch in local.launches if local else ():
        _backward_local(saved, local.k, local.v, launch, blocks, opts, local.key_mask)
    _backward_remote(saved, remote, blocks, opts)
    blocks.finish_all()
    return grads


def _scatter_into(blocks: Blocks, index: int, split, kind: Kind, sel, y: Tensor,
                  store: bool = False) -> None:
    """Add a launch's gradient (b * count, rows, heads, d) into a block (now or pending), or
    `store` it there (``stored_launches``); a launch split over blocks adds each block's
    entries there."""
    segs, heads, rows_index, stride = sel
    if not split:
        rel = blocks.relative(index, segs)
        blocks.add(index, kind, lambda a: _scatter(a, rel, heads, rows_index, stride, y),
                   y.nbytes, (lambda a: _assign(a, rel, y)) if store else None,
                   tiling=store)
        return
    # one segment: (b, rows, heads, d) -> (b, rows * heads, d), the entries in each block
    flat = y.flatten(1, 2)
    for share in split:
        entries = flat[:, share.index]

        def apply(a: Tensor, share=share, entries=entries) -> None:
            # each (row, head) once within a block: read-add-write is exact
            a[:, share.rows, share.heads] += entries

        blocks.add(share.block, kind, apply, entries.nbytes)


def _backward_remote(saved, remote: RemoteKeys, blocks: Blocks, opts: KernelOptions) -> None:
    """Launches on received keys: dq into query blocks, dK/dV home; ours come back."""
    dout, q, out, lse, dlse = saved
    acc = lse_dtype(q.dtype)
    for round_index, received in remote.keys():
        sent_back = []
        for transfer, buf, mask in received:
            # dK/dV go home only where some rank differentiates k or v
            grad = torch.zeros(buf.shape, dtype=acc, device=buf.device) if remote.kv_grad else None
            for launch in transfer.launches:
                g = launch.heads
                q_sel = (launch.queries, g.q_heads, g.q_index, g.q_stride)
                dq_g, dk_g, dv_g = attention_backward(
                    gather(dout, *q_sel), gather(q, *q_sel), _remote_block(buf[0], launch),
                    _remote_block(buf[1], launch), gather(out, *q_sel), gather(lse, *q_sel),
                    opts.for_launch(launch.id, causal=False),
                    dlse=None if dlse is None else gather(dlse, *q_sel),
                    key_mask=None if mask is None else _remote_block(mask, launch),
                    kv_grad=remote.kv_grad,
                )
                _scatter_into(blocks, launch.q_block, launch.q_split, Kind.DQ, q_sel, dq_g)
                # (b, kv_rows, hkv, d) -> the pair-major columns of the wire format
                for i, dx in enumerate((dk_g, dv_g) if remote.kv_grad else ()):
                    _remote_block(grad[i], launch).add_(dx)
                del dq_g, dk_g, dv_g
            sent_back.append(grad)
            del buf, mask
        if remote.kv_grad:  # else no rank needs them
            for transfer, home in remote.send_home(round_index, sent_back):
                _add_home(home, transfer, blocks)
        del sent_back


def _add_home(home: Tensor, transfer: Transfer, blocks: Blocks) -> None:
    """Add the dK/dV (2, b, columns, d) of our key part that a reader sent back."""
    for index, rows, heads, columns in transfer.homes:
        for which, kind in enumerate((Kind.DK, Kind.DV)):
            # (b, e, d) entries of this block: each (row, kv head) once, so += is exact
            entries = home[which][:, columns]

            def apply(a: Tensor, entries=entries, rows=rows, heads=heads) -> None:
                a[:, rows, heads] += entries

            blocks.add(index, kind, apply, entries.nbytes)
