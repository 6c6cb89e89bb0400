"""``dilated-attention bench``: time and peak memory per rank, measured.

Every rank builds only its own rows of q, k, v (values depend on the seed and
the global row index only, so every world size sees the same sequence), runs
warm-up passes, then timed passes. What is reported, per (implementation,
sequence length, ranks):

- time: per pass the slowest rank's wall time; min, median and max over the
  passes (a spread above SPREAD_WARNING of the median, or a machine that was
  busy before or during the run, draws a warning: other processes on the
  cores change times, not memory or traffic);
- peak memory per rank: CPU: resident-set high-water mark above the rank's
  baseline (``/proc/self/clear_refs`` + ``VmHWM``, taken after warm-up with
  no inputs alive), so inputs, outputs, workspace, communication buffers and
  saved tensors all count; CUDA: ``torch.cuda.max_memory_allocated`` above
  the baseline. The largest rank's value;
- communication per rank: bytes this rank sent in one pass, counted by
  ``comm.count_communication`` (largest rank).

Notation: b batch, n sequence (N total, n per rank), h heads, hk key/value
heads, d head dim; layout (b, n, h, d).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..distributed import comm
from . import launch
from ..distributed.sharding import piece_lengths, piece_ranges
from ..distributed import strategy as strategies
from ..functional import dilated_attention, ring_attention
from ..backends import recommended_dtype
from ..kernels import lse_dtype
from ..validation import check_strategy
from .estimate.formula import minimum
from .settings import (DEFAULT_SEQ_LENS, DEFAULT_WORLD_SIZES, MB, PROG, AttentionSetting,
                       check_mesh_heads, check_setting, check_window, check_zigzag,
                       default_threads, plural, ring_layout)

# how a case's ranks split the work: ("group", strategy) on a one-dimensional group, or
# ("mesh", (U, S)) on a 2-D mesh (head-parallel x sequence-parallel)
Split = Tuple[str, object]
# Rows per generator block: a rank seeds each block it overlaps from the
# global block index, so no rank materialises the rows of another.
ROW_BLOCK = 1024

# Time warnings: passes whose max - min exceeds this share of the median, and a
# machine whose other processes kept more than this share of the cores busy.
SPREAD_WARNING = 0.2
BUSY_WARNING = 0.5

COLUMNS = (
    ("impl", "implementation", "{}"),
    ("seq_len", "seq len", "{:d}"),
    ("world_size", "ranks", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("time_min_ms", "min (ms)", "{:.1f}"),
    ("time_ms", "median (ms)", "{:.1f}"),
    ("time_max_ms", "max (ms)", "{:.1f}"),
    ("peak_mem_mb", "peak mem/rank (MB)", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("speedup", "speedup vs 1 rank", "{:.2f}"),
    ("comm_mb", "comm/rank (MB)", "{:.2f}"),
    ("comm_wait", "comm wait", "{:.0%}"),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig(AttentionSetting):
    seq_lens: Tuple[int, ...]
    world_sizes: Tuple[int, ...]
    device: str
    backward: bool
    impls: Tuple[str, ...]
    warmup: int
    repeats: int
    threads: Optional[int]
    seed: int
    launched_world_size: Optional[int]
    strategies: Tuple[str, ...] = ("auto",)
    meshes: Tuple[Tuple[int, int], ...] = ()  # (U head-parallel, S sequence-parallel) ranks
    flat_world_sizes: Tuple[int, ...] = ()  # the world sizes run on a 1-D group

    def threads_for(self, world_size: int) -> int:
        """Torch threads per rank: the given number, else ``settings.default_threads``."""
        if self.threads is not None:
            return self.threads
        return default_threads(world_size)

    def cases_for(self, world_size: int) -> List[Tuple[str, int, Split]]:
        """(impl, N, how the ranks split the work) run at this world size: every --strategy
        on a one-dimensional group (the dilated op's; other implementations run once), and
        every --mesh of this many ranks; SDPA runs on one rank only."""
        splits: List[Split] = []
        if world_size in self.flat_world_sizes:
            splits += [("group", strategy) for strategy in self.strategies]
        splits += [("mesh", m) for m in self.meshes if m[0] * m[1] == world_size]
        return [
            (impl, n, split)
            for impl in self.impls
            for n in self.seq_lens
            for split in splits
            if not (impl == "sdpa" and (world_size > 1 or split[0] == "mesh"))
            and not (impl != "dilated" and split[0] == "group" and split != splits[0])
        ]

    @property
    def steps(self) -> int:
        return sum(len(self.cases_for(p)) for p in self.world_sizes)


def make_config(
    *,
    seq_lens: Optional[Sequence[int]] = None,
    world_sizes: Optional[Sequence[int]] = None,
    segment_lengths: Optional[Sequence[int]] = None,
    dilation_rates: Optional[Sequence[int]] = None,
    heads: int = 12,
    head_dim: int = 64,
    kv_heads: Optional[int] = None,
    batch: int = 1,
    dtype: str = "auto",
    device: str = "cpu",
    causal: bool = False,
    backward: bool = False,
    impls: Optional[Sequence[str]] = None,
    warmup: int = 1,
    repeats: int = 3,
    threads: Optional[int] = None,
    seed: int = 0,
    launched_world_size: Optional[int] = None,
    strategies: Optional[Sequence[str]] = None,
    meshes: Optional[Sequence[Tuple[int, int]]] = None,
    window: Optional[int] = None,
) -> BenchConfig:
    """Check the options; raise ValueError naming the option and value on a mistake."""
    segs, rates, kv_heads = check_setting(segment_lengths, dilation_rates, heads, kv_heads)
    seq_lens = tuple(sorted(set(seq_lens or DEFAULT_SEQ_LENS)))
    strategies = tuple(dict.fromkeys(check_strategy(s) for s in (strategies or ("auto",))))
    meshes = tuple(dict.fromkeys(tuple(m) for m in (meshes or ())))
    for mesh in meshes:
        check_mesh_heads(mesh, heads)
    if world_sizes is None and meshes:
        world_sizes = []  # only the meshes' sizes
    elif world_sizes is None:
        if launched_world_size is None:
            # spawned: one process per GPU on CUDA, so the defaults this machine holds
            most = torch.cuda.device_count() if device == "cuda" else DEFAULT_WORLD_SIZES[-1]
            world_sizes = [p for p in DEFAULT_WORLD_SIZES if p <= most] or [1]
        else:  # 1, 2, 4, ... and the launched size itself
            world_sizes = [p for p in (2**i for i in range(31)) if p < launched_world_size]
            world_sizes.append(launched_world_size)
    flat_world_sizes = tuple(sorted(set(world_sizes)))
    if launched_world_size is not None and any(u * sp != launched_world_size
                                               for u, sp in meshes):
        raise ValueError(f"--mesh needs U x S = the {launched_world_size} ranks torchrun "
                         f"launched, got {['%dx%d' % m for m in meshes]}")
    if "ulysses" in strategies:
        for p in flat_world_sizes:
            if p > 1 and heads % p:
                raise ValueError(f"--strategy ulysses at {p} ranks: the ranks must divide the "
                                 f"{heads} query heads (drop --world-sizes {p})")
    world_sizes = tuple(sorted(set(flat_world_sizes) | {u * sp for u, sp in meshes}))
    if launched_world_size is not None and world_sizes[-1] > launched_world_size:
        raise ValueError(
            f"--world-sizes {world_sizes[-1]} exceeds the {launched_world_size} ranks torchrun "
            f"launched"
        )
    if device == "cuda" and launched_world_size is None:
        available = torch.cuda.device_count()
        if world_sizes[-1] > available:
            raise ValueError(
                f"--world-sizes {world_sizes[-1]} needs that many CUDA devices, this machine has "
                f"{available} (use torchrun across machines)"
            )
    if seq_lens[0] < world_sizes[-1]:
        raise ValueError(
            f"world size {world_sizes[-1]} is larger than sequence length {seq_lens[0]}: every "
            f"rank needs at least one row"
        )
    impls = tuple(dict.fromkeys(impls or ("dilated",)))
    if impls == ("sdpa",) and 1 not in world_sizes:
        raise ValueError("--impl sdpa runs on one rank only: include 1 in --world-sizes")
    if dtype == "auto":
        # torch.float32 -> "float32": the config keeps the dtype's name
        dtype = str(recommended_dtype(device)).removeprefix("torch.")
    check_window(window, "ring" in impls)
    if "ring" in impls and causal and window is None:
        for n in seq_lens:
            for p in world_sizes:
                check_zigzag(n, p)
    return BenchConfig(
        seq_lens=seq_lens, world_sizes=world_sizes, segment_lengths=segs, dilation_rates=rates,
        heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch, dtype=dtype,
        device=device, causal=causal, backward=backward, impls=impls, warmup=warmup,
        repeats=repeats, threads=threads, seed=seed, launched_world_size=launched_world_size,
        strategies=strategies, meshes=meshes, flat_world_sizes=flat_world_sizes,
        window=window,
    )


def check_room(config: BenchConfig, free: Optional[int]) -> None:
    """What this machine cannot hold, refused before a rank starts (past its memory the OOM
    killer takes a rank, which then dies without a report, or the machine swaps): the most
    --world-sizes (``launch.check_room``) and, on CPU, the longest --seq-lens, whose inputs
    and outputs alone (the op's contract; the ranks' pieces together, all on this machine)
    and the ranks' own memory pass the `free` bytes (None: unknown, not checked). A lower
    bound of a case's peak: what passes may still not fit (``dilated-attention estimate``).
    A GPU's memory is not asked here (that would open a CUDA context in this process)."""
    launch.check_room(config.world_sizes[-1], "--world-sizes", free)
    if config.device != "cpu" or free is None:
        return
    n, p = config.seq_lens[-1], config.world_sizes[0]
    data = max(sum(phase.values()) for phase in minimum(config, n, config.backward).values())
    need = data + p * launch.RANK_BYTES
    if need > free:
        raise ValueError(
            f"--seq-lens {n}: its inputs and outputs alone take {data / 2**30:.1f} GiB"
            f"{' with the backward' if config.backward else ''} ({need / 2**30:.1f} GiB with "
            f"{plural(p, 'rank')}), more than the {free / 2**30:.1f} GiB this "
            f"machine has free; choose shorter --seq-lens"
        )


# --------------------------------------------------------------------------
# Inputs: each rank builds its own rows only


def make_rows(
    ranges: Sequence[Tuple[int, int]],
    shape: Tuple[int, int, int],
    *,
    seed: int,
    dtype: torch.dtype,
    device,
) -> Tensor:
    """Rows `ranges` of a (b, N, h, d) standard-normal tensor, identical for every layout.

    shape = (b, h, d). The values of global row t come from the generator of
    block t // ROW_BLOCK (seeded by `seed` and the block), so a rank generates
    at most two blocks more than it keeps and never the whole sequence.
    """
    b, h, d = shape
    parts = []
    for lo, hi in ranges:
        for block in range(lo // ROW_BLOCK, -(-hi // ROW_BLOCK)):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + block)
            # (b, ROW_BLOCK, h, d) for block, cut to the rows inside [lo, hi)
            values = torch.randn(b, ROW_BLOCK, h, d, generator=gen)
            start = block * ROW_BLOCK
            parts.append(values[:, max(lo, start) - start : min(hi, start + ROW_BLOCK) - start]
                         .to(device=device, dtype=dtype))
    if not parts:
        return torch.empty(b, 0, h, d, dtype=dtype, device=device)
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------
# Implementations: q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d)


def _dilated(q, k, v, config: BenchConfig, group, strategy: str) -> Tensor:
    return dilated_attention(
        q, k, v, config.segment_lengths, config.dilation_rates, is_causal=config.causal,
        group=group, strategy=strategy,
    )


def _ring(q, k, v, config: BenchConfig, group, strategy: str) -> Tensor:
    return ring_attention(q, k, v, is_causal=config.causal, group=group,
                          layout=_layout("ring", config, group),
                          window_size=config.window_size)


def _sdpa(q, k, v, config: BenchConfig, group, strategy: str) -> Tensor:
    # (b, n, h, d) -> (b, h, n, d) and back: SDPA takes heads second
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=config.causal,
        enable_gqa=config.kv_heads != config.heads,
    )
    return out.transpose(1, 2)


IMPL_FNS: Dict[str, Callable] = {"dilated": _dilated, "ring": _ring, "sdpa": _sdpa}


def _layout(impl: str, config: BenchConfig, group) -> str:
    """The ring's zigzag layout balances causal work on a 1-D group; everything else, a 2-D
    mesh and a sliding window (whose halo exchange is balanced as it is), take contiguous
    pieces."""
    if impl != "ring" or config.window is not None or \
            isinstance(comm.resolve_group(group), comm.Grid):
        return "contiguous"
    return ring_layout(config.causal, comm.group_size(group))


def rank_ranges(impl: str, n: int, group, rank: int, config: BenchConfig):
    """Global row ranges [start, stop) group rank (a mesh's piece) `rank` holds for `impl`."""
    return piece_ranges(n, comm.group_size(group), rank, _layout(impl, config, group))


def strategy_label(impl: str, n: int, split: Split, group, config: BenchConfig) -> str:
    """How the case ran: the strategy ("auto" resolved, from the same model as the op), or
    the mesh shape with what runs over its sequence dimension."""
    ring = "halo" if config.window is not None else "ring"
    if split[0] == "mesh":
        u, sp = split[1]
        inner = "" if sp == 1 else f" x {ring if impl == 'ring' else 'exchange'}"
        return f"{u}x{sp} mesh (ulysses{inner})"
    group = comm.resolve_group(group)
    if impl != "dilated":
        return ring if impl == "ring" and comm.is_distributed(group) else "-"
    p = comm.group_size(group)
    shape = strategies.Shape(tuple(piece_lengths(n, p)), (config.segment_lengths,
                             config.dilation_rates), config.causal, config.heads,
                             config.kv_heads, config.head_dim, config.batch,
                             config.torch_dtype.itemsize, lse_dtype(config.torch_dtype).itemsize,
                             None)
    kind = strategies.choose(split[1], group, shape, "contiguous")
    return f"{kind} (auto)" if split[1] == "auto" and kind != "local" else kind


# --------------------------------------------------------------------------
# Measuring one rank


def _proc_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of this process above a baseline: RSS high-water mark (CPU) or CUDA allocator."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.base: Optional[int] = None

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        rss = _proc_status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            rss = None
        self.base = None if rss is None else rss * 1024

    def peak_bytes(self) -> Optional[int]:
        """Bytes above the baseline at the highest point since `start` (None: cannot measure)."""
        if self.base is None:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        hwm = _proc_status_kib("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self.base)


def _build_inputs(impl, n, group, config: BenchConfig, device):
    """This rank's q, k, v (and dout when training), requiring grad when training."""
    ranges = rank_ranges(impl, n, group, comm.group_rank(group), config)
    dtype = config.torch_dtype
    b, h, hk, d = config.batch, config.heads, config.kv_heads, config.head_dim
    # three independent streams of rows: one seed offset per tensor
    q = make_rows(ranges, (b, h, d), seed=4 * config.seed, dtype=dtype, device=device)
    k = make_rows(ranges, (b, hk, d), seed=4 * config.seed + 1, dtype=dtype, device=device)
    v = make_rows(ranges, (b, hk, d), seed=4 * config.seed + 2, dtype=dtype, device=device)
    if not config.backward:
        return q, k, v, None
    dout = make_rows(ranges, (b, h, d), seed=4 * config.seed + 3, dtype=dtype, device=device)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _one_pass(fn, inputs, config: BenchConfig, group, strategy: str) -> None:
    q, k, v, dout = inputs
    if dout is None:
        with torch.no_grad():
            fn(q, k, v, config, group, strategy)
        return
    out = fn(q, k, v, config, group, strategy)
    out.backward(dout)
    del out
    for x in (q, k, v):
        x.grad = None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(impl: str, n: int, group, config: BenchConfig, device: str,
             split: Split = ("group", "auto")) -> Dict[str, object]:
    """Measure one (impl, N) on the ranks of `group` (None: one rank; a 2-D mesh: a piece
    per mesh rank) split as `split` says; every rank gets the row."""
    world_size = comm.group_size(group)
    strategy = split[1] if split[0] == "group" else "auto"
    fn = IMPL_FNS[impl]
    inputs = _build_inputs(impl, n, group, config, device)
    for _ in range(config.warmup):
        _one_pass(fn, inputs, config, group, strategy)
    del inputs
    memory = PeakMemory(device)
    comm.barrier(group)
    memory.start()
    inputs = _build_inputs(impl, n, group, config, device)
    times, waits, comm_bytes, comm_messages = [], [], 0, 0
    for i in range(config.repeats):
        comm.barrier(group)
        _sync(device)
        start = time.perf_counter()
        with comm.count_communication() as stats:
            _one_pass(fn, inputs, config, group, strategy)
        _sync(device)
        times.append(time.perf_counter() - start)
        waits.append(stats.wait_seconds / times[-1])
        if i == 0:
            comm_bytes, comm_messages = stats.bytes_sent, stats.messages
    peak = memory.peak_bytes()
    del inputs
    # per pass the slowest rank; peak and traffic of the largest rank (-1: not measurable)
    # the share of a pass this rank spent waiting on transfers overlap did not hide
    wait_share = statistics.median(waits)
    summary = torch.tensor(
        times + [float(-1 if peak is None else peak), float(comm_bytes), float(comm_messages),
                 wait_share],
        dtype=torch.float64, device=device,
    )
    comm.all_reduce_(summary, group, op="max")
    summary = summary.tolist()
    times = summary[: config.repeats]
    peak_max, bytes_max, messages_max, wait_max = summary[config.repeats:]
    seconds = statistics.median(times)
    return {
        "impl": impl,
        "seq_len": n,
        "world_size": world_size,
        "strategy": strategy_label(impl, n, split, group, config),
        "time_ms": seconds * 1e3,
        "time_min_ms": min(times) * 1e3,
        "time_max_ms": max(times) * 1e3,
        "peak_mem_mb": None if peak_max < 0 else peak_max / MB,
        "tokens_per_s": config.batch * n / seconds,
        "speedup": None,
        "comm_mb": bytes_max / MB,
        "comm_messages": int(messages_max),
        "comm_wait": wait_max,
        "rows_per_rank": max(hi - lo for p in range(world_size)
                             for lo, hi in rank_ranges(impl, n, group, p, config)),
        "times_ms": [t * 1e3 for t in times],
        "threads": torch.get_num_threads(),
    }


def rank_main(world, config: BenchConfig, progress: Callable[[str], None], *, device: str):
    """Run every case of this launch; rank 0 returns the rows, other ranks []."""
    world_size = comm.group_size(world)
    me = comm.group_rank(world)
    sizes = (world_size,) if config.launched_world_size is None else config.world_sizes
    rows = []
    for p in sizes:
        if p == world_size:
            group = world
        else:  # every rank of the launch creates the subgroup of ranks 0..p-1
            group = launch.new_group(list(range(p)))
        if me < p:
            for impl, n, split in config.cases_for(p):
                on = group if p > 1 else None
                if split[0] == "mesh":  # every rank of the launch (p of them) builds it
                    on = launch.init_device_mesh(split[1], device_type=device)
                row = run_case(impl, n, on, config, device, split)
                if me == 0:
                    rows.append(row)
                    progress(f"{impl} N={n} P={p} {row['strategy']}")
        comm.barrier(world)
    return rows


# --------------------------------------------------------------------------
# Report: one table, JSON rows, a plot


def add_speedups(rows: List[Dict[str, object]]) -> None:
    """speedup = time at one rank / time at P ranks, for the same impl and N."""
    single = {(r["impl"], r["seq_len"]): r["time_ms"] for r in rows if r["world_size"] == 1}
    for r in rows:
        base = single.get((r["impl"], r["seq_len"]))
        r["speedup"] = None if base is None else base / r["time_ms"]


def format_table(rows: List[Dict[str, object]]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(key) is None else fmt.format(r[key])
                      for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for j, row in enumerate(cells):
        # first column left-aligned, numbers right-aligned
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(config: BenchConfig, rows: List[Dict[str, object]]) -> str:
    # the threads the ranks really ran with (torchrun sets its own)
    threads = ", ".join(sorted({f"P={r['world_size']}: {r['threads']}" for r in rows}))
    pattern = f"segments {list(config.segment_lengths)}, rates {list(config.dilation_rates)}"
    window = "" if config.window is None else f"; ring: window_size {config.window_size}"
    return (
        f"measured on {config.device} ({config.dtype}, "
        f"{'forward + backward' if config.backward else 'forward only'}"
        f"{', causal' if config.causal else ''}); batch {config.batch}, {config.heads} heads x "
        f"{config.head_dim} (kv heads {config.kv_heads}); dilated: {pattern}{window}; torch "
        f"threads per rank {threads}. time: min, median and max over {plural(config.repeats, 'pass', 'passes')} "
        f"(each the slowest rank's); memory: peak above the rank's baseline, largest rank; comm: "
        f"bytes sent per pass, largest rank; comm wait: share of a pass a rank waited on "
        f"transfers (median), largest rank."
    )


class Load(NamedTuple):
    """The machine's load averages (1, 5, 15 minutes) before and after the runs (None: the
    platform has none). Other processes on the cores change times, so bench records them."""

    before: Optional[Tuple[float, float, float]]
    after: Optional[Tuple[float, float, float]]


def load_average() -> Optional[Tuple[float, float, float]]:
    """``os.getloadavg()``, or None where the platform has none (Windows)."""
    try:
        return tuple(os.getloadavg())  # type: ignore[return-value]
    except (AttributeError, OSError):
        return None


def time_warnings(rows: List[Dict[str, object]], load: Load, cores: int) -> List[str]:
    """One line per reason to distrust the times: a wide spread of passes, a busy machine.

    Busy: the 1-minute load average before the runs, or after them less the
    threads the largest run itself used, exceeds BUSY_WARNING of the cores
    (other processes then share the cores with the ranks).
    """
    out = []
    wide = [(r, (r["time_max_ms"] - r["time_min_ms"]) / r["time_ms"]) for r in rows
            if r["time_ms"] > 0]
    wide = [(r, spread) for r, spread in wide if spread > SPREAD_WARNING]
    if wide:
        r, spread = max(wide, key=lambda x: x[1])
        out.append(
            f"the passes of {len(wide)} of {plural(len(rows), 'row')} differ by more than "
            f"{SPREAD_WARNING:.0%} of their median (up to {spread:.0%}: {r['impl']} "
            f"N={r['seq_len']} P={r['world_size']}): compare times with care, or raise --repeats"
        )
    own = max((r["world_size"] * r["threads"] for r in rows), default=0)
    others = [x for x in (load.before and load.before[0],
                          load.after and load.after[0] - own) if x is not None]
    if others and max(others) > BUSY_WARNING * cores:
        out.append(
            f"the machine was busy (1-minute load average {max(others):.1f} from other "
            f"processes on {plural(cores, 'core')}): times are unreliable, memory and traffic "
            f"are not affected"
        )
    return out


def report(rows: List[Dict[str, object]], config: BenchConfig, *, out_dir: str, command: str,
           load: Load = Load(None, None)) -> None:
    """Print the table and any time warnings (stderr); write bench.json and bench.png (when
    matplotlib is installed)."""
    add_speedups(rows)
    warnings = time_warnings(rows, load, os.cpu_count() or 1)
    print(describe(config, rows))
    print(format_table(rows))
    for line in warnings:
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "bench.json")
    with open(json_path, "w") as f:
        json.dump(
            {
                "command": command,
                "config": dataclasses.asdict(config),
                "environment": _environment(config, load),
                "warnings": warnings,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {json_path}")
    plot_path = os.path.join(out_dir, "bench.png")
    if plot(rows, config, plot_path):
        print(f"wrote {plot_path}")
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")


def _environment(config: BenchConfig, load: Load) -> Dict[str, object]:
    env: Dict[str, object] = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": load._asdict(),
    }
    if config.device == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name()
    return env


# x axis of the plot -> (axis title, how a series of the other axis is labelled)
_AXES = {"seq_len": ("sequence length N", "N={:,}"), "world_size": ("ranks P", "P={}")}


def plot_series(rows: List[Dict[str, object]]) -> Tuple[str, Dict[str, List[Dict[str, object]]]]:
    """(x axis, {label: rows in x order}): one line per implementation and value of the other
    axis. The x axis is N, or P when every row has the same N (against N the ranks would
    stack over one x value)."""
    one_length = len({r["seq_len"] for r in rows}) == 1
    axis = "world_size" if one_length and len({r["world_size"] for r in rows}) > 1 else "seq_len"
    other = "seq_len" if axis == "world_size" else "world_size"
    grouped: Dict[Tuple[str, int], List[Dict[str, object]]] = {}
    # strategies compared (--strategy, --mesh) get a line each
    several = len({r.get("strategy") for r in rows if r["world_size"] > 1}) > 1
    for r in rows:
        name = f"{r['impl']} {r['strategy']}" if several and r["world_size"] > 1 else r["impl"]
        grouped.setdefault((name, r[other]), []).append(r)
    label = _AXES[other][1]
    return axis, {f"{impl}, {label.format(value)}": sorted(points, key=lambda r: r[axis])
                  for (impl, value), points in sorted(grouped.items())}


def zero_traffic_note(series: Dict[str, List[Dict[str, object]]]) -> Optional[str]:
    """The communication panel's note naming the lines that send nothing, and why (None when
    every line sends something): lines at 0 lie on one another and on the axis."""
    zero = [label for label, points in series.items() if not any(r["comm_mb"] for r in points)]
    if not zero:
        return None
    return (f"at 0 MB: {'; '.join(zero)}\n(one rank, or segments that stay inside a rank's "
            f"piece: nothing is sent)")


def plot(rows: List[Dict[str, object]], config: BenchConfig, path: str) -> bool:
    """Time (median, min-max bars), per-rank peak memory and per-rank traffic against N or P
    (``plot_series``), one line per implementation and value of the other."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    axis, series = plot_series(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (label, points) in enumerate(series.items()):
        xs = [r[axis] for r in points]
        times = [r["time_ms"] for r in points]
        # a marker shape per line, and each later line's markers smaller: lines that
        # coincide (several at 0 MB of traffic) stay visible inside one another
        style = dict(marker="osD^vP*X"[i % 8], markersize=max(3.0, 9.0 - 1.5 * i), label=label)
        # bars from the fastest to the slowest pass
        bars = [[t - r["time_min_ms"] for t, r in zip(times, points)],
                [r["time_max_ms"] - t for t, r in zip(times, points)]]
        axes[0].errorbar(xs, times, yerr=bars, capsize=3, **style)
        mem = [(x, r["peak_mem_mb"]) for x, r in zip(xs, points) if r["peak_mem_mb"] is not None]
        if mem:
            axes[1].plot(*zip(*mem), **style)
        axes[2].plot(xs, [r["comm_mb"] for r in points], **style)
    note = zero_traffic_note(series)
    if note is not None:
        axes[2].text(0.02, 0.97, note, transform=axes[2].transAxes, va="top", fontsize=7)
    top = max((r["comm_mb"] for r in rows), default=0.0) or 1.0
    titles = ("time (ms): median, min to max", "peak memory per rank (MB)",
              "communication per rank per pass (MB)")
    for ax, ylabel in zip(axes, titles):
        ax.set_xscale("log", base=2)
        if axis == "world_size":  # 1, 2, 4 rather than 2^0, 2^1, 2^2
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
                lambda x, _: f"{x:g}"))
        if ax is not axes[2]:
            ax.set_yscale("log")
        else:  # traffic is often 0: a linear scale, 0 lifted off the axis (room for the note)
            ax.set_ylim(-0.05 * top, 1.35 * top)
        ax.set_xlabel(_AXES[axis][0])
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no rows (nothing ran): no legend to draw
            ax.legend(fontsize=8)
    mode = "forward + backward" if config.backward else "forward"
    fig.suptitle(f"dilated-attention bench: {config.device}, {config.dtype}, {mode}, "
                 f"{config.heads}x{config.head_dim} heads (measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
