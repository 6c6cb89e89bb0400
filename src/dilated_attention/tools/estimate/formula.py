"""What ``estimate`` computes rather than measures: arithmetic that is no copy of the executor.

- the op's minimum: the inputs a rank holds and the outputs the op returns (its
  contract, not its working memory, which the dry run measures);
- traffic per rank: what each strategy's wire protocol sends, from segment shapes
  only (``plan.transfer_counts``, ``strategy.ulysses_bytes``, the ring's sub-pieces);
- the kernels' own buffers, which no tracing of tensors sees (modelled).

Notation: b batch, n a rank's rows, h heads, hk key/value heads, d head dim, s bytes
per element, a bytes per accumulator element (4; 8 for float64).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ...distributed.halo import halo_schedule
from ...distributed.ring import RingSizes
from ...distributed.strategy import ulysses_bytes
from ...distributed.ulysses import HeadSplit
from ...fused import cuda_tile_sizes
from ...fused_plan import tile_plan
from ...kernels import lse_dtype
from ...patterns import Heads
from ...layout import Layout
from ... import policy
from ...plan import Plan, transfer_counts
from ..settings import AttentionSetting
from .config import EstimateConfig, fuses, split

# forward bytes, forward messages, backward bytes, backward messages of one rank
Traffic = Tuple[int, int, int, int]

SCRATCH = "CPU kernel scratch (modelled)"
CUDA_SCRATCH = "CUDA kernel workspace (modelled)"
FUSED_PLANS = "fused kernel plan tables (modelled)"
FUSED_BESIDE = "fused kernel plan tables, CUDA kernel workspace (modelled)"
# the labels of the kernels' own buffers (kernel_scratch), one of which an estimate lists
KERNEL_BUFFERS = (SCRATCH, CUDA_SCRATCH, FUSED_PLANS, FUSED_BESIDE)
# CPU flash kernel blocking (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp):
# query blocks of 256 rows (64 below 768 rows, 32 below 192), key blocks of 512.
_KV_SPLIT = 512
# The CUDA kernels' own workspace beyond their outputs (cuDNN's and flash's forward keep
# their tiles on chip; cuDNN asks the allocator for a small workspace): an assumption.
CUDA_WORKSPACE = 8 << 20


def sizes(config: AttentionSetting) -> Tuple[int, int]:
    """(s, a): bytes per element of the dtype and of its accumulators."""
    return config.torch_dtype.itemsize, lse_dtype(config.torch_dtype).itemsize


def minimum(config: AttentionSetting, n: int, training: bool) -> Dict[str, Dict[str, int]]:
    """Per phase, the op's contract on a rank of n rows: {label: bytes} of the inputs it
    holds and the outputs that exist (forward: out, lse; training's backward: also dq, dk,
    dv)."""
    s, a = sizes(config)
    row = config.batch * n * config.head_dim * s  # one head's rows
    h, hk = config.heads, config.kv_heads
    inputs = {"inputs (q/k/v shards" + (", dout)" if training else ")"):
              row * (h + 2 * hk + (h if training else 0))}
    out = row * h + config.batch * n * h * a
    phases = {"forward": {**inputs, "outputs (out, lse)": out}}
    if training:
        phases["backward"] = {**inputs, "outputs (out, lse, dq, dk, dv)": out + row * (h + 2 * hk)}
    return phases


# --------------------------------------------------------------------------
# Traffic


def traffic(config: EstimateConfig) -> List[Traffic]:
    """Every rank's traffic per layer, in piece order (a mesh rank (u, s) holds piece s U + u).

    Ulysses (U > 1): four all-to-alls forward (q, k and v, out, lse); in backward
    the gradients of all but the lse's, after an all-reduce of two int32 flags
    (which gradients exist), as the dry run's loss of out alone has them; then
    the sequence-parallel op over S ranks on each rank's heads.
    """
    u, sp = split(config)
    lengths = config.lengths()
    if u == 1:
        return _sequence(config, lengths, Heads.of(config.heads, config.kv_heads))
    heads = HeadSplit.of(u, config.heads, config.kv_heads)
    shape = config.shape()
    blocks = [lengths[t * u:(t + 1) * u] for t in range(sp)]
    inner = [_sequence(config, [sum(b) for b in blocks], heads.local_heads(v)) for v in range(u)]
    flag = 2 * (u - 1) * 8 // u
    out = []
    for t, block in enumerate(blocks):
        forward, backward = ulysses_bytes(shape, block), ulysses_bytes(shape, block, lse=False)
        for v in range(u):
            fb, fm, bb, bm = inner[v][t]
            out.append((forward[v] + fb, 4 + fm) + ((backward[v] + flag + bb, 4 + bm)
                                                   if config.training else (0, 0)))
    return out


def _sequence(config: EstimateConfig, lengths: Sequence[int], heads: Heads) -> List[Traffic]:
    """The sequence-parallel op over ranks holding `lengths` rows, for `heads`."""
    if config.windowed:
        return _halo(config, lengths, heads)
    if config.impl == "ring":
        return _ring(config, lengths, heads)
    s, a = sizes(config)
    row = 2 * config.batch * config.head_dim  # k and v of one (row, kv head) pair
    counts = transfer_counts(Layout.contiguous(lengths), config.patterns, config.causal, heads,
                             None)
    # forward: the selected k and v of each transfer in one message; backward: ours again,
    # and the received keys' dK/dV home in the accumulators' dtype
    return [(c.sent * row * s, c.sends) + (((c.sent * s + c.received * a) * row,
                                            c.sends + c.receives) if config.training else (0, 0))
            for c in counts]


def _ring(config: EstimateConfig, lengths: Sequence[int], heads: Heads) -> List[Traffic]:
    """Ring attention (Note [sub-pieces] in distributed/ring.py): every rank's K/V piece
    passes every other rank in S sub-pieces, k and v apart; in backward again, in the
    backward's sub-pieces, with the fp32 dK/dV sub-pieces one step further, home."""
    p = len(lengths)
    if p == 1:
        return [(0, 0, 0, 0)]
    s, a = sizes(config)
    h = heads.count
    hk = max(heads.kv_of) + 1 if heads.grouped else h  # ungrouped heads get K/V per head
    row = 2 * config.batch * hk * config.head_dim  # k and v of one row
    total = sum(lengths)

    def sub_pieces(backward: bool) -> int:
        return RingSizes.bounded(max(lengths), h, hk, config.torch_dtype,
                                 backward=backward).sub_pieces(lengths)

    def messages(count: int, skip: int) -> int:  # k and v of every non-empty sub-piece
        return 2 * (sum(min(x, count) for x in lengths) - min(skip, count))

    forward = sub_pieces(False)
    backward = sub_pieces(True) if config.training else 0
    out = []
    for r in range(p):
        # forward: over P - 1 steps a rank passes on every piece but its successor's; the
        # backward passes them again and, one step further, every piece's dK/dV
        skipped = lengths[(r + 1) % p]
        fb = (total - skipped) * row * s
        out.append((fb, messages(forward, skipped)) + (
            (fb + total * row * a, messages(backward, skipped) + messages(backward, 0))
            if config.training else (0, 0)))
    return out


