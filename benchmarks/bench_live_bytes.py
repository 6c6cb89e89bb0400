"""Peak live tensor bytes per rank of a real forward: exact, whatever the machine's load.

    python benchmarks/bench_live_bytes.py                  # N = 64K, [2048, 65536] / [1, 16]
    python benchmarks/bench_live_bytes.py --world-sizes 1 4 --segment-lengths 2048 4096 \
        --dilation-rates 1 2

Runs ``dilated_attention`` (fp32 forward, batch 1) on P spawned gloo ranks, each on
its own N / P rows, under ``tools.estimate.dryrun.LiveBytes``: every tensor storage the
call creates is counted from its creation until it is freed (also while a
communication request still holds it), and the peak is kept. Unlike the resident
set that ``dilated-attention bench`` reports, this leaves out the allocator's and
the process group's own memory, and unlike ``dilated-attention estimate
--dry-run`` it runs the real kernels and a real gloo group. Printed per world
size: the inputs (q, k, v), the peak, and the peak's ratio to P = 1's.
"""

from __future__ import annotations

import argparse
from typing import List, Tuple

import torch

from dilated_attention import dilated_attention
from dilated_attention.distributed import comm
from dilated_attention.tools import launch
from dilated_attention.tools.estimate.dryrun import LiveBytes


def measure(group, n: int, heads: int, head_dim: int, segs: List[int],
            rates: List[int]) -> Tuple[int, int]:
    """(bytes of this rank's q, k, v; peak live bytes of the call, inputs included)."""
    rows = n // comm.group_size(group) + (comm.group_rank(group) < n % comm.group_size(group))
    tracker = LiveBytes(reuse=False)
    with tracker:
        q, k, v = (torch.randn(1, rows, heads, head_dim) for _ in range(3))
        inputs = tracker.live
        dilated_attention(q, k, v, segs, rates, group=group)
    return inputs, tracker.peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--segment-lengths", type=int, nargs="+", default=[2048, 65536])
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 16])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    options = (args.seq_len, args.heads, args.head_dim, args.segment_lengths,
               args.dilation_rates)
    one = None
    for world in args.world_sizes:
        if world == 1:
            results = [measure(None, *options)]
        else:
            results = launch.spawn(measure, world, options, timeout=3600.0, pg_timeout=1800.0)
        inputs, peak = max(results, key=lambda r: r[1])
        one = peak if world == 1 else one
        ratio = f", {peak / one:.3f} of P = 1" if one else ""
        print(f"P = {world}: inputs {inputs / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB per rank "
              f"(largest rank){ratio}")


if __name__ == "__main__":
    main()
