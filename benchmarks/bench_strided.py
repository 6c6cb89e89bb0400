"""Strided views against gathered copies: the same op, both ways, taking turns in one process.

    python benchmarks/bench_strided.py                              # CPU, fp32, 32K fwd, 16K fwd+bwd
    python benchmarks/bench_strided.py --device cuda --dtype bfloat16 --cases 1048576:fwd 1048576:bwd

A rate-r head group whose (head, first row) columns are arithmetic can be
read, merged and scattered through ``as_strided`` views (``patterns.Stride``)
or gathered into dense copies by advanced indexing. ``policy.STRIDED_VIEWS``
picks per device; this script runs the op with it on and off, alternating
call by call (a machine whose speed drifts slows both alike), in the LongNet
setting (12 heads x 64, segments [2048, 4096], rates [1, 2], batch 1 or
--batch), and
prints min/median/max seconds per call and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from dilated_attention import dilated_attention, policy

HEADS, HEAD_DIM = 12, 64
SEGMENTS, RATES = [2048, 4096], [1, 2]


def timed_call(batch: int, n: int, backward: bool, dtype: torch.dtype, device: str):
    """A function that runs one call (forward, or forward + backward) and returns its seconds."""
    # (b, n, h, d)
    q, k, v = (torch.randn(batch, n, HEADS, HEAD_DIM, dtype=dtype, device=device,
                           requires_grad=backward) for _ in range(3))
    dout = torch.randn_like(q)

    def call() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = dilated_attention(q, k, v, SEGMENTS, RATES)
        if backward:
            out.backward(dout)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return call


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["32768:fwd", "16384:bwd"],
                        help="N:fwd or N:bwd (forward + backward)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, batch {args.batch}, "
          f"{args.repeats} calls each "
          f"after a warm-up, strided and gathered taking turns")
    print("| n | pass | strided s (min/med/max) | gathered s (min/med/max) | strided / gathered |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        n, kind = case.split(":")
        call = timed_call(args.batch, int(n), kind == "bwd", dtype, args.device)
        times = {True: [], False: []}
        for repeat in range(args.repeats + 1):
            for strided in (True, False):
                with mock.patch.dict(policy.STRIDED_VIEWS, {args.device: strided}):
                    seconds = call()
                if repeat:  # the first round warms up (plans, allocator)
                    times[strided].append(seconds)
        cells = ["/".join(f"{x:.3f}" for x in (min(t), statistics.median(t), max(t)))
                 for t in times.values()]
        ratio = statistics.median(times[True]) / statistics.median(times[False])
        print(f"| {n} | {'fwd+bwd' if kind == 'bwd' else 'fwd'} | {cells[0]} | {cells[1]} | "
              f"{ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
