"""Instructions per chunk of the fused kernels' key loops, from their SASS (no GPU needed).

    python benchmarks/sass_loops.py                                  # LongNet, sm_90
    python benchmarks/sass_loops.py --patterns geometric --set BLOCK_M=128
    python benchmarks/sass_loops.py --patterns geometric --set BLOCK_M=128 SPAN_COUNTS=False
    python benchmarks/sass_loops.py --reference      # and plain flash attention's loops
    python benchmarks/sass_loops.py --patterns geometric --set BLOCK_M=64 --dropout

Each fused kernel (forward, dq, dK/dV) of one bf16 call with heads of 64 is
compiled as ``cross_compile.py`` does (the launch the op would make on that
architecture, its shipped tiles; the geometric case's launches are of narrow
tiles, 64 rows and fewer), with constexprs replaced by --set, and its
cubin disassembled with the ``nvdisasm`` Triton ships. Printed per kernel: its
instructions, and for each loop of at least 40 instructions (a label that a
later branch jumps back to) its length and most frequent opcodes. The
innermost loop first in the listing is the unmasked chunk loop: what one chunk
of keys costs (BENCHMARKS.md, "Kernels without per-key counts"). With
--reference, also the loops of plain flash attention's forward, dq and dK/dV
(``plain_flash.py``), each compiled with its fused kernel's first launch's tile: what
the same Triton emits for a chunk of dense attention. A count of instructions, not a
time. --dropout: the kernels with attention dropout (their own tiles, chunks halved).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple


def sass(cubin: bytes) -> str:
    from triton.backends.nvidia import compiler

    nvdisasm = Path(compiler.__file__).parent / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(nvdisasm), "-c", "-g", str(path)], capture_output=True,
                              text=True, check=True).stdout


def loops(listing: str) -> Tuple[List[str], List[Tuple[int, int]]]:
    """(opcodes in order, (first, last) instruction of every backward branch's loop)."""
    opcodes: List[str] = []
    operands: List[str] = []
    labels = {}
    for line in listing.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*?);", line)
        if op:
            opcodes.append(op.group(1).split(".")[0])
            operands.append(op.group(2))
    found = []
    for i, (opcode, text) in enumerate(zip(opcodes, operands)):
        target = re.search(r"(\.L_x_\d+)", text) if opcode == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            found.append((labels[target.group(1)], i))
    return opcodes, found


def describe_loops(name: str, cubin: bytes) -> None:
    """Print the instructions of `cubin` and those of each loop of at least 40."""
    opcodes, found = loops(sass(cubin))
    print(f"{name}: {len(opcodes)} instructions")
    for lo, hi in found:
        if hi - lo >= 40:
            common = collections.Counter(opcodes[lo:hi + 1])
            print(f"  loop of {hi - lo + 1}: " + ", ".join(
                f"{op} {n}" for op, n in common.most_common(8)))


def reference_launch(fused, cc):
    """The plain kernel (plain_flash.py) of `fused`, a fused kernel's launch, with its tile."""
    import plain_flash

    q = fused.args[0]
    n, h, d = q.shape[1], q.shape[2], fused.kwargs["BLOCK_D"]
    # (n, h, d) dense, n a multiple of the blocks; lse, delta (n, h)
    dense, rows = q.new_empty(n, h, d), q.new_empty(n, h, dtype=cc.DTYPES["float32"])
    role = cc.ROLES[fused.kernel.fn.__name__]
    tensors = {"forward": (dense,) * 4, "dq": (dense,) * 4 + (rows, rows, dense),
               "dkdv": (dense,) * 4 + (rows, rows, dense, dense)}[role]
    # its tile and compile options (FP fusion: triton_launch.COMPILE_OPTIONS)
    tile = {name: fused.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D",
                                                  "num_warps", "num_stages",
                                                  "enable_fp_fusion")}
    return cc.Launch(getattr(plain_flash, f"plain_flash_{role}"), tensors + (h * d, d, n, 0.18),
                     tile)


def main(argv: Optional[Sequence[str]] = None) -> None:
    # imported here: cross_compile creates the kernels compiled, not interpreted, for the
    # whole process (a test importing `loops` must not)
    import cross_compile as cc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--patterns", default="longnet", help="cross_compile.PATTERNS' name")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="constexpr overrides, e.g. EXTRAS=0 SPAN_COUNTS=False")
    parser.add_argument("--dropout", action="store_true",
                        help="the kernels with attention dropout (0.1), at their own tiles")
    parser.add_argument("--reference", action="store_true",
                        help="also plain flash attention's loops, at the fused kernels' tiles")
    args = parser.parse_args(argv)
    if args.patterns not in cc.PATTERNS:
        parser.error(f"--patterns: one of {sorted(cc.PATTERNS)}, not {args.patterns!r}")
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = {"True": True, "False": False}.get(value, value)
        if value.lstrip("-").isdigit():
            overrides[name] = int(value)
    case = cc.Case("bfloat16", 64, False, False, args.patterns, args.dropout)
    done = set()
    launches = cc.record_launches(case, args.arch)
    for launch in launches:
        name = launch.kernel.fn.__name__
        kwargs = {**launch.kwargs, **overrides}
        # each launch height once (a plan's narrow tiles; --set BLOCK_M=.. makes them one)
        key = (name, tuple(sorted(kwargs.items())))
        if name not in cc.ROLES or launch.kwargs.get("NONFINITE") or key in done:
            continue
        done.add(key)
        compiled = cc.compile_launch(cc.Launch(launch.kernel, launch.args, kwargs), args.arch)
        describe_loops(f"{name} sm_{args.arch} {args.patterns} M{kwargs['BLOCK_M']} "
                       f"EXTRAS={kwargs['EXTRAS']} SPAN_COUNTS={kwargs['SPAN_COUNTS']}"
                       f"{' PATTERNS=' + str(kwargs['PATTERNS']) if kwargs['PATTERNS'] else ''}",
                       compiled.asm["cubin"])
    if args.reference:
        for role in cc.ROLES:
            fused = next(launch for launch in launches if launch.kernel.fn.__name__ == role)
            reference = reference_launch(fused, cc)
            tile = reference.kwargs
            describe_loops(f"{reference.kernel.fn.__name__} sm_{args.arch} M{tile['BLOCK_M']} "
                           f"N{tile['BLOCK_N']} w{tile['num_warps']}",
                           cc.compile_launch(reference, args.arch).asm["cubin"])


if __name__ == "__main__":
    main()
