"""Single-device dilated attention against its floor and against dense SDPA.

The floor is the same kernel run on inputs that are already gathered into
per-launch dense batches: what this op would cost if gathering, scattering and
merging were free. Ratios are taken within one run, so a busy machine slows
both sides alike.

    python benchmarks/bench_single_device.py                      # LongNet setting, 8K..64K
    python benchmarks/bench_single_device.py --seq-lens 8192 --repeats 1

Working memory (peak resident memory beyond the inputs, the output included)
is measured in a fresh subprocess per case with /proc/self/clear_refs and
VmHWM, and reported in units of one input-sized tensor (b * n * h * d).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.kernels import KernelOptions, attention_backward, attention_forward
from dilated_attention.launches import sequence_launches
from dilated_attention.patterns import gather
from dilated_attention.tools.bench import PeakMemory

HEADS, HEAD_DIM = 12, 64
SEGMENTS, RATES = (2048, 4096), (1, 2)


def make_inputs(n: int, dtype: torch.dtype, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(n)
    # (b, n, h, d)
    q, k, v = (
        torch.randn(1, n, HEADS, HEAD_DIM, generator=gen).to(dtype).requires_grad_(requires_grad)
        for _ in range(3)
    )
    return q, k, v


def pregathered(q, k, v):
    """Per launch: the dense (b * s, rows, heads, d) blocks the op would gather."""
    blocks = []
    for launch in sequence_launches(q.shape[1], HEADS, HEADS, (SEGMENTS, RATES), q.device):
        region, group = launch.region, launch.group
        q_sel = (region, group.q_heads, group.q_index, group.identity)
        kv_sel = (region, group.kv_heads, group.kv_index, group.identity)
        blocks.append(
            tuple(x.contiguous() for x in (gather(q, *q_sel), gather(k, *kv_sel), gather(v, *kv_sel)))
        )
    return blocks


def run_case(impl: str, n: int, dtype: torch.dtype, backward: bool):
    """Return a callable running one iteration of `impl` at length n."""
    opts = KernelOptions(causal=False, scale=HEAD_DIM**-0.5)
    if impl == "dilated":
        q, k, v = make_inputs(n, dtype, requires_grad=backward)
        dout = torch.randn_like(q)

        def step():
            if backward:
                dilated_attention(q, k, v, SEGMENTS, RATES).backward(dout)
            else:
                with torch.no_grad():
                    dilated_attention(q, k, v, SEGMENTS, RATES)

        return step
    if impl == "floor":
        blocks = pregathered(*make_inputs(n, dtype))

        def step():
            for q_g, k_g, v_g in blocks:
                out, lse = attention_forward(q_g, k_g, v_g, opts)
                if backward:
                    attention_backward(out, q_g, k_g, v_g, out, lse, opts)

        return step
    if impl == "dense_sdpa":
        # (b, n, h, d) -> (b, h, n, d)
        q, k, v = (x.transpose(1, 2) for x in make_inputs(n, dtype, requires_grad=backward))
        dout = torch.randn_like(q)

        def step():
            if backward:
                F.scaled_dot_product_attention(q, k, v).backward(dout)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v)

        return step
    raise ValueError(f"unknown impl {impl!r}")


def time_case(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_memory_in_this_process(impl: str, n: int, dtype: torch.dtype) -> float:
    """Peak bytes beyond the inputs of one forward, output included."""
    run_case(impl, 1024, dtype, backward=False)()  # warm-up: imports, first ops
    step = run_case(impl, n, dtype, backward=False)
    if impl == "dilated":
        # keep the output alive, as a caller does
        q, k, v = make_inputs(n, dtype)

        def step():  # noqa: F811
            with torch.no_grad():
                return dilated_attention(q, k, v, SEGMENTS, RATES)

    memory = PeakMemory("cpu")  # the package's clear_refs + VmHWM recipe
    memory.start()
    result = step()
    peak = memory.peak_bytes()
    del result
    if peak is None:
        raise RuntimeError("cannot measure peak memory: /proc/self/clear_refs or VmHWM missing")
    return float(peak)


def measure_memory(impl: str, n: int, dtype_name: str) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, __file__, "--memory-case", impl, str(n), dtype_name],
        env=env, capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--dense-max", type=int, default=16384,
                        help="skip dense SDPA above this length (it is quadratic)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-out/single_device.json")
    parser.add_argument("--memory-case", nargs=3, metavar=("IMPL", "N", "DTYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_case:
        impl, n, dtype_name = args.memory_case
        print(measure_memory_in_this_process(impl, int(n), getattr(torch, dtype_name)))
        return
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"h={HEADS} d={HEAD_DIM} segments={list(SEGMENTS)} rates={list(RATES)} batch 1",
          flush=True)
    header = ("n", "pass", "dilated s", "floor s", "dilated/floor", "dense s", "tokens/s",
              "fwd mem (x input)", "floor mem (x input)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.seq_lens:
        input_bytes = n * HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
        mem = {impl: measure_memory(impl, n, args.dtype) / input_bytes for impl in ("dilated", "floor")}
        for backward in (False, True):
            t = {impl: time_case(run_case(impl, n, dtype, backward), args.repeats)
                 for impl in ("dilated", "floor")}
            dense = None
            if n <= args.dense_max:
                dense = time_case(run_case("dense_sdpa", n, dtype, backward), args.repeats)
            row = dict(n=n, backward=backward, dilated_s=t["dilated"], floor_s=t["floor"],
                       ratio=t["dilated"] / t["floor"], dense_sdpa_s=dense,
                       tokens_per_s=n / t["dilated"], fwd_mem_inputs=mem["dilated"],
                       floor_mem_inputs=mem["floor"], dtype=args.dtype)
            rows.append(row)
            print(f"| {n} | {'fwd+bwd' if backward else 'fwd'} | {t['dilated']:.3f} | "
                  f"{t['floor']:.3f} | {row['ratio']:.3f} | "
                  f"{'-' if dense is None else f'{dense:.3f}'} | {row['tokens_per_s']:.0f} | "
                  f"{mem['dilated']:.2f} | {mem['floor']:.2f} |", flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
