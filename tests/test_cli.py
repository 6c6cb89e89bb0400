"""The `dilated-attention` command: usage errors, estimate vs dry run vs measured, bench, verify.

Distributed parts spawn real gloo ranks through the command's own launcher
(one spawn per world size); everything else runs in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dilated_attention.tools import bench, cli, estimate, settings

# ---------------------------------------------------------------------------
# User mistakes: one line on stderr, exit status 2, never a traceback


USAGE_ERRORS = [
    (["bench", "--bogus"], "unrecognized arguments"),
    (["bench", "--seq-lens", "abc"], "expected a positive integer"),
    (["bench", "--seq-lens", "0"], "expected a positive integer"),
    (["bench", "--seq-lens", "2", "--world-sizes", "4"], "larger than sequence length"),
    (["bench", "--impl", "flash"], "invalid choice"),
    (["bench", "--heads", "12", "--kv-heads", "5"], "must divide"),
    (["bench", "--segment-lengths", "8", "--dilation-rates", "16"], "dilation_rates[0] = 16"),
    (["bench", "--segment-lengths", "8", "16"], "together"),
    (["bench", "--warmup", "-1"], "integer >= 0"),
    (["bench", "--impl", "ring", "--causal", "--seq-lens", "1000", "--world-sizes", "3"],
     "zigzag"),
    (["estimate"], "--seq-len"),
    (["estimate", "--seq-len", "4", "--world-size", "8"], "larger than sequence length"),
    (["estimate", "--seq-len", "1k", "--dtype", "int8"], "invalid choice"),
    (["estimate", "--seq-len", "64", "--training", "--forward-only"], "not allowed with"),
    (["verify", "--world-size", "1"], "at least 2 ranks"),
    (["verify", "--cases", "nope"], "unknown case 'nope'"),
    ([], "choose a command"),
]


@pytest.mark.parametrize("argv,message", USAGE_ERRORS, ids=[" ".join(a) or "none" for a, _ in
                                                            USAGE_ERRORS])
def test_usage_errors_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dilated-attention: error: ") and message in err, err
    assert "Traceback" not in err


def test_console_entry_point_exit_status():
    # the real process: python -m dilated_attention, as a user runs it
    proc = subprocess.run(
        [sys.executable, "-m", "dilated_attention", "bench", "--world-sizes", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_device_is_a_usage_error(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_help_exits_zero(capsys):
    assert cli.main(["estimate", "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out


def test_size_suffixes():
    assert cli.positive_int("64k") == 65536
    assert cli.positive_int("1G") == 2**30
    assert cli.flatten([[1, 2], [4]]) == [1, 2, 4]


# ---------------------------------------------------------------------------
# estimate: formula vs dry run (10%), both vs measured (25%)


ESTIMATE_CASES = [
    dict(impl="dilated", seq_len=8192, world_size=1),
    dict(impl="dilated", seq_len=6000, world_size=2, training=True),
    dict(impl="dilated", seq_len=9000, world_size=3, causal=True, training=True),
    dict(impl="dilated", seq_len=16384, world_size=4, segment_lengths=[1024, 8192, 16384],
         dilation_rates=[1, 4, 8], causal=True, kv_heads=4, training=True),
    dict(impl="dilated", seq_len=8192, world_size=4, segment_lengths=[8192],
         dilation_rates=[1], training=True, dtype="bfloat16"),
    dict(impl="ring", seq_len=8192, world_size=4, causal=True, training=True),
    dict(impl="ring", seq_len=9000, world_size=3, kv_heads=4, dtype="bfloat16"),
    # one rank (one kernel call); two ranks with batch 2 (the part sent at step 0 is a copy)
    dict(impl="ring", seq_len=4096, world_size=1, training=True),
    dict(impl="ring", seq_len=4096, world_size=2, batch=2, training=True),
]


@pytest.mark.parametrize("options", ESTIMATE_CASES, ids=lambda o: ",".join(
    f"{k}={v}" for k, v in o.items()))
def test_estimate_formula_matches_dry_run(options):
    config = estimate.make_config(threads=1, **options)
    f, d = estimate.formula(config), estimate.dry_run(config)
    assert abs(f.peak_bytes / d.peak_bytes - 1) <= 0.10, (f, d)
    # traffic: the formula's counts are the plan's, the dry run's what comm counted
    assert f.forward_bytes == d.forward_bytes and f.forward_messages == d.forward_messages
    if config.training:
        assert f.backward_bytes == d.backward_bytes


def test_estimate_command_labels_estimates(capsys):
    assert cli.main(["estimate", "--seq-len", "64k", "--world-size", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE (not measured)")
    assert "formula: peak per rank" in out and "dry run: peak per rank" in out
    assert "communication per layer" in out


@pytest.mark.distributed
def test_estimates_match_measured_peaks():
    # P = 2, training; the second pattern spans both ranks, so buffers travel
    config = bench.make_config(
        seq_lens=[4096], world_sizes=[2], segment_lengths=[1024, 4096], dilation_rates=[1, 2],
        impls=["dilated", "ring"], backward=True, warmup=1, repeats=1,
    )
    rows = cli.spawn(bench.rank_main, 2, (config,), device="cpu", timeout=300,
                     threads=config.threads_for(2))[0]
    assert [r["impl"] for r in rows] == ["dilated", "ring"]
    for row in rows:
        est = estimate.make_config(
            impl=row["impl"], seq_len=4096, world_size=2, segment_lengths=[1024, 4096],
            dilation_rates=[1, 2], training=True, threads=config.threads_for(2),
        )
        measured = row["peak_mem_mb"] * settings.MB
        for e in (estimate.formula(est), estimate.dry_run(est)):
            assert abs(e.peak_bytes / measured - 1) <= 0.25, (row, e)
        # traffic per pass (forward + backward) as counted by comm
        f = estimate.formula(est)
        assert row["comm_mb"] * settings.MB == pytest.approx(f.forward_bytes + f.backward_bytes)


# ---------------------------------------------------------------------------
# bench and verify end to end


@pytest.mark.distributed
def test_tiny_bench_table_and_json(tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["bench", "--seq-lens", "1024", "--world-sizes", "1", "2", "--repeats", "1",
            "--warmup", "0", "--segment-lengths", "256", "512", "--dilation-rates", "1", "2",
            "--heads", "4", "--head-dim", "16", "--out", str(out_dir)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("implementation"))
    for _, title, _ in bench.COLUMNS:
        assert title in header
    data = json.loads((out_dir / "bench.json").read_text())
    assert data["command"].startswith("dilated-attention bench --seq-lens 1024")
    rows = data["rows"]
    assert [(r["impl"], r["seq_len"], r["world_size"]) for r in rows] == [
        ("dilated", 1024, 1), ("dilated", 1024, 2)]
    for r in rows:
        assert set(key for key, _, _ in bench.COLUMNS) <= set(r)
        assert r["time_ms"] > 0 and r["tokens_per_s"] > 0
        if sys.platform.startswith("linux"):
            assert r["peak_mem_mb"] > 0
    assert rows[0]["speedup"] == 1.0 and rows[0]["comm_mb"] == 0.0
    # segments of 256 and 512 rows lie inside the two 512-row pieces: nothing to send
    assert rows[1]["comm_mb"] == 0.0
    plotted = (out_dir / "bench.png").exists()
    assert plotted == ("wrote " + str(out_dir / "bench.png") in out)
    if not plotted:
        assert "plot skipped" in out


@pytest.mark.distributed
def test_verify_tiny_passes(capsys):
    argv = ["verify", "--world-size", "2", "--cases", "span-two", "uneven-causal", "gqa",
            "ring-zigzag-causal"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 4 and all(line.startswith("PASS") for line in lines), out
    assert "4 passed, 0 failed" in out


def _verify_after_a_failure(group, out_dir):
    """verify.rank_main when a case fails: on every rank (agreed), then on rank 1 only."""
    import pickle

    from dilated_attention.distributed import comm
    from dilated_attention.tools import verify

    rank = comm.group_rank(group)
    config = verify.make_config(world_size=2, cases=["span-two", "gqa", "ring"], dtype="auto",
                                device="cpu")
    # rank 1 on the meta device: the op's agreement fails on both ranks, in step
    agreed = verify.rank_main(group, config, lambda label: None,
                              device="meta" if rank == 1 else "cpu")
    if rank == 1:  # a failure before any traffic, which rank 0 cannot see coming
        def fail(*args, **kwargs):
            raise RuntimeError("injected failure")

        verify.run_case = fail
    one_sided = verify.rank_main(group, config, lambda label: None, device="cpu")
    # the launcher's closing barrier may time out (the group is out of step): save now
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps((agreed, one_sided)))
    return None


@pytest.mark.distributed
def test_verify_stops_every_rank_after_a_failed_case(tmp_path, capsys):
    import pickle
    import time

    from dilated_attention.tools import verify
    from dist_harness import RankFailure, run_distributed

    start = time.monotonic()
    try:  # a 5 s group timeout: the one-sided failure costs at most a few of them
        run_distributed(_verify_after_a_failure, 2, tmp_path, timeout=120, pg_timeout=5.0)
    except RankFailure as exc:  # only the launcher's barrier after the out-of-step group
        assert "barrier" in str(exc) and "rank_main" not in str(exc), exc
    assert time.monotonic() - start < 60
    for rank in (0, 1):
        agreed, one_sided = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        for results in (agreed, one_sided):
            assert [r["name"] for r in results] == ["span-two", "gqa", "ring"]
            assert results[0]["failure"] and results[0]["failure"] != "not run"
            assert [r["failure"] for r in results[1:]] == ["not run: an earlier case failed"] * 2
        # the agreed failure is known to every rank, with every rank's message
        assert "rank 0: ValueError" in agreed[0]["failure"]
        assert "rank 1: ValueError" in agreed[0]["failure"]
    config = verify.make_config(world_size=2, cases=["span-two", "gqa", "ring"], dtype="auto",
                                device="cpu")
    capsys.readouterr()
    assert verify.report(agreed, config) == 1
    out = capsys.readouterr().out
    assert "FAIL  gqa" in out and "not run" in out and "0 passed, 3 failed" in out


def test_bench_inputs_do_not_depend_on_world_size():
    # a rank builds its own rows; together they are the one-rank sequence
    full = bench.make_rows([(0, 3000)], (1, 2, 4), seed=7, dtype=torch.float32, device="cpu")
    parts = [bench.make_rows([(lo, hi)], (1, 2, 4), seed=7, dtype=torch.float32, device="cpu")
             for lo, hi in [(0, 1100), (1100, 2048), (2048, 3000)]]
    assert torch.equal(torch.cat(parts, dim=1), full)
