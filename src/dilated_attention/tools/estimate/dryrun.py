"""The estimate's measurement: one rank's call, the real code, on meta tensors.

The rank's q, k, v (and dout) are ``meta`` tensors (shapes, no data) and its group
is torch's fake process group of world size P (collectives that move nothing; an
all-gather returns this rank's input for every rank, so the op's agreement sees P
copies of this rank's call: the ring takes every piece as long as this rank's,
which differ by a row at most). ``LiveBytes``, a dispatch mode, adds each new tensor
storage's bytes when an op makes it and subtracts them when the storage is freed:
its highest sum in a phase is the phase's peak. ``comm.count_communication``
counts what the rank sends.

What runs: the dilated op's executor under its validation (``launches`` on one
device, ``sp_forward``/``sp_backward`` over the group) with the plan of the device
modelled (the public op would plan for its tensors' device, meta). Where the
modelled GPU runs the fused kernel (``config.fuses``): its host side
(``fused.forward``/``backward``, which on meta allocates what its launches write)
for the whole op, or over the group for each rank's own pairs beside the launches
on received keys (``FusedPiece``). The public op for the ring and for Ulysses and
2-D meshes, which plan on the CPU's sizes.

Two shortcuts keep it fast and leave the bytes as they are (tests trace with and
without them): ``compact_plan``, and ``LiveBytes(reuse=True)``.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ... import launches
from ...dilated import backward_flat, dilated_attention_local, forward_flat
from ...distributed import comm
from .. import launch
from ...distributed.sequence_parallel import (FusedPiece,
                                               SequenceParallelDilatedAttentionFunction,
                                               sp_backward, sp_forward)
from ...distributed.halo import halo_schedule
from ...distributed.ulysses import HeadSplit, ulysses_attention
from ...functional import ring_attention
from ...kernels import KernelOptions
from ...patterns import Heads
from ...layout import Layout
from ...plan import Launch, Plan, make_plan
from ..launch import fake_world
from .config import EstimateConfig, backend_for, fuses, split
from .formula import Traffic

# The single-device op is a pair of custom ops: a dispatch mode sees each call as one
# op and is off inside it, so the tracer runs their Python code itself, traced too.
_CUSTOM_OPS = {"dilated_attention::forward": forward_flat,
               "dilated_attention::backward": backward_flat}


@dataclasses.dataclass
class Trace:
    """One rank's call: its rows, the live bytes at each phase's peak (inputs included),
    what it sent (counted), and its plan (None for the ring)."""

    piece: int
    rows: int
    peaks: Dict[str, int]
    sent: Traffic
    plan: Optional[Plan]


def plan_for(config: EstimateConfig, rank: int) -> Plan:
    """The rank's plan, as the op builds it on config.device (index tensors on meta)."""
    heads = Heads.of(config.heads, config.kv_heads)
    return make_plan(Layout.contiguous(config.lengths()), config.patterns, config.causal, heads,
                     rank, "meta", device_type=config.device)


