"""Decoding: one new query against cached key/value rows, on one device or spread over ranks.

Notation: b batch, h query heads, hk key/value heads, d head dim; a pattern
is (w, r); t the new query's position; o a batch row's origin (where its
sequence starts: 0, or its first real token after left padding).

The incremental rule (docs/spec.md, Generation): the query at position t is
row t of the causal op over positions o .. t, which does not depend on what
follows t. Per pattern (w, r) its segment starts at a = o + floor((t - o) / w)
w; head j takes part when (t - a) mod r == j mod r, and then reads the cached
rows u in [a, t] with (u - a) mod r == (t - a) mod r. Every head that takes
part in a pattern reads the SAME rows, one strided slice of the cache: the
work per step is sum_i min(w_i, t + 1) / r_i rows, whatever the context.
Patterns merge by log-sum-exp (merge.py).

Note [sharded generation]
    A prompt of n tokens generating M more rows of keys and values (the last
    new token is never fed back) over P ranks. The prefill runs
    sequence-parallel, as training does: rank p computes its contiguous
    piece [S_p, S_p + n_p) of the prompt (``shard_sequence``'s) and keeps that
    piece of every layer's keys and values. The new rows [n, n + M) are cut
    into P contiguous blocks so that every rank ends with its share of
    ``piece_lengths(n + M, P)``: rank p stores block p, whose length is that
    share less n_p (never negative), so per-rank cache memory is
    (n + M) / P (+ 1), allocated once after the prefill. Every rank knows
    every block (``CachePlan``), so the owner of position t is the same
    everywhere without a message.

        positions  0 ........ n | n ......................... n + M
        rank 0     [ piece 0 ]    [ block 0 ]
        rank 1                [ piece 1 ]   [ block 1 ]
        rank 2                    [piece 2]             [ block 2 ]

    Each step every rank computes the new token's q, k, v (the token id is
    known everywhere, and the layers are replicated); the owner of t writes
    the k/v row into its block; every rank then computes its partial (out,
    lse) over the rows it holds, pattern by pattern, reading only the rows
    of [a, t] the pattern selects (``decode_partial``). The partials are
    exact pieces of one softmax over disjoint key sets, so the log-sum-exp
    merge of all of them is the single-process result: one all-gather per
    layer of (out, lse), b x h x (d + 1) accumulator floats per rank
    (``merge_over_ranks``), independent of the context length, after which
    every rank merges the P partials in rank order. The same code on the
    same gathered bits gives every rank the same output bit for bit, so
    every rank samples the same token (with the same generator state); an
    all-reduce would do with fewer bytes at large P, but needs a second
    collective for the max and leaves bitwise agreement to the backend.

    Contiguous blocks keep each rank's rows two runs (its piece and its
    block), so every pattern reads at most two strided slices per rank. The
    price is that recent rows (short segments) live on one rank at a time:
    time per token is the busiest rank's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import validation as check
from .backends import select_backend
from .distributed import comm
from .distributed.sharding import piece_lengths
from .kernels import KernelOptions, attention_forward
from .merge import empty_accumulators, merge_
from .patterns import Heads, Patterns


class CachedRows(NamedTuple):
    """Cached keys and values at consecutive positions [start, start + count).

    k, v: (b, >= count, hk, d); rows past `count` (room not yet filled) are
    never read.
    """

    k: Tensor
    v: Tensor
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """Which positions one rank caches (Note [sharded generation]).

    prompt: [start, stop) of its piece of the prompt; block: [start, stop) of
    the new rows it stores; blocks: every rank's block, to find the owner of
    a position.
    """

    prompt: Tuple[int, int]
    block: Tuple[int, int]
    blocks: Tuple[Tuple[int, int], ...]

    @classmethod
    def of(cls, prompt_len: int, new_rows: int, size: int, rank: int) -> "CachePlan":
        """The plan of rank `rank` of `size` for a prompt of `prompt_len` tokens and
        `new_rows` new rows of keys and values."""
        pieces = piece_lengths(prompt_len, size)
        finals = piece_lengths(prompt_len + new_rows, size)
        blocks, start = [], prompt_len
        for piece, final in zip(pieces, finals):
            # final >= piece: a longer sequence never shortens a rank's share
            blocks.append((start, start + final - piece))
            start += final - piece
        first = sum(pieces[:rank])
        return cls((first, first + pieces[rank]), blocks[rank], tuple(blocks))

    def empty_block(self, k: Tensor, v: Tensor, *, heads_first: bool = False) -> CachedRows:
        """The room for this rank's new rows, like k and v (b, rows, hk, d): allocated once
        for every planned row (the allocator takes it whole), never zero-filled, as its
        rows past `count` are never read. heads_first: k, v are (b, hk, rows, d) (a
        transformers cache) and the room is laid out so, viewed (b, rows, hk, d). v's head
        dim may differ from k's (multi-head latent attention)."""
        first, end = self.block
        if heads_first:
            # (b, hk, rows, d), viewed (b, rows, hk, d)
            k, v = (x.new_empty((x.shape[0], x.shape[1], end - first, x.shape[3]))
                    .transpose(1, 2) for x in (k, v))
            return CachedRows(k, v, first, 0)
        k, v = (x.new_empty((x.shape[0], end - first) + tuple(x.shape[2:])) for x in (k, v))
        return CachedRows(k, v, first, 0)

    def store(self, block: CachedRows, t: int, k: Tensor, v: Tensor) -> CachedRows:
        """`block` with the row of new position t (k, v (b, hk, d)) written where t falls in
        this rank's block; a position past the planned rows is an error (on every rank:
        each checks every position)."""
        first, end = self.block
        self.owner(t)
        if not first <= t < end:
            return block
        block.k[:, t - first] = k
        block.v[:, t - first] = v
        return block._replace(count=t - first + 1)

    def owner(self, t: int) -> int:
        """The rank that stores the row of new position t."""
        for rank, (start, stop) in enumerate(self.blocks):
            if start <= t < stop:
                return rank
        raise ValueError(f"position {t} is outside the planned new rows "
                         f"[{self.blocks[0][0]}, {self.blocks[-1][1]})")


