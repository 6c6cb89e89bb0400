"""Sequence-parallel dilated attention: the sequence is split over the ranks of a group.

Notation: b batch, n rows of this rank's piece, h query heads, hk key/value
heads, d head dim; P ranks, rank p holds global rows [S_p, S_p + N_p) (any
lengths, empty pieces allowed), N = sum_p N_p; a pattern is (w, r) with
W = min(w, N) (the GLOBAL N, as on one device).

Note [sequence-parallel plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per pattern, the global segments [a, min(a + W, N)) are of two kinds:

    ranks:     |------ 0 ------|---- 1 ----|--------- 2 ---------|
    segments:  [  A  ][  B  ][  C  ][  D  ][  E  ][  F  ][  G  ][H]
               inside  inside  spans 0,1   spans 1,2  inside ...

- A segment inside one rank's piece (A, B, E, ...) is computed there by the
  single-device launches (launches.forward_launches), with no communication.
- A segment that spans ranks (C, D) is cut into slices, one per rank. Each
  rank computes ITS OWN query slice against every key slice it may see: its
  own slice locally (square causal when causal, like a segment), and the
  selected key/value rows of the other slices (with causal, earlier ranks
  only; full blocks, no mask), fetched from their owners. Head j reads
  rows t with (t - a) mod r == j mod r, so only the (row, kv head) pairs
  some head of the RECEIVING slice reads travel: about |slice| / r rows per
  (offset, kv head) pair, at most W / r per segment, independent of N.

A transfer's wire format is the concatenation, for k and v, of the
kernel-ready blocks of its head groups (patterns.cross_head_groups of the
query slice against the key slice): (2, b, pairs, d). Both sides derive the
groups from the agreed piece lengths, so nothing but the selected rows is
sent, and the receiver runs the kernel on views of its buffer.

Blocks merge into fp32 accumulators with merge.merge_. The backward reruns
every block with the final out/lse (kernels.attention_backward, exact),
fetches the remote keys again (nothing but the inputs is saved), keeps dq
local and sends the dK/dV of remote keys home, where they are summed.

Rounds. Transfers go in rounds, one comm.exchange each. In a segment that
spans L ranks, the transfer from slice i to slice i' is "step"
(i' - i) mod L (L(L-1) transfers; L(L-1)/2 causal).
- gather: a pattern's transfers all go in one round. Used when no rank
  would send or receive more (row, kv head) pairs than the largest piece
  holds (hk * max_p N_p), the usual LongNet regime (w / r small).
- rotate: otherwise (e.g. the dense case w >= N, r = 1 over many ranks),
  round s carries step s, so a rank holds at most one received slice per
  spanning segment (a rank has at most two) at a time: the sub-ring of the
  span's ranks, with each slice sent straight to its s-th successor.
Either way a rank's received K/V (and their dK/dV in backward) stay within
2 * hk * max_p N_p rows: per-rank memory is O(N / P) for balanced pieces,
whatever w is.

Memory: tools/estimate.py's formula (``_dilated_formula``) mirrors, by hand,
which buffers sp_forward and sp_backward keep alive in each round; change
the two together (the estimate's dry run runs this code and tests hold the
formula to it).

Dropout (p > 0, blockwise kernel) replays the same masks in backward: every
launch gets seed + rank * 2**32 + its launch id on the computing rank. The
masks are NOT those of the single-device op (blocks are cut differently);
only p = 0 equals the single device exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import KernelOptions, attention_backward, attention_forward, lse_dtype
from ..kernels import save_for_backward, saved_for_backward
from ..launches import Launch, backward_launches, forward_launches, merge_rows, region_launches
from ..merge import empty_accumulators
from ..patterns import (
    HeadGroup,
    Patterns,
    Region,
    cross_head_groups,
    gather,
    head_groups,
    scatter_add_,
    selected_pairs,
)
from . import comm

# Dropout seeds of different ranks' launches must differ (their launch ids
# overlap); launch ids of one call stay far below this.
_SEED_STRIDE = 1 << 32


# --------------------------------------------------------------------------
# The plan: pure functions of the agreed piece lengths


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows [lo, hi) of a segment (segment-local), held by `rank` from row `start` on."""

    rank: int
    lo: int
    hi: int
    start: int

    @property
    def region(self) -> Region:
        return Region(self.start, 1, self.hi - self.lo)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The selected key/value rows of slice `keys` read by the queries of slice `queries`.

    groups: `cross_head_groups` of the query slice against the key slice;
    spans: each group's columns [lo, hi) in the flat (2, b, pairs, d) buffer;
    launch: the receiver's launch id of the first group (dropout seeds).
    """

    keys: Slice
    queries: Slice
    groups: Tuple[HeadGroup, ...]
    spans: Tuple[Tuple[int, int], ...]
    launch: int

    @property
    def pairs(self) -> int:
        return self.spans[-1][1]


@dataclasses.dataclass(frozen=True)
class Round:
    """One exchange: this rank's key slices out, other ranks' key slices in."""

    sends: Tuple[Transfer, ...]
    recvs: Tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything one rank computes and exchanges, for all patterns.

    local: the launches on this rank's own rows;
    rounds: the exchanges with their remote blocks, in order;
    modes: per pattern "local" (no segment spans ranks), "gather" or "rotate".
    """

    lengths: Tuple[int, ...]
    local: Tuple[Launch, ...]
    rounds: Tuple[Round, ...]
    modes: Tuple[str, ...]


