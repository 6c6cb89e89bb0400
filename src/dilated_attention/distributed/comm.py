"""Every ``torch.distributed`` call of the package, counted.

No other module imports ``torch.distributed``: they call the functions here,
which take the process group as an explicit argument (``None`` means local:
size 1, rank 0, nothing is sent) and count every message and byte this
process sends, so tests and benchmarks can assert the traffic of an op.

Counting (per calling process, inside ``count_communication()`` blocks):

- ``messages``: point-to-point sends (one per tensor sent to one peer) plus
  one per collective call;
- ``bytes_sent``: bytes of point-to-point sends plus, for collectives, the
  bytes this rank sends in the bandwidth-optimal ring algorithm of that
  collective (all-gather: (P-1) * input, reduce-scatter: (P-1) * output,
  all-reduce: 2 (P-1) / P * input, broadcast from this rank: (P-1) * input);
- ``agreements``: calls of ``agree``, the small control collective before
  an op; it is kept out of ``messages``/``bytes_sent`` so that "a local
  pattern set sends nothing" reads ``stats.messages == 0``;
- ``by_kind``: the same numbers per kind ("send", "all_gather", ...);
- ``wait_seconds``: time this process spent blocked waiting for
  point-to-point transfers to complete (what overlap did not hide).

Zero-element tensors are never sent (both peers know the sizes, so both
skip them) and are not counted.

Groups: a ``ProcessGroup``, a ``DeviceMesh`` of one or two dimensions, or
None (local). A 2-D mesh is a ``Grid``: its first dimension head-parallel
(U ranks), its second sequence-parallel (S ranks), and the rank at mesh
coordinate (u, s) holds sequence piece ``s * U + u`` (USP's order). The
collectives here (``agree``, ``all_gather``, ``all_reduce_``,
``reduce_scatter``) take a Grid like a group of U * S ranks whose rank is
the piece index, so callers that only sum or gather over "all ranks" need
not know the shape; point-to-point traffic takes one dimension's group.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import math
import pickle
import time
from typing import (Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional, Sequence,
                    Tuple, Union)

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

ProcessGroup = Any  # torch.distributed.ProcessGroup, a Grid, or None (local)
Tensors = Union[Tensor, Sequence[Tensor]]


# --------------------------------------------------------------------------
# Counting


@dataclasses.dataclass
class CommStats:
    """What this process sent inside a ``count_communication()`` block."""

    messages: int = 0
    bytes_sent: int = 0
    agreements: int = 0
    by_kind: Dict[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    wait_seconds: float = 0.0

    def _add(self, kind: str, messages: int, nbytes: int) -> None:
        if kind == "agree":
            self.agreements += messages
        else:
            self.messages += messages
            self.bytes_sent += nbytes
        calls, total = self.by_kind.get(kind, (0, 0))
        self.by_kind[kind] = (calls + messages, total + nbytes)

    def messages_of(self, kind: str) -> int:
        return self.by_kind.get(kind, (0, 0))[0]

    def bytes_of(self, kind: str) -> int:
        return self.by_kind.get(kind, (0, 0))[1]


# The stats objects of the enclosing count_communication() blocks, innermost
# last; a ContextVar (not a module global) so threads and tasks stay separate.
_ACTIVE: contextvars.ContextVar[Tuple[CommStats, ...]] = contextvars.ContextVar(
    "dilated_attention_comm_stats", default=()
)


@contextlib.contextmanager
def count_communication() -> Iterator[CommStats]:
    """Count what this process sends inside the block; blocks nest (all count)."""
    stats = CommStats()
    token = _ACTIVE.set(_ACTIVE.get() + (stats,))
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


def _record(kind: str, messages: int, nbytes: int) -> None:
    for stats in _ACTIVE.get():
        stats._add(kind, messages, nbytes)


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


# The flat-buffer collectives: torch 2.13 deprecates the *_tensor names for
# *_single ones that older releases (this package supports >= 2.4) lack.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------
# Groups


@dataclasses.dataclass(frozen=True)
class Grid:
    """Ranks in a grid of U head-parallel x S sequence-parallel ranks (a 2-D DeviceMesh).

    heads: the U ranks that hold one contiguous block of the sequence (None when
    U == 1); sequence: the S ranks that hold the same heads after a head
    all-to-all (None when S == 1). The rank at (u, s) holds sequence piece
    s * U + u: ``group_rank(grid)`` is that piece index, ``group_size(grid)`` U * S.
    """

    heads: ProcessGroup
    sequence: ProcessGroup

    @property
    def shape(self) -> Tuple[int, int]:
        return group_size(self.heads), group_size(self.sequence)

    @property
    def coordinate(self) -> Tuple[int, int]:
        return group_rank(self.heads), group_rank(self.sequence)


def resolve_group(group: Any, name: str = "group") -> ProcessGroup:
    """The group an op runs over: a ProcessGroup, a Grid (2-D mesh) or None (local).

    Accepts None, a ``torch.distributed.ProcessGroup``, a 1-D ``DeviceMesh``
    (its group) or a 2-D one (a Grid: head-parallel x sequence-parallel).
    Anything else is a TypeError naming `name`; a group or mesh this rank is
    not a member of is a ValueError (it would otherwise compute alone).
    """
    if group is None or isinstance(group, Grid):
        return group
    if isinstance(group, DeviceMesh):
        if group.get_coordinate() is None:
            raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not in the "
                             f"device mesh {group}")
        if group.ndim == 1:
            return resolve_group(group.get_group(0), name)
        if group.ndim != 2:
            raise ValueError(f"{name} must be a 1-D or 2-D DeviceMesh (head-parallel x "
                             f"sequence-parallel), got a {group.ndim}-D mesh {group}")
        heads, sequence = (_one_or_none(group.get_group(dim)) for dim in (0, 1))
        return Grid(heads, sequence) if heads is not None else sequence
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name}: this rank (global rank {dist.get_rank()}) is not a member of the process "
            f"group (torch.distributed.new_group returned NON_GROUP_MEMBER here); call the op "
            f"only on the group's ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be None, a torch.distributed.ProcessGroup or a 1-D/2-D DeviceMesh, "
            f"got {type(group).__name__} {group!r}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not a member "
                         f"of the process group {group!r}")
    return group


def _one_or_none(group: ProcessGroup) -> ProcessGroup:
    """None for a group of one rank: a mesh dimension of size 1 does nothing."""
    return None if dist.get_world_size(group) == 1 else group


def _plain(group: Any) -> ProcessGroup:
    """A DeviceMesh as the group or Grid it stands for; anything else as it is."""
    return resolve_group(group) if isinstance(group, DeviceMesh) else group


def is_distributed(group: ProcessGroup) -> bool:
    """True when `group` is a process group (or grid) of more than one rank."""
    return group is not None and group_size(group) > 1


def group_size(group: ProcessGroup) -> int:
    """Ranks in `group`; None (local) is 1; a Grid U * S."""
    group = _plain(group)
    if group is None:
        return 1
    if isinstance(group, Grid):
        heads, sequence = group.shape
        return heads * sequence
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside `group`; None (local) is 0; in a Grid its piece index."""
    group = _plain(group)
    if group is None:
        return 0
    if isinstance(group, Grid):
        (u, s), (heads, _) = group.coordinate, group.shape
        return s * heads + u
    return dist.get_rank(group)


