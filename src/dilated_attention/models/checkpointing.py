"""Running a stack of blocks while training: activation checkpointing, block inputs offloaded.

Notation: b batch, n tokens (this rank's piece), e embed dim, L blocks.

Note [checkpoint modes]
    ``LongNetConfig(checkpoint=...)`` decides what autograd keeps between
    a block's forward and its backward:

    - ``"none"``: every tensor each block saves (attention inputs, outputs
      and log-sum-exps, the feed-forward's (b, n, f) intermediates, norms,
      dropout masks): the most memory, no recomputation.
    - ``"layers"``: each block runs under ``torch.utils.checkpoint``
      (non-reentrant): only its input (b, n, e) is kept, and backward runs
      the block's forward again first: L (b, n, e) tensors plus one block's
      activations at a time, for one more forward of every block. The
      recomputation restores the RNG state of the forward (CPU and the
      input's device), so dropout draws the same masks: ``nn.Dropout`` and
      the attention op, which draws its dropout seed from torch's default
      generator. Early stopping is off, so every rank's recomputation runs
      the whole block and the same collectives.
    - ``"offload"``: ``"layers"``, and each kept block input also moves to
      host memory (pinned) in forward and back in backward (``HostOffload``):
      on the device, one block's activations plus two (b, n, e) tensors, at
      the cost of L (b, n, e) tensors of host memory and their transfers. On
      CUDA the copies run on a side stream: the copy out overlaps the next
      block's forward, and backward fetches block k - 1's input while block
      k recomputes and differentiates. Other accelerators copy synchronously.
      On a CPU device the inputs already live in host memory: ``"offload"``
      is ``"layers"``.

    Only the block inputs are offloaded (the checkpoint saves nothing else
    under the offload hooks); the encoder-decoder's ``memory`` (the gathered
    encoder output, an input of every decoder block) stays on the device,
    once, instead of one copy per block.

    Inside a block the feed-forward's (b, n, ffn_dim) intermediates are the
    largest activations (three of them, 4 x embed_dim wide in LongNet's
    presets, against a handful of (b, n, e) ones for the attention), and
    under "layers" a block's backward holds them all. With
    ``LongNetConfig(ffn_chunk_bytes=...)`` the feed-forward (with its norm)
    runs over chunks of rows, each its own checkpoint (``run_in_chunks``):
    only one chunk's intermediates exist at a time in backward, for one
    more forward of the feed-forward. With dropout the feed-forward's masks
    are drawn chunk by chunk (other draws than unchunked, same distribution).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_MODES = ("none", "layers", "offload")


def run_blocks(layers: nn.ModuleList, x: Tensor, mode: str, **kwargs) -> Tensor:
    """x (b, n, e) through every block ``layer(x, **kwargs)``, kept as `mode` says
    (Note [checkpoint modes]); without gradients every mode is a plain loop."""
    if mode == "none" or not torch.is_grad_enabled():
        for layer in layers:
            x = layer(x, **kwargs)
        return x
    offload = mode == "offload" and x.device.type != "cpu"
    with HostOffload(x.device) if offload else contextlib.nullcontext():
        for layer in layers:
            # kwargs (memory, documents) through a partial: x is the checkpoint's only input,
            # the one tensor the offload hooks see
            x = checkpoint(functools.partial(layer, **kwargs), x, use_reentrant=False,
                           early_stop=False)
    return x


def chunk_rows(rows: int, chunk_bytes: int, row_bytes: int) -> Optional[int]:
    """Rows per chunk of `rows` rows whose intermediates take `row_bytes` each: at most
    `chunk_bytes` a chunk (one row at least); None where one chunk holds them all."""
    per_chunk = max(1, chunk_bytes // row_bytes)
    return per_chunk if rows > per_chunk else None


def run_in_chunks(fn, x: Tensor, chunk_bytes: int, row_bytes: int) -> Tensor:
    """``fn(x)`` for a row-wise fn, x (b, n, ...): with gradients, over chunks of rows along
    dim 1 (``chunk_rows``), each checkpointed (recomputed in backward), so only one chunk's
    intermediates exist at a time; whole where one chunk holds every row."""
    rows = chunk_rows(x.shape[1], chunk_bytes, row_bytes)
    if not torch.is_grad_enabled() or rows is None:
        return fn(x)
    # (b, n, ...) -> chunks (b, rows, ...) along the sequence, their outputs joined back
    return torch.cat([checkpoint(fn, chunk, use_reentrant=False, early_stop=False)
                      for chunk in x.split(rows, dim=1)], dim=1)


class PendingCopy:
    """A copy being made (a tensor; ``ShapeCopies``: its shape and dtype), and the event that
    marks it done (None: done already)."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor, event) -> None:
        self.tensor, self.event = tensor, event


