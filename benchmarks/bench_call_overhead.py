"""Where a short call's time goes on CUDA: wall clock against the kernels' own time.

    python benchmarks/bench_call_overhead.py                     # 8K and 64K, the fused kernel
    python benchmarks/bench_call_overhead.py --seq-lens 8192 --backend cuda_cudnn
    python benchmarks/bench_call_overhead.py --host-only          # any machine: the Python alone
    python benchmarks/bench_call_overhead.py --host-only --launcher   # and Triton's launcher's
    python benchmarks/bench_call_overhead.py --cpu                # CPU kernels, short lengths
    python benchmarks/bench_call_overhead.py --cpu --world-size 2 # the same on 2 gloo ranks

LongNet's setting (12 heads of 64, segments [2048, 4096], rates [1, 2]), bf16, batch 1,
forward and forward + backward. Per case, after three warm-up calls:

- wall: the median (and min) of 20 calls, each followed by a device synchronise;
- host per call: 20 calls queued back to back and no synchronise, divided by 20: the
  host's own time where the device keeps up, or the device's where a call waits for it
  (a read-back inside the call makes every call wait);
- kernels: the device time of every kernel of 5 calls (torch.profiler), per call, and the
  profiler's table of them;
- timeline: 5 calls each followed by a synchronise under torch.profiler (host and device
  on one clock), per call: from its start to its first work on the device (the host's
  lead, which nothing overlaps), the device busy (the union of its kernels and copies),
  the device idle between its first and last work (waiting for the host's next launch,
  or for a synchronising call), and from its last work to the synchronise's return;
  medians. What "wall minus kernels" is made of (the profiler's own overhead is in the
  host's parts);
- host: torch.profiler's CPU table of 5 calls queued without a synchronise, by self CPU
  time: the host's own work per op, and any call that waits for the device (a read-back,
  an allocation that syncs, a full launch queue) shows as the CUDA runtime call it waits in;
- with --profile TOP: cProfile's TOP Python functions by own time over 20 calls queued
  without a synchronise: where the host's Python goes on that machine, Triton's launcher
  (``JITFunction.run`` and the binder it generates) included, which --host-only stubs.

Wall minus kernels is what the host adds to a call that nothing overlaps (a benchmark's,
or a model's first layer): at 8K on an H100 it was half the call (BENCHMARKS.md, "The
fused kernel"). Needs a CUDA device.

--host-only (no device needed) times the host's own work per call of the fused
kernel's path with the Triton launches replaced by no-ops: fp16 CPU tensors of 64
rows (so that device work on a GPU, done here by the CPU, costs little),
LongNet's setting, backend "triton" (TRITON_INTERPRET=1 is set; nothing runs in the
interpreter). Per pass: min / median / max microseconds per call over repeats of
many calls, the aten ops one call dispatches (torch.profiler; views and allocations
left out: on a GPU each of the rest is a launch, though a CPU reduction also
dispatches a fill and a copy), the microseconds from a call's start to its first
fused kernel launch (the host's part of a call that waits for its result: its kernels
cannot start before), and with --profile cProfile's top functions. What is
left is the Python between the user's call and the launches (validation, the agreement, the
op's dispatch into autograd, the plan lookup, the launch arguments), which a GPU
call adds on top of its launches.

--host-only --launcher keeps Triton's launcher in: the kernels compiled for sm_90
(the half-precision tiles a bf16 call gets there), launched through
``JITFunction.run`` (its binder specialising each argument, the cache lookup, the launch
metadata) under a stand-in for Triton's CUDA driver whose launcher does nothing. So it
times the Python of a GPU call's launches as well, but not the C launcher that would
follow (each argument unpacked, cuLaunchKernel); then one forward launch alone, through
``JITFunction.run``, its binder alone, and ``CompiledKernel.run`` with the arguments bound
once (what launching from a cache of compiled kernels would leave). The first calls
compile (about a minute with a cold Triton cache); run it in a process of its own.

--cpu (no device needed) times whole calls on CPU with the real kernels, one thread, at
short lengths where the host's Python is a large part of a call (``--seq-lens 128 512 2048``
by default here, batch ``--batch``, ``--heads`` of 64): ``dilated_attention`` forward (no
grad) and forward + backward in LongNet's setting and in one pattern (segment n, rate 1),
``MultiheadDilatedAttention`` forward + backward, a tiny ``LongNetLM`` training step
(forward with targets, backward), and for scale ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention`` at the same shapes (causal). Min / median / max microseconds per
call over ``--repeats`` repeats of ``--calls`` calls (of which a machine shared with others
makes the min the steadiest). ``--world-size 2`` runs the library's cases on spawned gloo
ranks, each holding n / P rows (rank 0's times; torch's are one process's at n / P).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types
from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dilated_attention import dilated_attention

SEGMENTS, RATES = [2048, 4096], [1, 2]


def call_of(n: int, backend: str, training: bool):
    """One call of the op at length n, as a training step or an inference call."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # (b, n, h, d)
    q, k, v, dout = (torch.randn(1, n, 12, 64, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))

    def call():
        if training:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            dilated_attention(*leaves, SEGMENTS, RATES, backend=backend).backward(dout)
        else:
            with torch.no_grad():
                dilated_attention(q, k, v, SEGMENTS, RATES, backend=backend)

    return call


