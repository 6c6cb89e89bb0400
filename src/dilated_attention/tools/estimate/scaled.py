"""The estimate: the dry run of the real code, at the real length or at shorter ones.

Note [estimate]
~~~~~~~~~~~~~~~
One source of truth for the op's memory: the op's own code, run on meta tensors
(``dryrun.trace``). No formula mirrors the executor. What is arithmetic is what
the executor does not decide (``formula``): the inputs and outputs of the call,
the traffic of each strategy's wire protocol, the kernels' own buffers.

But a dry run costs what the rank's plan costs, about one launch per 2048 rows on
CPU sizes (a billion rows per rank: half a million launches, minutes), while
``estimate`` must answer for 2^40 tokens in seconds. So when the plan would have
more than BUDGET launches, the dry run runs at two *representative* lengths, N / k
and N / 2k, and the rest is composed: the peak is the call's inputs and outputs
at the real length (arithmetic) plus the working memory beyond them, which is
extrapolated along the line through the two representatives' (per rank and
phase; the modelled kernel buffers alike).

Why a line: above policy.MAX_BLOCKS row blocks per rank (``policy.block_rows``) a rank's
block grows with its rows, and so does every part of the working memory that is
not constant: one block's accumulators, launches over segments cut by blocks and
their pending outputs, the exchange's buffers. What stays constant is a launch of
a segment whole in a block, and merge slices. So the working memory is affine in
the rows, exactly, if the representatives' plans have the real plan's structure
with fewer repeats, which ``representative`` arranges:

- a pattern whose segments are longer than the real block shrinks with the
  sequence: it crosses as many blocks and ranks. Its rate shrinks too (the same
  rows per head: a sparse part stays sparse) where the heads keep their offsets
  (the scaled rate still at least the heads), else it stays (its launches then
  grow with the blocks, as the cut ones do);
- a pattern whose segments fit in the real block keeps its shape (fewer of them),
  shrunk only as far as it must to fit the representative's block, rate alike;
- runs of equal launches differ in length only, which ``compact_plan`` cuts to
  their ends anyway.

A sliding window (window.py, the halo exchange) has no row blocks that grow: its
stripes, tiles and halos are as long whatever the rows, so the line is flat, as
long as the representatives keep the real halos (pieces longer than twice the
window's reach; its traffic is the halo schedule's, at the real length).

The tests hold the result to the full dry run at lengths where both run: to the
byte for LongNet's setting, accumulators that grow with the blocks, a geometric
schedule spanning ranks and Ulysses (and, too slow for the tests, a dense causal
segment across two ranks, training). A plan
threshold between a representative and the real length (a segment part turning
sparse, the exchange's gather or rotate mode, a cut in heads, the block rounded
to the longest segment that fits, a rate that cannot shrink with its heads'
offsets) changes a constant part of the working memory instead; the tests hold
such a case within 1% of the peak. Traffic is never extrapolated: it is
arithmetic at the real length.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

from ... import policy
from . import dryrun
from .config import EstimateConfig, split
from .formula import busiest, kernel_scratch, minimum, traffic

# Launches a rank's plan may have for the dry run to run at the real length (8K: about
# three seconds of dry run on this machine's CPU; above it, two representatives of at
# most this many launches: `estimate --seq-len 1T` traces 4M and 8M rows in about 6 s,
# the same peak to the byte as with twice the budget, which took 9-11 s).
BUDGET = 1 << 13
# A representative's rows are at least this many blocks of the device's minimum, so that
# its blocks grow with its rows as the real ones do (above policy.MAX_BLOCKS blocks' worth).
_LARGE_BLOCKS = 2 * policy.MAX_BLOCKS
# A sliding window's dry run costs about one launch's per this many rows (its tiles run
# per 512-row block, forward and backward: 1.4 s of CPU for 128K rows in training here).
_WINDOW_ROWS_PER_LAUNCH = 8
# A sliding window's representatives are at least this many stripes (row blocks) longer
# than twice its reach.
_WINDOW_STRIPES = 16
# A ring of more ranks is estimated on a ring of this many, its pieces as long.
_RING_RANKS = 8
# Elements of a rank's largest tensor that the dry run creates on meta (torch indexes
# with int64; the executor multiplies sizes).
_MAX_ELEMENTS = 1 << 56


@dataclasses.dataclass
class Estimate:
    """Peak bytes of the largest rank, its breakdown, and the busiest rank's traffic per layer.

    `scale` k: the dry runs ran at N / k and N / 2k (1: at N itself); `rows`: the
    rows per rank of the traced lengths, for the peak rank."""

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
    scale: int = 1
    rows: Tuple[int, ...] = ()


def estimate(config: EstimateConfig, budget: int = BUDGET, *,
             traces: Optional[List[dryrun.Trace]] = None) -> Estimate:
    """The estimate (Note [estimate]), with the traffic computed; `traces`: the dry run's
    at the real length, where it has run (``estimate_with_dry_run``)."""
    start = time.perf_counter()
    ranks = _ring_ranks(config)
    if ranks < config.world_size:
        # a ring rank holds what it holds whatever P is (Note [sub-pieces] in ring.py), a
        # halo rank what its window reaches: trace a ring of `ranks` ranks of the longest
        # piece; traffic stays the real ring's
        lengths = config.lengths()
        best = estimate(dataclasses.replace(config, world_size=ranks,
                                            seq_len=ranks * max(lengths)), budget)
        if not config.windowed:
            best.rank = lengths.index(max(lengths))
        elif best.rank >= ranks // 2:  # a halo rank counted from the end it is near
            best.rank += config.world_size - ranks
    else:
        best = _estimate(config, budget, traces)
    per_rank = traffic(config)
    best.traffic_rank = busiest(per_rank)
    (best.forward_bytes, best.forward_messages, best.backward_bytes,
     best.backward_messages) = per_rank[best.traffic_rank]
    best.seconds = time.perf_counter() - start
    return best


def _ring_ranks(config: EstimateConfig) -> int:
    """Ranks of the ring whose ranks hold what the real ring's do: _RING_RANKS, and with a
    sliding window enough that a middle rank's window reaches no end (P for the dilated
    op and meshes)."""
    if config.impl != "ring" or config.mesh is not None:
        return config.world_size
    if not config.windowed:
        return _RING_RANKS
    span = -(-max(config.reaches()) // min(config.lengths()))  # pieces a window crosses
    return max(_RING_RANKS, 2 * span + 2)


def _estimate(config: EstimateConfig, budget: int,
              traces: Optional[List[dryrun.Trace]]) -> Estimate:
    """The peak: the dry run at the real length, or extrapolated from two representatives."""
    k = scale(config, budget)
    if k == 1:
        best = _largest(config, [_from_trace(config, t) for t in traces or _trace_all(config)])
    else:
        large, small = representative(config, k), representative(config, 2 * k)
        ranks = dryrun.distinct_ranks(large)
        best = _largest(config, [_extrapolate(config, *pair) for pair in zip(
            (_from_trace(small, dryrun.trace(small, r)) for r in ranks),
            (_from_trace(large, dryrun.trace(large, r)) for r in ranks))])
    best.method, best.scale = "estimate", k
    return best


def dry_run(config: EstimateConfig, *, traces: Optional[List[dryrun.Trace]] = None,
            **shortcuts) -> Estimate:
    """The dry run at the real length, every distinct rank; traffic as ``comm`` counted it."""
    start = time.perf_counter()
    traces = traces or _trace_all(config, **shortcuts)
    best = _largest(config, [_from_trace(config, t) for t in traces])
    sent = max(traces, key=lambda t: (t.sent[0] + t.sent[2], t.piece))
    (best.forward_bytes, best.forward_messages, best.backward_bytes,
     best.backward_messages) = sent.sent
    best.traffic_rank, best.seconds = sent.piece, time.perf_counter() - start
    return best


def estimate_with_dry_run(config: EstimateConfig) -> Tuple[Estimate, Estimate]:
    """``--dry-run``: the estimate and the dry run at the real length. Where the estimate
    runs the code at the real length itself, one run of each rank serves both (they differ
    in their traffic: arithmetic against counted)."""
    if _ring_ranks(config) < config.world_size or scale(config) > 1:
        return estimate(config), dry_run(config)
    start = time.perf_counter()
    traces = _trace_all(config)
    seconds = time.perf_counter() - start
    both = estimate(config, traces=traces), dry_run(config, traces=traces)
    for e in both:
        e.seconds += seconds
    return both


def check_dry_run(config: EstimateConfig) -> None:
    """ValueError when the dry run at the real length cannot make the rank's tensors."""
    if _elements(config) > _MAX_ELEMENTS:
        raise ValueError(f"--dry-run at {config.seq_len:,} rows would make tensors beyond "
                         f"torch's int64 sizes (the estimate alone extrapolates)")


