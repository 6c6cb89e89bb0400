"""The Triton kernels compile for NVIDIA GPUs, without a GPU: benchmarks/cross_compile.py.

The interpreter tests (test_fused.py, test_merge_kernel.py) check what the kernels
compute; these check what a GPU would be given. Every launch of a CUDA call (the fused
forward, dq and dK/dV kernels, and the merge kernel) is compiled for A100 (sm_80), consumer
Ampere (sm_86: 99 KiB of shared memory a block), H100 (sm_90) and consumer Blackwell
(sm_120; a newer ptxas) exactly as Triton's launcher specialises it, and must fit the
architecture's shared memory, must not spill at 255 registers a thread, and must pipeline
its key loop. The tool runs in a
subprocess: kernels this process made under TRITON_INTERPRET=1 (tests/conftest.py) are
interpreted ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dilated_attention.releases import installed_release

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parent.parent / "benchmarks" / "cross_compile.py"
ARCHS = ("80", "86", "90", "120")


def cross_compile(tmp_path: Path, *args: str) -> "tuple[int, str, str]":
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL), "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    report = out.read_text() if out.exists() else ""
    return done.returncode, report, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.skipif(
    installed_release("triton") < (3, 8),
    reason="the tiles are checked with triton 3.8 and 3.9; 3.6 and 3.7's code spills 40 B at "
           "255 registers on sm_80 (BENCHMARKS.md, 'With triton 3.6')")
def test_the_shipped_half_precision_tiles_compile_for_four_architectures(tmp_path):
    # bf16 (fp16 compiles to the same code): with and without causal + a padding mask, three
    # extra counts per span (the geometric schedule), d 64 and 128. Every dtype, head dim
    # and architecture is in the tool's full run (BENCHMARKS.md).
    code, report, log = cross_compile(
        tmp_path, "--archs", *ARCHS, "--dtypes", "bfloat16", "--head-dims", "64", "128",
        "--flags", "full", "causal+mask", "--patterns", "geometric")
    assert code == 0, log
    # the merge kernel too names its compile options (test_triton_launch.py: the fused ones)
    assert "FP_FUSION" not in log, log
    # the table of every kernel (after the summary)
    detail = report.split("| arch | kernel | case |")[1]
    rows = [line for line in detail.splitlines() if line.startswith("| sm_")]
    # archs x 2 head dims x 2 flag sets for the fused kernels, in three launches each: the
    # case's cells of 128 rows have classes of 64, 32 and 16 rows (Note [fused kernel],
    # "Narrow tiles"); then the kernels for the non-finite rule, one launch each (the
    # forward's variant, and the backward's), and the merge per head dim
    cases = len(ARCHS) * 2 * 2
    for kernel, count in (("fused_forward", cases * (3 + 1)), ("fused_dq", cases * 3),
                          ("fused_dkdv", cases * 3), ("fused_backward_rule", cases),
                          ("_merge_kernel", len(ARCHS) * 2)):
        assert sum(f"| {kernel} |" in row for row in rows) == count, report
    assert all(row.endswith("| - |") for row in rows), report  # no problem anywhere
    # the fused kernels' key loops are pipelined (cp.async)
    assert sum("| yes |" in row for row in rows) == cases * 11, report


def test_a_kernel_that_spills_is_reported_and_fails(tmp_path):
    # 128-row tiles of d = 128 with 4 warps need more than 255 registers per thread
    code, report, log = cross_compile(
        tmp_path, "--archs", "90", "--dtypes", "bfloat16", "--head-dims", "128", "--flags",
        "full", "--patterns", "longnet", "--no-merge", "--sizes", "128,64,4", "128,64,4",
        "128,32,4")
    assert code == 1, log
    assert "spills" in report and "kernels have problems" in log


def test_bad_tile_sizes_are_a_usage_error(tmp_path):
    code, _, log = cross_compile(tmp_path, "--sizes", "64,64", "64,64,4", "64,64,4")
    assert code == 2 and "--sizes" in log


def test_sass_loops_lists_each_kernels_chunk_loop_and_the_plain_ones(tmp_path):
    """benchmarks/sass_loops.py --reference: each fused kernel of LongNet's bf16 call on sm_90
    and plain flash attention's forward, dq and dK/dV at the fused kernels' tiles (their
    yardsticks, benchmarks/plain_flash.py) compile, and each has a loop of at least 40
    instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL.parent / "sass_loops.py"), "--reference"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = [line for line in done.stdout.splitlines() if not line.startswith(" ")]
    assert [line.split()[0] for line in kernels] == [
        "fused_forward", "fused_dq", "fused_dkdv", "plain_flash_forward", "plain_flash_dq",
        "plain_flash_dkdv"], done.stdout
    # each plain kernel takes its fused kernel's timed sm_90 tile (fused.TUNED_TILE_SIZES)
    assert ["M128 N64 w4" in kernels[3], "M128 N64 w4" in kernels[4],
            "M128 N32 w4" in kernels[5]] == [True] * 3, done.stdout
    assert all(block.count("loop of") >= 1
               for block in done.stdout.split("plain_flash_")[1:]), done.stdout


def test_sass_loops_finds_the_loops_a_branch_jumps_back_to():
    """benchmarks/sass_loops.py's parse of an nvdisasm listing: a loop is a label that a later
    branch jumps back to (a forward branch is none), its opcodes counted without operands."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        from sass_loops import loops
    finally:
        sys.path.remove(str(TOOL.parent))
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
    .L_x_0:
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/              @!P0 FMUL.FTZ R2, R2, R6 ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
        /*0040*/                   BRA `(.L_x_0) ;
    .L_x_1:
        /*0050*/                   EXIT ;
    """
    opcodes, found = loops(listing)
    assert opcodes == ["MOV", "FFMA", "FMUL", "BRA", "BRA", "EXIT"]
    assert found == [(1, 4)]
