"""Compile the Triton kernels for NVIDIA GPUs on any machine, and report what a GPU would run.

    python benchmarks/cross_compile.py              # sm_80, 86, 89, 90, 100, 120; every case
    python benchmarks/cross_compile.py --archs 90 --dtypes bfloat16 --head-dims 128
    python benchmarks/cross_compile.py --sizes 128,64,8 64,64,4 64,32,8   # other tiles
    python benchmarks/cross_compile.py --kernels fused_backward_rule        # one kernel

Why: the CI machines have no GPU. Triton's interpreter (TRITON_INTERPRET=1)
checks what the kernels compute, not whether they compile for a GPU nor what
they cost there. But Triton compiles for a target it is given
(``triton.compile(..., target=GPUTarget("cuda", 90, 32))``) without a driver,
and the ptxas it ships reports registers and spilled bytes. So every kernel a
CUDA call would launch (the fused forward, dq and dK/dV kernels; the merge
kernel) is compiled here for each architecture, exactly as the launch would
specialise it: the calls run on small CPU tensors with the kernels replaced by
recorders, and each recorded launch goes through Triton's own binder (strides
of 1 become constants, multiples of 16 get divisibility hints), with the CUDA
tile sizes (``fused.tile_sizes``).

Per kernel and case the report gives registers per thread, spilled bytes
(stores to local memory), shared memory against the architecture's limit per
block, and whether the key loop is software-pipelined (asynchronous copies in
the TTGIR; Triton pipelines only innermost loops, so a loop inside the key
loop would switch it off). A row fails when the kernel would not launch (it
needs more shared memory than the architecture has: Triton's OutOfResources),
spills with all 255 registers in use (its tile needs more), or is not
pipelined with num_stages > 1; the exit status is 1 if any row fails, and
tests/test_cross_compile.py runs a subset on every CI run. Spilled bytes at
fewer registers are ptxas's own trade for occupancy: reported, not failed; so
are the spills of the timed sm_90 tiles (fused.TUNED_TILE_SIZES: the timing
chose them; not of their narrow launches, a plan's tiles of fewer rows, which no
timing chose) and of the kernels for the non-finite rule (marked "rule": they
return at once unless the inputs hold a NaN or an infinity).

The architectures: A100 (sm_80), consumer and workstation Ampere and Ada
(sm_86, sm_89: 99 KiB of shared memory per block, against 163 on sm_80),
H100/H200 (sm_90), B200 (sm_100) and consumer Blackwell (sm_120, 99 KiB).

What this cannot say: time. Occupancy and tile sizes trade against each
other on a real device (benchmarks/gpu_suite.py measures them there).

Notation: M rows per tile, N elements per chunk of the other side, d head dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

# Kernels created under the interpreter cannot be compiled for a GPU: this process
# compiles them, whatever the environment says.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
# The oldest Triton whose compile internals this calls as it does (the binder, the
# launcher's _pack_args): 3.4 has no _pack_args, and 3.0-3.2 bind differently
OLDEST_TRITON = (3, 5)

from dilated_attention import dilated, fused, merge_kernel, triton_kernels  # noqa: E402
from dilated_attention.releases import installed_release  # noqa: E402

# Shared memory one block may use (the opt-in maximum, bytes), per compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
# Registers one thread can have. A kernel that spills with all of them needs more (its tile
# is too big); one that spills with fewer was given fewer by ptxas, which trades a few spilled
# bytes for more resident warps on its own (e.g. sm_86, bf16 d=64, 128 x 16 tiles of 4 warps:
# 168 registers and 20 bytes spilled), so that is reported, not a failure. Tiles timed on
# the architecture itself (fused.TUNED_TILE_SIZES) are exempt: the timing is the measure
# the spill rule stands in for (on sm_90 the fastest tiles spill a little).
MAX_REGISTERS = 255
# "tf32": float32 tensors with torch.set_float32_matmul_precision("high"), so the dot products
# run on tensor cores; "float32" at the default "highest" runs them in full fp32.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "tf32": torch.float32}
# Pattern sets: LongNet's two patterns, whose spans are split on every GPU (the kernels
# compiled without counts; Note [fused kernel], "Split spans"), and a geometric schedule
# whose rate-1 spans carry three extras (the kernels unroll them) and whose classes of 64,
# 32 and 16 rows per cell of 128 run in narrow launches ("Narrow tiles").
PATTERNS = {"longnet": ([2048, 4096], [1, 2]), "geometric": ([128, 256, 512, 1024], [1, 2, 4, 8])}
ROWS, HEADS = 8192, 4
# The fused kernels and their roles in fused.TileSizes; then the backward's kernel for the
# non-finite rule (dq's and dK/dV's tiles, one launch).
ROLES = {"fused_forward": "forward", "fused_dq": "dq", "fused_dkdv": "dkdv"}
BACKWARD_RULE = "fused_backward_rule"


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the op whose launches are compiled."""

    dtype: str
    head_dim: int
    causal: bool
    masked: bool
    patterns: str
    dropout: bool = False

    def describe(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("mask", self.masked),
                                 ("dropout", self.dropout)) if on]
        return f"{self.dtype} d={self.head_dim} {self.patterns} {'+'.join(flags) or 'full'}"


