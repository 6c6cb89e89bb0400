"""How long the fused kernels' launches take in waves, cell by cell against heaviest first.

    python benchmarks/tile_order_waves.py                  # windows of 1,024 tiles
    python benchmarks/tile_order_waves.py --window 264 --slots 216

Arithmetic, not a measurement (no GPU needed): each launch of the sm_90 tiles' plans
(``fused.TUNED_TILE_SIZES``, bf16, d 64; 12 heads) list-scheduled in order on
``--slots`` programs at once (an H100: 132 SMs, two programs each), a program taking the
keys its loop reaches (``fused_plan.tile_work``: causal bounds included) plus
``--overhead`` for its fixed work. Per kernel, the launches' time over the even share of
their work, ``order_window=0`` (cell by cell) -> ``--window`` (Note [fused kernel] in
fused_plan.py, "Tile order"). What it leaves out is what decides on a GPU: the L2 that
programs running together share, and how a GPU really starts them
(``gpu_suite.py --part tile-order`` times it).
"""

from __future__ import annotations

import argparse
import heapq
from typing import Sequence, Tuple

from dilated_attention import fused
from dilated_attention.fused_plan import TilePlan, tile_work, tile_plan
from dilated_attention.patterns import Heads

SCHEDULES = {"LongNet": ((2048, 4096), (1, 2)),
             "geometric": ((2048, 4096, 8192, 16384, 32768, 65536), (1, 2, 4, 8, 16, 32))}
HEADS = 12


def makespan(work: Sequence[float], slots: int) -> float:
    """Programs of `work` started in order, each on the first slot that frees."""
    ends = [0.0] * min(slots, len(work))
    for w in work:
        heapq.heappush(ends, heapq.heappop(ends) + w)
    return max(ends)


def launches(plan: TilePlan, causal: bool, keys: bool, slots: int, overhead: float
             ) -> Tuple[float, float]:
    """(time in waves, even share) of the plan's launches together."""
    work = [w + overhead for w in tile_work(plan.tiles, plan.rows, plan.spans, causal,
                                             keys).tolist()]
    total, lo = 0.0, 0
    for _, count in plan.heights:
        total += makespan(work[lo:lo + count], slots)
        lo += count
    return total, sum(work) / slots


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=264)
    parser.add_argument("--overhead", type=float, default=256)
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        default=[8192, 16384, 32768, 65536, 131072])
    args = parser.parse_args(argv)
    sizes = fused.TUNED_TILE_SIZES[((9, 0), "half", 64)]
    print(f"{args.slots} slots, {args.overhead:g} keys of fixed work a program; "
          f"cell by cell -> windows of {args.window}")
    print("| schedule | causal | n | forward | dq | dK/dV |")
    print("|---|---|---|---|---|---|")
    for name, patterns in SCHEDULES.items():
        for causal in (False, True):
            for n in args.seq_lens:
                cells = []
                for kernel in ("forward", "dq", "dkdv"):
                    plan_args = dict(sizes.plan(kernel), order_window=0)
                    plain = tile_plan(n, patterns, Heads.of(HEADS, HEADS), HEADS, causal, None,
                                      **plan_args)
                    plan_args["order_window"] = args.window
                    ordered = tile_plan(n, patterns, Heads.of(HEADS, HEADS), HEADS, causal,
                                        None, **plan_args)
                    (before, share), (after, _) = (
                        launches(p, causal, plan_args["keys"], args.slots, args.overhead)
                        for p in (plain, ordered))
                    cells.append(f"{before / share:.3f} -> {after / share:.3f}")
                print(f"| {name} | {'yes' if causal else 'no'} | {n:,} | " + " | ".join(cells)
                      + " |", flush=True)


if __name__ == "__main__":
    main()
