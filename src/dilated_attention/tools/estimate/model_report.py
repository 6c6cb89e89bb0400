"""What ``estimate --model`` prints: a step's memory per checkpoint mode, or the longest
sequence that fits a budget per world size, as text or JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional

from ...models.checkpointing import CHECKPOINT_MODES
from ..settings import megabytes, plural
from .model import Fit, ModelSetup, estimate_modes, longest, world_sizes
from .model_dryrun import dry_run


def report(setup: ModelSetup, *, trace: bool, as_json: bool,
           budget: Optional[int] = None) -> int:
    """Print the estimate at the setup's length, or with `budget` the longest sequences per
    P up to the setup's world size; exit status 0."""
    if budget is not None:
        return _report_fit(setup, budget, as_json)
    estimates = estimate_modes(setup)
    traced = {mode: dry_run(setup, mode) for mode in CHECKPOINT_MODES} if trace else {}
    if as_json:
        print(json.dumps({"model": _describe_json(setup),
                          "estimates": {m: dataclasses.asdict(e) for m, e in estimates.items()},
                          "dry_runs": {m: dataclasses.asdict(e) for m, e in traced.items()}},
                         indent=2))
        return 0
    print(f"ESTIMATE (not measured): {describe(setup)}")
    print(f"\n{'per rank':34s}" + "".join(f"{m:>16s}" for m in CHECKPOINT_MODES))
    labels = list(dict.fromkeys(k for e in estimates.values() for k in e.breakdown))
    for label in labels:
        print(f"  {label:32s}" + "".join(f"{megabytes(e.breakdown.get(label, 0)):>16s}"
                                       for e in estimates.values()))
    _row("peak on the device", [e.peak_bytes for e in estimates.values()])
    _row("host memory (offloaded inputs)", [e.host_bytes for e in estimates.values()])
    print(f"  {'peak at':32s}" + "".join(f"{_short(e.stage):>16s}" for e in estimates.values()))
    if traced:
        _row("dry run: peak on the device", [traced[m].peak_bytes for m in CHECKPOINT_MODES])
        print(f"  {'formula vs dry run':32s}" + "".join(
            f"{100 * (estimates[m].peak_bytes / traced[m].peak_bytes - 1):>+15.1f}%"
            for m in CHECKPOINT_MODES))
    if setup.device == "cpu":
        print("\n(on a CPU device offload is layers: the block inputs already live in host "
              "memory)")
    return 0


def _report_fit(setup: ModelSetup, budget: int, as_json: bool) -> int:
    fits: List[Dict[str, Fit]] = [longest(setup, budget, p)
                                  for p in world_sizes(setup.world_size)]
    if as_json:
        print(json.dumps({"model": _describe_json(setup), "budget_bytes": budget,
                          "fits": [{m: dataclasses.asdict(f) for m, f in row.items()}
                                   for row in fits]}, indent=2))
        return 0
    print(f"ESTIMATE (not measured): the longest training sequence N whose step fits "
          f"{_size(budget)} per rank: {describe(setup, with_length=False)}")
    print(f"\n{'P':>5s}" + "".join(f"{m:>14s}" for m in CHECKPOINT_MODES)
          + f"{'offload: host per rank':>26s}")
    for row in fits:
        p = row["none"].world_size
        cells = "".join(f"{_tokens(f.seq_len):>14s}" for f in row.values())
        host = row["offload"].estimate
        print(f"{p:>5d}{cells}{megabytes(host.host_bytes) if host else '-':>26s}")
    step = fits[0]["none"].step
    print(f"\nN in multiples of {step:,} P tokens; the attention op's working memory from its "
          f"dry run at the longest N of each P")
    if setup.config.positions == "learned":
        print(f"(learned positions: N at most max_seq_len = {setup.config.max_seq_len:,}, "
              f"the table's length)")
    if setup.device == "cpu":
        print("(on a CPU device offload is layers: the block inputs already live in host "
              "memory)")
    return 0


def describe(setup: ModelSetup, *, with_length: bool = True) -> str:
    c = setup.config
    kv = f", {c.num_kv_heads} kv heads" if c.num_kv_heads else ""
    ffn = (f", feed-forward over chunks of {megabytes(c.ffn_chunk_bytes)}"
           if c.ffn_chunk_bytes is not None else "")
    length = (f"N = {setup.seq_len:,} over P = {plural(setup.world_size, 'rank')} "
              f"({setup.rows:,} rows per rank); " if with_length else "")
    return (f"LongNetLM {setup.name} ({c.num_layers} layers, embed {c.embed_dim}, {c.num_heads} "
            f"heads{kv}, ffn {c.ffn_dim}, vocabulary {c.vocab_size:,}{ffn}), segments "
            f"{list(c.segment_lengths)}, rates {list(c.dilation_rates)}, causal; training step "
            f"(forward, backward, AdamW) with the loss over chunks of "
            f"{megabytes(c.loss_chunk_bytes)}; {length}batch {setup.batch}, {setup.dtype} "
            f"parameters, gradients and moments; {setup.device} kernels")


def _describe_json(setup: ModelSetup) -> dict:
    return {"name": setup.name, "config": dataclasses.asdict(setup.config),
            **{k: getattr(setup, k) for k in ("seq_len", "world_size", "batch", "dtype",
                                              "device", "strategy")}}


def _row(label: str, values: List[int]) -> None:
    print(f"  {label:32s}" + "".join(f"{megabytes(v):>16s}" for v in values))


def _short(stage: str) -> str:
    """A stage's name in at most 15 characters: the columns are 16 wide."""
    return (stage.replace("forward end, a loss chunk", "fwd end").replace("backward, ", "bwd ")
            .replace(" block's chunks recomputed", " recomp").replace(" block", ""))


def _tokens(n: int) -> str:
    if n == 0:
        return "none fits"
    if n % 1024:  # a learned position table's length
        return f"{n:,}"
    return f"{n / 2**20:,.2f}M" if n >= 2**20 else f"{n // 1024:,}K"


def _size(budget: int) -> str:
    """A budget in the unit that shows it: 80.0 GB, 300.0 MB, 1,000 bytes (not "0.0 GB")."""
    if budget >= 10**9:
        return f"{budget / 1e9:,.1f} GB"
    return megabytes(budget) if budget >= 10**6 else plural(budget, "byte")
