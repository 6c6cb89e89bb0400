"""Sharded generation with LongNetLM: cache memory per rank, time per token, traffic per step.

    python benchmarks/bench_generate.py                                   # tiny, 64K, P = 1 2 4
    python benchmarks/bench_generate.py --presets tiny base --contexts 65536 --new-tokens 16
    python benchmarks/bench_generate.py --prefill random --contexts 16384 32768 65536 \\
        131072 262144 --world-sizes 2 4 --new-tokens 8                    # traffic vs context

(The base preset at 64K holds 4.8 GB of cache on one rank, plus the
prefill's activations; at 256K its cache would not fit this 24 GiB machine,
so the traffic series runs on tiny: bytes per step follow the formula for
any model size.)

For each preset, context n and world size P, P spawned gloo ranks (CPU, fp32,
batch 1) build the same model, fill the key/value cache of an n-token prompt
and generate --new-tokens tokens greedily (decoding.py, Note [sharded
generation]). Per rank it measures:

- cache MiB: the bytes of this rank's cache tensors (keys and values of its
  prompt piece, plus its block of new rows), exact;
- peak MiB: the resident-memory high-water mark above the rank's baseline
  after building the model, over prefill and decoding (what the prefill's
  activations and the cache together cost);
- prefill s: the sequence-parallel prompt (``--prefill run``);
- ms/token: the median over the timed steps of one new token (its layers,
  the head and the sampling), and of that the time blocked in the per-layer
  all-gather of the partial results (which includes waiting for the slowest
  rank);
- bytes/step and messages/step this rank sends (distributed/comm.py's
  counters), and the formula layers x (P - 1) x b x h x (d + 1) x 4.

``--prefill random`` fills each rank's cache with random rows where the
prompt would have put them instead of running the prompt: the decode step
reads the same rows either way, so time, traffic and cache memory per step
are the same; it makes long contexts (256K) cheap, and the peak then is the
cache alone. The table prints the busiest rank (largest time, memory) per
row; cache / P=1 is the cache of the busiest rank over the one-process
cache of the same case.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Dict, List
from unittest import mock

import torch

from dilated_attention import LongNetConfig, LongNetLM
from dilated_attention.decoding import CachePlan
from dilated_attention.distributed import comm
from dilated_attention.distributed.sharding import piece_ranges
from dilated_attention.models.generation import LayerCache, decode_token, prefill
from dilated_attention.tools import launch
from dilated_attention.tools.bench import PeakMemory
from dilated_attention.tools.settings import default_threads


def cache_bytes(caches: List[LayerCache]) -> int:
    """The bytes of this rank's cache tensors: prompt rows and the new rows' block."""
    return sum(x.numel() * x.element_size() for c in caches for rows in c.rows()
               for x in (rows.k, rows.v))


def random_caches(model: LongNetLM, plan: CachePlan, seed: int) -> List[LayerCache]:
    """Each layer's cache with random rows where the prompt would put them."""
    attn = model.layers[0].self_attn
    (start, stop) = plan.prompt
    g = torch.Generator().manual_seed(seed)
    shape = (1, stop - start, attn.num_kv_heads, attn.head_dim)
    return [LayerCache(plan, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in model.layers]


def rank_main(group, preset: str, context: int, new_tokens: int, mode: str,
              warmup: int) -> Dict[str, float]:
    size, rank = comm.group_size(group), comm.group_rank(group)
    torch.manual_seed(0)  # the same model on every rank
    config = LongNetConfig.from_name(preset, max_seq_len=max(context + new_tokens, 8192))
    model = LongNetLM(config, process_group=group).eval()
    prompt = torch.randint(0, config.vocab_size, (1, context),
                           generator=torch.Generator().manual_seed(1))
    steps = warmup + new_tokens
    plan = CachePlan.of(context, steps, size, rank)
    with torch.no_grad():  # first calls (kernels, plans, allocator) outside what is measured
        short = prompt[:, :64]
        _, warm = prefill(model, short, CachePlan.of(64, 1, size, rank))
        decode_token(model, short[:, 0], 64, warm)
        del warm
    memory = PeakMemory("cpu")
    memory.start()
    prefill_s = float("nan")
    with torch.no_grad():
        if mode == "run":
            start = time.perf_counter()
            hidden, caches = prefill(model, prompt, plan)
            prefill_s = time.perf_counter() - start
        else:
            caches = random_caches(model, plan, seed=rank)
            hidden = torch.randn(1, config.embed_dim, generator=torch.Generator().manual_seed(2))
        waits: List[float] = []
        real_all_gather = comm.all_gather

        def timed_all_gather(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real_all_gather(*args, **kwargs)
            finally:
                waits[-1] += time.perf_counter() - start

        times, sent, messages = [], [], []
        with mock.patch.object(comm, "all_gather", timed_all_gather):
            for step in range(steps):
                waits.append(0.0)
                comm.barrier(group)  # every rank starts the step together
                with comm.count_communication() as stats:
                    start = time.perf_counter()
                    token = model.logits(model.norm(hidden)).argmax(-1)
                    hidden = decode_token(model, token, context + step, caches)
                    times.append(time.perf_counter() - start)
                sent.append(stats.bytes_sent)
                messages.append(stats.messages)
    timed = slice(warmup, None)
    attn = model.layers[0].self_attn
    return {
        "cache_bytes": cache_bytes(caches),
        "peak_bytes": memory.peak_bytes() or 0,
        "prefill_s": prefill_s,
        "ms_per_token": 1e3 * statistics.median(times[timed]),
        "wait_ms": 1e3 * statistics.median(waits[timed]),
        "bytes_per_step": max(sent[timed]),
        "messages_per_step": max(messages[timed]),
        "formula_bytes": (config.num_layers * (size - 1) * attn.num_heads
                          * (attn.head_dim + 1) * 4),
        "prompt_rows": plan.prompt[1] - plan.prompt[0],
        "piece": piece_ranges(context, size, rank)[0],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny"], choices=["tiny", "base"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[65536])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--new-tokens", type=int, default=16, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--prefill", choices=["run", "random"], default="run",
                        help="run the prompt, or fill the cache with random rows")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: the cores over the ranks)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per spawn")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, CPU fp32, batch 1, greedy, {args.new_tokens} timed "
          f"tokens after {args.warmup}, prefill {args.prefill}; the busiest rank per row")
    print("| preset | context | P | cache MiB/rank | cache / P=1 | peak MiB/rank | prefill s | "
          "ms/token | all-gather wait ms | bytes/step/rank (formula) | messages/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for context in args.contexts:
            single = None
            for size in args.world_sizes:
                ranks = launch.spawn(rank_main, size, (preset, context, args.new_tokens,
                                                       args.prefill, args.warmup),
                                     timeout=args.timeout,
                                     threads=args.threads or default_threads(size))
                busiest = {key: max(r[key] for r in ranks) for key in ranks[0]
                           if key != "piece"}
                if size == 1:
                    single = busiest["cache_bytes"]
                ratio = f"{busiest['cache_bytes'] / single:.3f}" if single else "-"
                prefill = busiest["prefill_s"]
                prefill = "-" if math.isnan(prefill) else f"{prefill:.1f}"  # --prefill random
                print(f"| {preset} | {context} | {size} | {busiest['cache_bytes'] / 2**20:.1f} | "
                      f"{ratio} | {busiest['peak_bytes'] / 2**20:.0f} | "
                      f"{prefill} | {busiest['ms_per_token']:.2f} | "
                      f"{busiest['wait_ms']:.1f} | {busiest['bytes_per_step']} "
                      f"({busiest['formula_bytes']}) | {busiest['messages_per_step']} |",
                      flush=True)


if __name__ == "__main__":
    main()