def global_rank(group: ProcessGroup, rank: int) -> int:
    """The global rank of group rank `rank` (p2p ops address global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


# Process-group lifecycle for launchers (CLI, benchmarks, tests). Library ops
# never create groups: they take one as an argument.


def init_process_group(
    backend: str, *, timeout_s: float = 1800.0, **kwargs: Any
) -> ProcessGroup:
    """``dist.init_process_group`` with a timeout in seconds; returns WORLD."""
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.group.WORLD


def new_group(ranks: Sequence[int], **kwargs: Any) -> ProcessGroup:
    """A subgroup of the given global ranks, or None on ranks outside it.

    Every rank of WORLD must call this, members or not.
    """
    group = dist.new_group(list(ranks), **kwargs)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def init_device_mesh(shape: Sequence[int], *, device_type: str = "cpu",
                     names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """A DeviceMesh of `shape` over the initialised world (every rank must call this).

    For a 2-D mesh passed as an op's `group`: dimension 0 head-parallel,
    dimension 1 sequence-parallel.
    """
    from torch.distributed.device_mesh import init_device_mesh as init

    return init(device_type, tuple(shape), mesh_dim_names=None if names is None else tuple(names))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------
# Agreement: one small collective before any collective work


def agree(
    group: ProcessGroup,
    config: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]]],
    *,
    per_rank: Sequence[str] = (),
) -> List[Dict[str, Any]]:
    """Check that every rank makes the same call; return every rank's dict.

    One all-gather of this rank's pickled `config` (plain picklable
    values: ints, floats, strings, tuples, dtypes). Keys in `per_rank` may
    differ between ranks (e.g. this rank's sequence length) and arrive in
    the returned list, indexed by group rank; every other key must be equal
    on all ranks, else every rank raises ``ValueError`` naming the first
    differing key in the dict's order (put the user's arguments before
    values derived from them) and each rank's value.

    A rank must reach this collective even when its own input is bad, or
    the others would wait for it until the group's timeout. So pass
    `config` as a zero-argument callable that validates and builds the
    dict: an exception it raises is shared in the same collective, the
    failing rank re-raises it and every other rank raises ``ValueError``
    naming that rank and its error::

        infos = comm.agree(group, lambda: _validated_config(q, k, v, ...), per_rank=("n",))

    With a local group (None or one rank) this is just the callable.
    """
    group = _plain(group)
    error: Optional[Exception] = None
    mine: Dict[str, Any] = {}
    try:
        mine = dict(config() if callable(config) else config)
    except Exception as exc:  # shared with every rank below, then re-raised
        if not is_distributed(group):
            raise
        error = exc
    if not is_distributed(group):
        return [mine]
    payload = {
        "config": mine,
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    gathered = _gather_objects(payload, group)
    failures = [(r, p["error"]) for r, p in enumerate(gathered) if p["error"] is not None]
    if failures:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
        raise ValueError(f"the call failed on another rank of the group ({detail})")
    configs = [p["config"] for p in gathered]
    _check_equal(configs, set(per_rank))
    return configs


def fail_on_all_ranks(group: ProcessGroup, error: Exception) -> NoReturn:
    """Raise `error` here and a ValueError naming it on every other rank of `group`.

    For a rank whose input failed a check before the agreement: it joins
    the other ranks' agreement collective with its error instead of a
    config, so no rank waits for it. With a local group this just raises.
    """

    def failing_config() -> Dict[str, Any]:
        raise error

    agree(group, failing_config)
    raise error  # only reached when `group` is local


def _gather_objects(obj: Any, group: ProcessGroup) -> List[Any]:
    """Every rank's picklable `obj`, by group rank (a Grid: by piece index).

    A Grid gathers in two steps, so that every rank of it sees every rank's
    object (an error anywhere reaches everyone): first within the heads group,
    then the heads groups' lists within the sequence group.
    """
    if not isinstance(group, Grid):
        data = pickle.dumps(obj)
        _record("agree", 1, len(data) * (group_size(group) - 1))
        return _all_gather_bytes(data, group)
    row = [obj] if group.heads is None else _gather_objects(obj, group.heads)
    rows = [row] if group.sequence is None else _gather_objects(row, group.sequence)
    # rows[s][u] -> piece order s * U + u
    return [x for row in rows for x in row]


def _all_gather_bytes(data: bytes, group: ProcessGroup) -> List[Any]:
    """Every rank's pickled payload, unpickled, by group rank.

    Not ``dist.all_gather_object``: in torch 2.13 it decodes through NumPy,
    which torch does not require. Two all-gathers instead: the lengths, then
    the payloads padded to the longest.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    size = group_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(size, dtype=torch.int64, device=device)
    _all_gather_flat(lengths, length, group=group)
    longest = int(lengths.max())
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(size * longest, dtype=torch.uint8, device=device)
    _all_gather_flat(everyone, mine, group=group)
    # (size * longest,) -> (size, longest): one padded payload per rank
    rows = everyone.view(size, longest).cpu()
    return [pickle.loads(bytes(rows[r, : int(n)].tolist())) for r, n in enumerate(lengths.cpu())]


