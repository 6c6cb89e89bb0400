"""Start ranks: spawn them so that they never hang, or join the ranks torchrun launched.

The one launcher of the command line, the tests and the examples.

    results = spawn(fn, world_size, args, timeout=120.0)

starts `world_size` processes (``spawn`` start method). Each joins a process
group through a ``file://`` rendezvous in a fresh temp dir (no fixed ports),
uses `threads` torch threads and runs ``fn(group, *args)`` with ``group`` the
WORLD group; `fn` must be importable by name. Its return value travels back
pickled (tensors detached and moved to the CPU first), never as a tensor
through the queue: shared-memory handles die with the child. ``results[r]``
is rank r's.

Every rank reports through one queue: its result, or the traceback of
whatever it raised (``BaseException`` included). The parent polls with a
hard deadline; after the first failure the others get `grace` seconds to
report theirs, and a rank that died without a report (a crash in a kernel)
counts as failed. Then every straggler is killed and ``LaunchFailed`` is
raised with each failed rank's error.

Under ``torchrun`` (RANK and WORLD_SIZE set) ``run_torchrun`` joins the
launched ranks instead; ``device_setup(device)`` is the per-rank set-up both
ways share (the rank's CUDA device, malloc tuning for honest RSS peaks).

Process groups are created and destroyed here (``init_process_group``,
``new_group``, ``init_device_mesh``, ``destroy_process_group``): the library's
ops never create one, they take a group as an argument and talk to it only
through ``distributed/comm``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import comm
from ..distributed.comm import Group


# --------------------------------------------------------------------------
# Process groups, for launchers (the command line, benchmarks, tests)


def init_process_group(
    backend: str, *, timeout_s: float = 1800.0, **kwargs: Any
) -> Group:
    """``dist.init_process_group`` with a timeout in seconds; returns WORLD."""
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.group.WORLD


def new_group(ranks: Sequence[int], **kwargs: Any) -> Group:
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


@dataclasses.dataclass(frozen=True)
class RankError:
    """What one rank reported on failure: a one-line summary and the full traceback."""

    summary: str
    traceback: str


class LaunchFailed(RuntimeError):
    """One or more ranks failed, crashed or ran past the deadline.

    ``str()`` is one line naming each failed rank's error; ``errors`` maps
    rank -> ``RankError``; ``details()`` holds every traceback.
    """

    def __init__(self, errors: Dict[int, RankError], world_size: int) -> None:
        self.errors = dict(sorted(errors.items()))
        self.world_size = world_size
        summary = "; ".join(f"rank {r}: {e.summary}" for r, e in self.errors.items())
        super().__init__(f"{len(errors)} of {world_size} ranks failed: {summary}")

    def details(self) -> str:
        """Every failed rank's traceback, rank by rank."""
        report = "\n".join(f"---- rank {r} ----\n{e.traceback}" for r, e in self.errors.items())
        return f"{len(self.errors)} of {self.world_size} ranks failed:\n{report}"


def spawn(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float,
    pg_timeout: float = 30.0,
    grace: float = 10.0,
    backend: str = "gloo",
    threads: int = 1,
    prepare: Optional[Callable[[int], Dict[str, Any]]] = None,
    on_progress: Optional[Callable[[str], None]] = None,
    tmp_prefix: str = "dilated_attention_",
) -> List[Any]:
    """Run ``fn(group, *args)`` on `world_size` spawned ranks; return results by rank.

    `timeout` is the hard deadline for the whole run and `pg_timeout` the
    collective timeout inside the group (seconds). ``prepare(rank)`` (if
    given; picklable) runs in each rank before it joins the group and
    returns extra keyword arguments for `fn` (e.g. the rank's device). With
    `on_progress`, `fn` also gets a positional ``progress(label)`` callable
    after `args`: rank 0's labels reach ``on_progress(label)`` here, other
    ranks' are dropped. Raises ``LaunchFailed`` on any failure.
    """
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        setup = _RankSetup(world_size, init_method, backend, threads, pg_timeout,
                           prepare, on_progress is not None)
        procs = [
            ctx.Process(target=_rank_entry, args=(setup, r, fn, tuple(args), out_q), daemon=True)
            for r in range(world_size)
        ]
        try:
            for r, p in enumerate(procs):
                try:
                    p.start()
                except OSError as exc:  # out of processes, file descriptors or memory
                    raise StartFailed(r, world_size, f"{type(exc).__name__}: {exc}") from exc
            results, errors = _collect(procs, out_q, timeout, grace, on_progress)
        finally:
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    p.kill()
            for p in started:
                p.join(timeout=5)
    if errors:
        raise LaunchFailed(errors, world_size)
    return [pickle.loads(results[r]) for r in range(world_size)]