def python_profile(run, top: int) -> str:
    """cProfile's `top` functions by own time while `run()` runs."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


Interval = Tuple[float, float]


def split_calls(calls: Sequence[Interval], device: Sequence[Interval]
                ) -> List[Optional[Tuple[float, float, float, float]]]:
    """Per call (start, end) on the host, with the device's work (start, end) on the same
    clock: (lead, busy, idle, tail), the call's time cut into its start to its first device
    work, the union of its device work (what starts within the call), the device idle
    between its first and last work, and its last work's end to the call's end; None for
    a call with no device work."""
    parts = []
    for lo, hi in calls:
        mine = sorted((start, end) for start, end in device if lo <= start < hi)
        if not mine:
            parts.append(None)
            continue
        busy, (run_start, run_end) = 0.0, mine[0]
        for start, end in mine[1:]:
            if start > run_end:
                busy += run_end - run_start
                run_start, run_end = start, end
            else:
                run_end = max(run_end, end)
        busy += run_end - run_start
        first, last = mine[0][0], max(end for _, end in mine)
        parts.append((first - lo, busy, last - first - busy, hi - last))
    return parts


def timeline_intervals(events) -> Tuple[List[Interval], List[Interval]]:
    """The profiler's events -> the calls' marks on the host and the device's work: a
    record_function range also shows on the device as a user annotation spanning the
    kernels it launched (kineto's gpu_user_annotation, named as the host's range), which
    is neither a call nor device work."""
    marks = [(e.time_range.start, e.time_range.end) for e in events
             if e.name.startswith("timeline call ") and e.device_type == DeviceType.CPU]
    device = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return marks, device


def timeline(call, calls: int = 5) -> str:
    """The module docstring's timeline of `calls` synchronised calls, in ms (medians)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"timeline call {i}"):
                call()
                torch.cuda.synchronize()
    parts = [p for p in split_calls(*timeline_intervals(prof.events())) if p is not None]
    if not parts:
        return "timeline: no device work seen\n"
    lead, busy, idle, tail = (statistics.median(p[i] for p in parts) / 1e3 for i in range(4))
    return (f"timeline of a synchronised call under the profiler (median of {len(parts)}): "
            f"to its first device work {lead:.3f} ms, device busy {busy:.3f}, device idle "
            f"between its first and last work {idle:.3f}, last work to the synchronise's "
            f"return {tail:.3f}\n")


def measure(call, profile_top: int = 0) -> str:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    walls = []
    for _ in range(20):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - start) / 20
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 5 / 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as host_prof:
        for _ in range(5):
            call()
    torch.cuda.synchronize()
    try:
        parts = timeline(call)
    except Exception as error:  # never run on a GPU before: keep the rest of the report
        parts = f"timeline: failed ({type(error).__name__}: {error})\n"
    python = ""
    if profile_top:
        python = ("Python, 20 calls queued without a synchronise:\n"
                  + python_profile(lambda: [call() for _ in range(20)], profile_top))
        torch.cuda.synchronize()
    return (f"wall median {statistics.median(walls) * 1e3:.3f} ms (min {min(walls) * 1e3:.3f}); "
            f"host per call, unsynchronised {host * 1e3:.3f} ms; kernels {kernels:.3f} ms\n"
            + parts
            + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8,
                                        max_name_column_width=50)
            + "host, 5 calls queued without a synchronise:\n"
            + host_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                             max_name_column_width=50)
            + python)