@dataclasses.dataclass
class Launch:
    """A kernel launch recorded instead of run: the JIT function and its arguments."""

    kernel: "triton.runtime.jit.JITFunction"
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Compiled:
    kernel: str
    arch: int
    case: Case
    sizes: str
    registers: int
    spilled: int
    shared: int
    pipelined: Optional[bool]  # None: the kernel has no loop to pipeline
    timed: bool = False  # its tiles were timed on this architecture (fused.TUNED_TILE_SIZES)
    # a kernel for the non-finite rule (the forward's NONFINITE variant, the backward's
    # kernel): it returns at once unless the inputs hold a NaN or an infinity, so its spills
    # cost no finite call anything
    rule: bool = False

    @property
    def problems(self) -> List[str]:
        found = []
        if (self.spilled and self.registers >= MAX_REGISTERS and not self.timed
                and not self.rule):
            found.append(f"spills {self.spilled} bytes at {self.registers} registers")
        if self.shared > SHARED_LIMIT[self.arch]:
            found.append(f"shared {self.shared} > {SHARED_LIMIT[self.arch]}")
        if self.pipelined is False:
            found.append("key loop not pipelined")
        return found


class _Recorder:
    """Stands in for a JIT function: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, launches: List[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def _recorded_kernels(launches: List[Launch]):
    """The triton_kernels module as fused.py uses it, with recorders for the kernels."""
    return type("RecordedKernels", (), {
        "LOG2E": triton_kernels.LOG2E,
        **{name: _Recorder(getattr(triton_kernels, name), launches)
           for name in (*ROLES, BACKWARD_RULE)}})


def capability(arch: int) -> Tuple[int, int]:
    """Compute capability (major, minor) of an architecture number (90 -> (9, 0))."""
    return arch // 10, arch % 10


def timed_tiles(case: Case, arch: int) -> bool:
    """Whether the shipped tiles of `case` on `arch` were timed there (TUNED_TILE_SIZES)."""
    key = fused.cuda_tile_key(DTYPES[case.dtype], case.head_dim)
    return (capability(arch),) + key in fused.TUNED_TILE_SIZES


def record_launches(case: Case, arch: int,
                    sizes: Optional[fused.TileSizes] = None) -> List[Launch]:
    """The fused kernels' launches of one forward and backward of `case`, as on a GPU of
    architecture `arch` (its shipped tiles, or `sizes`)."""
    launches: List[Launch] = []
    dtype = DTYPES[case.dtype]

    def cuda_sizes(device: torch.device, dtype: torch.dtype, head_dim: int,
                   dropout: bool = False) -> fused.TileSizes:
        return sizes or fused.cuda_tile_sizes(capability(arch), dtype, head_dim, dropout)

    # q, k, v, out, dout (b, n, h, d); lse, dlse (b, n, h); mask (b, n)
    q, k, v, out, dout = (torch.randn(1, ROWS, HEADS, case.head_dim, dtype=dtype)
                          for _ in range(5))
    lse, dlse = torch.randn(1, ROWS, HEADS), torch.randn(1, ROWS, HEADS)
    mask = torch.zeros(1, ROWS, dtype=torch.bool) if case.masked else None
    segments, rates = PATTERNS[case.patterns]
    call = (segments, rates, case.causal, case.head_dim ** -0.5, "triton",
            0.1 if case.dropout else 0.0, 0, 0, list(range(HEADS)), None)
    seed = fused.new_seed(q.device) if case.dropout else None
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if case.dtype == "tf32" else "highest")
    try:
        with mock.patch.object(fused, "_kernels", lambda device: _recorded_kernels(launches)), \
                mock.patch.object(fused, "tile_sizes", cuda_sizes):
            # the single-device op: each kernel and its variant for the non-finite rule
            _, _, nonfinite = dilated.forward_flat(q, k, v, *call, mask, seed, True)
            dilated.backward_flat(dout, q, k, v, out, lse, dlse, nonfinite, *call, mask, seed,
                                  True)
    finally:
        torch.set_float32_matmul_precision(precision)
    return launches


def record_merge(dtype: str, head_dim: int) -> List[Launch]:
    """merge_kernel's launch of one merge of `dtype` outputs into accumulators of that dtype
    (policy.in_output: a block that writes into the output)."""
    launches: List[Launch] = []
    acc_dtype = DTYPES[dtype]
    # accumulators (b, segments, rows, h, d) as launches.Blocks holds them
    acc_out = torch.zeros(1, 2, 512, HEADS, head_dim, dtype=acc_dtype)
    out = torch.randn(1, 2, 512, HEADS, head_dim, dtype=DTYPES[dtype])
    acc_lse, lse = torch.randn(1, 2, 512, HEADS), torch.randn(1, 2, 512, HEADS)
    with mock.patch.object(merge_kernel, "_merge_kernel",
                           _Recorder(merge_kernel._merge_kernel, launches)), \
            mock.patch.dict(merge_kernel.BLOCK_ELEMENTS,
                            {"cpu": merge_kernel.BLOCK_ELEMENTS["cuda"]}):
        merge_kernel.merge_(acc_out, acc_lse, out, lse)
    return launches


def compile_launch(launch: Launch, arch: int):
    """`launch` compiled for compute capability `arch` as Triton's launcher would: its
    binder makes the signature, constants and divisibility hints from the arguments."""
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound,
                                                             specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def ptxas_usage(ptx: str, arch: int) -> Dict[str, int]:
    """Registers per thread and spilled bytes of `ptx`, from the ptxas Triton uses."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        # Triton compiles sm_90 as sm_90a (its wgmma instructions)
        name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        try:
            ptxas = get_ptxas(arch)
        except TypeError:  # before Triton 3.6: one ptxas for every architecture
            ptxas = get_ptxas()
        done = subprocess.run([ptxas.path, "-v", f"-arch={name}", str(source), "-o",
                               str(Path(tmp) / "kernel.o")],
                              capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    return {"registers": int(registers.group(1)), "spilled": int(spills.group(1))}


def compile_report(launch: Launch, arch: int, case: Case, timed: bool = False) -> Compiled:
    compiled = compile_launch(launch, arch)
    usage = ptxas_usage(compiled.asm["ptx"], arch)
    kwargs = launch.kwargs
    name = launch.kernel.fn.__name__
    has_loop = name != "_merge_kernel"
    stages = kwargs.get("num_stages", 1)
    pipelined = ("async_copy_global_to_local" in compiled.asm["ttgir"]
                 if has_loop and stages > 1 else None)
    rule = bool(kwargs.get("NONFINITE")) or name == BACKWARD_RULE
    return Compiled(name, arch, case, _tile_sizes(name, kwargs, timed), usage["registers"],
                    usage["spilled"], compiled.metadata.shared, pipelined,
                    timed and has_loop, rule)


def _tile_sizes(name: str, kwargs: dict, timed: bool) -> str:
    """A launch's tiles as the report names them."""
    if name == "_merge_kernel":
        return f"R{kwargs['BLOCK_R']}"
    if name == BACKWARD_RULE:
        tiles = (f"dq M{kwargs['QUERY_BLOCK_M']} N{kwargs['QUERY_BLOCK_N']}, "
                 f"dK/dV M{kwargs['KEY_BLOCK_M']} N{kwargs['KEY_BLOCK_N']}")
    else:
        tiles = f"M{kwargs['BLOCK_M']} N{kwargs['BLOCK_N']}"
    return (f"{tiles} w{kwargs['num_warps']} s{kwargs.get('num_stages', 1)}"
            + (" (timed)" if timed else "")
            + (" rule" if kwargs.get("NONFINITE") or name == BACKWARD_RULE else ""))


def cases(dtypes: Sequence[str], head_dims: Sequence[int], flags: Sequence[str],
          patterns: Sequence[str]) -> List[Case]:
    """flags: "full" (none), or "causal", "mask", "dropout" joined by "+"."""
    return [Case(dtype, d, "causal" in f, "mask" in f, p, "dropout" in f)
            for dtype, d, f, p in itertools.product(dtypes, head_dims, flags, patterns)]


def _compile_case(job: "tuple[Case, int, Optional[fused.TileSizes], bool, Sequence[str]]"
                  ) -> List[Compiled]:
    """Every launch of one case compiled for one architecture (with the merge's, if asked),
    or those of the kernels named (none named: all)."""
    case, arch, sizes, merge, kernels = job
    launches = record_launches(case, arch, sizes)
    if merge:
        launches += record_merge(case.dtype, case.head_dim)
    if kernels:
        launches = [launch for launch in launches if launch.kernel.fn.__name__ in kernels]
    return [compile_report(launch, arch, case, sizes is None and _timed(launch, case, arch))
            for launch in launches]


def _timed(launch: Launch, case: Case, arch: int) -> bool:
    """Whether `launch` runs a tile timed on `arch`: its timed entry's, at its full height (a
    plan's narrow tiles launch at fewer rows, which no timing chose)."""
    role = ROLES.get(launch.kernel.fn.__name__)
    if role is None or not timed_tiles(case, arch) or case.dropout:
        return False  # (the dropout kernels' tiles are fused.TileSizes.for_dropout's)
    tiles = fused.cuda_tile_sizes(capability(arch), DTYPES[case.dtype], case.head_dim)
    return launch.kwargs["BLOCK_M"] == getattr(tiles, role).rows


def run(archs: Sequence[int], chosen: Sequence[Case], sizes: Optional[fused.TileSizes] = None,
        merge: bool = True, progress: Callable[[Compiled], None] = lambda row: None,
        jobs: int = 1, kernels: Sequence[str] = ()) -> List[Compiled]:
    """Compile every case for every architecture (only the `kernels` named, if any), in
    `jobs` processes; rows in that order."""
    work, seen = [], set()
    for case in chosen:
        # the merge kernel sees only the dtype and head dim of a call
        merges = merge and (DTYPES[case.dtype], case.head_dim) not in seen
        seen.add((DTYPES[case.dtype], case.head_dim))
        work += [(case, arch, sizes, merges, tuple(kernels)) for arch in archs]
    rows: List[Compiled] = []
    # fork: the workers inherit this process's modules (no CUDA here to break)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for compiled in pool.imap(_compile_case, work):
            for row in compiled:
                rows.append(row)
                progress(row)
    return rows


def _case(row: Compiled) -> str:
    # the merge kernel sees only the dtype and head dim of a call
    if row.kernel == "_merge_kernel":
        return f"{row.case.dtype} d={row.case.head_dim}"
    return row.case.describe()


def _pipelined(values: Sequence[Optional[bool]]) -> str:
    if all(v is None for v in values):
        return "-"
    return "yes" if all(v is not False for v in values) else "NO"


def table(rows: Sequence[Compiled]) -> str:
    """Every compiled kernel, one row each."""
    lines = ["| arch | kernel | case | tile sizes | registers | spilled bytes | shared KiB "
             "(limit) | pipelined | problems |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| sm_{r.arch} | {r.kernel} | {_case(r)} | {r.sizes} | {r.registers} | "
                     f"{r.spilled} | {r.shared / 1024:.1f} ({SHARED_LIMIT[r.arch] // 1024}) | "
                     f"{_pipelined([r.pipelined])} | {'; '.join(r.problems) or '-'} |")
    return "\n".join(lines)


def summary(rows: Sequence[Compiled]) -> str:
    """Per architecture, kernel, dtype and head dim: the most registers, spilled bytes and
    shared memory over the cases (flags, pattern sets)."""
    groups: Dict[tuple, List[Compiled]] = {}
    for r in rows:
        groups.setdefault((r.arch, r.kernel, r.case.dtype, r.case.head_dim), []).append(r)
    lines = ["| arch | kernel | dtype | d | tile sizes | cases | registers (most) | spilled "
             "bytes (most) | shared KiB (most) | pipelined |", "|" + "---|" * 10]
    for (arch, kernel, dtype, d), group in groups.items():
        sizes = ", ".join(sorted({r.sizes for r in group}))
        lines.append(f"| sm_{arch} | {kernel} | {dtype} | {d} | {sizes} | {len(group)} | "
                     f"{max(r.registers for r in group)} | {max(r.spilled for r in group)} | "
                     f"{max(r.shared for r in group) / 1024:.1f} | "
                     f"{_pipelined([r.pipelined for r in group])} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=sorted(SHARED_LIMIT),
                        choices=sorted(SHARED_LIMIT), help="compute capabilities (x10)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--flags", nargs="+", default=["full", "causal+mask"],
                        choices=["full", "causal", "mask", "causal+mask", "dropout",
                                 "causal+mask+dropout"],
                        help="'dropout': the kernels with attention dropout (0.1)")
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--sizes", nargs=3, metavar="ROWS,CHUNK,WARPS",
                        help="tiles to try instead of fused.tile_sizes, for the forward, dq "
                        "and dK/dV kernels (fused.KernelTiles)")
    parser.add_argument("--stages", type=int, default=2,
                        help="num_stages with --sizes (default 2)")
    parser.add_argument("--no-merge", action="store_true", help="skip the merge kernel")
    parser.add_argument("--kernels", nargs="+", default=[],
                        choices=[*ROLES, BACKWARD_RULE, "_merge_kernel"],
                        help="compile only these kernels (default: every one a call launches)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="compile in this many processes (default: one per core)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if installed_release("triton") < OLDEST_TRITON:
        parser.error(f"needs triton {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]} or newer (Triton's "
                     f"compile internals); got {triton.__version__}")
    for d in args.head_dims:
        if d < 1:
            parser.error(f"--head-dims: {d} is not a head dim")
    sizes = None
    if args.sizes:
        try:
            sizes = fused.TileSizes(*(fused.KernelTiles(*(int(x) for x in triple.split(",")))
                                      for triple in args.sizes), num_stages=args.stages)
        except (TypeError, ValueError):
            parser.error(f"--sizes: {' '.join(args.sizes)!r} is not three ROWS,CHUNK,WARPS")
    start = time.perf_counter()
    chosen = cases(args.dtypes, args.head_dims, args.flags, args.patterns)
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} is not a number of processes")
    rows = run(args.archs, chosen, sizes, merge=not args.no_merge, jobs=args.jobs,
               kernels=args.kernels,
               progress=lambda r: print(f"sm_{r.arch} {r.kernel} {_case(r)} {r.sizes}: "
                                        f"{r.registers} registers, {r.spilled} B spilled, "
                                        f"{r.shared} B shared {' '.join(r.problems)}",
                                        flush=True))
    report = (f"Cross-compiled with triton {triton.__version__}, torch {torch.__version__} "
              f"({len(rows)} kernels, {time.perf_counter() - start:.0f} s)\n\n"
              f"{summary(rows)}\n\n{table(rows)}\n")
    print("\n" + report)
    if args.out:
        Path(args.out).write_text(report)
    failed = [r for r in rows if r.problems]
    if failed:
        print(f"{len(failed)} of {len(rows)} kernels have problems", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