def trace(config: EstimateConfig, rank: int, *, reuse: bool = True,
          compact: bool = True) -> Trace:
    """Run the call of `rank` (a mesh's piece order: (u, s) is s U + u) on meta tensors.

    `reuse`, `compact`: the shortcuts (see LiveBytes, compact_plan)."""
    if launch.is_initialized():
        raise ValueError("the dry run needs a process without a default process group")
    # Imported here, not inside the trace: a meta kernel's first call imports it, and that
    # import keeps the frames that called it (and their tensors) until a garbage collection.
    import torch._dynamo  # noqa: F401

    u, sp = split(config)
    world = fake_world(rank, config.world_size) if config.world_size > 1 else None
    try:
        group = comm.resolve_group(launch.init_device_mesh((u, sp)) if config.mesh else world)
        piece = comm.group_rank(group)
        lengths = config.lengths()
        n = lengths[piece]
        opts = KernelOptions(config.causal, 1.0 / math.sqrt(config.head_dim), backend_for(config),
                             dropout_p=config.dropout)
        # the plan before the tracker: its index tensors are made once per shape and cached
        # (the fused kernel's too: formula.fused_plan_bytes counts those). The fused kernel
        # runs the whole op where a rank computes it (no plan), else each rank's own pairs
        whole_op = fuses(config) and sp == 1
        executor = (None if config.impl == "ring" or whole_op
                    else _plan(config, group, u, compact))
        # one device's whole op is the piece of all its rows
        own = _piece(config, group, u) if fuses(config) else None
        if whole_op:
            opts = dataclasses.replace(opts, backend="triton")
        tracker = LiveBytes(reuse=reuse)
        with tracker:
            # (b, n, heads, d) on meta: shapes only
            q, k, v, dout = (torch.empty(config.batch, n, heads, config.head_dim,
                                         dtype=config.torch_dtype, device="meta")
                             for heads in (config.heads, config.kv_heads, config.kv_heads,
                                           config.heads))
            dout = dout if config.training else None
            autograd = config.impl == "ring" or u > 1
            for x in (q, k, v):
                x.requires_grad_(autograd and config.training)
            with comm.count_communication() as forward:
                if config.impl == "ring":
                    out = ring_attention(q, k, v, is_causal=config.causal, group=group,
                                         layout="contiguous" if config.mesh else config.layout,
                                         backend=opts.backend, window_size=config.window_size)
                elif u > 1:
                    out = _ulysses(q, k, v, group, lengths, executor, opts, config.patterns,
                                   own)
                elif whole_op:
                    out, lse = own.forward(q, k, v, opts, None)
                else:
                    out, lse = (launches.forward(q, k, v, executor, opts) if group is None
                                else sp_forward(q, k, v, executor, opts, group, piece=own))
            peaks = {"forward": tracker.peak}
            tracker.peak = tracker.live
            with comm.count_communication() as backward:
                if config.training and autograd:
                    out.backward(dout)
                elif config.training and whole_op:
                    grads = own.backward(dout, q, k, v, out, lse, None, opts, None)
                    del grads
                elif config.training:
                    grads = (launches.backward(dout, q, k, v, out, lse, executor, opts)
                             if group is None else
                             sp_backward(dout, q, k, v, out, lse, executor, opts, group,
                                         piece=own))
                    del grads
            if config.training:
                peaks["backward"] = tracker.peak
            del out
    finally:
        if world is not None:
            launch.destroy_process_group()
    return Trace(piece, n, peaks, (forward.bytes_sent, forward.messages, backward.bytes_sent,
                                   backward.messages), executor)


def _groups(group) -> Tuple[comm.Group, comm.Group]:
    """(heads, sequence) groups of a head-parallel call: a mesh's, or a 1-D group's alone."""
    return (group.heads, group.sequence) if isinstance(group, comm.Grid) else (group, None)