def _halo(config: EstimateConfig, lengths: Sequence[int], heads: Heads) -> List[Traffic]:
    """The sliding window's halo exchange (Note [halo exchange] in distributed/halo.py): a
    rank sends each reader the k and v of the rows of its chunks that the reader's window
    reaches (one message per halo, in one round, or in one round per distance when the
    window spans ranks); in backward the halos again, and each reader sends their dK/dV
    home in the accumulators' dtype."""
    s, a = sizes(config)
    hk = max(heads.kv_of) + 1 if heads.grouped else heads.count
    row = 2 * config.batch * hk * config.head_dim  # k and v of one row
    left, right = config.reaches()
    schedule = halo_schedule(Layout.contiguous(lengths), left, right, None)
    out = []
    for r in range(len(lengths)):
        sent = [h.stop - h.start for h in schedule if h.src == r]
        received = [h.stop - h.start for h in schedule if h.dst == r]
        fb = sum(sent) * row * s
        out.append((fb, len(sent)) + ((fb + sum(received) * row * a, len(sent) + len(received))
                                      if config.training else (0, 0)))
    return out


def busiest(traffic: List[Traffic]) -> int:
    """The piece that sends most per layer (forward and backward; the last of equals)."""
    return max(range(len(traffic)), key=lambda r: (traffic[r][0] + traffic[r][2], r))


# --------------------------------------------------------------------------
# The kernels' own buffers


