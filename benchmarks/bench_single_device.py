"""Single-device dilated attention against two kernel floors and against dense SDPA.

Both floors run the dense kernel on inputs that are already gathered, and do
nothing else: no gathers, scatters or merges.

- *ideal floor*: for each pattern, ONE batched kernel call on its selected
  rows: all segments and heads of the pattern at once, (b * segments, w / r,
  heads, d), head j reading its own offset's rows (j mod r). What any
  implementation built on this kernel costs at best.
- *per-launch floor*: one kernel call per launch of the op's own plan (row
  blocks, head groups), each on its pre-gathered inputs: what the op would
  cost if moving rows and merging were free. op / ideal measures everything
  the op adds to the kernel; per-launch / ideal what cutting the work into
  launches costs.

The op and its floors take turns within one run (A B C A B C), so a machine
whose speed drifts slows all sides alike.

    python benchmarks/bench_single_device.py                      # LongNet setting, 8K..64K
    python benchmarks/bench_single_device.py --seq-lens 8192 --repeats 1
    python benchmarks/bench_single_device.py --cpu-time   # a shared machine: one thread's CPU time
    python benchmarks/bench_single_device.py --schedule geometric  # 2048..65536 / 1..32
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --seq-lens 8192 1048576
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --backend triton
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --queued 10
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --backend triton \
        --cuda-graph                                  # the kernels' time, no host in it
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --max-tokens
    python benchmarks/bench_single_device.py --device cuda --strided on   # views vs copies on a GPU
    python benchmarks/bench_single_device.py --device cuda --dtype bfloat16 --causal  # LM training

Schedules: ``longnet`` (segments [2048, 4096], rates [1, 2]) and
``geometric`` (segments 2048, 4096, ..., 65536, rates 1, 2, ..., 32: w / r =
2048), 12 heads x 64, batch 1; ``--causal`` times causal calls (a language model's:
the op with ``is_causal=True``, each floor call causal within its segment). The
floors run the kernel named by ``--floor-backend`` (default: the op's
``--backend``, or ``auto``, the device's best dense kernel, for a backend with
no per-launch kernel such as the fused ``triton``).

Working memory (peak resident memory beyond the inputs: q, k, v, and dout
for forward + backward; what the call returns, out and in training dq, dk,
dv, included) is measured in a fresh subprocess per case with
/proc/self/clear_refs and VmHWM, and reported in units of one input-sized
tensor (b * n * h * d elements of the dtype). Times: min/median/max.

On CUDA (``--device cuda``) times are taken after a device synchronise
(``--queued K``: after K calls back to back, per call, so that the host's
work overlaps the kernels queued before it, as in a training loop;
``--cuda-graph``: every step, the op's and the floors', captured once in a
CUDA graph and timed by its replays, so that no host work is in any time:
the op as torch.compile's mode="reduce-overhead" or a captured training step
runs it; the fused kernel only, the SDPA path reads its input check back), memory
is the allocator's peak (``torch.cuda.max_memory_allocated``) beyond the
inputs, in the same process, and the table adds the achieved TFLOP/s of
the useful work (the score and value products the patterns select: 4 b d
per (head, query, key) pair a pattern selects, about 4 b h d sum_i n w_i / r_i^2
forward, 2.5x that more in backward; a causal pattern selects a row's earlier keys
and itself, about half). ``--max-tokens`` searches the longest sequence whose forward,
and whose forward + backward, fit on the device.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.dilated import local_plan
try:
    from dilated_attention.backends import BACKENDS
except ImportError:  # a tree before backends.py (gpu_suite.py --part compare --baseline)
    from dilated_attention.kernels import BACKENDS
from dilated_attention.kernels import KernelOptions, attention_backward
from dilated_attention.kernels import attention_forward
from dilated_attention import policy
from dilated_attention.patterns import Heads, Segments, gather, head_groups
from dilated_attention.tools.bench import PeakMemory

HEADS, HEAD_DIM = 12, 64
SCHEDULES = {
    "longnet": ((2048, 4096), (1, 2)),
    "geometric": ((2048, 4096, 8192, 16384, 32768, 65536), (1, 2, 4, 8, 16, 32)),
}
SEGMENTS, RATES = SCHEDULES["longnet"]  # set once by main() from --schedule
CAUSAL = False
# the op, its two floors: they take turns in this order
TIMED = ("dilated", "ideal", "per_launch")


DEVICE = "cpu"  # set once by main() from --device
BACKEND = "auto"  # the op's kernel, from --backend
FLOOR_BACKEND = "auto"  # the floors' kernel, from --floor-backend
DROPOUT = 0.0  # the op's attention dropout, from --dropout (the floors run without)


def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The timed call: the op in the setting main() chose."""
    return dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=CAUSAL, backend=BACKEND,
                             dropout_p=DROPOUT)


