"""Single-device dilated attention against its floor and against dense SDPA.

The floor is the same kernel run on inputs that are already gathered into
per-launch dense batches: what this op would cost if gathering, scattering and
merging were free. The op and its floor take turns within one run (A B A B), so
a machine whose speed drifts slows both sides alike.

    python benchmarks/bench_single_device.py                      # LongNet setting, 8K..64K
    python benchmarks/bench_single_device.py --seq-lens 8192 --repeats 1
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --seq-lens 8192 1048576
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --max-tokens
    python benchmarks/bench_single_device.py --device cuda --strided on   # views vs copies on a GPU

Working memory (peak resident memory beyond the inputs: q, k, v, and dout
for forward + backward; what the call returns, out and in training dq, dk,
dv, included) is measured in a fresh subprocess per case with
/proc/self/clear_refs and VmHWM, and reported in units of one input-sized
tensor (b * n * h * d elements of the dtype). Times: min/median/max.

On CUDA (``--device cuda``) times are taken after a device synchronise,
memory is the allocator's peak (``torch.cuda.max_memory_allocated``) beyond
the inputs, in the same process, and the table adds the achieved TFLOP/s of
the useful work (the score and value products the patterns select:
4 b h d sum_i n w_i / r_i^2 forward, 2.5x that more in backward; causal
halves it). ``--max-tokens`` searches the longest sequence whose forward,
and whose forward + backward, fit on the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.dilated import local_plan
from dilated_attention.kernels import BACKENDS, KernelOptions, attention_backward
from dilated_attention.kernels import attention_forward
from dilated_attention import plan as planning
from dilated_attention.patterns import gather
from dilated_attention.tools.bench import PeakMemory

HEADS, HEAD_DIM = 12, 64
SEGMENTS, RATES = (2048, 4096), (1, 2)
CAUSAL = False


DEVICE = "cpu"  # set once by main() from --device
BACKEND = "auto"  # and the kernel from --backend


def make_inputs(n: int, dtype: torch.dtype, requires_grad: bool = False):
    # (b, n, h, d); drawn on the device itself (a CPU copy of 1M+ rows would dominate)
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    q, k, v = (
        torch.randn(1, n, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=dtype)
        .requires_grad_(requires_grad)
        for _ in range(3)
    )
    return q, k, v


def useful_flops(n: int, backward: bool) -> float:
    """The score and value products the patterns select (see the module docstring)."""
    fwd = sum(4 * HEADS * HEAD_DIM * n * min(w, n) / r**2 for w, r in zip(SEGMENTS, RATES))
    fwd = fwd / 2 if CAUSAL else fwd
    return fwd * 3.5 if backward else fwd


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def pregathered(q, k, v):
    """Per launch of the op's plan: the dense (b * s, rows, heads, d) blocks it would gather,
    and whether the launch is causal."""
    blocks = []
    plan = local_plan(q, k, (SEGMENTS, RATES), CAUSAL, None, None)
    for block in plan.blocks:
        for launch in block.forward:
            g = launch.group
            q_sel = (launch.queries, g.q_heads, g.q_index, g.q_stride)
            kv_sel = (launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
            gathered = (gather(q, *q_sel), gather(k, *kv_sel), gather(v, *kv_sel))
            blocks.append(tuple(x.contiguous() for x in gathered) + (launch.causal,))
    return blocks


def run_case(impl: str, n: int, dtype: torch.dtype, backward: bool):
    """Return a callable running one iteration of `impl` at length n."""
    scale = HEAD_DIM**-0.5
    if impl == "dilated":
        q, k, v = make_inputs(n, dtype, requires_grad=backward)
        dout = torch.randn_like(q)

        def step():
            if backward:
                dilated_attention(q, k, v, SEGMENTS, RATES, backend=BACKEND).backward(dout)
            else:
                with torch.no_grad():
                    dilated_attention(q, k, v, SEGMENTS, RATES, backend=BACKEND)

        return step
    if impl == "floor":
        blocks = pregathered(*make_inputs(n, dtype))

        def step():
            for q_g, k_g, v_g, causal in blocks:
                opts = KernelOptions(causal=causal, scale=scale, backend=BACKEND)
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


def time_cases(steps: Dict[str, Callable[[], None]], repeats: int) -> Dict[str, List[float]]:
    """Seconds of `repeats` runs of each step after one warm-up each, sorted (min, ..., max).

    The steps take turns (A B A B ...), so that a machine whose speed drifts
    (other jobs, clocks) slows every step alike and their ratio holds.
    """
    for step in steps.values():
        step()  # warm-up
    synchronize()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts) for name, ts in times.items()}


def measure_memory_in_this_process(n: int, dtype: torch.dtype, training: bool) -> float:
    """Peak bytes of one call beyond its inputs (q, k, v, and dout when training).

    What the call leaves is counted, as a caller keeps it: out, and in training
    dq, dk, dv.
    """
    def call(n):
        q, k, v = make_inputs(n, dtype, requires_grad=training)
        dout = torch.randn_like(q) if training else None
        def step():
            if training:
                out = dilated_attention(q, k, v, SEGMENTS, RATES)
                out.backward(dout)
                return out, q.grad, k.grad, v.grad
            with torch.no_grad():
                return dilated_attention(q, k, v, SEGMENTS, RATES)
        return step

    call(1024)()  # warm-up: imports, first ops
    step = call(n)
    memory = PeakMemory("cpu")  # the package's clear_refs + VmHWM recipe
    memory.start()
    result = step()
    peak = memory.peak_bytes()
    del result
    if peak is None:
        raise RuntimeError("cannot measure peak memory: /proc/self/clear_refs or VmHWM missing")
    return float(peak)


def measure_cuda_memory(n: int, dtype: torch.dtype, training: bool) -> float:
    """Peak allocated bytes of one call beyond its inputs (q, k, v, and dout when training),
    what the call returns included (out; in training dq, dk, dv)."""
    q, k, v = make_inputs(n, dtype, requires_grad=training)
    dout = torch.randn_like(q) if training else None
    synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if training:
        out = dilated_attention(q, k, v, SEGMENTS, RATES, backend=BACKEND)
        out.backward(dout)
    else:
        with torch.no_grad():
            out = dilated_attention(q, k, v, SEGMENTS, RATES, backend=BACKEND)
    synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, q, k, v, dout
    torch.cuda.empty_cache()
    return float(peak)


def fits(n: int, dtype: torch.dtype, training: bool) -> bool:
    """Whether one call at length n runs on the device (inputs included)."""
    try:
        measure_cuda_memory(n, dtype, training)
        return True
    except torch.cuda.OutOfMemoryError:
        pass
    # the failed call's tensors hang on its traceback's frames, a reference cycle: collect
    # them, or every later (smaller) try fails too
    gc.collect()
    torch.cuda.empty_cache()
    return False


def max_tokens(dtype: torch.dtype, training: bool, start: int = 1 << 20,
               quantum: int = 1 << 18) -> int:
    """The longest length (a multiple of `quantum`) whose call fits: doubling, then bisection."""
    lo, hi = 0, start
    while fits(hi, dtype, training):
        lo, hi = hi, hi * 2
    while hi - lo > quantum:
        mid = (lo + hi) // 2 // quantum * quantum
        lo, hi = (mid, hi) if fits(mid, dtype, training) else (lo, mid)
    return lo


def measure_memory(n: int, dtype_name: str, training: bool) -> float:
    """`measure_memory_in_this_process` in a fresh process (no earlier allocations);
    on CUDA the allocator's peak in this process."""
    if DEVICE == "cuda":
        return measure_cuda_memory(n, getattr(torch, dtype_name), training)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    strided = {True: "on", False: "off"}[planning.STRIDED_VIEWS.get(DEVICE, False)]
    out = subprocess.run(
        [sys.executable, __file__, "--memory-case", str(n), dtype_name, str(int(training)),
         "--strided", strided],
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
    parser.add_argument("--memory-only", action="store_true", help="skip the timings")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the kernel, for the op and its floor alike")
    parser.add_argument("--max-tokens", action="store_true",
                        help="CUDA: find the longest sequence whose forward, and whose forward "
                        "+ backward, fit on the device, then exit")
    parser.add_argument("--strided", default="auto", choices=["auto", "on", "off"],
                        help="read regular rate-r selections as strided views (on) or gathered "
                        "copies (off); auto: the library's default for the device "
                        "(plan.STRIDED_VIEWS)")
    parser.add_argument("--json", default="bench-out/single_device.json")
    parser.add_argument("--memory-case", nargs=3, metavar=("N", "DTYPE", "TRAINING"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.strided != "auto":
        planning.STRIDED_VIEWS[args.device] = args.strided == "on"
    if args.memory_case:
        n, dtype_name, training = args.memory_case
        print(measure_memory_in_this_process(int(n), getattr(torch, dtype_name),
                                             bool(int(training))))
        return
    global DEVICE, BACKEND
    DEVICE, BACKEND = args.device, args.backend
    dtype = getattr(torch, args.dtype)
    rows = []
    where = (torch.cuda.get_device_name() if DEVICE == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {where}, dtype {args.dtype}, backend {BACKEND}, "
          f"strided views {planning.STRIDED_VIEWS.get(DEVICE, False)}, h={HEADS} d={HEAD_DIM} segments={list(SEGMENTS)} rates={list(RATES)} batch 1, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.max_tokens:
        if DEVICE != "cuda":
            parser.error("--max-tokens needs --device cuda")
        for training in (False, True):
            n = max_tokens(dtype, training)
            print(f"longest {'forward + backward' if training else 'forward'}: {n:,} tokens "
                  f"({n / 2**20:.2f} Mi)", flush=True)
            rows.append(dict(max_tokens=n, backward=training, dtype=args.dtype))
        _write_json(args.json, rows)
        return
    header = ("n", "pass", "dilated s (min/med/max)", "floor s (min/med/max)",
              "dilated/floor (median)", "dense s", "tokens/s", "TFLOP/s",
              "working memory (x input)", "bytes/token")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.seq_lens:
        input_bytes = n * HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
        for backward in (False, True):
            mem = measure_memory(n, args.dtype, backward) / input_bytes
            row = dict(n=n, backward=backward, dtype=args.dtype, device=DEVICE,
                       memory_inputs=mem, memory_bytes_per_token=mem * input_bytes / n)
            cells = ["-"] * 6
            if not args.memory_only:
                t = time_cases({impl: run_case(impl, n, dtype, backward)
                                for impl in ("dilated", "floor")}, args.repeats)
                dense = None
                if n <= args.dense_max:
                    dense = statistics.median(time_cases(
                        {"dense": run_case("dense_sdpa", n, dtype, backward)}, args.repeats)["dense"])
                med = {impl: statistics.median(ts) for impl, ts in t.items()}
                row.update(dilated_s=t["dilated"], floor_s=t["floor"],
                           ratio=med["dilated"] / med["floor"], dense_sdpa_s=dense,
                           tokens_per_s=n / med["dilated"],
                           tflops=useful_flops(n, backward) / med["dilated"] / 1e12)
                cells = ["/".join(f"{x:.4f}" for x in (ts[0], med[i], ts[-1]))
                         for i, ts in t.items()]
                cells += [f"{row['ratio']:.3f}", "-" if dense is None else f"{dense:.4f}",
                          f"{row['tokens_per_s']:.0f}", f"{row['tflops']:.2f}"]
            rows.append(row)
            print(f"| {n} | {'fwd+bwd' if backward else 'fwd'} | " + " | ".join(cells) +
                  f" | {mem:.2f} | {row['memory_bytes_per_token']:.0f} |", flush=True)
    _write_json(args.json, rows)


def _write_json(path: str, rows) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
