"""A collective returns only once the backend has let go of its tensors.

Note [gloo releases a collective's tensors late]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Gloo runs a collective on one of its worker threads
(``ProcessGroupGloo::runLoop``), which completes the work (waking the
caller) and only then drops its own reference to it, and with it the
tensors the work holds. Dropping a tensor that has a Python object takes
the GIL (``TensorImpl::decref_pyobject``). If the caller has meanwhile
reached interpreter exit (a script whose last communication was this
collective: ``generate``'s final all-gather, ``destroy_process_group()``,
exit; the group and its worker threads outlive ``destroy_process_group``
while anything, a model or a global, holds the group), taking the GIL
ends the worker thread with ``pthread_exit``, whose unwinding through a
``noexcept`` function calls ``std::terminate``: the rank aborts after its
work is done ("terminate called without an active exception", SIGABRT).
The native stack of such an abort (torch 2.13, caught with a SIGABRT
handler): ``runLoop`` -> ``~AsyncAllgatherWork`` ->
``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil``
-> ``pthread_exit`` -> terminate. About half of all synchronous gloo
all-gathers return while the worker still holds their tensors (measured:
113 and 90 of 200 on two ranks).

The race is PyTorch's (pytorch/pytorch PR 179291 describes the same
finalization crash). What the library can do, it does: every collective
here waits, once complete, until gloo has let go of the tensors it was
given (their C++ use count is back where it was), so the worker's last
touch of them happens while the interpreter is alive and the caller
waits for it. Only under gloo: NCCL's watchdog frees works late by design
(waiting would stall on the GPU), and ``destroy_process_group`` joins it.
Point-to-point work is not affected: it has no worker thread (the caller
waits for it and drops it: ``wait_exchange``, ``RingComm.wait``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist

from .groups import Group

# A gloo worker lets go within microseconds of completing the work when it
# gets a core; under heavy load it may wait for one. Past this the wait
# stops: the collective itself is done, only a finalization race remains.
RELEASE_TIMEOUT_S = 1.0


@contextlib.contextmanager
def released_on_return(group: Group, *tensors: torch.Tensor) -> Iterator[None]:
    """Run the collective in the block; leave only once gloo no longer holds `tensors`
    (Note [gloo releases a collective's tensors late])."""
    if not _releases_late(group, tensors):
        yield
        return
    # C++ references (a Python object holds one); a gloo work holds one more per tensor
    before = [t._use_count() for t in tensors]
    yield
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    pause = 0.0  # the first pause only hands over the GIL the worker needs to drop them
    while any(t._use_count() > n for t, n in zip(tensors, before)):
        if time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = 1e-4  # then sleep for real: the worker may be waiting for a core


def _releases_late(group: Group, tensors) -> bool:
    """True when the collective runs on gloo's worker threads."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # one backend per device type: "cpu:gloo,cuda:nccl"
        backend = dict(pair.split(":", 1) for pair in backend.split(",")).get(
            tensors[0].device.type, "")
    # a torch without Tensor._use_count has nothing to count (nothing is waited for)
    return backend == "gloo" and hasattr(tensors[0], "_use_count")
