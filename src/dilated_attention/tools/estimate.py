"""``dilated-attention estimate``: per-rank peak memory and traffic, without running.

Two independent estimates of the same quantities, both labelled estimates:

- **formula**: the memory accounting of docs/memory.md ("Memory: row blocks")
  evaluated on the op's plan geometry: which segments span ranks and how
  many (row, kv head) pairs each transfer carries (``make_plan``, pure
  arithmetic on the piece lengths; index tensors on ``meta``, no data).
  Live bytes are summed per phase of the op (local launches, exchange
  rounds, casts; forward, then backward when training) and the largest
  phase is the peak.
- **dry run**: the op's executor (under its validation) runs on ``meta``
  tensors with a fake process group of world size P
  (``init_process_group("fake")``), under a ``TorchDispatchMode`` that adds
  each new tensor storage's bytes when an op creates it and subtracts them
  when the storage is freed; the highest sum is the peak. Traffic is what
  ``comm.count_communication`` counts. Two shortcuts keep it fast and leave
  the bytes as they are (``LiveBytes``, ``compact_plan``).

``--device`` picks what is modelled: CPU or CUDA row blocks and launch sizes
(``plan.ROWS_PER_BLOCK``, ``plan.ROWS_PER_LAUNCH``), merge slices
(``launches.SLICE_ELEMENTS``) and kernels (the CPU flash op; on CUDA the
kernel ``kernels.select_backend`` picks on a compute capability 9.0 GPU:
cuDNN for bf16/fp16, the memory-efficient op for fp32). No GPU is needed:
the dry run plans for the device type while its tensors stay on meta. (Its
merges run in the CPU's slices: the executor takes the slice size from the
tensors' device. That changes only the temporaries of merges of selected
rows, a few MB.)

Neither method sees memory inside a kernel: the CPU flash kernel's
per-thread scratch buffers (about a megabyte per thread), or the CUDA
kernels' workspace; both add the same modelled term for it
(``kernel_scratch``).

Notation: b batch, N total rows, P ranks, n this rank's rows, h heads, hk
key/value heads, d head dim, s bytes per element of the dtype, a bytes per
accumulator element (4; 8 for float64).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import launches
from ..dilated import IMPLEMENTATIONS
from ..distributed import comm
from ..distributed import strategy as strategies
from ..distributed.ring import SubBlocks
from ..distributed.sequence_parallel import sp_backward, sp_forward
from ..distributed.sharding import piece_lengths
from ..distributed.ulysses import HeadSplit
from ..functional import dilated_attention, ring_attention
from ..kernels import KernelOptions, lse_dtype
from ..launches import (BACKWARD_KINDS, SLICE_ELEMENTS, FORWARD_KINDS, Blocks, Kind,
                        count_writers, in_output)
from ..patterns import Heads, is_view
from ..plan import Launch, Layout, Plan, make_plan, work
from ..validation import check_strategy
from .settings import MB, check_setting, check_zigzag, default_threads, plural, ring_layout

# CPU flash kernel blocking (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp):
# query blocks of 256 rows (64 below 768 rows, 32 below 192), key blocks of 512.
_KV_SPLIT = 512


# Breakdown categories, in print order.
SHARDS = "q/k/v shards"
DOUT = "output gradient shard (dout)"
OUTPUT = "output shard (out, lse)"
SAVED = "saved for backward (out, lse)"
GRADS = "gradient shards (dq, dk, dv)"
COMM = "communication buffers"
OWN = "own rows, every head (q, k, v[, dout])"
A2A = "head all-to-all buffers (send and receive)"
WORKSPACE = "kernel workspace (gathers, launch outputs)"
SCRATCH = "CPU kernel scratch (modelled)"
CUDA_SCRATCH = "CUDA kernel workspace (modelled)"

DEVICES = ("cpu", "cuda")
# The CUDA kernels' own workspace beyond their outputs (cuDNN's and flash's
# forward keep their tiles on chip; cuDNN asks the allocator for a small
# workspace): an assumption, see cuda_workspace.
CUDA_WORKSPACE = 8 << 20


@dataclasses.dataclass(frozen=True)
class EstimateConfig:
    seq_len: int
    world_size: int
    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    heads: int
    head_dim: int
    kv_heads: int
    batch: int
    dtype: str
    causal: bool
    training: bool
    impl: str
    threads: int
    device: str = "cpu"
    strategy: str = "auto"
    mesh: Optional[Tuple[int, int]] = None  # (U head-parallel, S sequence-parallel)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def patterns(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        if self.impl == "ring":  # dense attention: one segment of N, rate 1
            return (self.seq_len,), (1,)
        return self.segment_lengths, self.dilation_rates

    @property
    def layout(self) -> str:
        return ring_layout(self.causal, self.world_size) if self.impl == "ring" else "contiguous"

    def lengths(self) -> Tuple[int, ...]:
        return tuple(piece_lengths(self.seq_len, self.world_size, self.layout))


def make_config(
    *,
    seq_len: int,
    world_size: int = 1,
    segment_lengths: Optional[Sequence[int]] = None,
    dilation_rates: Optional[Sequence[int]] = None,
    heads: int = 12,
    head_dim: int = 64,
    kv_heads: Optional[int] = None,
    batch: int = 1,
    dtype: str = "float32",
    causal: bool = False,
    training: bool = False,
    impl: str = "dilated",
    threads: Optional[int] = None,
    device: str = "cpu",
    strategy: Optional[str] = None,
    mesh: Optional[Tuple[int, int]] = None,
) -> EstimateConfig:
    """Check the options; ValueError names the option and value on a mistake."""
    segs, rates, kv_heads = check_setting(segment_lengths, dilation_rates, heads, kv_heads)
    strategy = check_strategy(strategy or "auto")
    if mesh is not None:
        u, sp = mesh
        if world_size not in (1, u * sp):
            raise ValueError(f"--mesh {u}x{sp} is {u * sp} ranks, but --world-size is "
                             f"{world_size}")
        world_size = u * sp
        if strategy == "exchange":
            raise ValueError("--strategy exchange needs a one-dimensional group: a --mesh runs "
                             "Ulysses over its first dimension")
        HeadSplit.of(u, heads, kv_heads)  # the heads must split over U
    elif strategy == "ulysses":
        if impl == "ring":
            raise ValueError("--strategy is the dilated op's; Ulysses for the ring: --mesh Px1")
        HeadSplit.of(world_size, heads, kv_heads)
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and threads is not None:
        raise ValueError(f"--threads {threads} sets CPU kernel threads: it does not apply to "
                         f"--device cuda")
    if world_size > seq_len:
        raise ValueError(
            f"world size {world_size} is larger than sequence length {seq_len}: every rank "
            f"needs at least one row"
        )
    if impl == "ring" and causal:
        check_zigzag(seq_len, world_size)
    if threads is None:
        threads = default_threads(world_size)
    return EstimateConfig(
        seq_len=seq_len, world_size=world_size, segment_lengths=segs, dilation_rates=rates,
        heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch, dtype=dtype,
        causal=causal, training=training, impl=impl, threads=threads, device=device,
        strategy=strategy, mesh=mesh,
    )


@dataclasses.dataclass
class Estimate:
    """Peak bytes of the largest rank, its breakdown, and that rank's traffic per layer."""

    method: str
    rank: int
    peak_bytes: int
    phase: str
    breakdown: Dict[str, int]
    forward_bytes: int
    forward_messages: int
    backward_bytes: int
    backward_messages: int
    seconds: float = 0.0
    traffic_rank: int = 0