def cached_dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths: Sequence[int],
                             dilation_rates: Sequence[int], *,
                             scale: Optional[float] = None) -> Tensor:
    """Causal dilated attention of the LAST position against all earlier keys (decoding).

    q (b, 1, h, d) is the query at position t = m - 1; k, v (b, m, hk, d)
    hold positions 0..t. Equals row t of the causal op over the m positions
    (see the module docstring). Inference only (no gradient).
    """
    m = k.shape[1]
    return decode(q, [CachedRows(k, v, 0, m)], m - 1,
                  (tuple(segment_lengths), tuple(dilation_rates)), scale=scale)


def decode(q: Tensor, rows: Sequence[CachedRows], t: int, patterns: Patterns, *,
           scale: Optional[float] = None, group=None, origins: Optional[Sequence[int]] = None,
           keep: Optional[Tensor] = None) -> Tensor:
    """The attention output (b, 1, h, d) of the query q (b, 1, h, d) at position t.

    rows: the cached key/value rows this rank holds (with `group`, every
    rank its own, each row on one rank; Note [sharded generation]); they
    must include position t's own. origins: per batch row, where its
    sequence starts (default 0). keep: (b, >= t + 1) bool over positions,
    False = ignore that key (padding). Inference only.
    """
    out, lse = decode_partial(q, rows, t, patterns, scale=scale, origins=origins, keep=keep)
    out, _ = merge_over_ranks(out, lse, group)
    return out.to(q.dtype)


