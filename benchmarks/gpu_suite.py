"""The GPU suite: every check and measurement a CUDA device session needs, one report.

    python benchmarks/gpu_suite.py --commit $(git rev-parse --short HEAD)       # everything
    python benchmarks/gpu_suite.py --part tests strided                         # some parts
    python benchmarks/gpu_suite.py --list                                       # parts, commands
    python benchmarks/gpu_suite.py --part bench-triton tiles --seq-lens 8192 65536 --budget 400
    python benchmarks/gpu_suite.py --part compare --baseline bench-out/baseline/src \
        --seq-lens 65536 1048576        # the fused kernel against another commit's

Parts, each a list of commands run from the repository root (their output is
printed as it comes and kept for the report). Measured on an H100: the
fused and CUDA tests took 1.6 min, bench-triton and bench-sdpa at five
lengths (--seq-lens 8192 32768 65536 262144 1048576) 2 min together, the
Triton compiles included; a tiles run of 24 candidates about 1 min. Give a
short lease --budget and the most wanted parts first (they run in the order
named); ``tiles`` before ``bench-triton`` (a faster tile goes into
fused.TUNED_TILE_SIZES first):

- ``tests``: the fused kernel's tests (tests/test_fused*.py) on the GPU, the
  CUDA tests (``pytest -m cuda``: tests/test_cuda.py and the other
  CUDA-marked tests), tests/test_compile.py.
- ``smoke``: a subset of ``tests`` for a short lease (a few minutes, where
  the whole part takes six: each fused kernel compiles in two variants):
  tests/test_fused.py's bf16 cases against float64, the non-finite rule and
  a CUDA graph of a training step. Not in ``all``.
- ``strided``: may the CUDA kernels read strided views instead of gathered
  copies (``policy.STRIDED_VIEWS["cuda"]``)? Per SDPA kernel (cuDNN, flash,
  memory-efficient) and dtype, forward and backward on the views a rate-2
  launch reads: equal to the same call on contiguous copies (bit for bit),
  and whether the call launches a copy of its own; the whole op with views
  on and off against the float64 reference; then their times
  (bench_strided.py).
- ``sdpa-whole``: the SDPA path with blocks of the whole sequence (one launch
  per pattern and head group: the ideal floor's calls, plus what the op adds
  to them), rate-r rows as strided views and then as gathered copies, both
  schedules, from 64K on, no memory: where the fused kernel's Triton code
  cannot reach the LongNet target, per-pattern cuDNN calls with only merges
  added might (BENCHMARKS.md, "The chunk loop against plain flash
  attention"). Not in ``all``.
- ``tiles``: tune_tiles.py, bf16 at 64K tokens, the LongNet setting (12
  heads of 64, the targets' setting): every candidate tile of each fused
  kernel timed in the op against the shipped one, and the fastest as a
  fused.CUDA_TILE_SIZES entry (to be checked with cross_compile.py before it
  is shipped). 19 candidates x 3 kernels, each compiled on first use: d 128
  (``--head-dims 128``) is a second call by hand.
- ``tile-order``: tune_tiles.py's ``--order-windows 0 1024``: each kernel
  with the shipped tiles cell by cell against heaviest first in windows of
  1,024 tiles (fused.TileSizes.order_window; a model, not a measurement, says
  launches of few waves end sooner: BENCHMARKS.md "Tile order"), LongNet at
  8K, causal at 16K and 64K, the geometric schedule causal at 16K. Not in
  ``all``.
- ``bench-sdpa`` / ``bench-triton``: bench_single_device.py in bf16 for the
  backend (the SDPA path, ``sdpa_backend``: what auto ran before the fused
  kernel, and still runs for fp32 and the exchange's launches; the fused
  Triton kernel, auto's choice for a whole op in bf16), 8K to 1M tokens,
  the LongNet setting and the geometric schedule: op / ideal floor, op /
  per-launch floor, working memory per length; bench-sdpa also runs the
  LongNet setting with the CUDA row blocks from before the 64K memory bound
  (131,072 rows), which says what the bound costs in time; bench-triton the
  LongNet setting queued (``--queued 10``: ten calls per synchronise, the
  host's work overlapping the kernels before it, as in a training loop), and
  in CUDA graphs (``--cuda-graph``: op and floors captured, their replays timed:
  the kernels alone, as mode="reduce-overhead" runs them).
- ``causal``: bench-triton's runs with ``is_causal=True`` (a language model's
  calls; the floors' calls causal too), both schedules, no memory.
- ``fp32``: the LongNet setting in float32 up to 256K, the fused kernel and then
  the SDPA path (auto's choice for fp32, its launches on the memory-efficient op),
  no memory: whether auto should take the fused kernel for fp32 too. Not in
  ``all``.
- ``dropout``: attention dropout (0.1), LongNet's setting up to 256K, no memory:
  the fused kernels' dropout (``backend="triton"``: Philox bits per pair and
  pattern, halved chunks) and then the blockwise kernel (what auto runs for
  dropout), both against floors without dropout: whether auto should take the
  fused kernel for dropout. Not in ``all``.
- ``triton-floor``: the fused kernel against floors made of the fused kernels
  themselves (``--floor-backend triton``: the same per-pattern calls on
  pre-gathered rows, through their dense plan), both schedules, no memory:
  op / that floor is what dilation and several patterns cost within Triton,
  and that floor against bench-triton's cuDNN one what Triton's code costs
  (BENCHMARKS.md, "The chunk loop against plain flash attention"). Not in
  ``all``.
- ``compare``: the fused kernel at this tree against another commit's, in one
  call (``--baseline``: that commit's src/ folder, made here with ``git archive
  COMMIT src | tar -x -C bench-out/baseline`` and carried to the device machine;
  bench-out is ignored, so name it in the call's carry): bench_single_device for
  each schedule, this tree then the baseline, so that two kernels' ratios to
  their floors come from one machine (``62ae452`` was measured so, by hand).
  Not in ``all``.
- ``memory``: working memory at 64K and 1M (both backends), the longest
  sequence on the device, and ``dilated-attention estimate --device cuda``'s
  dry run for the same 64K calls.
- ``profile``: torch.profiler tables (CUDA kernels by time) of one 1M-token
  call, forward and forward + backward, per backend; then where a short call's
  time goes at 8K and 64K (bench_call_overhead.py: wall against kernels, a
  synchronised call cut into the host's lead, device busy, device idle and the
  synchronise's tail, and the Python of queued calls by function, Triton's
  launcher included), the host's Python alone on this machine's CPU (its
  --host-only), and an 8K training step's host time by piece
  (bench_host_split.py).

The report (markdown: device, driver, CUDA, cuDNN, torch, triton, commit,
then per part its commands, their output and the minutes taken) goes to
--out (default bench-out/gpu_suite.md, which .gitignore covers, and a copy
to $OUT/gpu_suite.md when $OUT is set, as on the lent device machines). Runs
in parts accumulate: a part run again replaces its own section, so a
session can run the parts call by call and fetch one report at the end.
Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SEQ_LENS = ["8192", "16384", "32768", "65536", "131072", "262144", "524288", "1048576"]
ON_CUDA = [PY, "benchmarks/bench_single_device.py", "--device", "cuda"]
BENCH = ON_CUDA + ["--dtype", "bfloat16"]
# The tests, in parallel where pytest-xdist is installed (the GPU machines have it): the
# fused kernels' compiles dominate them, 6.3 minutes in one process on an H100 against 18 s
# in 12 on an H200
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (
    ["-n", str(min(12, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else [])


def bench_commands(backend: str, seq_lens: Sequence[str], dense_max: str = "32768",
                   name: str = "", schedules: Sequence[str] = ("longnet", "geometric"),
                   extra: Sequence[str] = (), dtype: str = "bfloat16") -> List[List[str]]:
    """The backend's bench_single_device runs: per schedule, at `seq_lens` (at least 0.3 s
    of turns per case: below 64K a call takes a millisecond or less), with `extra`
    arguments."""
    return [ON_CUDA + ["--dtype", dtype, "--backend", backend, "--schedule", schedule,
                       "--seq-lens", *seq_lens, "--repeats", "5", "--min-seconds", "0.3",
                       "--dense-max", dense_max, *extra,
                       "--json", f"bench-out/gpu_{name or backend}_{schedule}.json"]
            for schedule in schedules]


def compare_commands(baseline: Optional[str], seq_lens: Sequence[str]) -> List[List[str]]:
    """The fused kernel at this tree and at `baseline` (another commit's src/ folder, made
    with ``git archive COMMIT src | tar -x -C bench-out/baseline`` and carried to the device),
    per schedule the one then the other: their ratios to the floors taken in one call."""
    if baseline is None:
        return [[PY, "-c", "print('compare: no --baseline given')"]]
    runs = {"current": bench_commands("triton", seq_lens, "0", "current"),
            "baseline": [["env", f"PYTHONPATH={Path(baseline).resolve()}"] + command
                         for command in bench_commands("triton", seq_lens, "0", "baseline")]}
    return [command for pair in zip(runs["current"], runs["baseline"]) for command in pair]


def sdpa_backend(torch_dtype: str = "bfloat16") -> str:
    """The SDPA path's kernel on this GPU in that dtype (``select_backend`` of a launch, not
    a whole op): in bf16 cuDNN on an H100, in fp32 the memory-efficient op; without a GPU,
    those."""
    import torch

    from dilated_attention.backends import select_backend

    if not torch.cuda.is_available():
        return "cuda_cudnn" if torch_dtype == "bfloat16" else "cuda_efficient"
    return select_backend(torch.device("cuda"), getattr(torch, torch_dtype))


def parts(seq_lens: Sequence[str] = SEQ_LENS,
          baseline: Optional[str] = None) -> Dict[str, List[List[str]]]:
    """Part name -> its commands, in order; the bench parts at `seq_lens`; compare against
    the src/ folder `baseline`."""
    sdpa = sdpa_backend()
    fused_tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_fused*.py"))
    estimate = [PY, "-m", "dilated_attention", "estimate", "--device", "cuda", "--dtype",
                "bfloat16", "--seq-len", "65536", "--dry-run"]
    return {
        # the fused kernel's tests first: they have never run compiled
        "tests": ([[*PYTEST, *fused_tests]]
                  if fused_tests else []) + [
            [*PYTEST, "-m", "cuda", "tests"],
            [*PYTEST, "tests/test_compile.py"],
        ],
        # a few minutes' subset of them for a short lease: bf16 against float64, the
        # non-finite rule (the kernels' variants and the check the forward completes), a
        # CUDA graph of a training step, a call repeated (its launches from kept kernels)
        "smoke": [[*PYTEST, "tests/test_fused.py",
                   "-k", "bfloat16 or nonfinite or minus_inf or cuda_graph or repeated"]],
        "strided": [
            [PY, "benchmarks/gpu_suite.py", "--strided-check"],
            [PY, "benchmarks/bench_strided.py", "--device", "cuda", "--dtype", "bfloat16",
             "--cases", "65536:fwd", "65536:bwd", "1048576:fwd", "1048576:bwd"],
        ],
        # and the CUDA row blocks before the 64K memory bound (131072 rows): what it costs
        "bench-sdpa": bench_commands(sdpa, seq_lens) + [
            BENCH + ["--backend", sdpa, "--seq-lens", *[n for n in seq_lens if int(n) <= 262144],
                     "--repeats", "5", "--dense-max", "0", "--block-rows", "131072",
                     "--json", f"bench-out/gpu_{sdpa}_blocks131072.json"]],
        # the fused kernels' tiles, timed (fused.CUDA_TILE_SIZES are untimed choices; the
        # fastest go into fused.TUNED_TILE_SIZES for this GPU's capability)
        "tiles": [[PY, "benchmarks/tune_tiles.py", "--head-dims", "64",
                   "--out", "bench-out/gpu_tiles.md"]],
        # the shipped tiles cell by cell against heaviest first in windows of 1,024 tiles,
        # where a launch has few waves: short sequences, causal ones most
        "tile-order": [
            [PY, "benchmarks/tune_tiles.py", "--head-dims", "64", "--order-windows", "0", "1024",
             "--schedule", schedule, "--seq-len", n, *(["--causal"] if causal else []),
             "--min-seconds", "0.5", "--queued", "10",
             "--out", f"bench-out/gpu_tile_order_{schedule}_{n}{'_causal' if causal else ''}.md"]
            for schedule, n, causal in (("longnet", "8192", False), ("longnet", "16384", True),
                                        ("geometric", "16384", True), ("longnet", "65536", True))],
        # and LongNet's setting queued (10 calls per synchronise): the op's throughput with
        # the host's work overlapped, against its latency above; then captured in CUDA
        # graphs, op and floors alike: the kernels' time with no host work at all
        "bench-triton": bench_commands("triton", seq_lens) + bench_commands(
            "triton", seq_lens, "0", "triton_queued", ("longnet",),
            ["--no-memory", "--queued", "10"]) + bench_commands(
            "triton", seq_lens, "0", "triton_graph", ("longnet",),
            ["--no-memory", "--cuda-graph"]),
        # causal calls, a language model's: what auto runs for them in bf16
        "causal": bench_commands("triton", seq_lens, "0", "triton_causal",
                                 extra=["--no-memory", "--causal"]),
        "compare": compare_commands(baseline, seq_lens),
        # float32, which auto keeps on the SDPA path: is the fused kernel (full-precision
        # products, as torch's default matmul precision asks) faster there too?
        "fp32": [command for backend in ("triton", sdpa_backend(torch_dtype="float32"))
                 for command in bench_commands(
                     backend, [n for n in seq_lens if int(n) <= 262144] or seq_lens, "0",
                     f"{backend}_fp32", ("longnet",), ["--no-memory"], "float32")],
        # attention dropout: the fused kernels' against the blockwise kernel auto runs for it
        "dropout": [command for backend in ("triton", "blockwise")
                    for command in bench_commands(
                        backend, [n for n in seq_lens if int(n) <= 262144] or seq_lens, "0",
                        f"{backend}_dropout", ("longnet",), ["--no-memory", "--dropout", "0.1"])],
        "sdpa-whole": [
            command for views in ("on", "off") for command in bench_commands(
                sdpa, [n for n in seq_lens if int(n) >= 65536] or seq_lens, "0",
                f"{sdpa}_whole_views_{views}",
                extra=["--no-memory", "--strided", views, "--block-rows", str(1 << 30)])],
        "triton-floor": bench_commands("triton", seq_lens, "0", "triton_floor_triton",
                                       extra=["--no-memory", "--floor-backend", "triton"]),
        "memory": [
            BENCH + ["--backend", backend, "--seq-lens", "65536", "1048576", "--memory-only",
                     "--json", f"bench-out/gpu_memory_{backend}.json"]
            for backend in (sdpa, "triton")
        ] + [
            BENCH + ["--max-tokens", "--json", "bench-out/gpu_max_tokens.json"],
            estimate,
            estimate + ["--training"],
        ],
        "profile": [[PY, "benchmarks/gpu_suite.py", "--profile-case", backend]
                    for backend in (sdpa, "triton")]
        # with the Python of queued calls by function: Triton's launcher against ours
        + [[PY, "benchmarks/bench_call_overhead.py", "--seq-lens", "8192", "65536",
            "--profile", "25"],
           # the host's Python alone on this machine's CPU (launches stubbed): how much of
           # the host's time per GPU call is Python, and how much the launches
           [PY, "benchmarks/bench_call_overhead.py", "--host-only"],
           # an 8K training step's host time by piece, and torch's own costs beside it
           [PY, "benchmarks/bench_host_split.py"]],
    }


# --------------------------------------------------------------------------
# Running commands and writing the report


def run(command: Sequence[str], timeout: float) -> Tuple[str, int, float]:
    """Run `command` from the repository root, printing its output as it comes;
    (output, exit status, seconds). A command past `timeout` is killed (status 124)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests")] + env.get("PYTHONPATH", "").split(os.pathsep))
    print(f"$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    lines: List[str] = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                lines.append(line)
            status = proc.wait()
        finally:
            watchdog.cancel()
    seconds = time.perf_counter() - start
    if seconds >= timeout:
        lines.append(f"\n[killed after {timeout:.0f} s]\n")
        status = 124
    return "".join(lines), status, seconds


def environment(commit: str) -> str:
    """The report's header: what ran where."""
    import torch

    def version(module: str) -> str:
        try:
            return __import__(module).__version__
        except ImportError:
            return "not installed"

    driver = "unknown"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = smi.stdout.strip() or driver
    props = torch.cuda.get_device_properties(0)
    if commit == "unknown":
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
        commit = git.stdout.strip() or "unknown (no git here: pass --commit)"
    return "\n".join([
        "# GPU suite report",
        "",
        f"- device: {torch.cuda.get_device_name(0)} ({props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor})",
        f"- driver {driver}; CUDA {torch.version.cuda}; cuDNN "
        f"{torch.backends.cudnn.version()}",
        f"- torch {torch.__version__}; triton {version('triton')}; Python "
        f"{sys.version.split()[0]}",
        f"- commit {commit}",
        "",
    ])


SECTION = re.compile(r"^## Part: (\S+)", re.M)


def write_report(path: Path, header: str, sections: Dict[str, str]) -> None:
    """Merge `sections` (part -> markdown) into the report at `path`: a part already there
    is replaced, others kept; the header is this run's."""
    old: Dict[str, str] = {}
    if path.exists():
        text = path.read_text()
        starts = [(m.start(), m.group(1)) for m in SECTION.finditer(text)]
        for (start, name), (stop, _) in zip(starts, starts[1:] + [(len(text), "")]):
            old[name] = text[start:stop].rstrip() + "\n"
    old.update(sections)
    order = list(parts())
    body = [old[name] for name in sorted(old, key=lambda n: order.index(n) if n in order else 99)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + "\n".join(body))
    out = os.environ.get("OUT")
    if out:
        copy = Path(out) / path.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        # --out may already name that copy (--out $OUT/gpu_suite.md)
        if not (copy.exists() and copy.samefile(path)):
            shutil.copy(path, copy)


def run_part(name: str, commands: List[List[str]], timeout: float, deadline: float) -> str:
    """Run a part's commands, each stopped after `timeout` seconds or at `deadline`
    (time.perf_counter); commands not started by the deadline are listed as skipped.
    Its report section."""
    start = time.perf_counter()
    chunks = []
    for command in commands:
        shown = " ".join(c if c != PY else "python" for c in command)
        left = deadline - time.perf_counter()
        if left < 5:
            print(f"$ {shown}\n[not run: the --budget was spent]", flush=True)
            chunks.append(f"### `{shown}`\n\nnot run: the --budget was spent\n")
            continue
        output, status, seconds = run(command, min(timeout, left))
        chunks.append(f"### `{shown}`\n\nexit status {status}, {seconds:.0f} s\n\n```\n"
                      f"{output.rstrip()}\n```\n")
    minutes = (time.perf_counter() - start) / 60
    print(f"== part {name}: {minutes:.1f} min", flush=True)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"## Part: {name}\n\n{minutes:.1f} min, run {when}.\n\n" + "\n".join(chunks)


# --------------------------------------------------------------------------
# Checks that run as commands of their own (so that a crash is one command's failure)


def strided_check() -> None:
    """Per SDPA kernel and dtype: the kernel on the strided views of a rate-2 launch against
    the same call on contiguous copies, forward and backward; then the op with views on
    and off against the float64 reference."""
    import torch

    from dilated_attention import dilated_attention, policy
    from dilated_attention.kernels import KernelOptions, attention_backward, attention_forward
    from dilated_attention.backends import select_backend
    from dilated_attention.patterns import Heads, Segments, gather, head_groups, strided_view
    from reference import reference_dilated_attention

    b, n, h, d, w, r = 1, 16384, 12, 64, 4096, 2
    segs = Segments(0, n // w, w)
    # the offset-0 heads of a rate-2 pattern: (b * segments, w / 2, 6, d) views, the row
    # stride 2 h d and the head stride 2 d (patterns.Stride)
    group = head_groups(0, w, r, Heads.of(h, h), "cuda", strided=True)[0]
    assert group.strided
    print(f"views: rows {list(group.q_index[:, 0][:3].tolist())}... of heads "
          f"{group.q_heads.tolist()} in each {w}-row segment, n = {n}, d = {d}\n")
    print("| kernel | dtype | pass | bit-equal to contiguous | max abs diff | copies in the "
          "call (aten ops; CUDA copy kernels) | copies on contiguous inputs |")
    print("|---|---|---|---|---|---|---|")
    for backend in ("cuda_cudnn", "cuda_flash", "cuda_efficient"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            try:
                select_backend(torch.device("cuda"), dtype, backend=backend)
            except ValueError:
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            # (b, n, h, d): q, k, v, dout, and out / lse for the backward
            q, k, v, dout, out = (torch.randn(b, n, h, d, device="cuda", dtype=dtype,
                                              generator=gen) for _ in range(5))
            lse = torch.empty(b, n, h, device="cuda", dtype=torch.float32)
            opts = KernelOptions(causal=False, scale=d**-0.5, backend=backend)

            def sel(x):  # a view (is_view: strided group on a run of segments)
                return gather(x, segs, group.q_heads, group.q_index, group.q_stride)

            views = [sel(x) for x in (q, k, v)]
            dense = [x.contiguous() for x in views]
            fwd_v, ops_v = _profiled(lambda: attention_forward(*views, opts))
            fwd_c, ops_c = _profiled(lambda: attention_forward(*dense, opts))
            # the op's backward reads out and lse through the same views
            strided_view(out, segs, group.q_stride, *group.q_index.shape).copy_(
                fwd_v[0].unflatten(0, (b, -1)))
            strided_view(lse, segs, group.q_stride, *group.q_index.shape).copy_(
                fwd_v[1].unflatten(0, (b, -1)))
            args_v = [sel(x) for x in (dout, q, k, v, out, lse)]
            args_c = [x.contiguous() for x in args_v]
            bwd_v, bops_v = _profiled(lambda: attention_backward(*args_v, opts))
            bwd_c, bops_c = _profiled(lambda: attention_backward(*args_c, opts))
            for name, got, want, ops, base in (("forward", fwd_v, fwd_c, ops_v, ops_c),
                                                ("backward", bwd_v, bwd_c, bops_v, bops_c)):
                equal = all(torch.equal(x, y) for x, y in zip(got, want))
                diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, want))
                print(f"| {backend} | {str(dtype)[6:]} | {name} | {equal} | {diff:.3g} | {ops} "
                      f"| {base} |", flush=True)
    print("\nThe op, views on and off (LongNet setting, b 1, n 4096, 12 heads x 64, GQA 12/4, "
          "forward + backward), max |error| / max |reference| against float64:\n")
    print("| backend | dtype | strided views | out | dq | dk | dv |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    ref_in = [torch.randn(1, 4096, heads, 64, generator=gen, dtype=torch.float64)
              for heads in (12, 4, 4)]
    ref_in = [x.requires_grad_() for x in ref_in]
    dout = torch.randn(1, 4096, 12, 64, generator=gen, dtype=torch.float64)
    ref_out, _ = reference_dilated_attention(*ref_in, [2048, 4096], [1, 2])
    ref = [ref_out] + list(torch.autograd.grad(ref_out, ref_in, dout))
    for backend in ("cuda_cudnn", "cuda_flash", "cuda_efficient"):
        for dtype in (torch.bfloat16, torch.float16):
            try:
                select_backend(torch.device("cuda"), dtype, backend=backend)
            except ValueError:
                continue
            for strided in (False, True):
                dev = [x.detach().to("cuda", dtype).requires_grad_() for x in ref_in]
                with _patched(policy.STRIDED_VIEWS, "cuda", strided):
                    got_out = dilated_attention(*dev, [2048, 4096], [1, 2], backend=backend)
                    got = [got_out] + list(torch.autograd.grad(got_out, dev,
                                                               dout.to("cuda", dtype)))
                errors = [(g.double().cpu() - w).abs().max().item() / w.abs().max().item()
                          for g, w in zip(got, ref)]
                print(f"| {backend} | {str(dtype)[6:]} | {strided} | "
                      + " | ".join(f"{e:.2e}" for e in errors) + " |", flush=True)


class _patched:
    """dict[key] = value for a with block."""

    def __init__(self, table: dict, key, value) -> None:
        self.table, self.key, self.value = table, key, value

    def __enter__(self) -> None:
        self.old = self.table.get(self.key)
        self.table[self.key] = self.value

    def __exit__(self, *exc) -> None:
        self.table[self.key] = self.old


_COPY_OPS = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::_to_copy")


def _profiled(call):
    """(call's result, "n aten copies; CUDA copy kernels") of one call after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    events = prof.events()
    copies = sum(1 for e in events if e.name in _COPY_OPS)
    kernels = sorted({e.name[:40] for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA
                      and "copy" in e.name.lower()})
    return result, f"{copies}; {', '.join(kernels) or 'none'}"


def profile_case(backend: str) -> None:
    """torch.profiler tables of five 1M-token calls (LongNet setting, bf16) after a warm-up
    call, forward and forward + backward: CUDA kernels by total time, and the op count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dilated_attention import dilated_attention
    from dilated_attention.backends import select_backend

    try:
        select_backend(torch.device("cuda"), torch.bfloat16, backend=backend)
    except ValueError as e:
        print(f"backend {backend!r} does not run here: {e}")
        return
    n = 1 << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    # (b, n, h, d)
    q, k, v, dout = (torch.randn(1, n, 12, 64, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    for training in (False, True):
        def call():
            if training:
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                dilated_attention(qq, kk, vv, [2048, 4096], [1, 2], backend=backend).backward(dout)
            else:
                with torch.no_grad():
                    dilated_attention(q, k, v, [2048, 4096], [1, 2], backend=backend)

        call()
        torch.cuda.synchronize()
        calls = 5
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / calls
        ops = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                  and e.name.startswith("aten::")) // calls
        print(f"\n{'forward + backward' if training else 'forward'}, backend {backend}, "
              f"1M tokens, bf16, {calls} calls: {wall * 1e3:.1f} ms wall per call under the "
              f"profiler, {ops} aten ops per call (totals below: all {calls} calls)\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                        max_name_column_width=60))


# --------------------------------------------------------------------------


def main(argv=None) -> int:
    names = list(parts())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["all"], choices=["all"] + names,
                        help="which parts to run (default all)")
    parser.add_argument("--out", default="bench-out/gpu_suite.md",
                        help="the report; parts already there from an earlier run are kept "
                        "(default bench-out/gpu_suite.md; copied to $OUT when set)")
    parser.add_argument("--commit", default="unknown",
                        help="the commit measured (default: git rev-parse, where .git exists)")
    parser.add_argument("--timeout", type=float, default=540,
                        help="seconds after which one command is stopped (default 540)")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds for the whole run: a command still running then is "
                        "stopped, later ones are listed as not run (a device call's limit)")
    parser.add_argument("--seq-lens", nargs="+", default=SEQ_LENS, metavar="N",
                        help="the bench parts' lengths (default 8K..1M)")
    parser.add_argument("--baseline", metavar="SRC",
                        help="part compare: another commit's src/ folder to time the fused "
                        "kernel against (see compare_commands)")
    parser.add_argument("--list", action="store_true", help="print the parts' commands and exit")
    parser.add_argument("--strided-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # the parts in the order asked for (all: the suite's order, every part but compare,
    # which needs --baseline, smoke, a subset of tests, and triton-floor and sdpa-whole,
    # questions for when the rest is known)
    todo = ([n for n in names
             if n not in ("compare", "smoke", "triton-floor", "sdpa-whole", "fp32",
                          "tile-order", "dropout")]
            if "all" in args.part
            else list(dict.fromkeys(args.part)))
    table = parts(args.seq_lens, args.baseline)
    if args.list:
        for name in todo:
            print(f"{name}:")
            for command in table[name]:
                print("    " + " ".join(c if c != PY else "python" for c in command))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False (torch "
              f"{torch.__version__}); the GPU suite has nothing to run here.")
        return 0
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    if args.strided_check:
        strided_check()
        return 0
    if args.profile_case:
        profile_case(args.profile_case)
        return 0
    header = environment(args.commit)
    print(header, flush=True)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    start = time.perf_counter()
    deadline = start + args.budget
    for name in todo:
        section = run_part(name, table[name], args.timeout, deadline)
        write_report(out, header, {name: section})  # after each part: a stopped run keeps it
    print(f"== {', '.join(todo)}: {(time.perf_counter() - start) / 60:.1f} min; report {out}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