def _check_equal(configs: List[Dict[str, Any]], exempt: set) -> None:
    """Name the first key, in the configs' own order, on which ranks differ.

    Callers list what the user passed before what they derive from it (a
    kernel chosen from the dtype and dropout_p, say), so a difference in an
    argument is reported as that argument, not as a value derived from it.
    """
    # rank 0's order, then keys only other ranks have
    keys = [key for key in dict.fromkeys(k for c in configs for k in c) if key not in exempt]
    for key in keys:
        values = [c.get(key, "<missing>") for c in configs]
        if any(not _same(values[0], v) for v in values[1:]):
            listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"ranks disagree on {key!r}: {listing}")


def _same(a: Any, b: Any) -> bool:
    """Agreement values are plain data (ints, floats, strings, tuples, dtypes)."""
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------
# Point-to-point


def _as_list(x: Tensors) -> List[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def _post(ops: List[Tuple[str, Tensor, int, int]], group: ProcessGroup) -> List[Any]:
    """Post ("send" | "recv", tensor, global peer, tag) ops; return their requests.

    Tags number the tensors exchanged with one peer, so several tensors
    between the same two ranks in one batch always pair up in order.
    """
    ops = [op for op in ops if op[1].numel() > 0]
    if not ops:
        return []
    for kind, tensor, _, _ in ops:
        if kind == "send":
            _record("send", 1, _nbytes(tensor))
    fns = {"send": dist.isend, "recv": dist.irecv}
    p2p = [dist.P2POp(fns[kind], t, peer, group=group, tag=tag) for kind, t, peer, tag in ops]
    return dist.batch_isend_irecv(p2p)


def _wait(reqs: List[Any]) -> None:
    if not reqs:
        return
    start = time.perf_counter()
    for req in reqs:
        req.wait()
    waited = time.perf_counter() - start
    for stats in _ACTIVE.get():
        stats.wait_seconds += waited


class RingComm:
    """Send to the next rank of `group` and receive from the previous one.

    Queue ``send_recv`` calls, ``commit()`` posts them in one
    ``batch_isend_irecv``, ``wait()`` blocks until they are done; the
    receive buffers hold the data after ``wait()``. A received buffer must
    have the shape the previous rank sends (pass `recv_buffer` when blocks
    differ in size). Two RingComms used at once between the same ranks
    (e.g. K/V and dK/dV in a backward) take different `tag` bases.
    """

    def __init__(self, group: ProcessGroup, *, tag: int = 0) -> None:
        if not is_distributed(group):
            raise ValueError(f"RingComm needs a process group of more than one rank, got {group!r}")
        self.group = group
        self.rank = group_rank(group)
        self.size = group_size(group)
        self.send_to = global_rank(group, (self.rank + 1) % self.size)
        self.recv_from = global_rank(group, (self.rank - 1) % self.size)
        self.tag = tag
        self._ops: List[Tuple[str, Tensor, int, int]] = []
        self._reqs: List[Any] = []

    def send_recv(self, to_send: Tensor, recv_buffer: Optional[Tensor] = None) -> Tensor:
        """Queue sending `to_send` forward; return the buffer that will receive."""
        if recv_buffer is None:
            recv_buffer = torch.empty_like(to_send)
        tag = self.tag + len(self._ops) // 2
        self._ops.append(("send", to_send.contiguous(), self.send_to, tag))
        self._ops.append(("recv", recv_buffer, self.recv_from, tag))
        return recv_buffer

    def commit(self) -> None:
        if self._reqs:
            raise RuntimeError("RingComm.commit() called twice without wait()")
        self._reqs = _post(self._ops, self.group)
        self._ops = []

    def wait(self) -> None:
        _wait(self._reqs)
        self._reqs = []


def post_exchange(
    sends: Mapping[int, Tensors],
    recv_buffers: Mapping[int, Tensors],
    group: ProcessGroup,
) -> List[Any]:
    """Post sending and receiving tensors to and from peers (group ranks); return the handle.

    ``sends[p]`` goes to group rank p, ``recv_buffers[p]`` is filled from
    group rank p; a list of tensors per peer is matched in order with the
    peer's list. Every send must meet a receive of the same shape posted by
    its peer. All operations go out in one ``batch_isend_irecv``; the
    receive buffers hold the data after ``wait_exchange(handle)``. Entries
    for this rank itself are copied locally at once and not counted.
    """
    me = group_rank(group)
    if me in sends or me in recv_buffers:
        own_sends, own_recvs = _as_list(sends.get(me, [])), _as_list(recv_buffers.get(me, []))
        if len(own_sends) != len(own_recvs):
            raise ValueError(
                f"exchange: {len(own_sends)} tensors sent to this rank ({me}) but "
                f"{len(own_recvs)} receive buffers"
            )
        for src, dst in zip(own_sends, own_recvs):
            dst.copy_(src)
    ops: List[Tuple[str, Tensor, int, int]] = []
    for peer in sorted(set(sends) | set(recv_buffers)):
        if peer == me:
            continue
        if not 0 <= peer < group_size(group):
            raise ValueError(
                f"exchange: peer {peer} is not a rank of a group of {group_size(group)}"
            )
        gpeer = global_rank(group, peer)
        for tag, t in enumerate(_as_list(sends.get(peer, []))):
            ops.append(("send", t.contiguous(), gpeer, tag))
        for tag, t in enumerate(_as_list(recv_buffers.get(peer, []))):
            ops.append(("recv", t, gpeer, tag))
    return _post(ops, group)


def wait_exchange(handle: List[Any]) -> None:
    """Block until a `post_exchange` is done (its receive buffers are filled).

    Empties `handle`: a finished request still holds its tensor, so a send
    buffer would otherwise live as long as the caller keeps the handle.
    """
    _wait(handle)
    handle.clear()


def exchange(
    sends: Mapping[int, Tensors],
    recv_buffers: Mapping[int, Tensors],
    group: ProcessGroup,
) -> None:
    """`post_exchange`, then wait for it."""
    wait_exchange(post_exchange(sends, recv_buffers, group))


# --------------------------------------------------------------------------
# Collectives (counted); every one is a no-op copy for a local group


def all_gather(
    x: Tensor, group: ProcessGroup, *, dim: int = 0, sizes: Optional[Sequence[int]] = None
) -> Tensor:
    """Every rank's `x` concatenated along `dim`, in group-rank order.

    `sizes` (every rank's length along `dim`, e.g. from ``agree``) allows
    uneven pieces; without it all pieces must have x's shape. A Grid gathers
    in piece order (within the heads group, then those blocks in the sequence
    group).
    """
    group = _plain(group)
    if not is_distributed(group):
        return x
    if isinstance(group, Grid):
        heads, sequence = group.shape
        sizes = [x.shape[dim]] * heads * sequence if sizes is None else list(sizes)
        # sizes by piece s * U + u -> the heads group's pieces, then the blocks' lengths
        s = group.coordinate[1]
        block = all_gather(x, group.heads, dim=dim, sizes=sizes[s * heads:(s + 1) * heads])
        blocks = [sum(sizes[t * heads:(t + 1) * heads]) for t in range(sequence)]
        return all_gather(block, group.sequence, dim=dim, sizes=blocks)
    size, rank = group_size(group), group_rank(group)
    sizes = [x.shape[dim]] * size if sizes is None else list(sizes)
    if len(sizes) != size or sizes[rank] != x.shape[dim]:
        raise ValueError(
            f"all_gather: sizes {sizes} must list {size} lengths with this rank's ({rank}) "
            f"length {x.shape[dim]}"
        )
    longest = max(sizes)
    # (..., n_rank, ...) -> (n_rank, ...) padded to (longest, ...): one buffer shape for all
    front = x.movedim(dim, 0)
    if front.shape[0] < longest:
        pad = front.new_zeros((longest - front.shape[0],) + tuple(front.shape[1:]))
        front = torch.cat([front, pad])
    front = front.contiguous()
    out = front.new_empty((size * longest,) + tuple(front.shape[1:]))
    if longest > 0:
        _record("all_gather", 1, _nbytes(front) * (size - 1))
        _all_gather_flat(out, front, group=group)
    # (size * longest, ...) -> pieces of their true lengths, back along dim
    pieces = [out[r * longest : r * longest + n] for r, n in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim)


def all_reduce_(x: Tensor, group: ProcessGroup, *, op: str = "sum") -> Tensor:
    """In-place all-reduce ("sum", "max", "min", "avg") of `x`; returns x."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops and op != "avg":
        raise ValueError(f"op must be one of 'sum', 'max', 'min', 'avg', got {op!r}")
    group = _plain(group)
    if not is_distributed(group) or x.numel() == 0:
        return x
    if isinstance(group, Grid):
        for dim_group in (group.heads, group.sequence):
            all_reduce_(x, dim_group, op="sum" if op == "avg" else op)
        return x.div_(group_size(group)) if op == "avg" else x
    size = group_size(group)
    _record("all_reduce", 1, 2 * (size - 1) * _nbytes(x) // size)
    # gloo has no AVG: sum, then divide
    dist.all_reduce(x, op=ops["sum" if op == "avg" else op], group=group)
    if op == "avg":
        x.div_(size)
    return x


def reduce_scatter(
    x: Tensor, group: ProcessGroup, *, dim: int = 0, sizes: Optional[Sequence[int]] = None
) -> Tensor:
    """Sum `x` over ranks and return this rank's piece along `dim`.

    `sizes` (every rank's piece length, summing to x.shape[dim]) allows
    uneven pieces; without it x.shape[dim] must divide evenly. A Grid sums
    over the sequence group into blocks, then over the heads group into pieces.
    """
    group = _plain(group)
    if not is_distributed(group):
        return x
    total = x.shape[dim]
    if isinstance(group, Grid):
        heads, sequence = group.shape
        if sizes is None:
            if total % (heads * sequence):
                raise ValueError(f"reduce_scatter: length {total} does not divide over "
                                 f"{heads * sequence} ranks")
            sizes = [total // (heads * sequence)] * heads * sequence
        sizes, s = list(sizes), group.coordinate[1]
        blocks = [sum(sizes[t * heads:(t + 1) * heads]) for t in range(sequence)]
        block = reduce_scatter(x, group.sequence, dim=dim, sizes=blocks)
        return reduce_scatter(block, group.heads, dim=dim, sizes=sizes[s * heads:(s + 1) * heads])
    size, rank = group_size(group), group_rank(group)
    if sizes is None:
        if total % size:
            raise ValueError(f"reduce_scatter: length {total} does not divide over {size} ranks")
        sizes = [total // size] * size
    sizes = list(sizes)
    if len(sizes) != size or sum(sizes) != total:
        raise ValueError(f"reduce_scatter: sizes {sizes} must be {size} lengths summing to {total}")
    longest = max(sizes)
    # (..., total, ...) -> (total, ...) -> (size * longest, ...) padded per rank
    front = x.movedim(dim, 0)
    pieces = list(torch.split(front, sizes))
    padded = [
        torch.cat([p, p.new_zeros((longest - p.shape[0],) + tuple(p.shape[1:]))])
        if p.shape[0] < longest
        else p
        for p in pieces
    ]
    inp = torch.cat(padded).contiguous()
    out = inp.new_empty((longest,) + tuple(inp.shape[1:]))
    if longest > 0:
        _record("reduce_scatter", 1, _nbytes(out) * (size - 1))
        _reduce_scatter_flat(out, inp, group=group)
    return out[: sizes[rank]].movedim(0, dim)


def broadcast_(x: Tensor, src: int, group: ProcessGroup) -> Tensor:
    """In place: every rank's `x` becomes group rank `src`'s; returns x."""
    if not is_distributed(group) or x.numel() == 0:
        return x
    if isinstance(group, Grid):
        raise ValueError("broadcast_ takes a process group, not a grid of two")
    size = group_size(group)
    if group_rank(group) == src:
        _record("broadcast", 1, (size - 1) * _nbytes(x))
    dist.broadcast(x, global_rank(group, src), group=group)
    return x


def barrier(group: ProcessGroup) -> None:
    group = _plain(group)
    if isinstance(group, Grid):
        for dim_group in (group.heads, group.sequence):
            barrier(dim_group)
    elif is_distributed(group):
        dist.barrier(group=group)


def all_to_all(sends: Sequence[Tensor], recv_shapes: Sequence[Sequence[int]],
               group: ProcessGroup) -> Tensor:
    """Send ``sends[p]`` to group rank p; return what every rank sent here, as one buffer.

    One ``all_to_all_single`` over flat buffers with split sizes, so pieces
    may differ in size (or be empty). ``recv_shapes[p]`` is the shape rank p
    sends here (both sides derive every size from the agreed call). Returns
    the flat receive buffer: rank p's piece follows rank p - 1's, so pieces
    laid out rows-first are one (rows, ...) tensor by a plain view.
    Counted as one message; bytes are what this rank sends to the others.
    """
    size, rank = group_size(group), group_rank(group)
    if len(sends) != size or len(recv_shapes) != size:
        raise ValueError(f"all_to_all: {len(sends)} sends and {len(recv_shapes)} receive "
                         f"shapes for a group of {size} ranks")
    numels = [math.prod(shape) for shape in recv_shapes]
    recv = torch.empty(sum(numels), dtype=sends[0].dtype, device=sends[0].device)
    if not is_distributed(group):
        return recv.copy_(sends[0].reshape(-1))
    send = torch.cat([x.reshape(-1) for x in sends])
    _record("all_to_all", 1, sum(_nbytes(x) for p, x in enumerate(sends) if p != rank))
    dist.all_to_all_single(recv, send, output_split_sizes=numels,
                           input_split_sizes=[x.numel() for x in sends], group=group)
    return recv
