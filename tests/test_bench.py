"""The bench command's parts against numbers computed here: its configuration (lengths,
world sizes, meshes, which cases run), a row's statistics from a fake clock, the speedups,
the plot's axes (test_cli.py runs the command itself)."""

from __future__ import annotations

import types

import pytest

from dilated_attention.tools import bench, cli


def test_bench_checks_the_shortest_length_against_the_most_ranks():
    """BE1: --seq-lens in any order; the shortest must give every rank a row, and the
    lengths run shortest first."""
    with pytest.raises(ValueError, match="world size 4 is larger than sequence length 2"):
        bench.make_config(seq_lens=[64, 2], world_sizes=[4])
    assert bench.make_config(seq_lens=[64, 8], world_sizes=[1]).seq_lens == (8, 64)


def test_bench_under_torchrun_runs_up_to_the_launched_size():
    """BE2: under torchrun of 4 ranks the default world sizes are 1, 2, 4, and 4 is allowed."""
    config = bench.make_config(seq_lens=[64], launched_world_size=4)
    assert config.world_sizes == (1, 2, 4)
    assert bench.make_config(seq_lens=[64], world_sizes=[4], launched_world_size=4).world_sizes \
        == (4,)
    with pytest.raises(ValueError, match="exceeds the 4 ranks torchrun launched"):
        bench.make_config(seq_lens=[64], world_sizes=[8], launched_world_size=4)


def test_bench_on_cuda_defaults_to_the_ranks_its_gpus_hold(monkeypatch):
    """Spawned on CUDA (one process per GPU) the default world sizes stop at the GPUs here:
    the README's demo command on a machine with one GPU runs P = 1, not a usage error; asked
    for more ranks than GPUs, it is one."""
    import torch

    for gpus, sizes in ((1, (1,)), (2, (1, 2)), (3, (1, 2)), (8, (1, 2, 4))):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert bench.make_config(seq_lens=[64], dtype="bfloat16",
                                 device="cuda").world_sizes == sizes
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--world-sizes 2 needs that many CUDA devices, this "
                                         "machine has 1"):
        bench.make_config(seq_lens=[64], world_sizes=[2], dtype="bfloat16", device="cuda")
    assert bench.make_config(seq_lens=[64]).world_sizes == (1, 2, 4)  # CPU: gloo ranks


def test_bench_allows_one_row_per_rank():
    """BE3: N equal to the ranks is a row each (only N < P is refused)."""
    assert bench.make_config(seq_lens=[4], world_sizes=[4]).world_sizes == (4,)


def test_bench_mesh_head_ranks_must_divide_the_heads():
    """BE9: a U x S mesh's U head-parallel ranks split the heads; S does not."""
    with pytest.raises(ValueError, match="--mesh 2x1: its 2 head-parallel ranks must divide "
                                         "the 3 query heads"):
        bench.make_config(seq_lens=[64], meshes=[(2, 1)], heads=3)
    assert bench.make_config(seq_lens=[64], meshes=[(1, 2)], heads=3).meshes == ((1, 2),)


def test_bench_row_reports_min_median_max_and_tokens(monkeypatch):
    """BE4, BE5, BE6: three passes of 3.0, 0.5 and 1.0 s (a fake clock): min 0.5 s, median
    1.0 s (not the mean), max 3.0 s (not the last pass), tokens/s = batch N / median."""
    ticks = iter([0.0, 3.0, 10.0, 10.5, 20.0, 21.0])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    config = bench.make_config(seq_lens=[256], world_sizes=[1], segment_lengths=[128],
                               dilation_rates=[1], heads=2, head_dim=8, batch=2, warmup=0,
                               repeats=3, dtype="float32")
    row = bench.run_case("dilated", 256, None, config, "cpu")
    assert row["times_ms"] == [3000.0, 500.0, 1000.0]
    assert (row["time_min_ms"], row["time_ms"], row["time_max_ms"]) == (500.0, 1000.0, 3000.0)
    assert row["tokens_per_s"] == 2 * 256 / 1.0


def test_bench_speedup_is_one_rank_time_over_p_ranks_time():
    """BE7: 10 ms on one rank, 5 ms on two: a speedup of 2."""
    rows = [dict(impl="dilated", seq_len=8192, world_size=p, time_ms=t)
            for p, t in ((1, 10.0), (2, 5.0), (4, 4.0))]
    bench.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, 2.5]


def test_bench_runs_other_implementations_once_per_world_size():
    """BE8: --strategy applies to the dilated op; the ring runs once, whatever the strategies."""
    config = bench.make_config(seq_lens=[4096], world_sizes=[2], impls=["dilated", "ring"],
                               strategies=["exchange", "ulysses"], heads=4)
    assert [(impl, split) for impl, _, split in config.cases_for(2)] == [
        ("dilated", ("group", "exchange")), ("dilated", ("group", "ulysses")),
        ("ring", ("group", "exchange"))]
    assert config.steps == 3


def test_bench_timeout_nan_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """CL2: NaN is no positive number (a NaN deadline never passes); nothing runs."""
    ran = []
    monkeypatch.setattr(cli, "spawn", lambda *args, **kwargs: ran.append(kwargs) or [[]])
    monkeypatch.setattr(bench, "report", lambda *args, **kwargs: None)
    argv = ["bench", "--seq-lens", "64", "--world-sizes", "1", "--out", str(tmp_path),
            "--timeout"]
    assert cli.main(argv + ["nan"]) == 2
    err = capsys.readouterr().err
    assert "argument --timeout: expected a positive number, got 'nan'" in err and ran == []
    assert cli.main(argv + ["5"]) == 0 and ran[0]["timeout"] == 5.0


def test_bench_plots_one_point_against_n():
    """K5: one length on one rank count: the x axis stays N (P only when several P share
    one N), the line named by its P."""
    row = {"impl": "dilated", "seq_len": 8192, "world_size": 1, "time_ms": 1.0,
           "time_min_ms": 1.0, "time_max_ms": 1.0, "peak_mem_mb": 1.0, "comm_mb": 0.0,
           "threads": 1}
    axis, series = bench.plot_series([row])
    assert axis == "seq_len" and list(series) == ["dilated, P=1"]
