"""Key/value rows sent, round by round, to the ranks whose queries read them; their dK/dV
sent home. The exchange of selected rows (sequence_parallel.Exchange) and the halo
exchange (halo.HaloExchange) move their keys this way; they differ only in which rows
travel.

Notation: b batch, hk key/value heads, d head dim; a part is the rows of one rank's
keys that another rank reads in one round, (rows, ...) its shape per batch entry and
k/v (rows, hk, d) for a halo, (columns, d) for the exchange's packed pairs.

Wire format per part: k and v stacked, (2, b, rows, ...); then, with a key padding
mask, its rows (b, rows) as uint8 (which every backend sends). A part's dK/dV travel
back as one (2, b, rows, ...) tensor in the accumulators' dtype.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..kernels import lse_dtype
from . import comm

# (peer rank, the part's shape per batch entry: (rows, ...)), per round
Parts = Sequence[Sequence[Tuple[int, Tuple[int, ...]]]]


class KeyRounds:
    """The rounds of one op call's key parts over `group`.

    `sent[i]` / `received[i]`: round i's outgoing parts (to the reader) and incoming
    ones (from the owner), in the order both ranks agree on. A subclass says what an
    outgoing part holds (``parcels``). Round 0 is posted by ``post`` (before any local
    launch, to overlap them); later rounds when their turn comes. A round's receive
    buffers live until the consumer moves past it. `kv_grad`: whether some rank
    differentiates k or v (agreed, the same on every rank); without it the backward
    sends no dK/dV home (``homes`` is not called, and no write waits for one).
    """

    def __init__(self, k: Tensor, v: Tensor, key_mask: Optional[Tensor], group: Any,
                 sent: Parts, received: Parts, kv_grad: bool = True) -> None:
        self.k, self.v, self.key_mask, self.group = k, v, key_mask, group
        self.sent, self.received = sent, received
        self.kv_grad = kv_grad
        self.count = len(received)
        self._posted: Optional[Tuple[Any, List[Tuple[Tensor, Optional[Tensor]]]]] = None

    def parcels(self, index: int) -> List[List[Tensor]]:
        """Round `index`'s outgoing parts in wire format (``wire``), one per entry of
        ``sent[index]`` (one list may serve several readers)."""
        raise NotImplementedError

    def wire(self, k_rows: Tensor, v_rows: Tensor, mask_rows: Optional[Tensor]) -> List[Tensor]:
        """One part's tensors: k and v (b, rows, ...) stacked, then the mask's rows (b, rows)."""
        out = [torch.stack([k_rows, v_rows])]
        if mask_rows is not None:
            out.append(mask_rows.to(torch.uint8))
        return out

    def _start(self, index: int):
        b = self.k.shape[0]
        sends: Dict[int, List[Tensor]] = {}
        for (dst, _), parcel in zip(self.sent[index], self.parcels(index)):
            sends.setdefault(dst, []).extend(parcel)
        recvs: Dict[int, List[Tensor]] = {}
        buffers = []
        for src, shape in self.received[index]:
            buf = self.k.new_empty((2, b) + tuple(shape))
            recvs.setdefault(src, []).append(buf)
            mask = None
            if self.key_mask is not None:
                mask = torch.empty((b, shape[0]), dtype=torch.uint8, device=self.k.device)
                recvs[src].append(mask)
            buffers.append((buf, mask))
        return comm.post_exchange(sends, recvs, self.group), buffers

    def post(self) -> None:
        if self.count:
            self._posted = self._start(0)

    def arrivals(self) -> Iterator[Tuple[int, List[Tuple[Tensor, Optional[Tensor]]]]]:
        """(round, [(k and v (2, b, rows, ...), mask (b, rows) bool or None)]), one entry
        per ``received[round]``; the next round is exchanged when the consumer asks for it."""
        for index in range(self.count):
            handle, buffers = self._posted if index == 0 else self._start(index)
            self._posted = None
            comm.wait_exchange(handle)
            yield index, [(buf, None if mask is None else mask.bool()) for buf, mask in buffers]
            del buffers

    def homes(self, index: int, grads: List[Tensor]) -> List[Tensor]:
        """Round `index`'s dK/dV: `grads`, one (2, b, rows, ...) per received part, go to
        their owners; returns ours, one per sent part, from their readers."""
        acc = grads[0].dtype if grads else lse_dtype(self.k.dtype)
        b = self.k.shape[0]
        sends: Dict[int, List[Tensor]] = {}
        for (src, _), grad in zip(self.received[index], grads):
            sends.setdefault(src, []).append(grad)
        recvs: Dict[int, List[Tensor]] = {}
        homes = []
        for dst, shape in self.sent[index]:
            home = torch.empty((2, b) + tuple(shape), dtype=acc, device=self.k.device)
            recvs.setdefault(dst, []).append(home)
            homes.append(home)
        comm.exchange(sends, recvs, self.group)
        return homes