def make_inputs(n: int, dtype: torch.dtype, requires_grad: bool = False):
    # (b, n, h, d); drawn on the device itself (a CPU copy of 1M+ rows would dominate)
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    q, k, v = (
        torch.randn(1, n, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=dtype)
        .requires_grad_(requires_grad)
        for _ in range(3)
    )
    return q, k, v


def selected_pairs(n: int, segments: Sequence[int], rates: Sequence[int], heads: int,
                   causal: bool) -> int:
    """(head, query, key) pairs the patterns select, a pair that two select counted twice:
    per pattern (w, r), segments of min(w, n) rows (the last one shorter where it does not
    divide n), in each head j the m rows of offset j mod r attending m keys (causal: their
    own and the earlier ones, m (m + 1) / 2 pairs). fused_occupancy._floor counts the same;
    not called here: gpu_suite's compare part runs this script on older src/ trees."""
    pairs = 0
    for w, r in zip(segments, rates):
        length = min(w, n)
        for rows in [length] * (n // length) + ([n % length] if n % length else []):
            for j in range(heads):
                m = max(0, -(-(rows - j % r) // r))  # rows i < `rows` with i = j (mod r)
                pairs += m * (m + 1) // 2 if causal else m * m
    return pairs


def useful_flops(n: int, backward: bool) -> float:
    """The score and value products the patterns select (see the module docstring)."""
    fwd = 4 * HEAD_DIM * selected_pairs(n, SEGMENTS, RATES, HEADS, CAUSAL)
    return fwd * 3.5 if backward else fwd


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def captured(step: Callable[[], None], name: str = "step") -> Callable[[], None]:
    """`step` captured once in a CUDA graph (after three warm-up calls on a side stream, as
    capture needs), as the graph's replay: its kernels without any host work. A step whose
    capture fails (a kernel that refuses capture) is timed as it is, with a line saying so:
    the other steps' graphs still run, and the ratios against it mix the two."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as error:
        torch.cuda.synchronize()
        print(f"{name}: not captured, timed without a graph ({type(error).__name__}: "
              f"{str(error).splitlines()[0] if str(error) else ''})", flush=True)
        return step
    # The graph reads the step's tensors at their captured addresses, so the step (whose
    # closure holds them) must live as long as the replay: dropped, their blocks are free,
    # the next capture's empty_cache() unmaps them, and this replay faults.
    return functools.partial(_replay, graph, step)


def _replay(graph: torch.cuda.CUDAGraph, step: Callable[[], None]) -> None:
    """One replay of `graph`; `step` is held only to keep what the graph reads alive."""
    graph.replay()


# One kernel call of a floor: its q, k, v (b', rows, heads, d), contiguous, and causal
FloorCall = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]


def per_launch_calls(q, k, v) -> List[FloorCall]:
    """Per launch of the op's plan: the dense (b * s, rows, heads, d) blocks it would gather,
    and whether the launch is causal."""
    calls = []
    plan = local_plan(q, k, (SEGMENTS, RATES), CAUSAL, None, None)
    for block in plan.blocks:
        for launch in block.forward:
            g = launch.heads
            q_sel = (launch.queries, g.q_heads, g.q_index, g.q_stride)
            kv_sel = (launch.keys, g.kv_heads, g.kv_index, g.kv_stride)
            gathered = (gather(q, *q_sel), gather(k, *kv_sel), gather(v, *kv_sel))
            calls.append(tuple(x.contiguous() for x in gathered) + (launch.causal,))
    return calls


def ideal_calls(q, k, v) -> List[FloorCall]:
    """Per pattern ONE call: every segment and head at once, (b * segments, w / r, h, d),
    head j on its own offset's rows (j mod r). Segments of another length (a short last
    one) or heads with another row count, which only lengths that the segments or rates
    do not divide make, are one more call each."""
    n, h = q.shape[1], q.shape[2]
    heads = Heads.of(h, k.shape[2])
    calls = []
    for w, r in zip(SEGMENTS, RATES):
        length = min(w, n)  # W = min(w, n): a pattern longer than the sequence is one segment
        runs = [Segments(0, n // length, length)]
        if n % length:
            runs.append(Segments(n // length * length, 1, n % length))
        for segs in runs:
            # one gathered group per row count: the whole pattern, all heads, in one batch
            for g in head_groups(0, segs.length, r, heads, str(q.device), strided=False):
                gathered = (gather(q, segs, g.q_heads, g.q_index, None),
                            gather(k, segs, g.kv_heads, g.kv_index, None),
                            gather(v, segs, g.kv_heads, g.kv_index, None))
                calls.append(tuple(x.contiguous() for x in gathered) + (CAUSAL,))
    return calls


def floor_step(calls: Sequence[FloorCall], backward: bool) -> Callable[[], None]:
    scale = HEAD_DIM**-0.5

    def step():
        for q_g, k_g, v_g, causal in calls:
            opts = KernelOptions(causal=causal, scale=scale, backend=FLOOR_BACKEND)
            out, lse = attention_forward(q_g, k_g, v_g, opts)
            if backward:
                attention_backward(out, q_g, k_g, v_g, out, lse, opts)

    return step


def run_case(impl: str, n: int, dtype: torch.dtype, backward: bool):
    """Return a callable running one iteration of `impl` at length n."""
    if impl == "dilated":
        q, k, v = make_inputs(n, dtype, requires_grad=backward)
        dout = torch.randn_like(q)

        def step():
            if backward:
                # as a training step after zero_grad(set_to_none=True): no accumulation into
                # earlier gradients (which the floors would not pay)
                q.grad = k.grad = v.grad = None
                op(q, k, v).backward(dout)
            else:
                with torch.no_grad():
                    op(q, k, v)

        return step
    if impl == "ideal":
        return floor_step(ideal_calls(*make_inputs(n, dtype)), backward)
    if impl == "per_launch":
        return floor_step(per_launch_calls(*make_inputs(n, dtype)), backward)
    if impl == "dense_sdpa":
        # (b, n, h, d) -> (b, h, n, d)
        q, k, v = (x.transpose(1, 2) for x in make_inputs(n, dtype, requires_grad=backward))
        dout = torch.randn_like(q)

        def step():
            if backward:
                F.scaled_dot_product_attention(q, k, v, is_causal=CAUSAL).backward(dout)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=CAUSAL)

        return step
    raise ValueError(f"unknown impl {impl!r}")


# time.perf_counter, or with --cpu-time time.thread_time: the CPU time of the calling
# thread, with one kernel thread. On a machine that other jobs share, waiting for a core
# is not counted (two OpenMP threads there wait at barriers: a busy 2-core machine
# measured the op at 1.5x its floor in wall time, against 1.03-1.08x in CPU time).
CLOCK = time.perf_counter


def time_cases(steps: Dict[str, Callable[[], None]], repeats: int,
               min_seconds: float = 0.0, queued: int = 1) -> Dict[str, List[float]]:
    """Seconds of the runs of each step after one warm-up each, sorted (min, ..., max): at
    least `repeats` turns, more while the turns took under `min_seconds` (at most 1,000), so
    that sub-millisecond steps get a median of many runs. queued > 1: a run is that many
    calls back to back and one synchronise, its time per call (on CUDA the host's work then
    overlaps the kernels of the calls before, as in a training loop; 1: each call's
    latency, the host's work before its kernels included).

    The steps take turns (A B A B ...), so that a machine whose speed drifts
    (other jobs, clocks) slows every step alike and their ratio holds.
    """
    for step in steps.values():
        step()  # warm-up
    synchronize()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    turns, start = 0, CLOCK()
    while turns < repeats or (CLOCK() - start < min_seconds and turns < 1000):
        turns += 1
        for name, step in steps.items():
            t0 = CLOCK()
            for _ in range(queued):
                step()
            synchronize()
            times[name].append((CLOCK() - t0) / queued)
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
                out = op(q, k, v)
                out.backward(dout)
                return out, q.grad, k.grad, v.grad
            with torch.no_grad():
                return op(q, k, v)
        return step

    return peak_bytes_of(call, n, warm_up=1024)


def peak_bytes_of(call: Callable[[int], Callable[[], object]], n: int, warm_up: int) -> float:
    """Peak resident bytes of ``call(n)()`` beyond what exists before it (what it returns
    counted, as a caller keeps it), after a warm-up ``call(warm_up)()``: imports, first ops."""
    call(warm_up)()
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
        out = op(q, k, v)
        out.backward(dout)
    else:
        with torch.no_grad():
            out = op(q, k, v)
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


def measure_memory(n: int, dtype_name: str, training: bool, schedule: str,
                   block_rows: Optional[int]) -> float:
    """`measure_memory_in_this_process` in a fresh process (no earlier allocations);
    on CUDA the allocator's peak in this process."""
    if DEVICE == "cuda":
        return measure_cuda_memory(n, getattr(torch, dtype_name), training)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    strided = {True: "on", False: "off"}[policy.STRIDED_VIEWS.get(DEVICE, False)]
    out = subprocess.run(
        [sys.executable, __file__, "--memory-case", str(n), dtype_name, str(int(training)),
         "--strided", strided, "--schedule", schedule, "--backend", BACKEND,
         "--dropout", str(DROPOUT)]
        + (["--block-rows", str(block_rows)] if block_rows else [])
        + (["--causal"] if CAUSAL else []),
        env=env, capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _spread(ts: Sequence[float]) -> str:
    return "/".join(f"{x:.4f}" for x in (ts[0], statistics.median(ts), ts[-1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--schedule", default="longnet", choices=sorted(SCHEDULES),
                        help="longnet: segments [2048, 4096], rates [1, 2]; geometric: "
                        "segments 2048..65536, rates 1..32 (w / r = 2048)")
    parser.add_argument("--dense-max", type=int, default=16384,
                        help="skip dense SDPA above this length (it is quadratic)")
    parser.add_argument("--causal", action="store_true",
                        help="causal calls (the op and every floor call)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.0,
                        help="more turns than --repeats while a case's turns took less (at "
                        "most 1,000): for steps of a millisecond or less")
    parser.add_argument("--queued", type=int, default=1,
                        help="calls per timed run, back to back before one synchronise (the "
                        "time per call: throughput with the host's work overlapped, as in a "
                        "training loop); default 1, each call's latency")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="CUDA, backend triton: time each step by the replays of a CUDA "
                        "graph captured once (no host work in any time)")
    parser.add_argument("--memory-only", action="store_true", help="skip the timings")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the op's kernel (backend= of dilated_attention)")
    parser.add_argument("--floor-backend", choices=BACKENDS,
                        help="the floors' dense kernel (default: --backend, or auto for a "
                        "backend with no per-launch kernel, such as triton)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the op's dropout_p (auto then runs the blockwise kernel, "
                        "backend triton the fused kernels' dropout); the floors run without: "
                        "what dropout costs")
    parser.add_argument("--max-tokens", action="store_true",
                        help="CUDA: find the longest sequence whose forward, and whose forward "
                        "+ backward, fit on the device, then exit")
    parser.add_argument("--strided", default="auto", choices=["auto", "on", "off"],
                        help="read regular rate-r selections as strided views (on) or gathered "
                        "copies (off); auto: the library's default for the device "
                        "(plan.STRIDED_VIEWS)")
    parser.add_argument("--block-rows", type=int,
                        help="rows per block for the device (plan.ROWS_PER_BLOCK; on CUDA a "
                        "launch is a block: 131072 gives the sizes before the 64K memory "
                        "bound)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="CPU: time the CPU time of one thread (one kernel thread), not "
                        "wall time: for a machine that other jobs share")
    parser.add_argument("--json", default="bench-out/single_device.json")
    parser.add_argument("--memory-case", nargs=3, metavar=("N", "DTYPE", "TRAINING"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE, BACKEND, FLOOR_BACKEND, SEGMENTS, RATES, CAUSAL, CLOCK, DROPOUT
    SEGMENTS, RATES = SCHEDULES[args.schedule]
    CAUSAL = args.causal
    BACKEND = args.backend
    DROPOUT = args.dropout
    FLOOR_BACKEND = args.floor_backend or (BACKEND if BACKEND != "triton" else "auto")
    if args.strided != "auto":
        policy.STRIDED_VIEWS[args.device] = args.strided == "on"
    if args.block_rows:
        policy.ROWS_PER_BLOCK[args.device] = args.block_rows
    if args.memory_case:
        n, dtype_name, training = args.memory_case
        print(measure_memory_in_this_process(int(n), getattr(torch, dtype_name),
                                             bool(int(training))))
        return
    DEVICE = args.device
    if args.cpu_time:
        if DEVICE != "cpu":
            parser.error("--cpu-time needs --device cpu")
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    dtype = getattr(torch, args.dtype)
    rows = []
    where = (torch.cuda.get_device_name() if DEVICE == "cuda"
             else f"{torch.get_num_threads()} threads"
             + (", CPU time of the thread" if args.cpu_time else ", wall time"))
    if args.queued < 1:
        parser.error(f"--queued must be at least 1, got {args.queued}")
    if args.queued > 1:
        where += f", {args.queued} calls per synchronise"
    if args.cuda_graph:
        if DEVICE != "cuda" or BACKEND != "triton":
            parser.error("--cuda-graph needs --device cuda and --backend triton (the SDPA "
                         "path reads its input check back, which a capture cannot)")
        where += ", CUDA graph replays"
    dropout = f", the op's dropout_p {DROPOUT:g} (floors: none)" if DROPOUT else ""
    print(f"torch {torch.__version__}, {where}, dtype {args.dtype}, backend {BACKEND}{dropout} "
          f"(floors: {FLOOR_BACKEND}), strided views {policy.STRIDED_VIEWS.get(DEVICE, False)}, "
          f"block rows {policy.ROWS_PER_BLOCK.get(DEVICE)} (or n / {policy.MAX_BLOCKS}), "
          f"h={HEADS} d={HEAD_DIM} schedule {args.schedule}: segments={list(SEGMENTS)} "
          f"rates={list(RATES)} {'causal' if CAUSAL else 'not causal'}, batch 1, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.max_tokens:
        if DEVICE != "cuda":
            parser.error("--max-tokens needs --device cuda")
        for training in (False, True):
            n = max_tokens(dtype, training)
            print(f"longest {'forward + backward' if training else 'forward'}: {n:,} tokens "
                  f"({n / 2**20:.2f} Mi)", flush=True)
            rows.append(dict(max_tokens=n, backward=training, dtype=args.dtype,
                             schedule=args.schedule, causal=CAUSAL, backend=BACKEND))
        _write_json(args.json, rows)
        return
    header = ("n", "pass", "op s (min/med/max)", "ideal floor s", "per-launch floor s",
              "op/ideal", "op/per-launch", "per-launch/ideal", "dense s", "tokens/s", "TFLOP/s",
              "working memory (x input)", "bytes/token")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.seq_lens:
        input_bytes = n * HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
        for backward in (False, True):
            row = dict(n=n, backward=backward, dtype=args.dtype, device=DEVICE,
                       schedule=args.schedule, causal=CAUSAL, backend=BACKEND,
                       floor_backend=FLOOR_BACKEND,
                       queued=args.queued, cuda_graph=args.cuda_graph)
            mem: Optional[float] = None
            if not args.no_memory:
                mem = measure_memory(n, args.dtype, backward, args.schedule,
                                     args.block_rows) / input_bytes
                row.update(memory_inputs=mem, memory_bytes_per_token=mem * input_bytes / n)
            cells = ["-"] * 10
            if not args.memory_only:
                wrap = captured if args.cuda_graph else (lambda step, name: step)
                t = time_cases({impl: wrap(run_case(impl, n, dtype, backward), impl)
                                for impl in TIMED}, args.repeats, args.min_seconds, args.queued)
                dense = None
                if n <= args.dense_max:
                    dense = statistics.median(time_cases(
                        {"dense": wrap(run_case("dense_sdpa", n, dtype, backward), "dense")},
                        args.repeats, args.min_seconds, args.queued)["dense"])
                med = {impl: statistics.median(ts) for impl, ts in t.items()}
                row.update(dilated_s=t["dilated"], ideal_s=t["ideal"],
                           per_launch_s=t["per_launch"],
                           ratio_ideal=med["dilated"] / med["ideal"],
                           ratio_per_launch=med["dilated"] / med["per_launch"],
                           per_launch_over_ideal=med["per_launch"] / med["ideal"],
                           dense_sdpa_s=dense, tokens_per_s=n / med["dilated"],
                           tflops=useful_flops(n, backward) / med["dilated"] / 1e12)
                cells = [_spread(t[impl]) for impl in TIMED]
                cells += [f"{row[key]:.3f}" for key in
                          ("ratio_ideal", "ratio_per_launch", "per_launch_over_ideal")]
                cells += ["-" if dense is None else f"{dense:.4f}",
                          f"{row['tokens_per_s']:.0f}", f"{row['tflops']:.2f}"]
            rows.append(row)
            memory_cells = (["-", "-"] if mem is None
                            else [f"{mem:.2f}", f"{row['memory_bytes_per_token']:.0f}"])
            print(f"| {n} | {'fwd+bwd' if backward else 'fwd'} | " + " | ".join(cells + memory_cells)
                  + " |", flush=True)
    _write_json(args.json, rows)


def _write_json(path: str, rows) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