def kernel_scratch(config: EstimateConfig, plan: Plan = None, n: int = 0) -> Tuple[str, int]:
    """(label, bytes): the kernels' memory for the largest launch (of `plan`; without one,
    a launch of all n rows, or a sliding window's largest), which no tracing of tensors sees.

    CPU flash kernel, per thread, forward: qs*ks + 2 qs + qs*d accumulators, plus qs*ks
    in the dtype for bf16/fp16; backward 2 qs*ks more, and one buffer the size of the
    launch's q in the dtype (measured: the op's dq accumulation). qs, ks: its query and
    key block sizes. CUDA: CUDA_WORKSPACE (the fused kernels keep their tiles on chip),
    in backward also an fp32 dq and row statistic per query row and head of the
    largest launch (the flash-style backward accumulates dq in fp32 across key blocks).
    The fused Triton kernel (``fuses``): no workspace, but its plan's tables on the
    device (``fused_plan_bytes``); beside it (the exchange) the CUDA kernels' of the
    launches on received keys. With dropout none: the blockwise kernel is torch ops.
    """
    b, d = config.batch, config.head_dim
    s, a = sizes(config)
    if config.dropout > 0:  # the blockwise kernel: torch ops, which the dry run traces
        return (CUDA_SCRATCH if config.device == "cuda" else SCRATCH), 0
    fused = fuses(config)
    if fused and split(config)[1] == 1:
        return FUSED_PLANS, fused_plan_bytes(config)
    if plan is None and config.windowed:
        n = min(n, _window_launch_rows(config))
    if fused:
        # the launches on received keys (the fused kernel runs the local ones)
        source = (launch for rnd in plan.rounds for t in rnd.recvs for launch in t.launches)
    else:
        source = (launch for blk in (plan.blocks if plan is not None else ())
                  for launch in blk.forward)
    launches = [(launch.queries.count * launch.heads.rows, launch.heads.q_heads.numel())
                for launch in source]
    rows = max((r for r, _ in launches), default=n)
    entries = max((r * h for r, h in launches), default=0 if fused else n * config.heads)
    if config.device == "cuda":
        workspace = CUDA_WORKSPACE + (b * entries * (d + 1) * 4 if config.training else 0)
        if fused:
            return FUSED_BESIDE, fused_plan_bytes(config) + workspace
        return CUDA_SCRATCH, workspace
    qs = min(256 if rows >= 768 else 64 if rows >= 192 else 32, rows)
    ks = min(_KV_SPLIT, rows)
    per_thread = (qs * ks + 2 * qs + qs * d) * a + (qs * ks * s if s < a else 0)
    extra = 0
    if config.training:
        per_thread += 2 * qs * ks * a
        extra = b * entries * d * s if launches else 0
    return SCRATCH, config.threads * per_thread + extra


def fused_plan_bytes(config: EstimateConfig) -> int:
    """Bytes of the fused kernel's plans on an H100 (compute capability 9.0's tiles) for the
    first rank: its heads (of head-parallel rank 0) over its rows (the first block of the
    sequence-parallel dimension: all rows without one). The query tiles (forward and dq,
    one plan where their tiles agree) and in training the key tiles (dK/dV). The op caches
    them on the device (fused_plan.tile_plan), where they outlive the call; made on meta
    here, shapes only. About 24 bytes per tile of 64-128 (row, head) pairs and one int32 per
    (row, head) of each kind of cell geometry: well under 1% of q at long sequences."""
    u = split(config)[0]
    head_split = HeadSplit.of(u, config.heads, config.kv_heads)
    heads, kv_heads = head_split.local_heads(0), len(head_split.kv(0))
    rows = sum(config.lengths()[:u])
    tiles = cuda_tile_sizes((9, 0), config.torch_dtype, config.head_dim)
    kernels = ("forward", "dq", "dkdv") if config.training else ("forward",)
    total = 0
    for options in {tuple(tiles.plan(kernel).items()) for kernel in kernels}:
        plan = tile_plan(config.seq_len, config.patterns, heads, kv_heads, config.causal, None,
                         device="meta", window=(0, rows), **dict(options))
        total += sum(t.numel() * t.element_size()
                     for t in (plan.tiles, plan.rows, plan.spans, plan.extras))
    return total


def _window_launch_rows(config: EstimateConfig) -> int:
    """Query rows of a sliding window's largest kernel call: a run of tiles over a stripe
    of row blocks (window.window_plan; the backward's blocks are the longer)."""
    b_rows = policy.window_tile_rows(*config.reaches(), config.device, backward=True)
    stripe = policy.window_stripe_rows(b_rows, config.device)
    return max(b_rows, policy.rows_per_launch(config.device, stripe))