# ops that launch nothing on a GPU: views, allocations, metadata
_NO_LAUNCH = {"aten::" + name for name in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "select", "slice", "detach",
    "unsqueeze", "expand", "alias", "transpose", "permute", "t", "reshape", "_reshape_alias",
    "lift_fresh", "resolve_conj", "resolve_neg", "set_", "to")}


def dispatched_ops(call) -> int:
    """The aten ops one `call` dispatches, _NO_LAUNCH left out."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(event.count for event in prof.key_averages()
               if event.key.startswith("aten::") and event.key not in _NO_LAUNCH)


class StandInDriver:
    """Stands in for Triton's CUDA driver (``triton.runtime.driver.set_active``): an sm_90
    target whose kernels load as dummies, each compiled binary with its own function handle,
    and whose launcher only calls ``on_launch(kernel name, the launcher's arguments)``
    (tests/test_triton_launch.py records them)."""

    def __init__(self, on_launch) -> None:
        self.on_launch = on_launch

    class utils:
        @staticmethod
        def load_binary(name, kernel, shared, device):
            # module, function (one per binary), registers, spills, most threads per block
            return 1, hash(kernel), 0, 0, 1024

        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def launcher_cls(self, src, metadata):
        return lambda *args: self.on_launch(metadata.name, args)


def _with_launcher(fused, on_launch):
    """The fused module's kernels compiled for sm_90 and launched through Triton's own
    launcher, under StandInDriver (module docstring); returns the kernels' module."""
    from triton.runtime import driver

    driver.set_active(StandInDriver(on_launch))
    from dilated_attention import triton_kernels  # compiled: TRITON_INTERPRET is not set yet

    if type(triton_kernels.fused_forward).__name__ != "JITFunction":
        raise SystemExit("--launcher: the kernels were imported interpreted; run it in a "
                         "process of its own, without TRITON_INTERPRET")
    sizes = fused.cuda_tile_sizes((9, 0), torch.float16, 64)
    fused.tile_sizes = lambda device, dtype, head_dim, dropout=False: sizes
    return triton_kernels


def _microseconds_per_call(call, repeats: int, calls: int) -> List[float]:
    """Per repeat, the microseconds of one of `calls` calls of `call` back to back."""
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return per_call


class _FirstLaunch:
    """When a call's first fused kernel launch happened: the host's time on the critical
    path of a call that waits for its result (its kernels cannot start before)."""

    def __init__(self) -> None:
        self.at = None

    def __call__(self, *launch) -> None:
        if self.at is None:
            self.at = time.perf_counter()

    def microseconds(self, call, repeats: int, calls: int) -> List[float]:
        """Per repeat, the mean microseconds from a call's start to its first launch."""
        per_call = []
        for _ in range(repeats):
            total = 0.0
            for _ in range(calls):
                self.at = None
                start = time.perf_counter()
                call()
                total += self.at - start
            per_call.append(total / calls * 1e6)
        return per_call


def _spread(values: List[float]) -> str:
    return (f"min {min(values):.1f}, median {statistics.median(values):.1f}, "
            f"max {max(values):.1f}")


def _per_launch(call, repeats: int, calls: int) -> List[str]:
    """One fused forward launch of `call` timed four ways (us): through JITFunction.run;
    through triton_launch, as the op launches (the compiled kernel kept per call key); the
    binder of JITFunction.run (each argument specialised) alone; CompiledKernel.run with
    the arguments bound once, the least a launch can cost in Python (the stand-in driver's
    C launcher does nothing)."""
    import triton.runtime.jit as jit

    try:
        from dilated_attention import triton_launch
    except ImportError:  # an older tree (a baseline's src/ on PYTHONPATH)
        triton_launch = None

    seen = {}
    run = jit.JITFunction.run
    if triton_launch is not None:
        triton_launch.forget()  # so that the call binds through JITFunction.run again

    def keep(self, *args, grid, warmup, **kwargs):
        seen.setdefault(self.fn.__name__, (self, args, kwargs, grid))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    jit.JITFunction.run = keep
    try:
        call()
    finally:
        jit.JITFunction.run = run
    kernel, args, kwargs, grid = seen["fused_forward"]
    # as JITFunction.run unpacks it: the device's kernel cache, key cache, target, backend
    # and the generated binder
    *_, binder = kernel.device_caches[0]
    compiled = kernel[grid](*args, **kwargs)
    bound = list(binder(*args, **kwargs)[0].values())
    ways = {"JITFunction.run": lambda: kernel[grid](*args, **kwargs)}
    if triton_launch is not None:
        kept = triton_launch.launcher(kernel)
        ways["triton_launch (the op's launches)"] = lambda: kept[grid](*args, **kwargs)
    ways.update({
        "its binder": lambda: binder(*args, **kwargs),
        "CompiledKernel.run, arguments bound once": lambda: compiled.run(
            grid[0], grid[1], 1, 0, compiled.function, compiled.packed_metadata, None, None,
            None, *bound),
    })
    lines = [f"one fused_forward launch ({len(bound)} arguments), us:"]
    for name, way in ways.items():
        lines.append(f"  {name}: {_spread(_microseconds_per_call(way, repeats, calls))}")
    return lines


def host_only(repeats: int, calls: int, profile_top: int, launcher: bool = False) -> str:
    """The host's Python per call, the fused kernel's launches stubbed or (launcher) through
    Triton's launcher up to its C part (module docstring)."""
    from dilated_attention import fused

    real_kernels, real_sizes = fused._kernels, fused.tile_sizes
    first_launch = _FirstLaunch()
    if launcher:
        kernels = _with_launcher(fused, first_launch)
    # the op refuses CPU tensors for backend "triton" unless this is set
    os.environ["TRITON_INTERPRET"] = "1"
    # nor does the interpreter's release rule apply: it never runs (launches are stubbed or
    # go to the stand-in driver), and the GPU machines' triton 3.6 beside numpy 2.5 breaks it
    from dilated_attention import backends
    backends._INTERPRETER_PROBLEM = None
    # (b, n, h, d); half precision: the kernels a bf16 call runs on a GPU (the interpreter
    # takes fp16, not bf16)
    q, k, v, dout = (torch.randn(1, 64, 12, 64, dtype=torch.float16) for _ in range(4))

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: first_launch()

    if not launcher:
        kernels = types.SimpleNamespace(fused_forward=NoLaunch(), fused_dq=NoLaunch(),
                                        fused_dkdv=NoLaunch(), fused_backward_rule=NoLaunch(),
                                        LOG2E=fused._kernels(q.device).LOG2E)
    fused._kernels = lambda device: kernels

    def forward():
        with torch.no_grad():
            dilated_attention(q, k, v, SEGMENTS, RATES, backend="triton")

    def training():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        dilated_attention(*leaves, SEGMENTS, RATES, backend="triton").backward(dout)

    how = ("launches through Triton's launcher, its C part stubbed, sm_90 kernels"
           if launcher else "launches stubbed")
    lines = [f"torch {torch.__version__}, host only ({how}), fp16 CPU tensors (1, 64, 12, 64), "
             f"LongNet's setting; microseconds per call over {repeats} repeats of {calls} calls"]
    try:
        for name, call in (("forward", forward), ("forward + backward", training)):
            for _ in range(calls):
                call()
            lines.append(f"{name}: {_spread(_microseconds_per_call(call, repeats, calls))} us; "
                         f"{dispatched_ops(call)} aten ops; to its first fused launch "
                         f"{_spread(first_launch.microseconds(call, repeats, calls))} us")
            if profile_top:
                lines.append(python_profile(lambda: [call() for _ in range(calls)],
                                            profile_top))
        if launcher:
            lines += _per_launch(forward, repeats, calls)
    finally:
        fused._kernels, fused.tile_sizes = real_kernels, real_sizes
    return "\n".join(lines)


def cpu_cases(n: int, batch: int, heads: int, group=None):
    """(name, call) of the --cpu cases at length n (this rank's rows under `group`; torch's
    own only without one)."""
    import torch.nn.functional as F
    from dilated_attention import LongNetConfig, LongNetLM, MultiheadDilatedAttention

    gen = torch.Generator().manual_seed(0)
    # (b, n, h, d)
    q, k, v = (torch.randn(batch, n, heads, 64, generator=gen) for _ in range(3))
    x = torch.randn(batch, n, heads * 64, generator=gen)
    cases = []
    for label, (segs, rates) in (("LongNet", (SEGMENTS, RATES)), ("one pattern", ([n], [1]))):
        def forward(segs=segs, rates=rates):
            with torch.no_grad():
                dilated_attention(q, k, v, segs, rates, is_causal=True, group=group)

        def training(segs=segs, rates=rates):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            dilated_attention(*leaves, segs, rates, is_causal=True, group=group).sum().backward()

        cases += [(f"dilated_attention {label}, forward", forward),
                  (f"dilated_attention {label}, forward + backward", training)]
    mha = MultiheadDilatedAttention(heads * 64, heads, SEGMENTS, RATES, process_group=group)
    cases.append(("MultiheadDilatedAttention, forward + backward",
                  lambda: mha(x, x, x, is_causal=True)[0].sum().backward()))
    torch.manual_seed(0)
    lm = LongNetLM(LongNetConfig.from_name("tiny"), process_group=group)
    tokens = torch.randint(0, 64, (batch, n + 1), generator=gen)
    cases.append(("tiny LongNetLM training step",
                  lambda: lm(tokens[:, :-1], tokens[:, 1:])[1].backward()))
    if group is not None:
        return cases
    # (b, n, h, d) -> (b, h, n, d)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa_training():
        leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
        F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()

    def sdpa_forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    torch_mha = torch.nn.MultiheadAttention(heads * 64, heads, batch_first=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(n)
    return cases + [
        ("torch SDPA, forward", sdpa_forward),
        ("torch SDPA, forward + backward", sdpa_training),
        ("torch nn.MultiheadAttention, forward + backward",
         lambda: torch_mha(x, x, x, attn_mask=causal, is_causal=True,
                           need_weights=False)[0].sum().backward()),
    ]


def cpu_calls(seq_lens: Sequence[int], batch: int, heads: int, repeats: int, calls: int,
              profile_top: int = 0, group=None) -> str:
    """The --cpu report (module docstring); with `group`, this rank's. One thread: main()
    sets it (a spawned rank runs with one)."""
    size = 1 if group is None else torch.distributed.get_world_size(group)
    lines = [f"torch {torch.__version__}, CPU, 1 thread, fp32, batch {batch}, {heads} heads "
             f"of 64, causal, {size} process(es); microseconds per call over {repeats} "
             f"repeats of {calls} calls"]
    for n in seq_lens:
        for name, call in cpu_cases(n // size, batch, heads, group):
            for _ in range(3):
                call()
            lines.append(f"n = {n}, {name}: "
                         f"{_spread(_microseconds_per_call(call, repeats, calls))}")
            if profile_top:
                lines.append(python_profile(lambda: [call() for _ in range(calls)],
                                            profile_top))
    return "\n".join(lines)


def _cpu_rank(group, *args) -> str:
    return cpu_calls(*args, group=group)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        help="default 8192 65536 (--cpu: 128 512 2048)")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--host-only", action="store_true",
                        help="time the host's Python per call on CPU, launches stubbed")
    parser.add_argument("--launcher", action="store_true",
                        help="with --host-only: through Triton's launcher (sm_90 kernels, an "
                        "idle stand-in driver), not stubbed")
    parser.add_argument("--cpu", action="store_true",
                        help="whole calls on CPU at short lengths, against torch's own")
    parser.add_argument("--batch", type=int, default=1, help="with --cpu")
    parser.add_argument("--heads", type=int, default=12, help="with --cpu")
    parser.add_argument("--world-size", type=int, default=1,
                        help="with --cpu: spawned gloo ranks, each holding n / P rows")
    parser.add_argument("--repeats", type=int, default=7, help="with --host-only or --cpu")
    parser.add_argument("--calls", type=int, default=None,
                        help="per repeat, with --host-only (default 500) or --cpu (20)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="also cProfile's TOP Python functions by own time")
    args = parser.parse_args(argv)
    if args.cpu:
        seq_lens = args.seq_lens or [128, 512, 2048]
        job = (seq_lens, args.batch, args.heads, args.repeats, args.calls or 20, args.profile)
        if args.world_size == 1:
            torch.set_num_threads(1)
            print(cpu_calls(*job))
        else:
            from dilated_attention.tools import launch

            print(launch.spawn(_cpu_rank, args.world_size, job, timeout=3600)[0])
        return 0
    if args.calls is None:
        args.calls = 500
    if args.host_only:
        print(host_only(args.repeats, args.calls, args.profile, args.launcher))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, backend {args.backend}, "
          "bf16, LongNet's setting")
    for n in args.seq_lens or [8192, 65536]:
        for training in (False, True):
            print(f"\nn = {n:,}, {'forward + backward' if training else 'forward'}: "
                  + measure(call_of(n, args.backend, training), args.profile), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
