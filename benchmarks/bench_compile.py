"""torch.compile of MultiheadDilatedAttention: compile time, recompiles, run time against eager.

    python benchmarks/bench_compile.py                                  # CPU, float32
    python benchmarks/bench_compile.py --device cuda --dtype bfloat16 --seq-lens 65536 131072

For each length in order: the first compiled call (it compiles, or reuses
the graph of an earlier length when the length is marked dynamic), then the
median of `--repeats` compiled and eager calls, forward + backward. Dynamo
runs with ``fullgraph=True``, so a graph break is an error; the count of
compiled graphs and any warnings raised while compiling are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from dilated_attention import MultiheadDilatedAttention

EMBED, HEADS = 768, 12
SEGMENTS, RATES = (2048, 4096), (1, 2)


def timed(step, device: str) -> float:
    t0 = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 12288])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--static", action="store_true",
                        help="do not mark the sequence length dynamic")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(EMBED, HEADS, SEGMENTS, RATES, device=args.device,
                                     dtype=dtype)

    def step_of(module, x):
        def step():
            out, _ = module(x, x, x, is_causal=True)
            out.sum().backward()
        return step

    compiled = torch.compile(attn, backend=args.backend, fullgraph=True)
    print(f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, backend "
          f"{args.backend}, {'static' if args.static else 'dynamic'} length, "
          f"{torch.get_num_threads()} threads")
    print("| n | first compiled call (s) | compiled (s, median) | eager (s, median) | "
          "compiled / eager |")
    print("|---|---|---|---|---|")
    caught = []
    for n in args.seq_lens:
        x = torch.randn(1, n, EMBED, device=args.device, dtype=dtype, requires_grad=True)
        if not args.static:
            torch._dynamo.mark_dynamic(x, 1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first = timed(step_of(compiled, x), args.device)
        caught += [f"{w.category.__name__}: {w.message}" for w in seen]
        runs = {name: statistics.median(timed(step_of(m, x), args.device)
                                        for _ in range(args.repeats))
                for name, m in (("compiled", compiled), ("eager", attn))}
        print(f"| {n} | {first:.2f} | {runs['compiled']:.3f} | {runs['eager']:.3f} | "
              f"{runs['compiled'] / runs['eager']:.2f} |", flush=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"compiled graphs: {graphs}; warnings while compiling: {len(caught)}")
    for line in dict.fromkeys(caught):
        print("  " + line[:300])


if __name__ == "__main__":
    main()