def _sequence_rows(config: EstimateConfig, group, u: int) -> Tuple[Heads, int, List[int]]:
    """(heads, rank, piece lengths) of the sequence-parallel op this rank runs: its piece of
    every head, or under Ulysses its heads over its heads group's block of rows."""
    heads, rank, lengths = Heads.of(config.heads, config.kv_heads), comm.group_rank(group), \
        config.lengths()
    if u > 1:
        head_group, sequence = _groups(group)
        heads = HeadSplit.of(u, config.heads, config.kv_heads).local_heads(
            comm.group_rank(head_group))
        rank = comm.group_rank(sequence)
        lengths = [sum(lengths[t * u:(t + 1) * u]) for t in range(len(lengths) // u)]
    return heads, rank, list(lengths)


def _plan(config: EstimateConfig, group, u: int, compact: bool) -> Plan:
    """The plan the dilated op's executor runs on this rank (``_sequence_rows``)."""
    heads, rank, lengths = _sequence_rows(config, group, u)
    plan = make_plan(Layout.contiguous(lengths), config.patterns, config.causal, heads, rank,
                     "meta", device_type=config.device)
    return compact_plan(plan, heads.count) if compact else plan


def _piece(config: EstimateConfig, group, u: int) -> FusedPiece:
    """This rank's own pairs in the fused kernel, as the op runs them on the modelled GPU."""
    heads, rank, lengths = _sequence_rows(config, group, u)
    return FusedPiece(config.patterns, heads, None, sum(lengths),
                      ((sum(lengths[:rank]), 0, lengths[rank]),))


def _ulysses(q: Tensor, k: Tensor, v: Tensor, group, lengths, plan: Optional[Plan],
             opts: KernelOptions, patterns, piece: Optional[FusedPiece]) -> Tensor:
    """The dilated op head-parallel, as ``functional`` routes it: ``ulysses_attention`` over
    the heads group, the executor over the sequence group on all rows of the heads' block
    (`plan`, and `piece` where the fused kernel runs its own pairs), or with no plan
    (Ulysses over every rank, opts.backend the fused kernel) the single-device op on them."""
    heads, sequence = _groups(group)
    size = comm.group_size(heads)
    blocks = [lengths[t * size:(t + 1) * size] for t in range(comm.group_size(sequence))]

    def attend(q_u, k_u, v_u, local: Heads, mask):
        if plan is None:
            return dilated_attention_local(q_u, k_u, v_u, patterns, opts, heads=local)
        return SequenceParallelDilatedAttentionFunction.apply(q_u, k_u, v_u, plan, opts,
                                                              sequence, None, piece)

    return ulysses_attention(q, k, v, None, heads, blocks[comm.group_rank(sequence)], attend)[0]


def ranks_to_check(config: EstimateConfig) -> List[int]:
    """Every rank for small P; else the ranks whose pieces differ (ends, neighbours, middle)."""
    p = config.world_size
    if p <= 8:
        return list(range(p))
    return sorted({0, 1, 2, p // 2, p - 3, p - 2, p - 1})


def distinct_ranks(config: EstimateConfig) -> List[int]:
    """One rank per distinct plan among `ranks_to_check`: equal plans trace equally.

    A plan's signature is what its memory depends on: the piece length, the
    shapes of its local launches and the pairs of each exchange round. Ring ranks
    differ by their pieces only; Ulysses traces every candidate.
    """
    ranks = ranks_to_check(config)
    if config.windowed and config.mesh is None:
        # a halo rank's memory follows its piece and the halos it receives and sends
        layout = Layout.contiguous(config.lengths())
        schedule = halo_schedule(layout, *config.reaches(), None)
        keys = {(layout.rows_of(r),) + tuple((h.stop - h.start, h.round, h.dst == r)
                                              for h in schedule if r in (h.src, h.dst)): r
                for r in reversed(ranks)}
        return sorted(keys.values())
    if config.impl == "ring" and config.mesh is None:
        # a ring rank's memory follows its piece and its neighbours' (all blocks pass it)
        lengths, p = config.lengths(), config.world_size
        keys = {(lengths[r - 1], lengths[r], lengths[(r + 1) % p]): r for r in reversed(ranks)}
        return sorted(keys.values())
    if config.impl == "ring" or split(config)[0] > 1:
        return ranks
    chosen: Dict[tuple, int] = {}
    for r in ranks:
        plan = plan_for(config, r)
        local = sorted({(len(b.forward), b.hi - b.lo) + tuple(sorted(_launch_size(item)
                        for item in b.forward)) for b in plan.blocks})
        rounds = tuple((tuple(t.columns for t in rnd.sends), tuple(t.columns for t in rnd.recvs))
                       for rnd in plan.rounds)
        chosen.setdefault((plan.rows, tuple(local), rounds), r)
    return sorted(chosen.values())


# --------------------------------------------------------------------------
# Shortcut: runs of identical launches


def compact_plan(plan: Plan, heads: int) -> Plan:
    """The plan with each run of identical launches of a block cut to its first and last.

    A run is three or more consecutive launches of a block's forward with the
    same shapes (rows, keys, heads, segments, mask) that write only the
    block's own rows (dq, dK, dV too: query and key rows in the block, no
    split). Between two of them the live tensors are the same (the
    accumulators, the pending outputs of other launches); each adds the same
    temporaries and frees them. Keeping the first (which makes the
    accumulators) and the last (after which they may be written out) keeps
    every lifetime and so the peak, forward and backward (a launch of the
    block's own rows is in both lists, and so are the writers' counts, which
    the executor takes from the same plan). A block's first launches that tile
    it store their results instead of merging them (``launches.stored_launches``,
    decided from the plan the executor runs): they all stay.
    """
    dropped, stored = set(), set()
    for block in plan.blocks:
        # a block's first launches that tile it store their results (launches.stored_launches,
        # which the executor decides from the plan it runs): they stay, so that it still does
        span = (block.lo, block.hi)
        stored.update(item.id for item in block.forward[:launches.stored_launches(
            block.forward, span, heads)])
        stored.update(item.id for item in block.backward[:launches.stored_launches(
            block.backward, span, heads, keys=True)])
        run: List[Launch] = []
        for item in block.forward + (None,):
            sig = _own_launch(item, block.index)
            if run and (sig is None or sig != _own_launch(run[0], block.index)):
                dropped.update(item.id for item in run[1:-1])
                run = []
            if sig is not None:
                run.append(item)
    dropped -= stored
    if not dropped:
        return plan
    blocks = tuple(b._replace(forward=tuple(item for item in b.forward if item.id not in dropped),
                              backward=tuple(item for item in b.backward if item.id not in dropped))
                   for b in plan.blocks)
    return plan._replace(blocks=blocks)


def _launch_size(launch: Launch) -> Tuple[int, int, int, int]:
    """(query rows, key rows, query heads, kv heads) of a launch, all segments."""
    g, count = launch.heads, launch.queries.count
    return count * g.rows, count * g.kv_index.shape[0], g.q_heads.numel(), g.kv_heads.numel()


def _own_launch(launch: Optional[Launch], block: int) -> Optional[tuple]:
    """A launch's shapes when it writes block `block`'s rows only, else None."""
    if launch is None or launch.q_split or launch.k_split or (launch.q_block,
                                                               launch.k_block) != (block, block):
        return None
    return (_launch_size(launch), launch.causal, launch.queries.count, launch.queries.length,
            launch.queries.starts is None, launch.keys.starts is None,
            launch.heads.q_stride is None)


# --------------------------------------------------------------------------
# Shortcut: the tracer


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside the mode; keeps the peak.

    Each storage is counted once, when the first op that returns a tensor on
    it runs, and subtracted when the storage is freed (weakref finalizer).
    Views share their base's storage and add nothing.

    Shapes only, so cheaper (`reuse`): many meta kernels of elementwise ops are
    Python decompositions (``logaddexp`` took 5-20 ms a call here: 21 of a 23 s dry run
    while its ``out=`` form, the merges', was not reused), and a dry run repeats the same
    merge thousands of times. An elementwise op or an index
    read on meta tensors whose call (shapes, strides, dtypes, other arguments)
    was seen before gets a new tensor of the output metadata seen then (or, in
    place, its input back), without running the meta kernel again: what the
    tracker counts is unchanged.
    """

    def __init__(self, *, reuse: bool = True) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, int] = {}
        self.reuse = reuse
        # per op: "fresh", "inplace" or None (not reused); call metadata -> output
        # (shape, stride, dtype), or () for an in-place op. Per trace, never shared.
        self._kinds: Dict[object, Optional[str]] = {}
        self._outputs: Dict[tuple, tuple] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # nothing under this mode is compiled: no dynamo.disable around it, whose first call
        # imports torch._dynamo (seconds, at every command)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        python = _CUSTOM_OPS.get(func._schema.name)
        if python is not None:
            with self:
                out = python(*args, **kwargs)
        else:
            out = self._call(func, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t)
        return out

    def _call(self, func, args, kwargs):
        """`func(*args, **kwargs)`, or its output's metadata from an earlier equal call."""
        if func not in self._kinds:
            self._kinds[func] = _reuse_kind(func) if self.reuse else None
        kind = self._kinds[func]
        key = None if kind is None else _metadata(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        seen = self._outputs.get(key)
        if seen is None:
            out = func(*args, **kwargs)  # the first call also checks the shapes
            self._outputs[key] = ((out.shape, out.stride(), out.dtype) if kind == "fresh"
                                  else ())
            return out
        if kind == "inplace":
            return args[0]
        if kind == "out":
            return kwargs["out"]
        return torch.empty_strided(*seen[:2], dtype=seen[2], device="meta")

    def _track(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)


def _reuse_kind(func) -> Optional[str]:
    """Whether an op's output metadata is a function of its inputs' metadata: "fresh" (one
    new tensor), "inplace" (its first argument, modified), "out" (its ``out`` argument,
    written), or None (not reused).

    That is: an aten elementwise op, out of place, in place or out=, or ``index.Tensor``
    (a boolean index, whose output shape depends on data, fails on meta before
    anything is kept); not views or collectives.
    """
    if func is torch.ops.aten.index.Tensor:
        return "fresh"
    if torch.Tag.pointwise not in func.tags or len(func._schema.returns) != 1:
        return None
    returned = func._schema.returns[0].alias_info
    if returned is None:
        return "fresh"
    # in place: it writes and returns its first argument (`add_(Tensor(a!) self, ...) ->
    # Tensor(a!)`), read off the schema: torch.Tag.inplace is newer than torch 2.11 (on
    # 2.13 the two agree on all 534 pointwise aten overloads)
    first = func._schema.arguments[0].alias_info if func._schema.arguments else None
    if (first is not None and first.is_write and returned.is_write
            and first.before_set == returned.before_set):
        return "inplace"
    # out=: it writes and returns its `out` argument (`logaddexp.out(Tensor self, Tensor
    # other, *, Tensor(a!) out) -> Tensor(a!)`); a first call whose out has another shape
    # resizes it, and that call is the one that runs
    for arg in func._schema.arguments:
        if (arg.name == "out" and arg.kwarg_only and arg.alias_info is not None
                and arg.alias_info.is_write and returned.is_write
                and arg.alias_info.before_set == returned.before_set):
            return "out"
    return None


def _metadata(func, args, kwargs) -> Optional[tuple]:
    """The call as (func, its arguments with tensors as (shape, stride, dtype)), or None
    when a tensor is not on meta or an argument cannot be a key.

    Not the storage offset: an output's layout follows its inputs' shapes and strides.
    """
    key = [func]
    for x in (*args, *kwargs.items()):
        for y in (x if isinstance(x, (list, tuple)) else (x,)):
            if isinstance(y, Tensor):
                if not y.is_meta:
                    return None
                y = (y.shape, y.stride(), y.dtype)
            key.append(y)
        key.append(len(x) if isinstance(x, (list, tuple)) else None)
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key
