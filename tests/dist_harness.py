"""Run a function on real spawned gloo ranks; never hang.

    results = run_distributed(fn, world_size, *args, timeout=120)

spawns `world_size` processes; each joins a gloo process group (file://
rendezvous in a fresh temp dir: no fixed ports; 30 s collective timeout),
calls ``torch.set_num_threads(1)`` and runs ``fn(group, *args)`` with
``group`` the WORLD group. `fn` must be importable by name (a module-level
function of a test module). Its return value travels back pickled (tensors
are detached and moved to the CPU first) and ``results[r]`` is rank r's.

One spawn costs seconds, so `fn` should loop over many cases and return a
list of per-case results. Inside `fn`, ``subgroup(ranks)`` creates a
subgroup (every rank must call it; non-members get None).

Any failure (an exception in any rank, a crashed rank, the deadline) kills
the remaining ranks and raises ``RankFailure`` with every traceback the
ranks managed to report.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

PG_TIMEOUT_S = 30.0


class RankFailure(RuntimeError):
    """One or more ranks failed, crashed or ran past the deadline."""


def subgroup(ranks: Sequence[int]):
    """A gloo subgroup of `ranks` (call on every rank); None on non-members."""
    from dilated_attention import comm

    return comm.new_group(ranks)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _child(rank: int, world_size: int, init_method: str, fn: Callable, args: tuple, out_q,
           pg_timeout_s: float) -> None:
    code = 1
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(dist.group.WORLD, *args)
        payload = pickle.dumps(_to_cpu(result))
        # every rank is done with its traffic before any rank tears down
        dist.barrier()
        dist.destroy_process_group()
        out_q.put((rank, "ok", payload))
        code = 0
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        out_q.put((rank, "error", traceback.format_exc()))
    finally:
        out_q.close()
        out_q.join_thread()
        os._exit(code)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = PG_TIMEOUT_S,
    grace: float = 10.0,
) -> List[Any]:
    """Run ``fn(group, *args)`` on `world_size` spawned gloo ranks; return results by rank.

    `timeout` is the hard deadline for the whole run (seconds); after the
    first failure the other ranks get `grace` seconds to report theirs.
    """
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dist_harness_") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, init_method, fn, args, out_q, pg_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            results, errors = _collect(procs, out_q, timeout, grace)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    if errors:
        report = "\n".join(f"---- rank {r} ----\n{msg}" for r, msg in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [pickle.loads(results[r]) for r in range(world_size)]


def _collect(procs, out_q, timeout: float, grace: float):
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: Dict[int, bytes] = {}
    errors: Dict[int, str] = {}
    first_failure: Optional[float] = None
    while len(results) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline or (first_failure is not None and now > first_failure + grace):
            break
        try:
            rank, status, payload = out_q.get(timeout=0.2)
        except queue.Empty:
            # a rank that died without reporting (e.g. a crash in a kernel)
            for r, p in enumerate(procs):
                if r in results or r in errors or p.exitcode is None:
                    continue
                try:  # its report may still be in the pipe
                    rank, status, payload = out_q.get(timeout=1.0)
                except queue.Empty:
                    errors[r] = f"process exited with code {p.exitcode} without a report"
                    first_failure = first_failure or time.monotonic()
                    break
                else:
                    (results if status == "ok" else errors)[rank] = payload
                    if status != "ok":
                        first_failure = first_failure or time.monotonic()
                    break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors[rank] = payload
            first_failure = first_failure or time.monotonic()
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if missing and not errors:
        for r in missing:
            errors[r] = f"no result within the {timeout:.0f} s deadline (killed)"
    elif missing:
        for r in missing:
            errors[r] = "no report after another rank failed (killed)"
    return results, errors
