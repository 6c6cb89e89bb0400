"""The estimate: the dry run of the real code.

Note [estimate]
~~~~~~~~~~~~~~~
One source of truth for the op's memory: the op's own code, run on meta tensors
(``dryrun.trace``). No formula mirrors the executor. What is arithmetic is what
the executor does not decide (``formula``): the inputs and outputs of the call,
the traffic of each strategy's wire protocol, the kernels' own buffers.

Traffic is never measured into the estimate: it is arithmetic. The dry run at
``--dry-run`` counts what the code sends, to compare.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Tuple

from . import dryrun
from .config import EstimateConfig
from .formula import busiest, kernel_scratch, minimum, traffic


@dataclasses.dataclass
class Estimate:
    """Peak bytes of the largest rank, its breakdown, and the busiest rank's traffic per layer.

    `rows`: the rows per rank of the traced length, for the peak rank."""

    method: str
    rank: int
    peak_bytes: int
    phase: str
    breakdown: Dict[str, int]
    forward_bytes: int = 0
    forward_messages: int = 0
    backward_bytes: int = 0
    backward_messages: int = 0
    seconds: float = 0.0
    traffic_rank: int = 0
    rows: Tuple[int, ...] = ()


def estimate(config: EstimateConfig) -> Estimate:
    """The estimate (Note [estimate]): the dry run's peak, the traffic computed."""
    start = time.perf_counter()
    best = _largest(config, [_from_trace(config, t) for t in _trace_all(config)])
    per_rank = traffic(config)
    best.traffic_rank = busiest(per_rank)
    (best.forward_bytes, best.forward_messages, best.backward_bytes,
     best.backward_messages) = per_rank[best.traffic_rank]
    best.method, best.seconds = "estimate", time.perf_counter() - start
    return best


def dry_run(config: EstimateConfig, **shortcuts) -> Estimate:
    """The dry run at the real length, every distinct rank; traffic as ``comm`` counted it."""
    start = time.perf_counter()
    traces = _trace_all(config, **shortcuts)
    best = _largest(config, [_from_trace(config, t) for t in traces])
    sent = max(traces, key=lambda t: (t.sent[0] + t.sent[2], t.piece))
    (best.forward_bytes, best.forward_messages, best.backward_bytes,
     best.backward_messages) = sent.sent
    best.traffic_rank, best.seconds = sent.piece, time.perf_counter() - start
    return best


def _trace_all(config: EstimateConfig, **shortcuts) -> List[dryrun.Trace]:
    return [dryrun.trace(config, r, **shortcuts) for r in dryrun.distinct_ranks(config)]


# --------------------------------------------------------------------------
# From traces to estimates


@dataclasses.dataclass
class _Rank:
    """One rank's peak as working memory beyond the call's minimum, per phase."""

    piece: int
    rows: int
    working: Dict[str, int]
    scratch: Tuple[str, int]


def _from_trace(config: EstimateConfig, t: dryrun.Trace) -> _Rank:
    floor = minimum(config, t.rows)
    working = {phase: peak - sum(floor[phase].values()) for phase, peak in t.peaks.items()}
    return _Rank(t.piece, t.rows, working, kernel_scratch(config, t.plan, t.rows))


def _largest(config: EstimateConfig, ranks: List[_Rank]) -> Estimate:
    """The rank and phase with the highest peak: the call's minimum there, the working
    memory beyond it, and the kernels' own buffers."""
    options = []
    for rank in ranks:
        floor = minimum(config, rank.rows)
        for phase, working in rank.working.items():
            label = "working memory (traced)"
            breakdown = {**floor[phase], label: working, rank.scratch[0]: rank.scratch[1]}
            options.append((sum(breakdown.values()), rank.piece, phase, breakdown,
                            (rank.rows,)))
    peak, piece, phase, breakdown, rows = max(options, key=lambda o: (o[0], -o[1]))
    return Estimate("dry run", piece, peak, phase, breakdown, rows=rows)
