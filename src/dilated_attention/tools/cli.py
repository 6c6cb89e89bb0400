"""The ``dilated-attention`` command: ``bench``, ``verify`` and ``estimate``.

This module parses arguments and checks them (a user mistake is one line on
stderr and exit status 2, never a traceback), then hands the ranks to the
launcher (``launch``): under ``torchrun`` it joins the launched ranks,
otherwise it spawns its own. The work itself lives in ``bench``, ``verify``
and ``estimate``: each rank runs ``fn(group, *args, progress, device=...)``
and returns a picklable result.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import tempfile
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..validation import STRATEGIES
from . import launch
from .settings import DTYPES, IMPLS, PROG

# Exit statuses: 0 success, 1 a run or a check failed, 2 a user mistake.
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A user mistake: reported as one line, exit status 2."""


class RunFailed(Exception):
    """A rank failed or a check did not pass: reported briefly, exit status 1."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block and exits; we want one line and a code.
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


# --------------------------------------------------------------------------
# Argument types


_SUFFIXES = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def positive_int(text: str) -> int:
    """An int >= 1; accepts k/M/G/T suffixes (powers of 1024), e.g. 64k or 1G."""
    raw = text.strip().lower().replace("_", "")
    scale = 1
    if raw and raw[-1] in _SUFFIXES:
        raw, scale = raw[:-1], _SUFFIXES[raw[-1]]
    try:
        value = int(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_list(text: str) -> List[int]:
    """Comma-separated positive ints (also usable repeatedly via nargs)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def mesh_shape(text: str) -> Tuple[int, int]:
    """ "2x2" -> (2, 2): U head-parallel x S sequence-parallel ranks."""
    parts = text.lower().split("x")
    try:
        u, s = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected UxS (e.g. 2x2), got {text!r}") from None
    if u < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"mesh dimensions must be >= 1, got {text!r}")
    return u, s


def _add_parallel_options(p: argparse.ArgumentParser, *, many: bool) -> None:
    """--strategy and --mesh: how sequence-parallel ranks split the work (issue 12)."""
    nargs = "+" if many else None
    p.add_argument("--strategy", choices=STRATEGIES, nargs=nargs, default=None,
                   help="dilated attention on a one-dimensional group: the exchange of "
                        "selected rows, Ulysses (head all-to-all), or auto (the one whose "
                        "busiest rank sends less; the table says which ran)" +
                        (" (default auto; several compare)" if many else " (default auto)"))
    p.add_argument("--mesh", type=mesh_shape, nargs=nargs, default=None, metavar="UxS",
                   help="a 2-D DeviceMesh of U head-parallel x S sequence-parallel ranks "
                        "(Ulysses over U, the exchange or the ring over S)")


def flatten(lists: Optional[Sequence[Sequence[int]]]) -> Optional[List[int]]:
    """`nargs="+"` of `int_list` values -> one list (``8192 16384`` or ``8192,16384``)."""
    return None if lists is None else [x for part in lists for x in part]


# --------------------------------------------------------------------------
# The parser