# --------------------------------------------------------------------------
# The formula


def _sizes(config: EstimateConfig) -> Tuple[int, int]:
    """(s, a): bytes per element of the dtype and of the fp32/fp64 accumulators."""
    dtype = config.torch_dtype
    return torch.empty(0, dtype=dtype).element_size(), 8 if dtype == torch.float64 else 4


def kernel_scratch(config: EstimateConfig, plan=None) -> Tuple[str, int]:
    """(breakdown label, bytes): the kernels' own memory for the largest launch, which no
    tracing sees (``cpu_scratch`` or ``cuda_workspace``)."""
    if config.device == "cuda":
        return CUDA_SCRATCH, cuda_workspace(config, plan)
    return SCRATCH, cpu_scratch(config, plan)


def cpu_scratch(config: EstimateConfig, plan=None) -> int:
    """The CPU flash kernel's own buffers for the largest launch (not seen by tracing).

    Forward: threads x (qs*ks + 2 qs + qs*d) accumulators, plus qs*ks in the
    dtype for bf16/fp16; backward: threads x 2 qs*ks more, and one buffer the
    size of the launch's q in the dtype (measured: the op's dq accumulation).
    qs, ks: the kernel's query and key block sizes (256 and 512 rows for
    long launches).
    """
    s, a = _sizes(config)
    rows = config.seq_len // config.world_size
    if plan is not None:
        rows = max((_launch_size(l)[0] for blk in plan.blocks for l in blk.forward), default=rows)
    qs = 256 if rows >= 768 else 64 if rows >= 192 else 32
    qs, ks = min(qs, rows), min(_KV_SPLIT, rows)
    per_thread = (qs * ks + 2 * qs + qs * config.head_dim) * a
    if s < a:  # reduced-precision copy of the score block
        per_thread += qs * ks * s
    extra = 0
    if config.training:
        per_thread += 2 * qs * ks * a
        extra = max((config.batch * _launch_size(l)[0] * _launch_size(l)[2] * config.head_dim * s
                     for blk in (plan.blocks if plan is not None else ()) for l in blk.forward),
                    default=0)
    return config.threads * per_thread + extra


def cuda_workspace(config: EstimateConfig, plan=None) -> int:
    """The CUDA kernels' own memory (cuDNN, flash, memory-efficient), modelled.

    Forward: CUDA_WORKSPACE (a few MB: the fused kernels keep their blocks on
    chip; their out and lse are launch outputs, counted as such). Backward:
    CUDA_WORKSPACE plus, for the largest launch, an fp32 accumulator of dq
    and an fp32 row statistic (sum(dout * out)) per query row and head: the
    flash-style backward kernels accumulate dq in fp32 across key blocks.
    """
    if not config.training:
        return CUDA_WORKSPACE
    rows_heads = _largest_launch(config, plan)
    return CUDA_WORKSPACE + config.batch * rows_heads * (config.head_dim + 1) * 4


