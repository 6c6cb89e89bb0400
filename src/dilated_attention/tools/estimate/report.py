"""What ``estimate`` prints: the estimate (and the dry run at the real length), as text or JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import List, Tuple

from ...plan import work
from ..settings import megabytes, plural
from . import dryrun
from .config import EstimateConfig, kernels_name, split, strategy_name
from .scaled import Estimate, estimate, estimate_with_dry_run, representative


def report(config: EstimateConfig, *, trace: bool, as_json: bool) -> int:
    """Print the estimate (and, with `trace`, the dry run at the real length); exit status 0."""
    estimates = list(estimate_with_dry_run(config)) if trace else [estimate(config)]
    if as_json:
        print(json.dumps({"config": dataclasses.asdict(config),
                          "estimates": [dataclasses.asdict(e) for e in estimates]}, indent=2))
        return 0
    print(f"ESTIMATE (not measured): {describe(config)}")
    for e in estimates:
        print(f"\n{e.method}: peak per rank {megabytes(e.peak_bytes)} (rank {e.rank}, {e.phase}; "
              f"{_how(e)}; {e.seconds:.2f} s)")
        for name, nbytes in e.breakdown.items():
            print(f"  {name:44s} {megabytes(nbytes):>16s}")
        print(f"  communication per layer, sent by rank {e.traffic_rank} (the busiest): forward "
              f"{megabytes(e.forward_bytes)} in {plural(e.forward_messages, 'message')}"
              + (f", backward {megabytes(e.backward_bytes)} in "
                 f"{plural(e.backward_messages, 'message')}"
                 if config.training else ""))
    if config.impl == "dilated" and config.world_size > 1 and split(config)[0] == 1:
        ranks, loads = work_per_rank(config, estimates[0].scale)
        mean = sum(loads) / len(loads)
        which = "every rank" if len(ranks) == config.world_size else f"ranks {ranks}"
        scaled = f", at 1/{estimates[0].scale} of N" if estimates[0].scale > 1 else ""
        print(f"\nattention work per rank (score entries, forward; {which}{scaled}): busiest "
              f"{max(loads):,.0f} = {max(loads) / mean:.3f} x the mean")
    if trace:
        e, d = estimates
        print(f"\nestimate vs dry run: peak {100 * (e.peak_bytes / d.peak_bytes - 1):+.1f}%, "
              f"forward traffic {megabytes(e.forward_bytes)} vs {megabytes(d.forward_bytes)}")
    return 0


def _how(e: Estimate) -> str:
    if len(e.rows) == 1:
        return f"the real code at {e.rows[0]:,} rows per rank"
    return f"the real code at {e.rows[0]:,} and {e.rows[1]:,} rows per rank, extrapolated"


def describe(config: EstimateConfig) -> str:
    mode = "training (forward + backward)" if config.training else "forward only"
    window = (f", sliding window of {config.window} keys" if config.window is not None
              else "")
    what = (f"dense ring attention{window}" if config.impl == "ring" else
            f"dilated attention, segments {list(config.segment_lengths)}, rates "
            f"{list(config.dilation_rates)}")
    lengths = config.lengths()
    rows = (f"{min(lengths):,} to {max(lengths):,} rows each" if min(lengths) != max(lengths)
            else f"{lengths[0]:,} rows each")
    kernels = (f"CPU kernels, {plural(config.threads, 'thread')} per rank"
               if config.device == "cpu" else f"CUDA kernels ({kernels_name(config)})")
    return (f"{what}; N = {config.seq_len:,} over P = {plural(config.world_size, 'rank')} "
            f"({rows}, {config.layout}; strategy {strategy_name(config)}); batch "
            f"{config.batch}, {config.heads} heads x "
            f"{config.head_dim} (kv heads {config.kv_heads}), {config.dtype}, "
            f"{'causal, ' if config.causal else ''}{mode}; {kernels}")


def work_per_rank(config: EstimateConfig, scale: int = 1) -> Tuple[List[int], List[int]]:
    """(ranks, each one's attention work) from the plans (at N / `scale`, as the estimate
    traced them): every rank up to 16, else a sample."""
    traced = representative(config, scale)
    p = config.world_size
    ranks = list(range(p)) if p <= 16 else dryrun.ranks_to_check(config)
    return ranks, [work(dryrun.plan_for(traced, r)) for r in ranks]