def spanning_segments(
    lengths: Tuple[int, ...], seg_len: int
) -> List[Tuple[int, Tuple[Slice, ...]]]:
    """The segments of length `seg_len` that span several ranks, with their slices.

    Returns (segment index, slices in rank order) for every segment that
    contains rows of two or more (non-empty) pieces.
    """
    starts = _starts(lengths)
    total = starts[-1]
    # a segment spans ranks iff a piece boundary falls strictly inside it
    cut = sorted({s // seg_len for s in starts[1:-1] if 0 < s < total and s % seg_len})
    out = []
    for i in cut:
        a, e = i * seg_len, min((i + 1) * seg_len, total)
        slices = []
        # ranks whose piece [S_p, S_p + N_p) meets [a, e)
        for p in range(bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, e)):
            lo, hi = max(a, starts[p]), min(e, starts[p + 1])
            if hi > lo:
                slices.append(Slice(p, lo - a, hi - a, lo - starts[p]))
        out.append((i, tuple(slices)))
    return out


def _starts(lengths: Tuple[int, ...]) -> List[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


def _local_regions(
    lengths: Tuple[int, ...], rank: int, seg_len: int, spanning: Dict[int, Tuple[Slice, ...]]
) -> Iterator[Tuple[Region, int, int]]:
    """(region in this rank's piece, lo, hi) of the segment rows this rank computes alone.

    Segments inside the piece come as regions of whole segments (lo = 0,
    hi = segment length); the rank's slices of spanning segments come one
    by one with their segment-local rows [lo, hi).
    """
    starts = _starts(lengths)
    first, stop, total = starts[rank], starts[rank + 1], starts[-1]
    if stop == first:
        return
    i0, i1 = first // seg_len, (stop - 1) // seg_len
    for i in sorted({i0, i1} & set(spanning)):
        (own,) = [s for s in spanning[i] if s.rank == rank]
        yield own.region, own.lo, own.hi
    lo_i, hi_i = i0 + (i0 in spanning), i1 - (i1 in spanning)
    last = (total - 1) // seg_len
    tail = total % seg_len != 0 and lo_i <= last <= hi_i
    full_hi = last - 1 if tail else hi_i
    if full_hi >= lo_i:
        yield Region(lo_i * seg_len - first, full_hi - lo_i + 1, seg_len), 0, seg_len
    if tail:
        yield Region(last * seg_len - first, 1, total - last * seg_len), 0, total - last * seg_len


@functools.lru_cache(maxsize=64)
def make_plan(
    lengths: Tuple[int, ...],
    patterns: Patterns,
    causal: bool,
    num_heads: int,
    num_kv_heads: int,
    rank: int,
    device: str = "cpu",
) -> Plan:
    """The plan of `rank` (see Note [sequence-parallel plan]); equal inputs on all ranks."""
    total = sum(lengths)
    budget = num_kv_heads * max(lengths, default=0)
    local: List[Launch] = []
    rounds: List[Round] = []
    modes: List[str] = []
    launch = 0
    for w, r in zip(*patterns):
        if total == 0:
            modes.append("local")
            continue
        seg_len = min(w, total)
        spans = dict(spanning_segments(lengths, seg_len))
        for region, lo, hi in _local_regions(lengths, rank, seg_len, spans):
            groups = head_groups(lo, hi, r, num_heads, num_kv_heads, device)
            launches = region_launches(region, groups, torch.device(device), launch)
            local.extend(launches)
            launch += len(launches)
        # every transfer of the pattern, on all ranks: (step, keys, queries)
        moves: List[Tuple[int, Slice, Slice]] = []
        sent: Counter = Counter()
        received: Counter = Counter()
        for _, slices in sorted(spans.items()):
            for i, src in enumerate(slices):
                for j, dst in enumerate(slices):
                    if i == j or (causal and i > j):
                        continue
                    pairs = selected_pairs(
                        dst.lo, dst.hi, src.lo, src.hi, r, num_heads, num_kv_heads
                    )
                    if pairs:
                        moves.append(((j - i) % len(slices), src, dst))
                        sent[src.rank] += pairs
                        received[dst.rank] += pairs
        if not moves:
            modes.append("local")
            continue
        gather_all = max(list(sent.values()) + list(received.values())) <= budget
        modes.append("gather" if gather_all else "rotate")
        steps = [0] if gather_all else sorted({s for s, _, _ in moves})
        for step in steps:
            sends: List[Transfer] = []
            recvs: List[Transfer] = []
            for s, src, dst in moves:
                if (not gather_all and s != step) or rank not in (src.rank, dst.rank):
                    continue
                transfer = _transfer(src, dst, r, num_heads, num_kv_heads, device, launch)
                if dst.rank == rank:
                    recvs.append(transfer)
                    launch += len(transfer.groups)
                else:
                    sends.append(transfer)
            if sends or recvs:
                rounds.append(Round(tuple(sends), tuple(recvs)))
    return Plan(tuple(lengths), tuple(local), tuple(rounds), tuple(modes))


def _transfer(
    keys: Slice, queries: Slice, rate: int, h: int, hk: int, device: str, launch: int
) -> Transfer:
    groups = cross_head_groups(queries.lo, queries.hi, keys.lo, keys.hi, rate, h, hk, device)
    spans, col = [], 0
    for g in groups:
        spans.append((col, col + g.kv_index.numel()))
        col += g.kv_index.numel()
    return Transfer(keys, queries, groups, tuple(spans), launch)


# --------------------------------------------------------------------------
# Moving selected rows


def _pack(k: Tensor, v: Tensor, t: Transfer) -> Tensor:
    """The wire buffer of transfer `t`: (2, b, pairs, d), k then v, group after group."""
    buf = k.new_empty((2, k.shape[0], t.pairs, k.shape[3]))
    for g, (lo, hi) in zip(t.groups, t.spans):
        for i, x in enumerate((k, v)):
            # (b, n, hk, d) -> (b, kv_rows, hkv, d) -> (b, kv_rows * hkv, d)
            block = gather(x, t.keys.region, g.kv_heads, g.kv_index, g.identity)
            buf[i, :, lo:hi] = block.flatten(1, 2)
    return buf


def _unpack(buf: Tensor, t: Transfer) -> Iterator[Tuple[int, HeadGroup, Tensor, Tensor]]:
    """(group index, group, k block, v block) views of a (2, b, pairs, d) buffer."""
    for gi, (g, (lo, hi)) in enumerate(zip(t.groups, t.spans)):
        # (b, kv_rows * hkv, d) -> (b, kv_rows, hkv, d)
        shape = tuple(g.kv_index.shape)
        yield gi, g, buf[0, :, lo:hi].unflatten(1, shape), buf[1, :, lo:hi].unflatten(1, shape)


def _swap(
    outgoing: List[Tuple[int, Tensor]], incoming: List[Tuple[int, Tensor]], group: Any
) -> None:
    """One comm.exchange: (peer, tensor) pairs out, (peer, buffer) pairs in, in plan order."""
    sends: Dict[int, List[Tensor]] = {}
    recvs: Dict[int, List[Tensor]] = {}
    for peer, x in outgoing:
        sends.setdefault(peer, []).append(x)
    for peer, x in incoming:
        recvs.setdefault(peer, []).append(x)
    comm.exchange(sends, recvs, group)


def _fetch_keys(k: Tensor, v: Tensor, rnd: Round, group: Any) -> List[Tensor]:
    """Send this rank's selected rows of the round, return the received (2, b, pairs, d)."""
    bufs = [k.new_empty((2, k.shape[0], t.pairs, k.shape[3])) for t in rnd.recvs]
    _swap(
        [(t.queries.rank, _pack(k, v, t)) for t in rnd.sends],
        [(t.keys.rank, buf) for t, buf in zip(rnd.recvs, bufs)],
        group,
    )
    return bufs


# --------------------------------------------------------------------------
# Forward and backward


def sp_forward(q: Tensor, k: Tensor, v: Tensor, plan: Plan, opts: KernelOptions,
               group: Any) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) pieces -> out (b, n, h, d), lse (b, n, h) fp32."""
    b, n, h, d = q.shape
    acc_out, acc_lse = empty_accumulators((b, n, h, d), q.dtype, q.device)
    forward_launches(q, k, v, plan.local, acc_out, acc_lse, opts)
    for rnd in plan.rounds:
        for t, buf in zip(rnd.recvs, _fetch_keys(k, v, rnd, group)):
            region = t.queries.region
            for gi, g, k_g, v_g in _unpack(buf, t):
                # (b, n, h, d) -> (b, rows, hq, d)
                q_g = gather(q, region, g.q_heads, g.q_index, g.identity)
                # remote keys are all earlier (causal) or all visible: no mask
                out_g, lse_g = attention_forward(
                    q_g, k_g, v_g, opts.for_launch(t.launch + gi, causal=False)
                )
                merge_rows(acc_out, acc_lse, region, g, out_g, lse_g)
                del q_g, out_g, lse_g
    return acc_out.to(q.dtype), acc_lse


def sp_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                plan: Plan, opts: KernelOptions, group: Any,
                dlse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of `sp_forward` for this rank's pieces, given its final out and lse."""
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    backward_launches(dout, q, k, v, out, lse, plan.local, dq, dk, dv, opts, dlse)
    for rnd in plan.rounds:
        grads = []
        for t, buf in zip(rnd.recvs, _fetch_keys(k, v, rnd, group)):
            grad = torch.empty(buf.shape, dtype=acc, device=q.device)
            for gi, g, k_g, v_g in _unpack(buf, t):
                q_sel = (t.queries.region, g.q_heads, g.q_index, g.identity)
                dq_g, dk_g, dv_g = attention_backward(
                    gather(dout, *q_sel), gather(q, *q_sel), k_g, v_g, gather(out, *q_sel),
                    gather(lse, *q_sel), opts.for_launch(t.launch + gi, causal=False),
                    dlse=None if dlse is None else gather(dlse, *q_sel),
                )
                scatter_add_(dq, *q_sel, dq_g)
                lo, hi = t.spans[gi]
                # (b, kv_rows, hkv, d) -> (b, kv_rows * hkv, d)
                grad[0, :, lo:hi] = dk_g.flatten(1, 2)
                grad[1, :, lo:hi] = dv_g.flatten(1, 2)
                del dq_g, dk_g, dv_g
            grads.append(grad)
        # dK/dV of remote keys go home; ours come back from the ranks that read them
        homes = [torch.empty((2, k.shape[0], t.pairs, k.shape[3]), dtype=acc, device=q.device)
                 for t in rnd.sends]
        _swap(
            [(t.keys.rank, grad) for t, grad in zip(rnd.recvs, grads)],
            [(t.queries.rank, home) for t, home in zip(rnd.sends, homes)],
            group,
        )
        del grads
        for t, home in zip(rnd.sends, homes):
            for _, g, dk_g, dv_g in _unpack(home, t):
                kv_sel = (t.keys.region, g.kv_heads, g.kv_index, g.identity)
                scatter_add_(dk, *kv_sel, dk_g)
                scatter_add_(dv, *kv_sel, dv_g)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class SequenceParallelDilatedAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `sp_backward` (a collective: every rank calls it)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, opts, group):
        result = sp_forward(q, k, v, plan, opts, group)
        return save_for_backward(ctx, q, k, v, result, (plan, opts, group))

    @staticmethod
    def backward(ctx, dout, dlse):
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        plan, opts, group = ctx.args
        dq, dk, dv = sp_backward(dout, q, k, v, out, lse, plan, opts, group, dlse)
        return dq, dk, dv, None, None, None


def sequence_parallel_dilated_attention(q: Tensor, k: Tensor, v: Tensor, patterns: Patterns,
                                        opts: KernelOptions, group: Any,
                                        lengths: Tuple[int, ...]) -> Tuple[Tensor, Tensor]:
    """Dilated attention over the sequence split across `group` (differentiable).

    Each rank passes its own contiguous piece, in rank order: q (b, n_p, h, d),
    k/v (b, n_p, hk, d), n_p = lengths[rank] >= 0. Returns this rank's rows of
    the single-device out (b, n_p, h, d) and lse (b, n_p, h) (fp32; fp64 for
    fp64). The call must already be agreed on every rank (functional.py
    validates it once, in the agreement collective), `opts.seed` included:
    each rank decorrelates it by its rank. Every rank must also run the
    backward.
    """
    rank = comm.group_rank(group)
    plan = make_plan(lengths, patterns, opts.causal, q.shape[2], k.shape[2], rank, str(q.device))
    opts = dataclasses.replace(opts, seed=opts.seed + rank * _SEED_STRIDE)
    return SequenceParallelDilatedAttentionFunction.apply(q, k, v, plan, opts, group)
