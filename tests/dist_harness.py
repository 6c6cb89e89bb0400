"""Run a function on real spawned gloo ranks; never hang.

    results = run_distributed(fn, world_size, *args, timeout=120)

spawns `world_size` processes through ``dilated_attention.tools.launch.spawn``;
each joins a gloo process group (file:// rendezvous in a fresh temp dir: no
fixed ports; 30 s collective timeout), calls ``torch.set_num_threads(1)``
and runs ``fn(group, *args)`` with ``group`` the WORLD group. `fn` must be
importable by name (a module-level function of a test module). Its return
value travels back pickled (tensors are detached and moved to the CPU
first) and ``results[r]`` is rank r's.

One spawn costs seconds, so `fn` should loop over many cases and return a
list of per-case results. Inside `fn`, ``subgroup(ranks)`` creates a
subgroup (every rank must call it; non-members get None). Tests whose functions
need the same world size share one spawn through ``SharedSpawn``.

Any failure (an exception in any rank, a crashed rank, the deadline) kills
the remaining ranks and raises ``RankFailure`` with every traceback the
ranks managed to report.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from dilated_attention.distributed.sharding import piece_ranges
from dilated_attention.tools import launch

PG_TIMEOUT_S = 30.0


class RankFailure(RuntimeError):
    """One or more ranks failed, crashed or ran past the deadline."""


def subgroup(ranks: Sequence[int]):
    """A gloo subgroup of `ranks` (call on every rank); None on non-members."""
    return launch.new_group(ranks)


def case_ranges(case: dict, world: int, rank: int) -> List[Tuple[int, int]]:
    """The global row ranges a rank holds in a test case: ``case["layout"]`` "zigzag" over
    ``case["n"]`` rows, else the contiguous pieces ``case["lengths"]``."""
    if case["layout"] == "zigzag":
        return piece_ranges(case["n"], world, rank, "zigzag")
    start = sum(case["lengths"][:rank])
    return [(start, start + case["lengths"][rank])]


def rows_of(x: torch.Tensor, ranges, dim: int = 1) -> torch.Tensor:
    """Those rows of a full tensor, in the rank's local order."""
    return torch.cat([x.narrow(dim, a, z - a) for a, z in ranges], dim=dim)


def error_of(fn: Callable[[], Any]) -> Tuple[str, float]:
    """("ValueError: ..." or "TypeError: ...", seconds) of calling `fn`; "no error" if it
    returns. The seconds show that a rank whose call failed elsewhere did not wait for a
    timeout."""
    t0 = time.monotonic()
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


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
    try:
        return launch.spawn(fn, world_size, args, timeout=timeout, pg_timeout=pg_timeout,
                            grace=grace, threads=1, tmp_prefix="dist_harness_")
    except launch.LaunchFailed as exc:
        # the test report shows every rank's traceback, not just the summaries
        raise RankFailure(exc.details()) from None


def run_each(group, parts: Sequence[Tuple]) -> List[Any]:
    """Each ``(fn, *args)`` of `parts` on this rank, in turn: their results (SharedSpawn)."""
    return [fn(group, *args) for fn, *args in parts]


class SharedSpawn:
    """One spawn per world size for the rank functions of several tests (one spawn costs
    seconds): ``parts[world]`` lists their ``(fn, *args)``, run in that order on the same
    ranks; ``results(world, fn, *args)`` is every rank's result of one of them, from the
    spawn made at the first call for `world`. Where that spawn fails, each part then spawns
    alone (kept per part), so that only the tests whose part fails fail, as with a spawn
    per test."""

    def __init__(self, parts: Dict[int, Sequence[Tuple]], timeout: float = 600.0,
                 pg_timeout: float = PG_TIMEOUT_S) -> None:
        self.parts, self.timeout, self.pg_timeout = parts, timeout, pg_timeout
        self._shared: Dict[int, Any] = {}  # world -> every rank's results, or None: it failed
        self._alone: Dict[Tuple[int, int], List[Any]] = {}  # (world, index) -> by rank

    def results(self, world: int, fn: Callable, *args: Any) -> List[Any]:
        part = (fn, *args)
        index = list(self.parts[world]).index(part)
        if world not in self._shared:
            try:
                self._shared[world] = self._spawn(world, self.parts[world])
            except RankFailure:
                self._shared[world] = None
        if self._shared[world] is not None:
            return [ranks[index] for ranks in self._shared[world]]
        if (world, index) not in self._alone:
            self._alone[world, index] = [ranks[0] for ranks in self._spawn(world, [part])]
        return self._alone[world, index]

    def _spawn(self, world: int, parts: Sequence[Tuple]) -> List[List[Any]]:
        return run_distributed(run_each, world, parts, timeout=self.timeout,
                               pg_timeout=self.pg_timeout)
