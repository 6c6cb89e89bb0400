"""benchmarks/bench_precision.py: its yardstick is the op's function, and it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_precision.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_precision", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setting", ["dense", "2 patterns causal", "4 patterns"])
def test_the_yardstick_computes_the_op(bench, setting):
    """torch's per-pattern SDPA merged by lse, run in float64, is the reference's function
    (outputs and gradients): the bench compares errors of one function, not of two."""
    shape = (1, 64, 4, 2, 8)
    setting = bench.SETTINGS[setting]
    setting = (tuple(min(w, 32) for w in setting[0]),) + setting[1:]  # several segments
    q, k, v, dout = bench.inputs("large", shape, torch.float64, 0)
    for got, want in zip(bench.torch_sdpa(q, k, v, dout, shape, setting),
                         bench.reference(q, k, v, dout, shape, setting)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_bench_reports_ratios_and_the_largest(bench, capsys):
    assert bench.main(["--seq-len", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                       "--settings", "2 patterns", "--cases", "normal", "dominant",
                       "--dtypes", "float32", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 2 patterns | normal | float32 | auto |" in out
    assert "| auto | float32 |" in out and "| blockwise | float32 |" in out