class StartFailed(LaunchFailed):
    """The machine could not start rank `rank`'s process (the ranks started before it are
    killed): `world_size` is more ranks than it can spawn."""

    def __init__(self, rank: int, world_size: int, reason: str) -> None:
        self.rank, self.reason = rank, reason
        super().__init__({rank: _lost(f"could not start its process ({reason})")}, world_size)


@dataclasses.dataclass(frozen=True)
class _RankSetup:
    """Everything a spawned rank needs besides its rank, `fn` and args (pickled to it)."""

    world_size: int
    init_method: str
    backend: str
    threads: int
    pg_timeout: float
    prepare: Optional[Callable[[int], Dict[str, Any]]]
    with_progress: bool


def _rank_entry(setup: _RankSetup, rank: int, fn: Callable, args: tuple, out_q) -> None:
    """A spawned rank: join the group, run `fn`, report the result or the traceback, exit."""
    code = 1
    try:
        torch.set_num_threads(setup.threads)
        extra = setup.prepare(rank) if setup.prepare is not None else {}
        group = init_process_group(
            setup.backend, init_method=setup.init_method, rank=rank,
            world_size=setup.world_size, timeout_s=setup.pg_timeout,
        )

        def progress(label: str) -> None:
            if rank == 0:
                out_q.put((rank, "progress", label))

        positional = args + (progress,) if setup.with_progress else args
        payload = pickle.dumps(_to_cpu(fn(group, *positional, **extra)))
        # every rank is done with its traffic before any rank tears down
        comm.barrier(group)
        destroy_process_group()
        out_q.put((rank, "ok", payload))
        code = 0
    except BaseException as exc:  # report everything, including SystemExit/KeyboardInterrupt
        text = str(exc)
        summary = f"{type(exc).__name__}: {text}".splitlines()[0] if text else type(exc).__name__
        out_q.put((rank, "error", RankError(summary, traceback.format_exc())))
    finally:
        # flush the report before the hard exit, which skips atexit handlers
        out_q.close()
        out_q.join_thread()
        os._exit(code)


def _to_cpu(obj: Any) -> Any:
    """Detached CPU copies of the tensors in `obj` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _collect(
    procs: List[Any], out_q, timeout: float, grace: float,
    on_progress: Optional[Callable[[str], None]],
) -> Tuple[Dict[int, bytes], Dict[int, RankError]]:
    """Poll the ranks' reports until all are in, one failed (plus `grace`), or the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: Dict[int, bytes] = {}
    errors: Dict[int, RankError] = {}
    first_failure: Optional[float] = None
    while len(results) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline or (first_failure is not None and now > first_failure + grace):
            break
        try:
            rank, status, payload = out_q.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode is not None and r not in results and r not in errors]
            if not dead:
                continue
            try:  # a dead rank's report may still be in the pipe
                rank, status, payload = out_q.get(timeout=1.0)
            except queue.Empty:
                r = dead[0]
                errors[r] = _lost(f"process exited with code {procs[r].exitcode} "
                                  "without a report")
                first_failure = first_failure or time.monotonic()
                continue
        if status == "progress":
            if on_progress is not None:
                on_progress(payload)
        elif status == "ok":
            results[rank] = payload
        else:
            errors[rank] = payload
            first_failure = first_failure or time.monotonic()
    # decided before filling in: every silent rank missed the deadline, or none did
    why = ("no report after another rank failed (killed)" if errors
           else f"no result within the {timeout:.0f} s deadline (killed)")
    for r in range(world_size):
        if r not in results and r not in errors:
            errors[r] = _lost(why)
    return results, errors


def _lost(summary: str) -> RankError:
    """A rank that never reported: the summary is all there is."""
    return RankError(summary, summary)


# --------------------------------------------------------------------------
# Per-rank device set-up, and joining torchrun's ranks