class StreamCopies:
    """CUDA copies on a side stream, ordered against the current stream by events.

    The allocator must not hand a tensor's memory to other work while a
    copy on the side stream still reads or writes it: ``record_stream``
    marks each tensor used on the other stream. Pinned host memory lets the
    copies run asynchronously.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def to_host(self, t: Tensor) -> PendingCopy:
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        return PendingCopy(host, self.stream.record_event())

    def to_device(self, host: PendingCopy, device: torch.device, ahead: bool) -> PendingCopy:
        """Back to `device`: on the side stream when fetched `ahead` of its use, else on the
        current stream (after the copy out finished)."""
        stream = self.stream if ahead else torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            stream.wait_event(host.event)
            t = host.tensor.to(device, non_blocking=True)
        return PendingCopy(t, stream.record_event() if ahead else None)

    def wait(self, copy: PendingCopy) -> Tensor:
        """The tensor, usable on the current stream."""
        if copy.event is not None:
            current = torch.cuda.current_stream(copy.tensor.device)
            current.wait_event(copy.event)
            copy.tensor.record_stream(current)
        return copy.tensor


class BlockingCopies:
    """Synchronous copies (devices without the stream machinery above)."""

    def to_host(self, t: Tensor) -> PendingCopy:
        return PendingCopy(t.to("cpu"), None)

    def to_device(self, host: PendingCopy, device: torch.device, ahead: bool) -> PendingCopy:
        return PendingCopy(host.tensor.to(device), None)

    def wait(self, copy: PendingCopy) -> Tensor:
        return copy.tensor


class ShapeCopies:
    """Meta tensors (``estimate``'s dry run of a model): the copy out keeps only the shape
    and dtype, the copy back is a new meta tensor, so the device memory that the offload
    frees and takes back is what a real device's would be."""

    def to_host(self, t: Tensor) -> PendingCopy:
        return PendingCopy((t.shape, t.dtype), None)

    def to_device(self, host: PendingCopy, device: torch.device, ahead: bool) -> PendingCopy:
        shape, dtype = host.tensor
        return PendingCopy(torch.empty(shape, dtype=dtype, device=device), None)

    def wait(self, copy: PendingCopy) -> Tensor:
        return copy.tensor


class _Slot:
    """One saved tensor in host memory; `previous` is the one saved before it, which backward
    needs next."""

    __slots__ = ("host", "device", "previous", "fetched", "copies")

    def __init__(self, host: PendingCopy, device: torch.device, previous: Optional["_Slot"],
                 copies) -> None:
        self.host, self.device, self.previous, self.copies = host, device, previous, copies
        self.fetched: Optional[PendingCopy] = None

    def fetch_ahead(self) -> None:
        if self.fetched is None:
            self.fetched = self.copies.to_device(self.host, self.device, ahead=True)

    def take(self) -> Tensor:
        fetched, self.fetched = self.fetched, None
        if fetched is None:
            fetched = self.copies.to_device(self.host, self.device, ahead=False)
        return self.copies.wait(fetched)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep the tensors of `device` in host memory until backward.

    One object per forward of a stack: each unpack (backward, in reverse
    order) starts fetching the tensor saved before it, so that its copy
    overlaps the work between the two. Tensors of other devices stay where
    they are. `copies` moves the data (``StreamCopies`` on CUDA,
    ``ShapeCopies`` on meta, ``BlockingCopies`` elsewhere; tests pass their own).
    """

    def __init__(self, device: torch.device, copies=None) -> None:
        self.device = device
        self.copies = copies if copies is not None else (
            StreamCopies(device) if device.type == "cuda" else
            ShapeCopies() if device.type == "meta" else BlockingCopies())
        self._last: Optional[_Slot] = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor):
        # an empty tensor has nothing to move (torch 2.11's checkpoint saves one per block)
        if t.device != self.device or t.numel() == 0:
            return t
        self._last = _Slot(self.copies.to_host(t), t.device, self._last, self.copies)
        return self._last

    @staticmethod
    def _unpack(packed) -> Tensor:
        if not isinstance(packed, _Slot):
            return packed
        if packed.previous is not None:
            packed.previous.fetch_ahead()
        return packed.take()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        # the slots live in the graph now, each holding its predecessor; the chain's head
        # here would keep every host copy alive as long as this object (a reference cycle
        # through its bound pack hook: until the garbage collector runs)
        self._last = None