def _add_model_options(p: argparse.ArgumentParser, *, many_lengths: bool) -> None:
    """Options shared by bench and estimate: the attention setting."""
    if many_lengths:
        p.add_argument("--seq-lens", type=int_list, nargs="+", metavar="N",
                       help="total sequence lengths (default 8192 16384 32768)")
        p.add_argument("--world-sizes", type=int_list, nargs="+", metavar="P",
                       help="numbers of ranks (default 1 2 4, on CUDA those the GPUs here "
                            "hold; under torchrun: 1, 2, 4, ... up to the launched world size)")
    p.add_argument("--segment-lengths", type=int_list, nargs="+", default=None, metavar="W",
                   help="segment length of each pattern (default 2048 4096, LongNet)")
    p.add_argument("--dilation-rates", type=int_list, nargs="+", default=None, metavar="R",
                   help="dilation rate of each pattern (default 1 2)")
    p.add_argument("--heads", type=positive_int, default=12, help="query heads (default 12)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim (default 64)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="key/value heads, dividing --heads (default: --heads)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--window", type=positive_int, default=None, metavar="L",
                   help="ring attention with a sliding window (--impl ring): each query sees "
                        "the L keys before it (and, without --causal, the L after it); "
                        "sequence-parallel it runs the halo exchange")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Exact LongNet dilated attention and ring attention: benchmark, verify "
                    "and estimate on this machine or a torchrun cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,verify,estimate}")

    bench = sub.add_parser(
        "bench", help="time and measure peak memory per rank over sequence lengths and ranks",
        description="Benchmark on spawned gloo ranks (or the ranks torchrun launched): time, "
                    "peak memory per rank, tokens/s, speedup over one rank, communication per "
                    "rank. Prints one table; writes bench.json and bench.png to --out.",
    )
    _add_model_options(bench, many_lengths=True)
    bench.add_argument("--impl", nargs="+", choices=IMPLS,
                       default=None, help="implementations (default dilated): dilated "
                       "attention (sequence-parallel for P > 1), dense ring attention, plain "
                       "single-device SDPA (dense, P = 1 only)")
    bench.add_argument("--dtype", choices=("auto",) + DTYPES, default="auto",
                       help="default recommended_dtype(device): float32 on CPU; on CUDA bfloat16 from "
                       "compute capability 8.0, float16 on 7.x, float32 below")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="default cuda when available, else cpu")
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--backward", dest="backward", action="store_true",
                      help="time forward + backward")
    mode.add_argument("--forward-only", dest="backward", action="store_false",
                      help="time the forward only (default)")
    bench.set_defaults(backward=False)
    bench.add_argument("--warmup", type=nonnegative_int, default=1, help="warm-up runs (1)")
    bench.add_argument("--repeats", type=positive_int, default=3,
                       help="timed runs; their min, median and max are reported (3)")
    bench.add_argument("--threads", type=positive_int, default=None,
                       help="torch threads per rank (default: cores // ranks, at least 1)")
    bench.add_argument("--seed", type=nonnegative_int, default=0, help="input seed (0)")
    bench.add_argument("--out", default="dilated_attention_bench",
                       help="output folder for bench.json and bench.png (default "
                            "dilated_attention_bench)")
    bench.add_argument("--timeout", type=positive_float, default=3600.0,
                       help="seconds before spawned ranks are stopped (3600)")
    _add_parallel_options(bench, many=True)
    bench.set_defaults(run=_cmd_bench)

    verify = sub.add_parser(
        "verify", help="check sequence-parallel results against one device",
        description="Check that sequence-parallel outputs and gradients equal single-device "
                    "ones, on spawned gloo ranks or the ranks torchrun launched. One line per "
                    "case; exit status 1 if any case fails.",
    )
    verify.add_argument("--world-size", type=positive_int, default=None,
                        help="ranks to spawn (default 4; ignored under torchrun)")
    verify.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                        help="run only these cases (see --list)")
    verify.add_argument("--list", action="store_true", help="list the cases and exit")
    verify.add_argument("--dtype", choices=("auto",) + DTYPES, default="auto",
                        help="default float64 on CPU, float32 on CUDA")
    verify.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    verify.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds before spawned ranks are stopped (600)")
    verify.set_defaults(run=_cmd_verify)

    estimate = sub.add_parser(
        "estimate", help="estimate peak memory per rank and communication per layer",
        description="Estimate (not measure) per-rank peak memory with a breakdown and the "
                    "communication per layer: the real code runs on meta tensors with a fake "
                    "process group of world size P, at the real length or, for long ranks, at "
                    "two shorter ones, extrapolated; traffic is arithmetic.",
    )
    estimate.add_argument("--seq-len", type=positive_int, default=None,
                          help="total length N (required but with --model --fit-memory)")
    estimate.add_argument("--world-size", type=positive_int, default=1, help="ranks P (1)")
    _add_model_options(estimate, many_lengths=False)
    estimate.add_argument("--impl", choices=("dilated", "ring"), default="dilated",
                          help="dilated attention or dense ring attention (dilated)")
    estimate.add_argument("--dtype", choices=DTYPES, default="float32",
                          help="the inputs' (with --model: the parameters') dtype (default "
                               "float32; --device cuda models the fused Triton kernel only in "
                               "bfloat16 and float16, what bench picks on a GPU)")
    estimate.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                          help="the device modelled: its row blocks, launch sizes and kernels "
                               "(default cpu; no GPU is needed)")
    estimate.add_argument("--threads", type=positive_int, default=None,
                          help="CPU kernel threads per rank (default: cores // ranks)")
    emode = estimate.add_mutually_exclusive_group()
    emode.add_argument("--training", dest="training", action="store_true",
                       help="forward + backward")
    emode.add_argument("--forward-only", dest="training", action="store_false",
                       help="forward only (default)")
    estimate.set_defaults(training=None)
    estimate.add_argument("--model", default=None, metavar="base|tiny|CONFIG.json",
                          help="a whole LongNetLM's training step per rank: parameters, "
                               "gradients, AdamW, activations per checkpoint mode, the loss "
                               "chunk, the attention op (a JSON file of LongNetConfig fields; "
                               "{\"preset\": \"base\", ...} starts from a preset)")
    estimate.add_argument("--fit-memory", default=None, metavar="SIZE",
                          help="with --model: the longest N whose step fits SIZE per rank "
                               "(80GB, 24GiB) for each checkpoint mode, P = 1, 2, 4, ... up to "
                               "--world-size")
    estimate.add_argument("--dry-run", action="store_true",
                          help="also run the real code at the real length and count what it "
                               "sends, to compare (slow at billions of rows per rank)")
    _add_parallel_options(estimate, many=False)
    estimate.add_argument("--json", action="store_true", help="print JSON instead of text")
    estimate.set_defaults(run=_cmd_estimate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        args.argv = argv
        if args.command is None:
            raise UsageError("choose a command: bench, verify or estimate (see --help)")
        status = int(args.run(args))
        sys.stdout.flush()  # a reader that left raises here, inside this try, not at exit
        return status
    except BrokenPipeError:
        # `dilated-attention estimate ... | head`: stop quietly, as cat does; stdout onto
        # devnull so that the interpreter's own flush at exit does not raise it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except UsageError as exc:
        _error(_with_dash_hint(str(exc), argv))
        return EXIT_USAGE
    except RunFailed as exc:
        _error(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _with_dash_hint(message: str, argv: Sequence[str]) -> str:
    # argparse reads a value such as -1G or -2x1 (a '-' and a digit, but not a plain number) as
    # an option and says only "expected one argument": name the value it skipped. No flag takes
    # a value below zero, so the value is the mistake.
    match = re.match(r"argument (--[\w-]+): expected (?:one argument|at least one argument)$",
                     message)
    if match is None:
        return message
    at = [i for i, token in enumerate(argv[:-1]) if token == match.group(1)]
    if not at or not re.match(r"-[\d.]", argv[at[-1] + 1]):
        return message
    return f"{message}: {argv[at[-1] + 1]!r} was read as an option (no value here is negative)"


def _error(message: str) -> None:
    # one line, whatever the message holds
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


# --------------------------------------------------------------------------
# Commands: check arguments, then run


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    launched = torchrun_world()
    device = resolve_device(args.device)
    config = _checked(
        bench.make_config, seq_lens=flatten(args.seq_lens), world_sizes=flatten(args.world_sizes),
        segment_lengths=flatten(args.segment_lengths), dilation_rates=flatten(args.dilation_rates),
        heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads, batch=args.batch,
        dtype=args.dtype, device=device, causal=args.causal, backward=args.backward,
        impls=args.impl, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
        seed=args.seed, launched_world_size=launched, strategies=args.strategy,
        meshes=args.mesh, window=args.window,
    )
    if launched is None or os.environ.get("RANK") == "0":  # the rank that writes the results
        writable_folder("--out", args.out, ("bench.json", "bench.png"))
    if launched is None:  # ranks of torchrun's may be on other machines
        _checked(bench.check_room, config, launch.available_memory())
    command = shlex.join([PROG] + args.argv)
    load_before = bench.load_average()  # other processes' load, before ours adds to it
    if launched is not None:
        rows = run_launched(bench.rank_main, config, device=device)
        if rows is None:  # not rank 0: rank 0 reports
            return 0
    else:
        rows = []
        progress = Progress(config.steps, "bench")
        try:
            for world_size in config.world_sizes:
                rows += spawn(bench.rank_main, world_size, (config,), device=device,
                              timeout=args.timeout, threads=config.threads_for(world_size),
                              progress=progress, option="--world-sizes")[0]
        finally:
            progress.close()
    bench.report(rows, config, out_dir=args.out, command=command,
                 load=bench.Load(load_before, bench.load_average()))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import verify

    if args.list:
        for case in verify.CASES:
            print(f"{case.name:28s} {case.description}")
        return 0
    launched = torchrun_world()
    device = resolve_device(args.device)
    world_size = launched or args.world_size or 4
    config = _checked(verify.make_config, world_size=world_size, cases=args.cases,
                      dtype=args.dtype, device=device)
    if launched is not None:
        results = run_launched(verify.rank_main, config, device=device)
        if results is None:
            return 0
    else:
        _checked(launch.check_room, world_size, "--world-size", launch.available_memory())
        progress = Progress(config.steps, "verify")
        try:
            # small cases: a rank stuck on a failed peer gives up after a minute
            results = spawn(verify.rank_main, world_size, (config,), device=device,
                            timeout=args.timeout, threads=1, progress=progress,
                            pg_timeout=60.0, option="--world-size")[0]
        finally:
            progress.close()
    return verify.report(results, config)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from . import estimate

    if args.model is not None or args.fit_memory is not None:
        return _cmd_estimate_model(args)
    if args.seq_len is None:
        raise UsageError("estimate needs --seq-len (or --model with --fit-memory)")
    args.training = bool(args.training)
    config = _checked(
        estimate.make_config, seq_len=args.seq_len, world_size=args.world_size,
        segment_lengths=flatten(args.segment_lengths), dilation_rates=flatten(args.dilation_rates),
        heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads, batch=args.batch,
        dtype=args.dtype, causal=args.causal, training=args.training,
        impl=args.impl, threads=args.threads, device=args.device, strategy=args.strategy,
        mesh=args.mesh, window=args.window,
    )
    if args.dry_run:
        _checked(estimate.check_dry_run, config=config)
    return estimate.report(config, trace=args.dry_run, as_json=args.json)


def _cmd_estimate_model(args: argparse.Namespace) -> int:
    """``estimate --model``: the whole model's training step (tools/estimate/model.py)."""
    from .estimate import model, model_report

    if args.model is None:
        raise UsageError("--fit-memory needs --model")
    if args.training is False:
        raise UsageError("--model estimates a training step: drop --forward-only")
    if (args.seq_len is None) == (args.fit_memory is None):
        raise UsageError("--model needs --seq-len N or --fit-memory SIZE (which searches N), "
                         "one of them")
    if args.fit_memory is not None and args.dry_run:
        raise UsageError("--dry-run runs one length: give --seq-len, not --fit-memory")
    given = [name for name, value, default in (
        ("--segment-lengths", args.segment_lengths, None), ("--dilation-rates",
         args.dilation_rates, None), ("--kv-heads", args.kv_heads, None),
        ("--heads", args.heads, 12), ("--head-dim", args.head_dim, 64),
        ("--causal", args.causal, False), ("--impl", args.impl, "dilated"),
        ("--mesh", args.mesh, None), ("--window", args.window, None)) if value != default]
    if given:
        raise UsageError(f"{', '.join(given)}: the model's config sets the attention with "
                         f"--model (a JSON file of LongNetConfig fields changes it)")
    budget = _checked(model.parse_bytes, text=args.fit_memory) if args.fit_memory else None
    setup = _checked(model.make_setup, model=args.model,
                     seq_len=args.seq_len or args.world_size, world_size=args.world_size,
                     batch=args.batch, dtype=args.dtype, device=args.device,
                     threads=args.threads, strategy=args.strategy)
    return model_report.report(setup, trace=args.dry_run, as_json=args.json, budget=budget)


def writable_folder(option: str, folder: str, files: Sequence[str]) -> None:
    """Create `folder` and check that `files` can be written in it, before a long run
    whose results would otherwise be lost at the end; a UsageError naming `option`."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {folder}: cannot write there ({exc.strerror or exc})") \
            from None
    for name in files:
        path = os.path.join(folder, name)
        if os.path.exists(path) and not os.path.isfile(path):
            raise UsageError(f"{option} {folder}: {path} exists and is not a file")


def _checked(check: Callable, *args: Any, **options: Any) -> Any:
    """Build or check a command's config; its ValueError is a user mistake."""
    try:
        return check(*args, **options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when available else "cpu"; "cuda" must be available."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    return device


# --------------------------------------------------------------------------
# Progress: tqdm when importable, else plain lines on stderr


class Progress:
    """A progress bar over `total` steps on stderr.

    Without tqdm (not installed, or `use_tqdm` False: pass that in ranks
    started by ``launch.spawn``, where tqdm's multiprocessing lock leaked a
    semaphore at exit) it prints a plain line every `every` steps and at the
    last one.
    """

    def __init__(self, total: int, what: str, *, use_tqdm: bool = True, every: int = 1) -> None:
        self.total, self.done, self.what, self.every = total, 0, what, every
        self._bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=what, file=sys.stderr, leave=False,
                                 dynamic_ncols=True)

    def step(self, label: str) -> None:
        """One step finished; `label` names the one that comes next or just ended."""
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        elif self.done % self.every == 0 or self.done == self.total:
            print(f"{self.what}: {self.done}/{self.total} {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --------------------------------------------------------------------------
# Launching ranks (the launcher does the work; failures become RunFailed)


def torchrun_world() -> Optional[int]:
    """The world size torchrun launched, else None; a bad WORLD_SIZE is a usage error."""
    try:
        return launch.torchrun_world_size()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_launched(fn: Callable, config: Any, *, device: str) -> Optional[Any]:
    """`fn` on torchrun's ranks with a progress bar on rank 0; rank 0's result, else None."""
    first = os.environ.get("RANK") == "0"
    progress = Progress(config.steps, fn.__module__.rsplit(".", 1)[-1]) if first else None
    try:
        return launch.run_torchrun(fn, (config,), device=device,
                                   progress=progress.step if progress else None)
    except launch.LaunchFailed as exc:
        raise RunFailed(str(exc)) from exc
    finally:
        if progress is not None:
            progress.close()


def spawn(
    fn: Callable,
    world_size: int,
    args: tuple,
    *,
    device: str,
    timeout: float,
    threads: int,
    progress: Optional[Progress] = None,
    pg_timeout: float = 600.0,
    grace: float = 10.0,
    option: str = "world size",
) -> List[Any]:
    """Run ``fn(group, *args, progress, device=...)`` on `world_size` spawned ranks.

    ``launch.spawn`` with the rank set-up of `device`; ``results[r]`` is
    rank r's. Any failure or the `timeout` deadline kills the remaining
    ranks and raises ``RunFailed`` naming each failed rank's error; ranks the
    machine cannot start, ``RunFailed`` naming `option` (the flag that set the
    world size) and the value.
    """
    try:
        return launch.spawn(
            fn, world_size, args, timeout=timeout, pg_timeout=pg_timeout, grace=grace,
            backend=launch.backend_for(device), threads=threads,
            prepare=launch.device_setup(device),
            on_progress=progress.step if progress is not None else _no_progress,
        )
    except launch.StartFailed as exc:
        raise RunFailed(f"{option} {world_size}: this machine could not start rank {exc.rank} "
                        f"of {world_size} ({exc.reason}); spawn fewer ranks") from None
    except launch.LaunchFailed as exc:
        first = next(iter(exc.errors.values()))
        raise RunFailed(str(exc)) from _Remote(first.traceback)


def _no_progress(label: str) -> None:
    """A progress callback that drops its labels."""


class _Remote(Exception):
    """A rank's traceback, chained to RunFailed for callers that want it."""
