"""Time the fused Triton kernels' tiles on a GPU, and print the fastest per kernel.

    python benchmarks/tune_tiles.py                     # bf16, d 64 and 128, 64K tokens, LongNet
    python benchmarks/tune_tiles.py --head-dims 64 --seq-len 131072 --schedule geometric
    python benchmarks/tune_tiles.py --rows 64 128 --chunks 32 64 --warps 4 8 --stages 2 3
    python benchmarks/tune_tiles.py --head-dims 64 --seq-len 16384 --causal --order-windows 0 1024

fused.CUDA_TILE_SIZES holds tiles that compile on every architecture
(benchmarks/cross_compile.py), not timed ones; fused.TUNED_TILE_SIZES those
this timed on one GPU, by compute capability. This times, per head dim and
kernel (the forward; dq; dK/dV), every candidate tile (rows x chunk x warps,
and num_stages) in the op itself, 12 heads as in bench_single_device.py, the
other two kernels keeping their shipped tiles: the forward kernel by a
forward under no_grad, dq and dK/dV by the backward of one forward whose
graph is kept (one kernel's tile changed at a time, so the rows of one
kernel differ by that kernel's time; num_stages is one value for all three
kernels: the suggestion takes the forward's). The candidates take turns
(A B C A B C ...), so that drift slows all alike.

``--order-windows W ...`` asks another question: the shipped tiles themselves,
each launch's tiles heaviest first in windows of W tiles (fused.TileSizes'
order_window; Note [fused kernel] in fused_plan.py, "Tile order"; 0: cell by
cell), one candidate per W, instead of other tiles. ``--causal`` times causal
calls (a language model's), whose tiles' work differs most.

A candidate that does not launch (Triton's OutOfResources: too much shared
memory) or whose result differs from the shipped tiles' beyond rounding is
reported and left out. The report: milliseconds min/median/max per candidate,
its ratio to the shipped tile's median, and per head dim the entry of the
fastest. It goes into fused.TUNED_TILE_SIZES under the GPU's compute
capability (only that GPU gets it); for the portable fused.CUDA_TILE_SIZES,
`python benchmarks/cross_compile.py --sizes F D K --stages S` must pass on
every architecture first (the command is printed).

On CPU tensors (TRITON_INTERPRET=1, a small --seq-len) the same code runs
under Triton's interpreter: its times mean nothing; tests/test_tune_tiles.py
checks the mechanics there.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_single_device as bench  # noqa: E402

from dilated_attention import dilated_attention, fused  # noqa: E402

KERNELS = ("forward", "dq", "dkdv")
# |candidate - shipped| / max|shipped|: different tiles sum in another order (fp32
# accumulators, outputs rounded to the dtype); a wrong tile is off by O(1)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclasses.dataclass
class Timed:
    kernel: str
    head_dim: int
    sizes: fused.TileSizes
    seconds: List[float]  # sorted; empty when it did not run
    problem: str = ""

    @property
    def tile(self) -> fused.KernelTiles:
        return getattr(self.sizes, self.kernel)

    def describe(self) -> str:
        t = self.tile  # as cross_compile.py writes tiles, and the tile order's window
        order = f" o{self.sizes.order_window}" if self.sizes.order_window else ""
        return f"M{t.rows} N{t.chunk} w{t.num_warps} s{self.sizes.num_stages}{order}"


def candidates(shipped: fused.TileSizes, kernel: str, rows: Sequence[int],
               chunks: Sequence[int], warps: Sequence[int], stages: Optional[Sequence[int]],
               order_windows: Optional[Sequence[int]] = None) -> List[fused.TileSizes]:
    """The shipped tiles with `kernel`'s replaced by each candidate (the shipped one first;
    stages None: the shipped num_stages); with `order_windows`, the shipped tiles in each
    tile order instead."""
    out = [shipped]
    if order_windows is not None:
        return out + [dataclasses.replace(shipped, order_window=w) for w in order_windows
                      if w != shipped.order_window]
    for r, c, w, s in itertools.product(rows, chunks, warps, stages or [shipped.num_stages]):
        sizes = dataclasses.replace(shipped, num_stages=s,
                                    **{kernel: fused.KernelTiles(r, c, w)})
        if sizes != shipped:
            out.append(sizes)
    return out


def _step(kernel: str, q, k, v, out, dout, segments, rates) -> Callable[[], object]:
    """One call that runs `kernel`: a forward without autograd (its result: out), or the
    backward of `out` (the gradients)."""
    if kernel == "forward":
        def forward():
            with torch.no_grad():
                return dilated_attention(q, k, v, segments, rates, is_causal=bench.CAUSAL,
                                         backend="triton")
        return forward

    def backward():
        q.grad = k.grad = v.grad = None
        out.backward(dout, retain_graph=True)
        return torch.cat([q.grad.flatten(), k.grad.flatten(), v.grad.flatten()])
    return backward


def _deviation(result, reference) -> float:
    scale = reference.abs().max().item() or 1.0
    return (result.float() - reference.float()).abs().max().item() / scale


def tune_kernel(kernel: str, head_dim: int, options: argparse.Namespace,
                dtype: torch.dtype, device: str) -> List[Timed]:
    """Every candidate of `kernel` at `head_dim`, timed in turns; the shipped tiles first."""
    shipped = fused.tile_sizes(torch.device(device), dtype, head_dim)
    segments, rates = bench.SCHEDULES[options.schedule]
    gen = torch.Generator(device=device).manual_seed(0)
    # q, k, v, dout (b, n, h, d)
    q, k, v, dout = (torch.randn(1, options.seq_len, options.heads, head_dim, generator=gen,
                                 device=device, dtype=dtype) for _ in range(4))
    q, k, v = (x.requires_grad_(kernel != "forward") for x in (q, k, v))
    # one forward (shipped tiles) whose graph every backward candidate reuses: the
    # backward kernels plan their tiles when they run
    out = (None if kernel == "forward" else
           dilated_attention(q, k, v, segments, rates, is_causal=bench.CAUSAL, backend="triton"))
    rows: List[Timed] = []
    steps: Dict[int, Callable[[], object]] = {}
    reference = None
    for index, sizes in enumerate(candidates(shipped, kernel, options.rows, options.chunks,
                                             options.warps, options.stages,
                                             options.order_windows)):
        timed = Timed(kernel, head_dim, sizes, [])
        rows.append(timed)
        patch = mock.patch.object(fused, "tile_sizes", lambda *_, sizes=sizes: sizes)
        try:
            with patch:
                step = _step(kernel, q, k, v, out, dout, segments, rates)
                result = step()
        except Exception as error:  # noqa: BLE001  (OutOfResources, compile errors: reported)
            timed.problem = f"did not run: {type(error).__name__}: {str(error)[:120]}"
            continue
        if reference is None:
            reference = result
        elif (deviation := _deviation(result, reference)) > TOLERANCE[dtype]:
            timed.problem = f"differs from the shipped tiles' result by {deviation:.2e} (relative)"
            continue

        def patched(step=step, patch=patch):
            with patch:
                step()
        steps[index] = patched
    for index, seconds in bench.time_cases(steps, options.repeats, options.min_seconds,
                                           options.queued).items():
        rows[index].seconds = seconds
    return rows


def report(rows: Sequence[Timed]) -> str:
    lines = ["| d | kernel | tile | ms min/median/max | / shipped | note |",
             "|---|---|---|---|---|---|"]
    for (d, kernel), group in itertools.groupby(rows, lambda r: (r.head_dim, r.kernel)):
        group = list(group)
        shipped = statistics.median(group[0].seconds) if group[0].seconds else None
        best = _fastest(group)
        for r in group:
            if not r.seconds:
                lines.append(f"| {d} | {kernel} | {r.describe()} | - | - | {r.problem} |")
                continue
            ratio = f"{statistics.median(r.seconds) / shipped:.3f}" if shipped else "-"
            note = "; ".join(n for n in ("shipped" if r is group[0] else "",
                                         "fastest" if r is best else "") if n)
            spread = "/".join(f"{1e3 * x:.3f}" for x in (r.seconds[0],
                                                          statistics.median(r.seconds),
                                                          r.seconds[-1]))
            lines.append(f"| {d} | {kernel} | {r.describe()} | {spread} | {ratio} | {note} |")
    return "\n".join(lines)


def _fastest(group: Sequence[Timed]) -> Optional[Timed]:
    ran = [r for r in group if r.seconds]
    return min(ran, key=lambda r: statistics.median(r.seconds)) if ran else None


def suggestion(rows: Sequence[Timed], dtype: torch.dtype,
               capability: Optional[Tuple[int, int]] = None) -> str:
    """Per head dim, the table entry of each kernel's fastest tile (keyed by `capability`
    for TUNED_TILE_SIZES where given, else as a CUDA_TILE_SIZES key), and the
    cross_compile command to run before shipping it to every GPU."""
    lines = []
    for d, group in itertools.groupby(rows, lambda r: r.head_dim):
        group = list(group)
        best = {kernel: _fastest([r for r in group if r.kernel == kernel]) for kernel in KERNELS}
        missing = [kernel for kernel, b in best.items() if b is None]
        if missing:
            lines.append(f"d={d}: no timed tile for {', '.join(missing)}")
            continue
        tiles = {kernel: best[kernel].tile for kernel in KERNELS}
        # one value for the three kernels: the forward's
        stages, order = best["forward"].sizes.num_stages, best["forward"].sizes.order_window
        key = fused.cuda_tile_key(dtype, d)
        if capability is not None:
            key = (capability,) + key
        entry = ", ".join(f"KernelTiles({t.rows}, {t.chunk}, {t.num_warps})"
                          for t in tiles.values())
        sizes = " ".join(f"{t.rows},{t.chunk},{t.num_warps}" for t in tiles.values())
        order_entry = f", order_window={order}" if order else ""
        lines.append(f"{key!r}: TileSizes({entry}, num_stages={stages}{order_entry}),\n"
                     f"    check: python benchmarks/cross_compile.py --head-dims {d} "
                     f"--sizes {sizes} --stages {stages}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=bench.HEADS)
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--schedule", default="longnet", choices=sorted(bench.SCHEDULES))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+",
                        help="num_stages to try (default: the shipped one)")
    parser.add_argument("--order-windows", type=int, nargs="+", metavar="W",
                        help="time the shipped tiles in each tile order instead of other "
                        "tiles (0: cell by cell)")
    parser.add_argument("--causal", action="store_true", help="causal calls")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.0,
                        help="more turns while they took less (bench_single_device's)")
    parser.add_argument("--queued", type=int, default=1,
                        help="calls per synchronise, timed per call (the host's work "
                        "overlapping the kernels: short calls' kernels compared)")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)
    for name in ("rows", "chunks", "warps"):
        bad = [x for x in getattr(args, name) or [] if x < 1 or x & (x - 1)]
        if bad:
            parser.error(f"--{name}: {bad} are not powers of two")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to tune (on CPU: --device cpu with TRITON_INTERPRET=1)")
        return 0
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1")
    if any(w < 0 for w in args.order_windows or []):
        parser.error(f"--order-windows: {args.order_windows} has a negative window")
    bench.DEVICE = args.device  # bench.time_cases synchronises that device
    bench.CAUSAL = args.causal
    dtype = getattr(torch, args.dtype)
    rows: List[Timed] = []
    for d, kernel in itertools.product(args.head_dims, args.kernels):
        rows += tune_kernel(kernel, d, args, dtype, args.device)
        print(report([r for r in rows if (r.head_dim, r.kernel) == (d, kernel)]), flush=True)
    if args.device == "cuda":
        name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        table = f"fused.TUNED_TILE_SIZES entries (compute capability {capability})"
    else:
        name, capability, table = "CPU (interpreter)", None, "fused.CUDA_TILE_SIZES entries"
    text = (f"{name}, {args.dtype}, {args.heads} heads, {args.seq_len} tokens, "
            f"{args.schedule} patterns{', causal' if args.causal else ''}, "
            f"{args.repeats} turns\n\n{report(rows)}\n\n"
            f"Fastest per kernel, as {table}:\n\n"
            f"{suggestion(rows, dtype, capability)}\n")
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