def _trace_all(config: EstimateConfig, **shortcuts) -> List[dryrun.Trace]:
    check_dry_run(config)
    return [dryrun.trace(config, r, **shortcuts) for r in dryrun.distinct_ranks(config)]


def _elements(config: EstimateConfig) -> int:
    """Elements of the largest tensor a rank's call makes, about."""
    return _traced_rows(config) * max(config.heads, 2 * config.kv_heads) * config.head_dim * \
        config.batch


# --------------------------------------------------------------------------
# Representatives


def scale(config: EstimateConfig, budget: int = BUDGET) -> int:
    """k: 1 when the real length's plan has at most `budget` launches (and its tensors can
    be made); else the smallest power of two whose representative's plan has (the one at
    2k then has about half), as long as both stay above _LARGE_BLOCKS blocks (a window:
    its reach twice and _WINDOW_STRIPES stripes, so that the halos keep their rows and
    rounds, and the stripes they write are followed by stripes they do not)."""
    rows = _traced_rows(config)
    block = policy.rows_per_block(config.device)
    large = _LARGE_BLOCKS * block
    if config.windowed:
        large = 2 * max(config.reaches()) + _WINDOW_STRIPES * block
    k = 1
    while (_launches(representative(config, k)) > budget
           or _elements(config) // k > _MAX_ELEMENTS) and rows // (4 * k) >= large:
        k *= 2
    return k


def representative(config: EstimateConfig, k: int) -> EstimateConfig:
    """The call at N / k with the real plan's structure (Note [estimate])."""
    if k == 1:
        return config
    n = config.seq_len // k
    if config.impl == "ring":
        # zigzag: 2P equal chunks
        step = 2 * config.world_size if config.layout == "zigzag" else 1
        return dataclasses.replace(config, seq_len=n // step * step)
    rows = _traced_rows(config)
    block = policy.block_rows(rows, config.segment_lengths, config.device)
    target = rows // k // policy.MAX_BLOCKS  # the representative's block
    segs, rates = [], []
    for w, r in zip(*config.patterns):
        long = min(w, config.seq_len) > block
        f = k if long else 1
        while f < k and w // f > target:
            f *= 2
        segs.append(max(1, w // f))
        # the rate shrinks too (the same rows per head), unless that would give heads other
        # offsets: a long segment then keeps its rate (its launches grow with the blocks)
        keep = long and (r % f or r // f < config.heads) and r <= w // f
        rates.append(r if keep else max(1, r // f))
    return dataclasses.replace(config, seq_len=n, segment_lengths=tuple(segs),
                               dilation_rates=tuple(rates))


def _traced_rows(config: EstimateConfig) -> int:
    """Rows of the op a rank runs: its piece, or under Ulysses all rows of its heads' block."""
    u, sp = split(config)
    return max(config.lengths()) if u == 1 else config.seq_len // sp


def _launches(config: EstimateConfig) -> int:
    """About how many launches the traced rank's plan has (the ring's do not grow with N; a
    window's: its rows in _WINDOW_ROWS_PER_LAUNCH)."""
    rows = _traced_rows(config)
    if config.windowed:
        return rows // _WINDOW_ROWS_PER_LAUNCH
    if config.impl == "ring":
        return 0
    # CUDA launches take a whole block, but the plan still enumerates its segments: count
    # those in CPU-sized launches
    launch = policy.ROWS_PER_LAUNCH.get(config.device) or policy.ROWS_PER_LAUNCH["cpu"]
    return sum(-(-rows // max(min(w, config.seq_len), launch)) for w in config.segment_lengths)


# --------------------------------------------------------------------------
# From traces to estimates


@dataclasses.dataclass
class _Rank:
    """One rank's peak as working memory beyond the call's minimum, per phase."""

    piece: int
    rows: int
    working: Dict[str, int]
    scratch: Tuple[str, int]
    traced: Tuple[int, ...] = ()  # the representatives' rows, when extrapolated


def _from_trace(config: EstimateConfig, t: dryrun.Trace) -> _Rank:
    floor = minimum(config, t.rows, config.training)
    working = {phase: peak - sum(floor[phase].values()) for phase, peak in t.peaks.items()}
    return _Rank(t.piece, t.rows, working, kernel_scratch(config, t.plan, t.rows))


def _extrapolate(config: EstimateConfig, small: _Rank, large: _Rank) -> _Rank:
    """The rank at the real length, on the line through its two representatives."""
    n = config.lengths()[large.piece]

    def line(a: int, b: int) -> int:
        return b + (b - a) * (n - large.rows) // (large.rows - small.rows)

    working = {phase: line(small.working[phase], x) for phase, x in large.working.items()}
    scratch = (large.scratch[0], line(small.scratch[1], large.scratch[1]))
    return _Rank(large.piece, n, working, scratch, (small.rows, large.rows))


def _largest(config: EstimateConfig, ranks: List[_Rank]) -> Estimate:
    """The rank and phase with the highest peak: the call's minimum there, the working
    memory beyond it, and the kernels' own buffers."""
    options = []
    for rank in ranks:
        floor = minimum(config, rank.rows, config.training)
        for phase, working in rank.working.items():
            label = f"working memory ({'extrapolated' if rank.traced else 'traced'})"
            breakdown = {**floor[phase], label: working, rank.scratch[0]: rank.scratch[1]}
            options.append((sum(breakdown.values()), rank.piece, phase, breakdown,
                            rank.traced or (rank.rows,)))
    peak, piece, phase, breakdown, rows = max(options, key=lambda o: (o[0], -o[1]))
    return Estimate("dry run", piece, peak, phase, breakdown, rows=rows)
