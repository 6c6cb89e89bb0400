"""Counting what this process sends: messages, bytes, agreements, time blocked.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Dict, Iterator, Tuple

from torch import Tensor


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


def record(kind: str, messages: int, nbytes: int) -> None:
    """Count `messages` of `kind` carrying `nbytes` in every enclosing count_communication()."""
    for stats in _ACTIVE.get():
        stats._add(kind, messages, nbytes)


def nbytes(x: Tensor) -> int:
    """The bytes of `x`'s elements (what a message of it carries)."""
    return x.numel() * x.element_size()


def record_wait(seconds: float) -> None:
    """Count time spent blocked on point-to-point transfers."""
    for stats in _ACTIVE.get():
        stats.wait_seconds += seconds