@torch.no_grad()
def decode_partial(q: Tensor, rows: Sequence[CachedRows], t: int, patterns: Patterns, *,
                   scale: Optional[float] = None, origins: Optional[Sequence[int]] = None,
                   keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The partial (out (b, 1, h, d), lse (b, 1, h)) in fp32 (fp64) accumulators of the
    query at position t over `rows` alone (see `decode`)."""
    b, _, h, d = q.shape
    acc_out, acc_lse = empty_accumulators((b, 1, h, d), q.dtype, q.device)
    rows = [r for r in rows if r.count > 0]
    if not rows:
        return acc_out, acc_lse
    heads = Heads.of(h, rows[0].k.shape[2])
    scale = check.check_scale(scale, d)
    # the kernels chosen once, not by each launch ("auto" options: about 2 us a launch)
    opts, masked_opts = (KernelOptions(False, scale, select_backend(q.device, q.dtype,
                                                                    masked=masked))
                         for masked in (False, True))
    device = str(q.device)
    for lo, hi, origin in origin_runs(origins, b):
        # whether this run's accumulators still hold the merge's identity (0, -inf): a launch
        # of every head then stores its results, the values a merge into the identity gives
        # (it multiplies them by 1), without the merge's passes
        identity = True
        for w, r in zip(*patterns):
            a = origin + (t - origin) // w * w
            launches = _taking_part((t - a) % r, r, heads, device)
            if not launches:
                continue  # no head selects row t in this pattern
            reads = _run_reads(rows, a, t, r, None if keep is None else keep[lo:hi])
            if not reads:
                continue
            # Launch by launch, each over the runs: a head is in one launch of a pattern, so
            # its merges come in the same order as run by run, and a launch's query heads and
            # accumulator entries are selected (advanced indexing: copies) and written back
            # once, not once per run (a tiny LongNetLM layer at 256 + 1 rows: 143 -> 129 ops,
            # 416 -> 381 us)
            for q_heads, kv_heads, every_head in launches:
                # (b, 1, h, d) -> (b, 1, hq, d)
                qg = q[lo:hi] if every_head else q[lo:hi, :, q_heads]
                index = (slice(lo, hi), slice(None), q_heads)
                acc = (acc_out[lo:hi], acc_lse[lo:hi]) if every_head else \
                    (acc_out[index], acc_lse[index])
                for run, picked, mask in reads:
                    # (b, rows, hk, d) -> (b, rows, hkv, d), in one indexing (it was two)
                    sel = (slice(lo, hi), picked) if every_head else \
                        (slice(lo, hi), picked, kv_heads)
                    kg, vg = run.k[sel], run.v[sel]
                    if mask is None:
                        out_g, lse_g = attention_forward(qg, kg, vg, opts)
                    else:
                        out_g, lse_g = attention_forward(
                            qg, kg, vg, masked_opts,
                            key_mask=mask[:, :, None].expand(-1, -1, kg.shape[2]))
                    if every_head and identity:
                        acc[0].copy_(out_g)
                        acc[1].copy_(lse_g)
                    else:
                        merge_(*acc, out_g, lse_g)
                    identity = False
                if not every_head:
                    acc_out[index], acc_lse[index] = acc
    return acc_out, acc_lse


def _run_reads(rows: Sequence[CachedRows], a: int, t: int, r: int, keep: Optional[Tensor]
               ) -> List[Tuple[CachedRows, slice, Optional[Tensor]]]:
    """(run, its rows that pattern rate r selects in [a, t], the ignored ones among them (b,
    rows) or None) of each run holding some; keep: (b, >= t + 1) over positions, or None."""
    reads = []
    for run in rows:
        # the selected rows of [a, t] in this run: a + (t - a) mod r + r i
        first = max(a, run.start)
        first += (t - first) % r
        last = min(t, run.start + run.count - 1)
        if last < first:
            continue
        mask = None
        if keep is not None:
            ignored = ~keep[:, _stride(first, last, r)]  # (b, rows)
            if bool(ignored.any()):
                mask = ignored
        reads.append((run, _stride(first - run.start, last - run.start, r), mask))
    return reads


def merge_over_ranks(out: Tensor, lse: Tensor, group) -> Tuple[Tensor, Tensor]:
    """Every rank's partial (out (b, 1, h, d), lse (b, 1, h)) accumulators merged, in rank
    order, on every rank: one all-gather (Note [sharded generation])."""
    if not comm.is_distributed(group):
        return out, lse
    # (b, 1, h, d) and (b, 1, h) -> (1, b, 1, h, d + 1): one buffer, one collective
    packed = torch.cat([out, lse[..., None]], dim=-1)[None]
    everyone = comm.all_gather(packed, group, dim=0)  # (P, b, 1, h, d + 1)
    acc_out, acc_lse = empty_accumulators(out.shape, out.dtype, out.device)
    for partial in everyone:
        merge_(acc_out, acc_lse, partial[..., :-1], partial[..., -1])
    return acc_out, acc_lse


def _stride(first: int, last: int, rate: int) -> slice:
    """The positions first, first + rate, ..., last (last - first a multiple of rate) as a
    slice; one row as first:first + 1 (a huge rate as a step would overflow a view's stride)."""
    return slice(first, last + 1, rate) if last > first else slice(first, first + 1)


def origin_runs(origins: Optional[Sequence[int]], batch: int) -> List[Tuple[int, int, int]]:
    """(first row, end row, origin) of each run of consecutive batch rows sharing an origin
    (None: all rows at 0): a run's rows compute together, their rows views, never copies."""
    if origins is None:
        return [(0, batch, 0)]
    runs: List[Tuple[int, int, int]] = []
    for i, origin in enumerate(origins):
        if runs and runs[-1][2] == origin:
            runs[-1] = (runs[-1][0], i + 1, origin)
        else:
            runs.append((i, i + 1, origin))
    return runs


@functools.lru_cache(maxsize=4096)
def _taking_part(offset: int, rate: int, heads: Heads,
                 device: str) -> Tuple[Tuple[Tensor, Tensor, bool], ...]:
    """The launches of the heads whose dilation offset under `rate` is `offset`.

    Each launch is (query heads (hq,), kv heads (hkv,), every_head): kv
    heads read by equally many of those query heads, the query heads in
    kernel GQA order (hq = hkv x that many); every_head marks a launch of
    all heads in order (no head indexing). Cached: a few small index tensors
    per (offset, rate), which the step after reuses.
    """
    readers: Dict[int, List[int]] = {}
    for j, kv in enumerate(heads.kv_of):
        if (heads.first + j) % rate == offset:
            readers.setdefault(kv, []).append(j)
    by_count: Dict[int, List[int]] = {}
    for kv, members in readers.items():
        by_count.setdefault(len(members), []).append(kv)
    launches = []
    for _, kv_heads in sorted(by_count.items()):
        q_heads = [j for kv in kv_heads for j in readers[kv]]
        every_head = q_heads == list(range(heads.count)) and heads.grouped and \
            kv_heads == list(range(max(heads.kv_of) + 1))
        launches.append((torch.tensor(q_heads, device=device),
                         torch.tensor(kv_heads, device=device), every_head))
    return tuple(launches)
