"""benchmarks/tune_tiles.py's mechanics, under Triton's interpreter (its times mean nothing
here; on a GPU they pick fused.CUDA_TILE_SIZES): every candidate runs in the op, a candidate
whose result differs from the shipped tiles' is left out, the fastest per kernel becomes a
CUDA_TILE_SIZES entry."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_tiles.py"
# small: 2 heads of 16, 128 tokens for the tile orders; one candidate beside the shipped tiles
# per kernel on 64 tokens (two of the shipped tiles' 32 rows, four of the candidate's 16:
# every candidate still runs the op whole, at a quarter of the interpreter's work)
TINY = ["--device", "cpu", "--dtype", "float32", "--head-dims", "16", "--heads", "2",
        "--repeats", "1"]
SMALL = TINY + ["--seq-len", "128"]
ARGS = TINY + ["--seq-len", "64", "--rows", "16", "--chunks", "16", "--warps", "1"]


@pytest.fixture(scope="module")
def tune_tiles():
    spec = importlib.util.spec_from_file_location("tune_tiles", TOOL)
    module = importlib.util.module_from_spec(spec)
    # its dataclasses look their module up by name
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "tune_tiles", module)
        spec.loader.exec_module(module)
        yield module


def _rows(report: str, kernel: str):
    return [line for line in report.splitlines() if line.startswith(f"| 16 | {kernel} |")]


def test_every_candidate_is_timed_and_the_fastest_becomes_an_entry(tune_tiles, tmp_path):
    out = tmp_path / "tiles.md"
    assert tune_tiles.main(ARGS + ["--out", str(out)]) == 0
    report = out.read_text()
    for kernel in tune_tiles.KERNELS:
        rows = _rows(report, kernel)
        # the shipped (interpreter) tiles, then the candidate; both timed, one fastest
        assert [r.split(" | ")[2] for r in rows] == ["M32 N32 w1 s1 o3", "M16 N16 w1 s1 o3"], report
        assert "shipped" in rows[0] and "| 1.000 |" in rows[0], report
        assert sum("fastest" in r for r in rows) == 1, report
    entry = report.split("as fused.CUDA_TILE_SIZES entries:")[1]
    assert "('ieee', 64): TileSizes(KernelTiles(" in entry and "num_stages=1" in entry, report
    assert "python benchmarks/cross_compile.py --head-dims 16 --sizes " in entry, report


def test_a_candidate_with_another_result_is_left_out(tune_tiles, tmp_path, monkeypatch):
    # any deviation at all counts as wrong: every candidate but the shipped one is left out
    monkeypatch.setitem(tune_tiles.TOLERANCE, tune_tiles.torch.float32, -1.0)
    out = tmp_path / "tiles.md"
    assert tune_tiles.main(ARGS + ["--kernels", "forward", "--out", str(out)]) == 0
    shipped, candidate = _rows(out.read_text(), "forward")
    assert "fastest" in shipped
    assert "differs from the shipped tiles' result" in candidate and "| - |" in candidate


def test_tiles_must_be_powers_of_two(tune_tiles):
    with pytest.raises(SystemExit):
        tune_tiles.main(ARGS + ["--rows", "48"])


def test_tile_orders_are_timed_on_the_shipped_tiles(tune_tiles, tmp_path):
    """--order-windows: the shipped tiles (the interpreter's order their windows of 3) in
    each order asked for, not other tiles; causal calls, whose tiles' work differs; the
    suggestion carries the forward's fastest order."""
    out = tmp_path / "orders.md"
    assert tune_tiles.main(SMALL + ["--causal", "--order-windows", "0", "3", "--queued", "2",
                                    "--out", str(out)]) == 0
    report = out.read_text()
    assert ", causal, " in report.splitlines()[0], report
    for kernel in tune_tiles.KERNELS:
        rows = _rows(report, kernel)
        assert [r.split(" | ")[2] for r in rows] == ["M32 N32 w1 s1 o3", "M32 N32 w1 s1"], report
        assert all("did not run" not in r and "differs" not in r for r in rows), report
    forward = _rows(report, "forward")
    entry = report.split("as fused.CUDA_TILE_SIZES entries:")[1]
    assert ("order_window=3" in entry) == ("fastest" in forward[0]), report
