"""Planning LongNet's billion-token schedule: seconds per rank to build one rank's plan.

    python benchmarks/bench_plan.py                          # 2^30 tokens over 128 and 256 ranks
    python benchmarks/bench_plan.py --world-sizes 128 --device cuda --causal
    python benchmarks/bench_plan.py --world-sizes 128 --fused    # and the fused kernel's

LongNet's geometric schedule (w / r = 2048): segments [2048, 16384, 131072,
2^20, 2^23, 2^26, 2^29, 2^30] with rates [1, 8, 64, 512, 4096, 32768, 2^18,
2^19], 12 heads. For each world size P, the plans of ranks 0, 5, P / 2 and
P - 1 are built in this process, in that order (``plan.make_plan`` on meta
index tensors, with the row blocks and launch sizes of --device: what every
rank of a real run builds for itself before its first launch, and what
``dilated-attention estimate`` builds). Each plan is built once, cold: the
first rank of a world size also pays the transfer schedule that all its
ranks share, and the very first plan the one-time imports. Printed: seconds
per rank (wall clock, and this process's CPU time, which a machine busy with
other work inflates less), launches, row blocks and exchange rounds. With
--fused also what a rank builds where its own pairs run in the fused kernel
(CUDA, bf16: ``fused_plan.tile_plan`` of its piece, with the H100's tiles
for heads of 64, ``fused.cuda_tile_sizes``: query tiles of 128 rows, key
tiles of 128, spans split as there): seconds (wall) and int32 entries of the
row tables.
"""

from __future__ import annotations

import argparse
import time

import torch

from dilated_attention.fused import cuda_tile_sizes
from dilated_attention.fused_plan import _tile_plan
from dilated_attention.patterns import Heads
from dilated_attention.plan import Layout, make_plan

SEGMENTS = (2048, 16384, 131072, 2**20, 2**23, 2**26, 2**29, 2**30)
RATES = tuple(w // 2048 for w in SEGMENTS)


def pieces(n: int, world_size: int) -> Layout:
    """n rows over world_size ranks, the first n % world_size one row longer."""
    return Layout.contiguous([n // world_size + (p < n % world_size) for p in range(world_size)])


def plan_times(layout: Layout, ranks, *, causal: bool, device: str, heads: int):
    """(rank, wall s, cpu s, plan) for each rank's plan, built in order."""
    out = []
    for rank in ranks:
        wall, cpu = time.perf_counter(), time.process_time()
        plan = make_plan(layout, (SEGMENTS, RATES), causal, Heads.of(heads, heads), rank, "meta",
                         device_type=device)
        out.append((rank, time.perf_counter() - wall, time.process_time() - cpu, plan))
    return out


def fused_plan_time(layout: Layout, rank: int, *, causal: bool, heads: int):
    """(wall s, row table entries) of the rank's fused-kernel piece plans, built cold
    (uncached: the op caches them per shape)."""
    chunks = layout.of_rank(rank)
    window = (chunks[0].start, chunks[0].stop) if chunks else (0, 0)
    tiles = cuda_tile_sizes((9, 0), torch.bfloat16, 64)
    wall, rows = time.perf_counter(), 0
    for kernel in ("forward", "dkdv"):
        plan = _tile_plan(layout.total, (SEGMENTS, RATES), Heads.of(heads, heads), heads,
                          causal, None, window=window, **tiles.plan(kernel))
        rows += plan.rows.numel()
    return time.perf_counter() - wall, rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2**30)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[128, 256])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="whose row blocks and launch sizes to plan with (default cpu)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--fused", action="store_true",
                   help="also time the fused kernel's plans of each rank's piece")
    args = p.parse_args(argv)
    print(f"N = {args.seq_len:,}, segments {list(SEGMENTS)}, rates {list(RATES)}, "
          f"{args.heads} heads, {'causal, ' if args.causal else ''}{args.device} sizes")
    fused = (" fused plans s (wall) | fused row entries |", " --- | --- |") if args.fused \
        else ("", "")
    print("| ranks | rank | seconds (wall) | seconds (CPU) | launches | row blocks | rounds |"
          + fused[0])
    print("| --- | --- | --- | --- | --- | --- | --- |" + fused[1])
    for world_size in args.world_sizes:
        ranks = list(dict.fromkeys([0, 5, world_size // 2, world_size - 1]))
        layout = pieces(args.seq_len, world_size)
        for rank, wall, cpu, plan in plan_times(layout, ranks, causal=args.causal,
                                                device=args.device, heads=args.heads):
            extra = ""
            if args.fused:
                seconds, entries = fused_plan_time(layout, rank, causal=args.causal,
                                                   heads=args.heads)
                extra = f" {seconds:.2f} | {entries:,} |"
            print(f"| {world_size} | {rank} | {wall:.2f} | {cpu:.2f} | {plan.launches:,} | "
                  f"{len(plan.blocks)} | {len(plan.rounds)} |" + extra, flush=True)


if __name__ == "__main__":
    main()