def backend_for(device: str) -> str:
    """The process-group backend for ranks on `device`: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device == "cuda" else "gloo"


def device_setup(device: str) -> Callable[[int], Dict[str, Any]]:
    """A picklable ``prepare(rank)`` for `spawn`: tune malloc, pick the rank's device.

    It returns ``{"device": "cpu" | "cuda:i"}``, so `fn` gets a ``device=``
    keyword.
    """
    return functools.partial(_prepare_rank, device)


def _prepare_rank(device: str, rank: int) -> Dict[str, Any]:
    limit_malloc_caching()
    return {"device": _setup_device(device, rank)}


def _setup_device(device: str, local_rank: int) -> str:
    """The device string this rank uses: "cpu", or "cuda:i" (made current)."""
    if device == "cuda":
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


# A spawned rank's own memory before it holds a tensor (torch, gloo, the library): about
# 150 MB anonymous on the CI machines, counted as 100 MiB so that the checks of room below
# refuse only what cannot run.
RANK_BYTES = 100 << 20


def available_memory() -> Optional[int]:
    """Bytes this machine can still give without swapping (MemAvailable in /proc/meminfo),
    None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_room(world_size: int, option: str, free: Optional[int]) -> None:
    """`world_size` ranks whose own memory alone (RANK_BYTES each) passes the `free` bytes
    (``available_memory``; None: unknown, not checked): a ValueError naming `option`, before
    any starts (past it the kernel's OOM killer picks a rank, or the machine swaps)."""
    need = world_size * RANK_BYTES
    if free is not None and need > free:
        raise ValueError(
            f"{option} {world_size}: {world_size} ranks take at least {need / 2**30:.1f} GiB "
            f"({RANK_BYTES >> 20} MiB each before any tensor), more than the "
            f"{free / 2**30:.1f} GiB this machine has free; spawn fewer ranks"
        )


def limit_malloc_caching() -> None:
    """Let freed memory go back to the OS, so a process's RSS peak is its tensors' peak.

    glibc raises its mmap threshold after large frees (up to 32 MiB), after
    which freed tensors stay in the heap and a later run reuses them without
    raising the high-water mark; a fixed threshold keeps every large tensor
    mmapped, so each one counts in RSS while alive and leaves when freed.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 256 * 1024)
    libc.mallopt(m_trim_threshold, 1024 * 1024)


def fake_world(rank: int, world_size: int) -> comm.Group:
    """Torch's fake process group as `rank` of `world_size`, for CPU and meta tensors ("fake"
    alone has no backend for meta, where ``batch_isend_irecv`` looks one up): the process
    ``dilated-attention estimate`` runs a rank of P in (tools/estimate/dryrun.py)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # as torch picks for "fake"

    world = init_process_group("cpu:fake,meta:fake", rank=rank, world_size=world_size,
                               store=FakeStore(), timeout_s=60.0)
    # torch 2.13 sets no default backend for a plugin named per device (it compares the
    # plugin's name in another case), and then warns on stderr at every destroy
    world._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return world


def torchrun_world_size() -> Optional[int]:
    """The launched world size when run under torchrun (RANK, WORLD_SIZE set), else None;
    ValueError unless WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        values = {}
        for name in ("WORLD_SIZE", "RANK"):
            try:
                values[name] = int(os.environ[name])
            except ValueError:
                raise ValueError(
                    f"{name} must be an integer, got {os.environ[name]!r}"
                ) from None
        world_size, rank = values["WORLD_SIZE"], values["RANK"]
        if world_size < 1:
            raise ValueError(f"WORLD_SIZE must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE = {world_size}), got {rank}")
        return world_size
    return None


def run_torchrun(fn: Callable, args: Sequence[Any], *, device: str,
                 progress: Optional[Callable[[str], None]] = None) -> Optional[Any]:
    """Run ``fn(world, *args, progress, device=...)`` on the ranks torchrun launched.

    Returns rank 0's result on rank 0 and None elsewhere; rank 0 calls
    ``progress(label)`` (others get a callback that drops labels). A
    failure raises ``LaunchFailed`` naming this rank.
    """
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    limit_malloc_caching()
    rank_device = _setup_device(device, local_rank)
    try:
        world = init_process_group(backend_for(device), timeout_s=1800.0)
    except (ValueError, RuntimeError) as exc:  # no MASTER_ADDR, a refused rendezvous, ...
        text = f"joining the launched ranks: {type(exc).__name__}: {exc}"
        raise LaunchFailed({rank: RankError(text.splitlines()[0], traceback.format_exc())},
                           int(os.environ["WORLD_SIZE"])) from exc
    report = progress if rank == 0 and progress is not None else _drop_label
    try:
        result = fn(world, *args, report, device=rank_device)
        comm.barrier(world)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        raise LaunchFailed({rank: RankError(text.splitlines()[0], traceback.format_exc())},
                           comm.group_size(world)) from exc
    finally:
        destroy_process_group()
    return result if rank == 0 else None


def _drop_label(label: str) -> None:
    """A progress callback that drops its labels (ranks other than 0)."""
