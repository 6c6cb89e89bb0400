"""benchmarks/gpu_suite.py off a GPU: it says so and exits 0; its report and runner work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_suite.py"


def _load(name: str):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, SUITE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def suite():
    return _load("gpu_suite")


def _listed(suite, capsys, *args: str) -> str:
    """What `gpu_suite.py --list ARGS` prints (exit status 0)."""
    assert suite.main(["--list", *args]) == 0
    return capsys.readouterr().out


def _part_commands(suite, capsys, *args: str):
    """The commands `gpu_suite.py --list --part ARGS` prints, one per line after the
    part's name."""
    return [line.strip() for line in _listed(suite, capsys, "--part", *args).splitlines()[1:]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_without_cuda_it_says_so_and_exits_0():
    done = subprocess.run([sys.executable, str(SUITE)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


def test_list_names_every_part(suite, capsys):
    out = _listed(suite, capsys)
    for name in ("tests", "strided", "bench-sdpa", "tiles", "bench-triton", "causal",
                 "memory", "profile"):
        assert f"{name}:" in out
    assert "--schedule geometric" in out and "--max-tokens" in out and "-m cuda" in out
    assert "tune_tiles.py" in out
    # the SDPA path is benchmarked by its kernel's name: auto runs the fused kernel on a GPU
    assert "--backend cuda_cudnn" in out and "--backend auto" not in out


def test_the_causal_part_times_causal_calls_of_the_fused_kernel(suite, capsys):
    commands = _part_commands(suite, capsys, "causal", "--seq-lens", "65536")
    assert len(commands) == 2
    for command, schedule in zip(commands, ("longnet", "geometric")):
        assert "--backend triton" in command and "--causal" in command
        assert f"--schedule {schedule}" in command and "causal" in command.split("--json")[1]


def test_the_dropout_part_times_the_fused_kernels_dropout_against_the_blockwise_kernel(
        suite, capsys):
    commands = _part_commands(suite, capsys, "dropout", "--seq-lens", "8192", "1048576")
    assert len(commands) == 2
    for command, backend in zip(commands, ("triton", "blockwise")):
        assert f"--backend {backend}" in command and "--dropout 0.1" in command
        assert "--schedule longnet" in command and "1048576" not in command


def test_the_fp32_part_times_the_fused_kernel_against_the_sdpa_path(suite, capsys):
    commands = _part_commands(suite, capsys, "fp32", "--seq-lens", "8192", "1048576")
    assert len(commands) == 2
    for command, backend in zip(commands, ("triton", "cuda_efficient")):
        assert command.count("--dtype") == 1 and "--dtype float32" in command
        assert f"--backend {backend}" in command and "--schedule longnet" in command
        assert "--seq-lens 8192 --" in command  # past 256K an fp32 call takes seconds
    assert "fp32:" not in _listed(suite, capsys)


def test_the_tile_order_part_times_the_shipped_tiles_in_both_orders(suite, capsys):
    commands = _part_commands(suite, capsys, "tile-order")
    assert len(commands) == 4 and sum("--causal" in c for c in commands) == 3
    outs = set()
    for command in commands:
        assert "tune_tiles.py" in command and "--order-windows 0 1024" in command
        outs.add(command.split("--out ")[1])
    assert len(outs) == 4  # a report each
    assert "tile-order:" not in _listed(suite, capsys)


def test_report_keeps_parts_and_replaces_a_part_run_again(suite, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    report = tmp_path / "report.md"
    suite.write_report(report, "# header 1\n", {"memory": "## Part: memory\n\nfirst\n"})
    suite.write_report(report, "# header 2\n", {"tests": "## Part: tests\n\nok\n"})
    suite.write_report(report, "# header 3\n", {"memory": "## Part: memory\n\nsecond\n"})
    text = report.read_text()
    assert text.startswith("# header 3")
    # parts in the suite's order, the memory part replaced
    assert text.index("## Part: tests") < text.index("## Part: memory")
    assert "second" in text and "first" not in text
    assert (tmp_path / "out" / "report.md").read_text() == text
    # --out naming the copy itself ($OUT/gpu_suite.md on a device machine) is no error
    copy = tmp_path / "out" / "report.md"
    suite.write_report(copy, "# header 4\n", {"tests": "## Part: tests\n\nagain\n"})
    assert "again" in copy.read_text()


def test_run_records_output_status_and_stops_at_the_timeout(suite):
    output, status, _ = suite.run([sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                                  timeout=60)
    assert output == "hello\n" and status == 3
    output, status, seconds = suite.run([sys.executable, "-c", "import time; time.sleep(30)"],
                                        timeout=1)
    assert status == 124 and "killed after 1 s" in output and seconds < 20


def test_compare_times_this_tree_then_the_baseline_per_schedule(suite, capsys):
    commands = _part_commands(suite, capsys, "compare", "--baseline", "bench-out/base/src",
                              "--seq-lens", "65536")
    assert len(commands) == 4
    for current, baseline, schedule in zip(commands[::2], commands[1::2],
                                           ("longnet", "geometric")):
        assert current.startswith("python benchmarks/bench_single_device.py")
        # the same command, with the other commit's src/ first on the path
        assert baseline.startswith("env PYTHONPATH=") and baseline.split(" ", 2)[1].endswith(
            "bench-out/base/src")
        assert baseline.split(" ", 2)[2] == current.replace("gpu_current", "gpu_baseline")
        assert f"--schedule {schedule}" in current and "--backend triton" in current
    # not in "all": it needs --baseline
    assert "compare:" not in _listed(suite, capsys)


def test_triton_floor_times_the_fused_kernel_against_floors_of_its_own(suite, capsys):
    commands = _part_commands(suite, capsys, "triton-floor", "--seq-lens", "65536")
    assert len(commands) == 2
    for command, schedule in zip(commands, ("longnet", "geometric")):
        assert "--backend triton" in command and "--floor-backend triton" in command
        assert f"--schedule {schedule}" in command and "--no-memory" in command
    # not in "all": a question for after the rest
    assert "triton-floor:" not in _listed(suite, capsys)


def test_sdpa_whole_times_whole_sequence_blocks_with_views_and_copies(suite, capsys):
    commands = _part_commands(suite, capsys, "sdpa-whole", "--seq-lens", "8192", "65536")
    assert len(commands) == 4  # views on, then off; each for both schedules
    for command, views in zip(commands, ("on", "on", "off", "off")):
        assert "--backend cuda_cudnn" in command and f"--strided {views}" in command
        # one block: every row of the longest sequence; only lengths from 64K
        assert f"--block-rows {1 << 30}" in command and "--seq-lens 65536 --" in command
    assert "sdpa-whole:" not in _listed(suite, capsys)


def test_bench_dropout_reaches_the_op_and_its_memory_run(monkeypatch):
    """bench_single_device.py --dropout: the timed op draws dropout masks, and the memory
    subprocess is told the same dropout."""
    bench = _load("bench_single_device")
    monkeypatch.setattr(bench, "SEGMENTS", (32,))
    monkeypatch.setattr(bench, "RATES", (1,))
    q = torch.randn(1, 64, 2, 8)
    plain = bench.op(q, q, q)
    monkeypatch.setattr(bench, "DROPOUT", 0.5)
    assert not torch.equal(bench.op(q, q, q), plain)
    argvs = []
    monkeypatch.setattr(bench.subprocess, "run", lambda argv, **kwargs: argvs.append(argv) or
                        types.SimpleNamespace(stdout="1.0\n"))
    assert bench.measure_memory(64, "float32", False, "longnet", None) == 1.0
    assert argvs[0][argvs[0].index("--dropout") + 1] == "0.5"


def test_short_steps_get_more_turns_than_repeats():
    """bench_single_device.time_cases: at least `repeats` turns, more while they took under
    min_seconds (the GPU suite asks 0.3 s: a millisecond call gets a median of hundreds)."""
    bench = _load("bench_single_device")
    calls = {"a": 0, "b": 0}

    def step(name):
        def run():
            calls[name] += 1
        return run

    times = bench.time_cases({"a": step("a"), "b": step("b")}, repeats=3)
    assert [len(t) for t in times.values()] == [3, 3] and calls == {"a": 4, "b": 4}
    times = bench.time_cases({"a": step("a"), "b": step("b")}, repeats=3, min_seconds=0.05)
    assert 3 < len(times["a"]) == len(times["b"]) <= 1000
    assert times["a"] == sorted(times["a"])


def test_queued_runs_time_several_calls_per_synchronise():
    """bench_single_device.time_cases(queued=K): each run is K calls before one synchronise,
    recorded per call (the op's throughput with the host's work overlapped)."""
    bench = _load("bench_single_device")
    calls = []
    bench.synchronize = lambda: calls.append("sync")

    def step():
        calls.append("call")
        time.sleep(0.01)

    times = bench.time_cases({"a": step}, repeats=2, queued=3)
    # one warm-up call and its synchronise, then per run three calls and one synchronise
    assert calls == ["call", "sync"] + (["call"] * 3 + ["sync"]) * 2
    assert len(times["a"]) == 2 and all(0.01 <= t < 0.5 for t in times["a"])


def test_the_host_only_measurement_runs_anywhere_and_restores_the_kernels():
    """The suite's profile part ends with bench_call_overhead.py --host-only, which runs on
    any machine (CPU tensors, the fused launches stubbed) and puts the real kernels back."""
    bench = _load("bench_call_overhead")
    from dilated_attention import fused

    kernels = fused._kernels
    report = bench.host_only(repeats=2, calls=3, profile_top=0)
    assert fused._kernels is kernels
    lines = report.splitlines()
    assert lines[1].startswith("forward: min ") and lines[2].startswith("forward + backward: ")
    assert all(float(word.rstrip(",")) > 0 for word in lines[1].split()[2:7:2])


def test_the_cpu_measurement_names_each_case_with_its_spread():
    """bench_call_overhead.py --cpu (whole CPU calls at short lengths, against torch's own):
    one line per case and length, each with its min, median and max."""
    bench = _load("bench_call_overhead")
    lines = bench.cpu_calls([16], batch=1, heads=2, repeats=1, calls=1).splitlines()
    names = [line.split(": min ")[0] for line in lines[1:]]
    assert names == [f"n = 16, {name}" for name in (
        "dilated_attention LongNet, forward", "dilated_attention LongNet, forward + backward",
        "dilated_attention one pattern, forward",
        "dilated_attention one pattern, forward + backward",
        "MultiheadDilatedAttention, forward + backward", "tiny LongNetLM training step",
        "torch SDPA, forward", "torch SDPA, forward + backward",
        "torch nn.MultiheadAttention, forward + backward")]
    assert all(", median " in line and ", max " in line for line in lines[1:])


def test_the_timeline_cuts_a_call_into_lead_busy_idle_and_tail():
    """bench_call_overhead.py's timeline (where a synchronised call's time goes, for the GPU
    session that measures it): overlapping device work counts once, idle is the device's
    time between its first and last work, work that starts outside a call is not its."""
    bench = _load("bench_call_overhead")
    calls = [(0.0, 100.0), (100.0, 150.0), (200.0, 210.0)]
    # call 0: work 10-30 and 25-40 (one run: 30 busy), then 60-70 (20 idle before it), its
    # end 30 later; call 1: 120-140 and 145-160 (the latter ending after the call: a tail
    # of -10); call 2: none
    device = [(25.0, 40.0), (10.0, 30.0), (60.0, 70.0), (120.0, 140.0), (145.0, 160.0)]
    parts = bench.split_calls(calls, device)
    assert parts[0] == (10.0, 40.0, 20.0, 30.0)
    assert parts[1] == (20.0, 35.0, 5.0, -10.0)
    assert parts[2] is None


def test_the_timeline_keeps_the_device_annotation_out_of_calls_and_work():
    """A record_function range comes back twice from a CUDA profile: the host's range and
    a user annotation on the device over the kernels it launched, under the same name.
    Counted as a call, it would halve the medians' calls; as device work, it would fill
    the idle time it spans."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench = _load("bench_call_overhead")

    def event(name, start, end, device_type, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                               device_type=device_type, is_user_annotation=annotation)

    events = [event("timeline call 0", 0.0, 100.0, DeviceType.CPU),
              event("timeline call 0", 10.0, 70.0, DeviceType.CUDA, annotation=True),
              event("fused_forward", 10.0, 30.0, DeviceType.CUDA),
              event("fused_forward", 60.0, 70.0, DeviceType.CUDA),
              event("cudaLaunchKernel", 5.0, 8.0, DeviceType.CPU)]
    marks, device = bench.timeline_intervals(events)
    assert marks == [(0.0, 100.0)]
    assert device == [(10.0, 30.0), (60.0, 70.0)]
    assert bench.split_calls(marks, device) == [(10.0, 30.0, 30.0, 30.0)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_useful_work_counts_every_pair_the_patterns_select(causal):
    """bench_single_device's TFLOP/s count the (head, query, key) pairs of the count matrix
    (a pair that two patterns select twice), causal or not, with short last segments,
    segments longer than the sequence and head counts that the rates do not divide."""
    from reference import dilated_counts

    bench = _load("bench_single_device")
    for n, segments, rates, heads in [(64, (16, 32), (1, 2), 4), (50, (12, 20, 80), (1, 3, 5), 3),
                                      (33, (8, 8), (2, 2), 5), (7, (16,), (4,), 2)]:
        want = int(dilated_counts(n, heads, segments, rates, causal).sum())
        assert bench.selected_pairs(n, segments, rates, heads, causal) == want


def test_the_waves_model_starts_each_program_on_the_first_free_slot():
    """tile_order_waves.makespan (BENCHMARKS.md, "Tile order"): programs in order, each
    on the slot that frees first; a launch ending on its heaviest program waits for it."""
    waves = _load("tile_order_waves")
    assert waves.makespan([3, 3, 2, 2, 2], 2) == 7  # 3 | 3, then 2 + 2 | 2
    assert waves.makespan([1, 1, 1, 4], 2) == 5 and waves.makespan([4, 1, 1, 1], 2) == 4
    assert waves.makespan([5], 8) == 5
