"""Point-to-point traffic: a ring (``RingComm``) and exchanges with any peers, batched in one
``batch_isend_irecv`` each, counted, with the time spent waiting."""

from __future__ import annotations

import time
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .counting import nbytes, record, record_wait
from .groups import (Group, global_rank, group_rank, group_size, is_distributed,
                     moves_data)

Tensors = Union[Tensor, Sequence[Tensor]]


def _as_list(x: Tensors) -> List[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def _post(ops: List[Tuple[str, Tensor, int, int]], group: Group) -> List[Any]:
    """Post ("send" | "recv", tensor, global peer, tag) ops; return their requests.

    Tags number the tensors exchanged with one peer, so several tensors
    between the same two ranks in one batch always pair up in order.
    """
    ops = [op for op in ops if op[1].numel() > 0]
    if not ops:
        return []
    for kind, tensor, _, _ in ops:
        if kind == "send":
            record("send", 1, nbytes(tensor))
    if not moves_data(*(op[1] for op in ops)):
        return []
    fns = {"send": dist.isend, "recv": dist.irecv}
    p2p = [dist.P2POp(fns[kind], t, peer, group=group, tag=tag) for kind, t, peer, tag in ops]
    return dist.batch_isend_irecv(p2p)


def _wait(reqs: List[Any]) -> None:
    if not reqs:
        return
    start = time.perf_counter()
    for req in reqs:
        req.wait()
    record_wait(time.perf_counter() - start)


class RingComm:
    """Send to the next rank of `group` and receive from the previous one.

    Queue ``send_recv`` calls, ``commit()`` posts them in one
    ``batch_isend_irecv``, ``wait()`` blocks until they are done; the
    receive buffers hold the data after ``wait()``. A received buffer must
    have the shape the previous rank sends (pass `recv_buffer` when blocks
    differ in size). Two RingComms used at once between the same ranks
    (e.g. K/V and dK/dV in a backward) take different `tag` bases.
    """

    def __init__(self, group: Group, *, tag: int = 0) -> None:
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
    group: Group,
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
    group: Group,
) -> None:
    """`post_exchange`, then wait for it."""
    wait_exchange(post_exchange(sends, recv_buffers, group))
