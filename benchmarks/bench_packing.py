"""Packed documents: one call over many documents against one document and separate calls.

    python benchmarks/bench_packing.py                       # 2^20 tokens, 10,000 documents
    python benchmarks/bench_packing.py --tokens 65536 --documents 500 --repeats 3

Three forward passes over the same N tokens (batch 1, fp32, LongNet's
segments [2048, 4096] with rates [1, 2], --heads x 64):

- one document: the N tokens as one sequence (no cu_seqlens);
- packed: the N tokens cut into --documents documents of random lengths,
  one call with cu_seqlens;
- separate: the same documents, one call each.

Packed and separate compute the same attention (each document alone), so
their ratio is the cost of packing; packed against one document shows what
many short documents cost next to one long one (less attention, more
launches). Times are min/median/max of --repeats runs, taken in one process,
alternating the cases. ``--memory`` instead measures the working memory of
one document and of packed (peak resident memory beyond q, k, v, the output
included, in input-sized tensors), each in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from dilated_attention import dilated_attention
from dilated_attention.dilated import local_plan
from dilated_attention.tools.bench import PeakMemory

SEGMENTS, RATES = (2048, 4096), (1, 2)


def documents(n: int, count: int, seed: int) -> list:
    """cu_seqlens of `count` documents of random lengths (at least 1 token) summing to n."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(n - 1, generator=g)[: count - 1] + 1
    return [0] + sorted(cuts.tolist()) + [n]


def working_memory(n: int, heads: int, count: int, packed: bool) -> float:
    """Peak bytes of one forward beyond q, k, v (output included) / one input-sized tensor."""
    g = torch.Generator().manual_seed(0)
    cu = documents(n, count, seed=1) if packed else None
    with torch.no_grad():
        small = torch.randn(1, 4096, heads, 64)
        dilated_attention(small, small, small, SEGMENTS, RATES)  # warm-up: imports, first ops
        q, k, v = (torch.randn(1, n, heads, 64, generator=g) for _ in range(3))
        memory = PeakMemory("cpu")
        memory.start()
        out = dilated_attention(q, k, v, SEGMENTS, RATES, cu_seqlens=cu)
        peak = memory.peak_bytes()
    del out
    return peak / q.nbytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2**20)
    p.add_argument("--documents", type=int, default=10_000)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory", action="store_true",
                   help="measure working memory (fresh processes) instead of time")
    p.add_argument("--memory-case", choices=("one", "packed"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = args.tokens
    if args.memory_case:
        print(working_memory(n, args.heads, args.documents, args.memory_case == "packed"))
        return
    if args.memory:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        for case in ("one", "packed"):
            out = subprocess.run([sys.executable, __file__, "--tokens", str(n), "--documents",
                                  str(args.documents), "--heads", str(args.heads),
                                  "--memory-case", case], env=env, capture_output=True,
                                 text=True, check=True)
            name = "one document" if case == "one" else f"packed ({args.documents:,} documents)"
            print(f"{name}: working memory {float(out.stdout.split()[-1]):.2f} input-sized "
                  f"tensors beyond q, k, v (N = {n:,}, {args.heads} heads x 64, fp32, forward)")
        return
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, args.heads, 64, generator=g) for _ in range(3))
    cu = documents(n, args.documents, seed=1)
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]

    def one():
        return dilated_attention(q, k, v, SEGMENTS, RATES)

    def packed():
        return dilated_attention(q, k, v, SEGMENTS, RATES, cu_seqlens=cu)

    def separate():
        for s, e in zip(cu[:-1], cu[1:]):
            dilated_attention(q[:, s:e], k[:, s:e], v[:, s:e], SEGMENTS, RATES)

    cases = {"one document": one, "packed": packed, "separate calls": separate}
    times = {name: [] for name in cases}
    with torch.no_grad():
        torch.testing.assert_close(  # the packed call is the separate calls, concatenated
            packed()[:, cu[1]:cu[2]],
            dilated_attention(q[:, cu[1]:cu[2]], k[:, cu[1]:cu[2]], v[:, cu[1]:cu[2]],
                              SEGMENTS, RATES))
        for _ in range(args.repeats):
            for name, fn in cases.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    def launches(docs):
        plan = local_plan(q, k, (SEGMENTS, RATES), False, None, docs)
        return sum(len(b.forward) for b in plan.blocks)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}; N = {n:,} tokens, {args.heads} heads x 64, fp32, forward; "
          f"{args.documents:,} documents of {min(lengths)} to {max(lengths)} tokens "
          f"(median {int(statistics.median(lengths))})")
    print("| case | launches | seconds (min/median/max) |")
    print("|---|---|---|")
    for name, ts in times.items():
        count = {"one document": launches(None), "packed": launches(tuple(cu)),
                 "separate calls": "-"}[name]
        ts = sorted(ts)
        print(f"| {name} | {count} | {ts[0]:.2f} / {statistics.median(ts):.2f} / {ts[-1]:.2f} |")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"packed / separate calls: {med['packed'] / med['separate calls']:.3f}; "
          f"packed / one document: {med['packed'] / med['one document']:.3f}")


if __name__ == "__main__":
    main()