def _largest_launch(config: EstimateConfig, plan=None) -> int:
    """Query rows x heads of the plan's largest launch (without a plan: the rank's rows)."""
    if plan is None:
        return -(-config.seq_len // config.world_size) * config.heads
    return max((_launch_size(l)[0] * _launch_size(l)[2] for blk in plan.blocks
                for l in blk.forward), default=0)


# --------------------------------------------------------------------------
# Ulysses and 2-D meshes: the head all-to-all around the op over the heads' ranks


def _shape(config: EstimateConfig) -> strategies.Shape:
    return strategies.Shape(config.lengths(), config.patterns, config.causal, config.heads,
                            config.kv_heads, config.head_dim, config.batch,
                            config.torch_dtype.itemsize, lse_dtype(config.torch_dtype).itemsize,
                            None)


def split(config: EstimateConfig) -> Tuple[int, int]:
    """(U head-parallel, S sequence-parallel) ranks: the mesh, or strategy.choose's decision."""
    if config.mesh is not None:
        return config.mesh
    p = config.world_size
    if p == 1 or config.impl == "ring" or config.strategy == "exchange":
        return 1, p
    if config.strategy == "ulysses" or strategies.auto_choice(_shape(config)) == "ulysses":
        return p, 1
    return 1, p


def strategy_name(config: EstimateConfig) -> str:
    u, sp = split(config)
    inner = "ring" if config.impl == "ring" else "exchange"
    if u == 1:
        name = inner if sp > 1 else "local"
    else:
        name = f"{u}x{sp} (ulysses" + (f" x {inner})" if sp > 1 else ")")
    return name + (" (auto)" if config.strategy == "auto" and config.mesh is None and
                   config.impl == "dilated" and config.world_size > 1 else "")


def _inner(config: EstimateConfig) -> EstimateConfig:
    """The op over the S sequence-parallel ranks after the all-to-all: all N rows split in S
    blocks, h / U query heads and the key/value heads the busiest rank reads."""
    u, sp = split(config)
    heads = config.heads // u
    hk = max(len(HeadSplit.of(u, config.heads, config.kv_heads).kv(r)) for r in range(u))
    return dataclasses.replace(config, world_size=sp, heads=heads,
                               kv_heads=hk if heads % hk == 0 else heads, mesh=None,
                               strategy="exchange",
                               threads=config.threads)


def _ulysses_formula(config: EstimateConfig) -> Estimate:
    """The op over the heads' ranks (``_inner``) plus what Ulysses adds around it: this rank's
    own rows of every head (inputs, output, dout, gradients: the all-to-alls' ends), and the
    send and receive buffers of the largest all-to-all (the stacked k and v, or q)."""
    inner = formula(_inner(config))
    u, sp = split(config)
    b, d = config.batch, config.head_dim
    s, a = _sizes(config)
    n = max(config.lengths())
    h, hk = config.heads, config.kv_heads
    own = b * n * (h + 2 * hk) * d * s + (b * n * h * d * s if config.training else 0)
    out_own = b * n * h * (d * s + a)  # this rank's out and lse
    buffers = 2 * b * n * max(h, 2 * hk) * d * s  # the largest all-to-all's send and receive
    heads = {k: v for k, v in inner.breakdown.items()}
    if config.training:
        # the caller holds out through backward; the all-to-all back of dq, dk, dv runs
        # while the heads' gradients are alive (the rest the heads' op saved is freed)
        base = own + out_own
        # at the all-to-all of dk, dv: dq (of the heads or already this rank's), the heads'
        # dk, dv stacked for the wire, and two of its send buffer, receive buffer and the
        # rank's dk, dv cut from it (the same sizes as the heads': U divides hk, or about)
        ends = {"dq (the heads' or this rank's)": b * n * h * d * s,
                "heads' dk, dv, stacked": b * n * 2 * hk * d * s}
        buffers = 2 * b * n * 2 * hk * d * s
    else:
        # the all-to-all back of out and lse, while the heads' inputs and output are alive
        base = own
        ends = {"heads' " + k: heads.get(k, 0) for k in (SHARDS, OUTPUT)}
        ends[OUTPUT] = out_own
    at_ends = sum(ends.values()) + buffers
    if at_ends > inner.peak_bytes:
        breakdown = {OWN: own, **({OUTPUT: out_own} if config.training else {}), **ends,
                     A2A: buffers}
        phase = "the all-to-all back"
    else:
        breakdown = {OWN: own, **({OUTPUT: out_own} if config.training else {}),
                     **{f"heads' {k}": v for k, v in heads.items()}}
        phase = inner.phase
    shape = _shape(config)
    traffic = max(strategies.traffic("ulysses", shape, (u, sp)))
    backward = 0
    if config.training:
        # a loss of out alone, as the dry run's: the gradients of the forward's all-to-alls
        # but the lse's, after a flag all-reduce (which gradients exist: 2 int32), and the
        # inner strategy's backward beyond its forward
        flag = 2 * (u - 1) * 8 // u
        backward = (max(strategies.traffic("ulysses", shape, (u, sp), lse=False)) + flag
                    + inner.backward_bytes - inner.forward_bytes)
    return Estimate(
        "formula", inner.rank, base + max(inner.peak_bytes, at_ends), phase, breakdown,
        traffic, 4 + inner.forward_messages, backward,
        (4 + inner.backward_messages) if config.training else 0,
    )


def formula(config: EstimateConfig) -> Estimate:
    """Peak per rank from the accounting of docs/memory.md, largest over ranks."""
    start = time.perf_counter()
    if split(config)[0] > 1:
        best = _ulysses_formula(config)
        best.seconds = time.perf_counter() - start
        return best
    lengths = config.lengths()
    if config.impl == "ring":
        candidates = [_ring_formula(config, lengths, r) for r in _ranks_to_check(config)]
    else:
        candidates = [_dilated_formula(config, lengths, r) for r in _ranks_to_check(config)]
    best = _largest(candidates)
    best.seconds = time.perf_counter() - start
    return best


def _largest(estimates: List[Estimate]) -> Estimate:
    """The rank with the highest peak, with the traffic of the rank that sends most."""
    best = max(estimates, key=lambda e: e.peak_bytes)
    busiest = max(estimates, key=lambda e: (e.forward_bytes + e.backward_bytes, e.rank))
    best.forward_bytes, best.forward_messages = busiest.forward_bytes, busiest.forward_messages
    best.backward_bytes, best.backward_messages = busiest.backward_bytes, busiest.backward_messages
    best.traffic_rank = busiest.rank
    return best


def _ranks_to_check(config: EstimateConfig) -> List[int]:
    """Every rank for small P; else the ranks whose pieces differ (ends, neighbours, middle)."""
    p = config.world_size
    if p <= 8:
        return list(range(p))
    return sorted({0, 1, 2, p // 2, p - 3, p - 2, p - 1})


def _phases_to_estimate(
    method: str, rank: int, phases: Dict[str, Dict[str, int]], traffic: Tuple[int, int, int, int],
    scratch: Tuple[str, int],
) -> Estimate:
    """The phase with most live bytes is the peak; its components are the breakdown, plus the
    kernels' own memory (`scratch`: label, bytes)."""
    name, parts = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    parts = {k: v for k, v in parts.items() if v}
    parts[scratch[0]] = scratch[1]
    return Estimate(method, rank, sum(parts.values()), name, parts, *traffic)


class _Shapes:
    """Byte sizes of (b, rows, heads, d) blocks for one config."""

    def __init__(self, config: EstimateConfig) -> None:
        self.b, self.h, self.hk, self.d = (config.batch, config.heads, config.kv_heads,
                                           config.head_dim)
        self.s, self.a = _sizes(config)
        self.chunk = SLICE_ELEMENTS[config.device]  # elements per merge or scatter slice
        # the aten CUDA kernels take as many K/V heads as query heads (kernels._repeat_kv)
        self.repeats_kv = backend_for(config) in ("cuda_cudnn", "cuda_efficient")
        # a forward launch's kernel reads dense copies of its strided views
        self.dense_inputs = launches.DENSE_KERNEL_INPUTS.get(config.device, False)

    def rows(self, n: int, heads: int, elem: int, d: Optional[int] = None) -> int:
        """Bytes of a (b, n, heads, d) tensor (d = 1 for lse-like tensors)."""
        return self.b * n * heads * (self.d if d is None else d) * elem


def _launch_size(launch) -> Tuple[int, int, int, int, bool]:
    """(query rows, key rows, query heads, kv heads, view) of a launch, all segments; `view`:
    its selections are views (a strided group on a run of segments), not gathered copies."""
    g = launch.group
    count = launch.queries.count
    return (count * g.rows, count * g.kv_index.shape[0], g.q_heads.numel(), g.kv_heads.numel(),
            is_view(launch.queries, g.q_stride))


def _merge_temps(sh: "_Shapes", elements: int, view: bool, in_output: bool = False) -> int:
    """Temporaries of a merge or scatter, which run in slices of launches.SLICE_ELEMENTS.

    Per slice a few lse-sized fp32 values (new lse, weights); a launch on
    selected rows (not a view) also copies the slice's accumulator
    rows out and back (``merge_selected_``, the scatter's indexed add), in
    fp32. A view merges and adds in place, except a merge into a
    half-precision output that is its own accumulator (`in_output`), which
    goes through an fp32 copy of the slice.
    """
    part = min(elements, sh.chunk)
    copy = not view or (in_output and sh.s != sh.a)
    return 3 * part // sh.d * sh.a + (part * sh.a if copy else 0)


def _launch_fwd(sh: "_Shapes", nq: int, nk: int, hq: int, hkv: int, view: bool,
                gathered_kv: bool = True, in_output: bool = False,
                dense: bool = False) -> Tuple[int, int]:
    """Peak temporaries of one forward launch (launches.forward, merge_rows): (while the
    kernel runs, while its output merges). The block's accumulators are made between
    the two, for its first launch.

    Gathers of q (and k, v when `gathered_kv`) unless the launch reads
    views (`dense`: views with gaps that the kernel reads as dense copies,
    launches.DENSE_KERNEL_INPUTS), K/V repeated to the query heads for the
    CUDA kernels (GQA), the launch's out and lse, then the chunked merge.
    """
    out = sh.rows(nq, hq, sh.s) + sh.rows(nq, hq, sh.a, 1)
    copied = not view or dense
    gathers = sh.rows(nq, hq, sh.s) if copied else 0
    if copied and gathered_kv:
        gathers += 2 * sh.rows(nk, hkv, sh.s)
    if sh.repeats_kv and hkv != hq:
        gathers += 2 * sh.rows(nk, hq, sh.s)
    return gathers + out, out + _merge_temps(sh, sh.b * nq * hq * sh.d, view, in_output)


def _launch_bwd(sh: "_Shapes", nq: int, nk: int, hq: int, hkv: int, view: bool,
                gathered_kv: bool = True) -> Tuple[int, int]:
    """Peak temporaries of one backward launch (launches.backward, _scatter): (while the
    kernel runs, while its gradients are added into the accumulators).

    Gathers of dout, q, out, lse (and k, v) unless views, the
    kernel's dq, dk, dv, then the chunked scatters. The CUDA kernels (GQA)
    also take K/V repeated to the query heads and return dK/dV per query head,
    summed over each kv head's group.
    """
    outputs = sh.rows(nq, hq, sh.s) + 2 * sh.rows(nk, hkv, sh.s)
    gathers = 0
    if not view:
        gathers = 3 * sh.rows(nq, hq, sh.s) + sh.rows(nq, hq, sh.a, 1)
        if gathered_kv:
            gathers += 2 * sh.rows(nk, hkv, sh.s)
    if sh.repeats_kv and hkv != hq:
        gathers += 4 * sh.rows(nk, hq, sh.s)
    return gathers + outputs, _merge_temps(sh, sh.b * nq * hq * sh.d, view) + outputs


def plan_for(config: EstimateConfig, lengths: Tuple[int, ...], rank: int):
    """The rank's plan, as the op builds it on config.device (index tensors on meta: no data)."""
    layout = Layout.contiguous(lengths)
    heads = Heads.of(config.heads, config.kv_heads)
    return make_plan(layout, config.patterns, config.causal, heads, rank, "meta",
                     device_type=config.device)


def _writes(split, block: int, nbytes: int, per_entry: int) -> List[Tuple[int, int]]:
    """(block, bytes) a launch output writes: all to `block`, or `per_entry` per split entry."""
    if not split:
        return [(block, nbytes)]
    return [(x.block, x.index.numel() * per_entry) for x in split]


def _alive(blocks: Blocks) -> int:
    """Bytes of a Blocks' live accumulators and pending outputs (sizes, in the formula)."""
    return (sum(blocks.nbytes(blocks.by_index[i], kind) for i, kind in blocks.live)
            + sum(blocks.pending_bytes.values()))


def _make_acc(sim: Blocks, sh: "_Shapes", index: int, kind: Kind) -> int:
    """``sim.acc(index, kind)``; the bytes live while it is made: the new accumulator and the
    pending outputs it takes in (freed once applied, each merged through a copy of the
    accumulator rows it selects, in slices), before any of them is freed."""
    before = _alive(sim)
    key = (index, kind)
    if key in sim.live:
        return before
    pending = sim.pending_bytes.get(key, 0)
    sim.acc(index, kind)
    size = sim.nbytes(sim.by_index[index], kind)
    return before + size + (min(pending * sh.a // sh.s, sh.chunk * sh.a) if pending else 0)


def _sim_blocks(plan, kinds: Tuple[Kind, ...], nbytes, backward: bool) -> Blocks:
    """The executor's Blocks, run on sizes only: accumulators are placeholders."""
    return Blocks(plan, kinds, lambda block, kind, init: None, lambda block, kind, acc: None,
                  nbytes, count_writers(plan, backward=backward))


def _dilated_formula(config: EstimateConfig, lengths: Tuple[int, ...], rank: int) -> Estimate:
    """Forward (and backward) phases of single-device or sequence-parallel dilated attention.

    NOTE: this accounting mirrors, by hand, which buffers are alive when in
    launches.py (it replays the plan through the executor's own ``Blocks``
    bookkeeping on sizes: block accumulators and pending outputs, Note
    [block accumulators]; plus each launch's temporaries) and
    distributed/sequence_parallel.py (the exchange: round 0 posted before the
    local launches). Edit both together: the dry run, which runs the real
    code, keeps them honest (tests/test_cli.py holds the two within 10%).
    """
    sh = _Shapes(config)
    s, a, h, hk, b, d = sh.s, sh.a, sh.h, sh.hk, sh.b, sh.d
    # runs of identical launches of a block add and free the same temporaries: their first
    # and last keep every lifetime (compact_plan), as in the dry run
    plan = compact_plan(plan_for(config, lengths, rank))
    n = plan.rows
    shards = {SHARDS: sh.rows(n, h + 2 * hk, s)}
    if config.training:
        shards[DOUT] = sh.rows(n, h, s)
    output = sh.rows(n, h, s) + sh.rows(n, h, a, 1)  # out, and lse (fp32) written in place

    def wire(transfers) -> int:
        return sum(2 * b * t.columns * d * s for t in transfers)

    def pack_temp(transfers) -> int:
        # packing gathers each group, then concatenates: about twice the largest send
        return max((2 * b * t.columns * d * s for t in transfers), default=0)

    def out_size(l) -> int:  # a launch's (out, lse) or dq, kept pending
        nq, _, hq, _, _ = _launch_size(l)
        return sh.rows(nq, hq, s) + sh.rows(nq, hq, a, 1)

    rounds = plan.rounds
    # one packed buffer per distinct send (Round.packed), and the receive buffers
    posted = wire(rounds[0].distinct_sends) + wire(rounds[0].recvs) if rounds else 0
    phases: Dict[str, Dict[str, int]] = {}
    fwd_bytes = sum(wire(r.sends) for r in rounds)
    fwd_msgs = sum(1 for r in rounds for t in r.sends if t.columns)

    dtype = config.torch_dtype
    blocks_by = {block.index: block for block in plan.blocks}

    def acc_bytes(block, heads: int) -> int:  # a block's accumulator (none in the output)
        return 0 if in_output(block, dtype) else sh.rows(block.hi - block.lo, heads, a)

    sim = _sim_blocks(plan, FORWARD_KINDS, lambda block, kind: acc_bytes(block, h), backward=False)
    remote_done = not rounds
    for block in plan.blocks:
        if block.remote and not remote_done:
            for i, rnd in enumerate(rounds):
                peak = 0
                for t in rnd.recvs:
                    for l in t.launches:
                        size = _launch_size(l)
                        # keys come from the buffer, not gathered
                        peak = max(peak, _alive(sim) + max(_launch_fwd(sh, *size, False)))
                        for index, nbytes in _writes(l.q_split, l.q_block, out_size(l), b * (d * s + a)):
                            sim.add(index, Kind.OUT, lambda acc: None, nbytes)
                phases[f"forward, exchange round {i}"] = {
                    **shards, OUTPUT: output, WORKSPACE: max(peak, _alive(sim)),
                    # the sends are freed once the round arrives (round 0's were posted
                    # before the local launches); a later round packs and posts here
                    COMM: wire(rnd.recvs) + (wire(rnd.distinct_sends) + pack_temp(rnd.sends)
                                             if i else 0)}
            remote_done = True
        sim.turn(block.index)
        peak = 0
        for l in block.forward:
            before = _alive(sim)
            making = _make_acc(sim, sh, block.index, 0)
            kernel, merge = _launch_fwd(sh, *_launch_size(l),
                                        in_output=in_output(blocks_by[l.q_block], dtype),
                                        dense=sh.dense_inputs and not l.group.identity)
            peak = max(peak, before + kernel, making, _alive(sim) + merge)
            for index, nbytes in _writes(l.q_split, l.q_block, out_size(l), b * (d * s + a)):
                sim.add(index, Kind.OUT, lambda acc: None, nbytes)
        phases[f"forward, block {block.index}"] = {
            **shards, OUTPUT: output, WORKSPACE: peak,
            COMM: 0 if remote_done else posted + pack_temp(rounds[0].sends)}
        sim.end_turn(block.index)

    bwd_bytes = bwd_msgs = 0
    if config.training:
        saved = sh.rows(n, h, s) + sh.rows(n, h, a, 1)
        grads = sh.rows(n, h + 2 * hk, s)
        base = {**shards, SAVED: saved, GRADS: grads}
        heads_of = {Kind.DQ: h, Kind.DK: hk, Kind.DV: hk}
        sim = _sim_blocks(
            plan, BACKWARD_KINDS, lambda block, kind: acc_bytes(block, heads_of[kind]),
            backward=True)
        remote_done = not rounds
        for block in plan.blocks:
            if block.remote and not remote_done:
                for i, rnd in enumerate(rounds):
                    keys = wire(rnd.recvs)
                    grads_out = keys * a // s
                    peak = 0
                    for t in rnd.recvs:
                        for l in t.launches:
                            size = _launch_size(l)
                            peak = max(peak, _alive(sim) + max(_launch_bwd(sh, *size, False)))
                            for index, nbytes in _writes(l.q_split, l.q_block,
                                                         sh.rows(size[0], size[2], s), b * d * s):
                                sim.add(index, Kind.DQ, lambda acc: None, nbytes)
                    homes = wire(rnd.sends) * a // s
                    # the sends are done once the keys arrive; the keys stay until the
                    # dK/dV of the round have gone home and ours came back
                    phases[f"backward, exchange round {i}"] = {
                        **base, WORKSPACE: max(peak, _alive(sim)),
                        COMM: keys + grads_out + homes}
                    for t in rnd.sends:
                        for index, rows, _, _ in t.homes:
                            for kind in (Kind.DK, Kind.DV):
                                sim.add(index, kind, lambda acc: None, b * rows.numel() * d * a)
                    bwd_bytes += wire(rnd.sends) + grads_out
                    # our keys again (k and v in one message), the received keys' dK/dV home
                    bwd_msgs += sum(1 for t in rnd.sends if t.columns) + sum(
                        1 for t in rnd.recvs if t.columns)
                remote_done = True
            sim.turn(block.index)
            peak = 0
            for l in block.backward:
                nq, nk, hq, hkv, _ = size = _launch_size(l)
                before = making = _alive(sim)
                for kind, blocks in ((Kind.DQ, l.q_blocks), (Kind.DK, l.k_blocks),
                                     (Kind.DV, l.k_blocks)):
                    if block.index in blocks:
                        making = max(making, _make_acc(sim, sh, block.index, kind))
                kernel, scatter = _launch_bwd(sh, *size)
                peak = max(peak, before + kernel, making, _alive(sim) + scatter)
                for kind, split, index, nbytes in (
                        (Kind.DQ, l.q_split, l.q_block, sh.rows(nq, hq, s)),
                        (Kind.DK, l.k_split, l.k_block, sh.rows(nk, hkv, s)),
                        (Kind.DV, l.k_split, l.k_block, sh.rows(nk, hkv, s))):
                    for target, part in _writes(split, index, nbytes, b * d * s):
                        sim.add(target, kind, lambda acc: None, part)
            phases[f"backward, block {block.index}"] = {
                **base, WORKSPACE: peak,
                COMM: 0 if remote_done else posted + pack_temp(rounds[0].sends)}
            sim.end_turn(block.index)
    return _phases_to_estimate("formula", rank, phases, (fwd_bytes, fwd_msgs, bwd_bytes, bwd_msgs),
                               kernel_scratch(config, plan))


def _ring_formula(config: EstimateConfig, lengths: Tuple[int, ...], rank: int) -> Estimate:
    """Forward (and backward) phases of ring attention (see ring_forward/ring_backward).

    P = 1 is one kernel call: its out and lse, in backward its dq, dk, dv.
    Otherwise (Note [sub-blocks] in distributed/ring.py) K/V travel in S
    parts of at most m rows and launches cover at most r query rows, each
    pass with its own sizes.

    Forward: the fp32 accumulators (the output itself for fp32), the parts
    in flight (the one computed on and the next arriving: one received part
    at P = 2, two beyond; with b > 1 the part sent at step 0 is a copy), one
    launch's out and lse and the merge's lse-sized temporaries. Backward:
    saved out/lse, dq (fp32) and dk/dv, the parts in flight, three fp32
    dK/dV parts (sent, arriving, this unit's own) and one launch's dq, dk,
    dv. Not modelled: the lse-gradient padding of a backward with ``dlse``.
    """
    sh = _Shapes(config)
    s, a, h, hk = sh.s, sh.a, sh.h, sh.hk
    p = config.world_size
    n = lengths[rank]
    shards = {SHARDS: sh.rows(n, h + 2 * hk, s)}
    if config.training:
        shards[DOUT] = sh.rows(n, h, s)
    saved = sh.rows(n, h, s) + sh.rows(n, h, a, 1)
    phases: Dict[str, Dict[str, int]] = {}
    if p == 1:
        phases["forward, kernel"] = {**shards, OUTPUT: saved}
        if config.training:
            phases["backward, kernel"] = {**shards, SAVED: saved,
                                          GRADS: sh.rows(n, h + 2 * hk, s)}
        return _phases_to_estimate("formula", rank, phases, (0, 0, 0, 0), kernel_scratch(config))

    def sizes(backward: bool) -> Tuple[int, int, int]:
        """(S, m, r) of a pass: parts per block, rows of the longest part, of a launch."""
        sub = SubBlocks.bounded(max(lengths), h, hk, config.torch_dtype, backward=backward)
        parts = sub.parts(lengths)
        return parts, -(-max(lengths) // parts), min(sub.q_rows, n)

    def in_flight(m: int) -> int:
        """K/V parts of m rows held at once: one received at P = 2 (b = 1), else two."""
        return (1 if p == 2 and sh.b == 1 else 2) * 2 * sh.rows(m, hk, s)

    parts, m, r = sizes(False)
    launch_out = sh.rows(r, h, s) + sh.rows(r, h, a, 1)
    merge_temps = 4 * sh.rows(r, h, a, 1)  # merge_: the new lse, its safe copy, two weights
    acc = sh.rows(n, h, a) + sh.rows(n, h, a, 1)
    phases["forward, ring units"] = {**shards, OUTPUT: acc, COMM: in_flight(m),
                                     WORKSPACE: launch_out + merge_temps}
    if s != a:
        phases["forward, output cast"] = {**shards, OUTPUT: acc + sh.rows(n, h, s)}
    row_elems = 2 * sh.b * hk * sh.d  # k and v of one row

    def travel(steps: int, parts: int) -> Tuple[int, int]:
        """(rows, messages) of the blocks sent at steps 0..steps-1: each in min(L, S) parts."""
        blocks = [lengths[(rank - t) % p] for t in range(steps)]
        return sum(blocks), 2 * sum(min(length, parts) for length in blocks)

    kv_rows, fwd_msgs = travel(p - 1, parts)
    fwd_bytes = kv_rows * row_elems * s
    bwd_bytes = bwd_msgs = 0
    if config.training:
        parts, m, r = sizes(True)
        grads = sh.rows(n, h, a) + 2 * sh.rows(n, hk, s)
        base = {**shards, SAVED: saved, GRADS: grads}
        kernel = sh.rows(r, h, s) + 2 * sh.rows(m, hk, s)
        phases["backward, ring units"] = {**base, WORKSPACE: kernel,
                                          COMM: in_flight(m) + 3 * 2 * sh.rows(m, hk, a)}
        if s != a:
            phases["backward, gradient cast"] = {**base, GRADS: grads + sh.rows(n, h, s)}
        dkv_rows, dkv_msgs = travel(p, parts)
        bwd_bytes = fwd_bytes + dkv_rows * row_elems * a
        bwd_msgs = travel(p - 1, parts)[1] + dkv_msgs
    return _phases_to_estimate("formula", rank, phases, (fwd_bytes, fwd_msgs, bwd_bytes, bwd_msgs),
                               kernel_scratch(config))


# --------------------------------------------------------------------------
# The dry run


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside the mode; keeps the peak.

    Each storage is counted once, when the first op that returns a tensor on
    it runs, and subtracted when the storage is freed (weakref finalizer).
    Views share their base's storage and add nothing.

    Shapes only, so cheaper: many meta kernels of elementwise ops are Python
    decompositions (``logaddexp`` took 5-20 ms a call here), and a dry run
    repeats the same merge thousands of times. An elementwise op or an index
    read on meta tensors whose call (shapes, strides, dtypes, other
    arguments) was seen before gets a new tensor of the output metadata seen
    then (or, in place, its input back), without running the meta kernel
    again: what the tracker counts is unchanged.
    """

    def __init__(self, *, reuse: bool = True) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, int] = {}
        self.reuse = reuse  # False: every meta kernel runs (tests compare the two)
        # per op: "fresh", "inplace" or None (not reused); call metadata -> output
        # (shape, stride, dtype), or () for an in-place op. Per trace, never shared.
        self._kinds: Dict[object, Optional[str]] = {}
        self._outputs: Dict[tuple, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in IMPLEMENTATIONS:
            # the op's own code, traced too (a dispatch mode is off inside the op it handles)
            with self:
                out = IMPLEMENTATIONS[func](*args, **kwargs)
        else:
            out = self._call(func, args, kwargs)
        if isinstance(out, Tensor):
            self._track(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self._track(t)
        return out

    def _call(self, func, args, kwargs):
        """`func(*args, **kwargs)`, or its output's metadata from an earlier equal call."""
        if func not in self._kinds:
            self._kinds[func] = _reuse_kind(func) if self.reuse else None
        kind = self._kinds[func]
        key = None if kind is None else _metadata(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        seen = self._outputs.get(key)
        if seen is None:
            out = func(*args, **kwargs)  # the first call also checks the shapes
            self._outputs[key] = () if kind == "inplace" else (out.shape, out.stride(), out.dtype)
            return out
        if kind == "inplace":
            return args[0]
        return torch.empty_strided(*seen[:2], dtype=seen[2], device="meta")

    def _track(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)


def _reuse_kind(func) -> Optional[str]:
    """Whether an op's output metadata is a function of its inputs' metadata: "fresh" (one
    new tensor), "inplace" (its first argument, modified), or None (not reused).

    That is: an aten elementwise op, out of place or in place, or ``index.Tensor``
    (a boolean index, whose output shape depends on data, fails on meta before
    anything is kept); not out= variants, views or collectives.
    """
    if func is torch.ops.aten.index.Tensor:
        return "fresh"
    if torch.Tag.pointwise not in func.tags or len(func._schema.returns) != 1:
        return None
    if func._schema.returns[0].alias_info is None:
        return "fresh"
    return "inplace" if torch.Tag.inplace in func.tags else None


def _metadata(func, args, kwargs) -> Optional[tuple]:
    """The call as (func, its arguments with tensors as (shape, stride, dtype)), or None
    when a tensor is not on meta or an argument cannot be a key.

    Not the storage offset: an output's layout follows its inputs' shapes and strides.
    """
    key = [func]
    for x in (*args, *kwargs.items()):
        if isinstance(x, Tensor):
            if not x.is_meta:
                return None
            key.append((x.shape, x.stride(), x.dtype))
        elif isinstance(x, (list, tuple)):  # index lists, (name, value) of kwargs
            key.append(len(x))
            for y in x:
                if isinstance(y, Tensor):
                    if not y.is_meta:
                        return None
                    key.append((y.shape, y.stride(), y.dtype))
                else:
                    key.append(y)
        else:
            key.append(x)
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _meta_rows(config: EstimateConfig, n: int, heads: int) -> Tensor:
    # (b, n, heads, d) on meta: shapes only
    return torch.empty(config.batch, n, heads, config.head_dim, dtype=config.torch_dtype,
                       device="meta")


def backend_for(config: EstimateConfig) -> str:
    """The kernel the modelled device runs: what ``kernels.select_backend`` picks there.

    CPU: the flash op. CUDA: on a compute capability 9.0+ GPU without
    flash-attn (an H100), cuDNN for bf16/fp16 and the memory-efficient op for
    fp32; fp64 runs the blockwise kernel. Their meta kernels give the outputs'
    shapes, so the dry run allocates what the real launches allocate.
    """
    if config.device == "cpu":
        return "cpu_flash"
    if config.torch_dtype in (torch.float16, torch.bfloat16):
        return "cuda_cudnn"
    return "cuda_efficient" if config.torch_dtype == torch.float32 else "blockwise"


def _trace_rank(config: EstimateConfig, rank: int, *, reuse: bool = True,
                compact: bool = True) -> Estimate:
    """Run the real op for `rank` of a fake group of world size P on meta tensors.

    `reuse`: see LiveBytes; `compact`: run the plan's repeated launches once
    (``compact_plan``). Both leave the traced bytes as they are and cut the
    dry run's time (tests run without them and compare).

    Dilated attention runs the layer below the public op (``launches`` on one
    device, ``sp_forward``/``sp_backward`` over the group) with the plan of
    config.device: the public op sizes its plan from its tensors' device,
    which is meta here. Above that layer the op only validates the call.
    """
    lengths = config.lengths()
    n = lengths[rank]
    group = None
    if config.world_size > 1:
        group = comm.init_process_group("fake", rank=rank, world_size=config.world_size,
                                        timeout_s=60.0)
    plan = None if config.impl == "ring" else plan_for(config, lengths, rank)
    if plan is not None and compact:
        plan = compact_plan(plan)
    backend = backend_for(config)
    try:
        tracker = LiveBytes(reuse=reuse)
        with tracker:
            q = _meta_rows(config, n, config.heads)
            k = _meta_rows(config, n, config.kv_heads)
            v = _meta_rows(config, n, config.kv_heads)
            dout = _meta_rows(config, n, config.heads) if config.training else None
            inputs = tracker.live
            with comm.count_communication() as forward:
                if plan is None:
                    for x in (q, k, v):
                        x.requires_grad_(config.training)
                    out = ring_attention(q, k, v, is_causal=config.causal, group=group,
                                         layout=config.layout, backend=backend)
                else:
                    opts = KernelOptions(config.causal, 1.0 / math.sqrt(config.head_dim), backend)
                    out, lse = _dilated_forward(q, k, v, plan, opts, group)
            forward_peak = tracker.peak
            with comm.count_communication() as backward:
                if config.training and plan is None:
                    out.backward(dout)
                elif config.training:
                    grads = _dilated_backward(dout, q, k, v, out, lse, plan, opts, group)
                    del grads
            del out
    finally:
        if group is not None:
            comm.destroy_process_group()
    phase = "backward" if tracker.peak > forward_peak else "forward"
    label, scratch = kernel_scratch(config, plan)
    breakdown = {
        "inputs (q/k/v shards" + (", dout)" if config.training else ")"): inputs,
        "everything else at the peak (traced)": tracker.peak - inputs,
        label: scratch,
    }
    return Estimate(
        "dry run", rank, sum(breakdown.values()), phase, breakdown,
        forward.bytes_sent, forward.messages, backward.bytes_sent, backward.messages,
    )


def compact_plan(plan: Plan) -> Plan:
    """The plan with each run of identical launches of a block cut to its first and last.

    A run is three or more consecutive launches of a block's forward with the
    same shapes (rows, keys, heads, segments, mask) that write only the
    block's own rows (dq, dK, dV too: query and key rows in the block, no
    split). Between two of them the live tensors are the same (the
    accumulators, the pending outputs of other launches); each adds the same
    temporaries and frees them. Keeping the first (which makes the
    accumulators) and the last (after which they may be written out) keeps
    every lifetime and so the peak, forward and backward (a launch of the
    block's own rows is in both lists, and so are the writers' counts, which
    the executor takes from the same plan). LongNet's 2048-row segments on a
    CPU rank of 8M rows are 4,096 launches in runs of 128; the compact plan
    has 64.
    """
    dropped = set()
    for block in plan.blocks:
        run: List[Launch] = []
        for launch in block.forward + (None,):
            sig = _own_launch(launch, block.index)
            if run and (sig is None or sig != _own_launch(run[0], block.index)):
                dropped.update(l.id for l in run[1:-1])
                run = []
            if sig is not None:
                run.append(launch)
    if not dropped:
        return plan
    blocks = tuple(b._replace(forward=tuple(l for l in b.forward if l.id not in dropped),
                              backward=tuple(l for l in b.backward if l.id not in dropped))
                   for b in plan.blocks)
    return plan._replace(blocks=blocks)


def _own_launch(launch: Optional[Launch], block: int) -> Optional[tuple]:
    """A launch's shapes when it writes block `block`'s rows only, else None."""
    if launch is None or launch.q_split or launch.k_split or (launch.q_block,
                                                               launch.k_block) != (block, block):
        return None
    return (_launch_size(launch), launch.causal, launch.queries.count, launch.queries.length,
            launch.queries.starts is None, launch.keys.starts is None)


def _dilated_forward(q: Tensor, k: Tensor, v: Tensor, plan, opts: KernelOptions, group):
    """What the dilated op runs under its validation: one device or sequence-parallel."""
    if group is None:
        return launches.forward(q, k, v, plan, opts)
    return sp_forward(q, k, v, plan, opts, group)


def _dilated_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      plan, opts: KernelOptions, group):
    """The op's backward, given its saved q, k, v, out, lse (autograd calls the same)."""
    if group is None:
        return launches.backward(dout, q, k, v, out, lse, plan, opts)
    return sp_backward(dout, q, k, v, out, lse, plan, opts, group)


def _distinct_ranks(config: EstimateConfig) -> List[int]:
    """One rank per distinct plan among `_ranks_to_check`: equal plans trace equally.

    A plan's signature is what its memory depends on: the piece length, the
    shapes of its local launches and the pairs of each exchange round. Ring
    plans are cheap to trace, so every candidate rank is traced.
    """
    ranks = _ranks_to_check(config)
    if config.impl == "ring":
        return ranks
    lengths = config.lengths()
    chosen: Dict[tuple, int] = {}
    for r in ranks:
        plan = plan_for(config, lengths, r)
        local = sorted({(len(b.forward), b.hi - b.lo) + tuple(sorted(_launch_size(l)
                        for l in b.forward)) for b in plan.blocks})
        rounds = tuple((tuple(t.columns for t in rnd.sends), tuple(t.columns for t in rnd.recvs))
                       for rnd in plan.rounds)
        chosen.setdefault((plan.rows, tuple(local), rounds), r)
    return sorted(chosen.values())


def _trace_public(config: EstimateConfig, rank: int) -> Estimate:
    """Run the public op, head-parallel, for `rank` of a fake world (a fake 2-D mesh for
    --mesh) on meta tensors. The op plans for its tensors' device (meta: CPU sizes)."""
    u, sp = split(config)
    world = comm.init_process_group("fake", rank=rank, world_size=config.world_size,
                                    timeout_s=60.0)
    try:
        group = comm.init_device_mesh((u, sp)) if config.mesh is not None else world
        piece = comm.group_rank(group)  # a mesh rank (u, s) holds piece s * U + u
        n = config.lengths()[piece]
        tracker = LiveBytes()
        with tracker:
            q = _meta_rows(config, n, config.heads).requires_grad_(config.training)
            k = _meta_rows(config, n, config.kv_heads).requires_grad_(config.training)
            v = _meta_rows(config, n, config.kv_heads).requires_grad_(config.training)
            dout = _meta_rows(config, n, config.heads) if config.training else None
            inputs = tracker.live
            with comm.count_communication() as forward:
                if config.impl == "ring":
                    out = ring_attention(q, k, v, is_causal=config.causal, group=group)
                else:
                    out = dilated_attention(q, k, v, *config.patterns, is_causal=config.causal,
                                            group=group, strategy=config.strategy)
            forward_peak = tracker.peak
            with comm.count_communication() as backward:
                if config.training:
                    out.backward(dout)
            del out
    finally:
        comm.destroy_process_group()
    label, scratch = kernel_scratch(config)
    breakdown = {
        "inputs (q/k/v shards" + (", dout)" if config.training else ")"): inputs,
        "everything else at the peak (traced)": tracker.peak - inputs,
        label: scratch,
    }
    return Estimate(
        "dry run", piece, sum(breakdown.values()),
        "backward" if tracker.peak > forward_peak else "forward", breakdown,
        forward.bytes_sent, forward.messages, backward.bytes_sent, backward.messages,
    )


def dry_run(config: EstimateConfig) -> Estimate:
    """Trace the ranks whose peaks can differ; return the largest."""
    if comm.is_initialized():
        raise ValueError("--dry-run needs a process without a default process group")
    start = time.perf_counter()
    if split(config)[0] > 1:
        if config.device != "cpu":
            raise ValueError("--dry-run of Ulysses or a --mesh runs the public op, which "
                             "plans for its tensors' device: use --device cpu")
        best = _largest([_trace_public(config, r) for r in _ranks_to_check(config)])
        best.seconds = time.perf_counter() - start
        return best
    best = _largest([_trace_rank(config, r) for r in _distinct_ranks(config)])
    best.seconds = time.perf_counter() - start
    return best


# --------------------------------------------------------------------------
# Report


def _mb(x: int) -> str:
    return f"{x / MB:,.1f} MB"


def describe(config: EstimateConfig) -> str:
    mode = "training (forward + backward)" if config.training else "forward only"
    what = ("dense ring attention" if config.impl == "ring" else
            f"dilated attention, segments {list(config.segment_lengths)}, rates "
            f"{list(config.dilation_rates)}")
    lengths = config.lengths()
    rows = (f"{min(lengths):,} to {max(lengths):,} rows each" if min(lengths) != max(lengths)
            else f"{lengths[0]:,} rows each")
    kernels = (f"CPU kernels, {plural(config.threads, 'thread')} per rank"
               if config.device == "cpu" else f"CUDA kernels ({backend_for(config)})")
    return (f"{what}; N = {config.seq_len:,} over P = {plural(config.world_size, 'rank')} "
            f"({rows}, {config.layout}; strategy {strategy_name(config)}); batch "
            f"{config.batch}, {config.heads} heads x "
            f"{config.head_dim} (kv heads {config.kv_heads}), {config.dtype}, "
            f"{'causal, ' if config.causal else ''}{mode}; {kernels}")


def report(config: EstimateConfig, *, trace: bool, as_json: bool) -> int:
    """Print the formula's estimate (and the dry run's, when `trace`); exit status 0."""
    estimates = [formula(config)]
    if trace:
        estimates.append(dry_run(config))
    if as_json:
        print(json.dumps({"config": dataclasses.asdict(config),
                          "estimates": [dataclasses.asdict(e) for e in estimates]}, indent=2))
        return 0
    print(f"ESTIMATE (not measured): {describe(config)}")
    for e in estimates:
        print(f"\n{e.method}: peak per rank {_mb(e.peak_bytes)} (rank {e.rank}, {e.phase}; "
              f"{e.seconds:.2f} s)")
        for name, nbytes in e.breakdown.items():
            print(f"  {name:44s} {_mb(nbytes):>16s}")
        print(f"  communication per layer, sent by rank {e.traffic_rank} (the busiest): forward "
              f"{_mb(e.forward_bytes)} in {plural(e.forward_messages, 'message')}"
              + (f", backward {_mb(e.backward_bytes)} in "
                 f"{plural(e.backward_messages, 'message')}"
                 if config.training else ""))
    if config.impl == "dilated" and config.world_size > 1 and split(config)[0] == 1:
        ranks, loads = work_per_rank(config)
        mean = sum(loads) / len(loads)
        which = "every rank" if len(ranks) == config.world_size else f"ranks {ranks}"
        print(f"\nattention work per rank (score entries, forward; {which}): busiest "
              f"{max(loads):,.0f} = {max(loads) / mean:.3f} x the mean")
    if trace:
        f, d = estimates
        print(f"\nformula vs dry run: peak {100 * (f.peak_bytes / d.peak_bytes - 1):+.1f}%, "
              f"forward traffic {_mb(f.forward_bytes)} vs {_mb(d.forward_bytes)}")
    return 0


def work_per_rank(config: EstimateConfig) -> Tuple[List[int], List[int]]:
    """(ranks, each one's attention work) from the plans: every rank up to 16, else a sample."""
    p = config.world_size
    ranks = list(range(p)) if p <= 16 else _ranks_to_check(config)
    lengths = config.lengths()
    return ranks, [work(plan_for(config, lengths, r)) for r in ranks]
