"""Two or more versions of the op, in turn: has a change made it slower?

    git worktree add /tmp/before <commit>
    python benchmarks/bench_versions.py /tmp/before . --seq-lens 16384 --rounds 3

Each round runs every source tree once, in the order given, in a fresh
process with that tree's ``src`` first on the path; a process times
`dilated_attention` (LongNet setting: 12 heads x 64, segments [2048, 4096],
rates [1, 2], batch 1, fp32) forward and forward + backward, median of 3
calls after a warm-up. Taking turns spreads a drifting machine over every
version; compare the rounds' spread before reading a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(seq_lens) -> dict:
    """{"<n> fwd" | "<n> fwd+bwd": median seconds} with the package on sys.path.

    Only the public `dilated_attention` is called (not bench_single_device's
    floor): older trees lack the internals that builds on."""
    import torch
    from dilated_attention import dilated_attention

    result = {}
    for n in seq_lens:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, n, 12, 64, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)

        def forward():
            with torch.no_grad():
                dilated_attention(q, k, v, [2048, 4096], [1, 2])

        def training():
            dilated_attention(q, k, v, [2048, 4096], [1, 2]).backward(dout)

        for name, call in (("fwd", forward), ("fwd+bwd", training)):
            call()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            result[f"{n} {name}"] = statistics.median(times)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="source trees (repository roots) to compare")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.seq_lens)))
        return
    rows = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), tree, "--measure", "--seq-lens",
                 *map(str, args.seq_lens)], env=env, capture_output=True, text=True,
                check=True, cwd="/")
            rows[tree].append(json.loads(out.stdout.splitlines()[-1]))
    keys = list(rows[args.trees[0]][0])
    print("| tree | " + " | ".join(f"{k} s (each round)" for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for tree, results in rows.items():
        cells = [" / ".join(f"{r[k]:.2f}" for r in results) for k in keys]
        print(f"| {tree} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
