"""The fused kernels (Triton): forward, dq, dK/dV over the tiles of ``fused_plan``.

Imported only by ``fused`` when a call runs with ``backend="triton"``: triton is
optional, and whether ``@triton.jit`` makes compiled or interpreted kernels is
decided when this module is imported (TRITON_INTERPRET=1 at that moment gives
the interpreter, which runs on CPU tensors).

Every program of a plain kernel computes one tile for one batch row (grid
(tiles, batch)); a variant for the non-finite rule (below) has fewer programs
per batch row, each computing every so many tiles. A tile is rows
``cell + rows[row_lo : row_lo + count]`` of one head, and a list of spans of
the other side: ``cell + start + stride * i`` for ``i < count`` of the span's
head, key i counting times + #{extras: i mod period == phase} times (a span
with extras has times 1; Note [fused kernel] in fused_plan.py). The softmax is
in base 2, exp2(s * scale * log2(e) - (m - log2 times)) * count: one fused
multiply-add per pair before the exp2 (the row max m is taken over the raw
products, the scale being positive; the span's times shift m once per row and
chunk), and where the plan has extras the per-key count a product after it,
not a log2 added before; the counts (and with dropout the patterns' bits) are
computed once per span where every period divides BLOCK_N (SPAN_COUNTS: they
repeat from chunk to chunk), else per chunk. With attention dropout (PATTERNS >
0) the probabilities that weigh v, and those of the gradients, are the pairs'
masked ones (``triton_dropout``; Note [fused dropout] in fused.py); the lse
keeps every key.

Non-finite inputs (docs/spec.md, "Non-finite inputs"): the rule has kernels of
its own, launched after the plain ones over the same tiles: the forward's
variant (NONFINITE), and the backward's, ``fused_backward_rule``, which does
dq's and dK/dV's work in one launch. Their programs return at once unless
AnyBad (the op's device-side check, read by no host) is a NaN or an infinity,
and then overwrite what the plain ones wrote. Each is one launch of a few
programs that loop over the tiles (fused.TileSizes.rule_programs), every
height of the plan at its widest: a finite call, where they all return, then
schedules a few hundred programs (tens of thousands from 64K tokens on for a
program per tile), each taking its resources for nothing, in two launches per
training step, not one per kernel and tile height. Their loops' bounds, the
tile counts, are not specialised: counts that are multiples of 16 and others
share the compiled kernels. The check starts at 0, and the plain forward
(REPORT) makes it NaN where a q row it loads, an out it writes, or a row of k
is not finite: each program sums its tile's q, its out, and an equal share of
k's rows (all of k across the first launch's programs, after their key loops).
That covers every input the rule concerns at no cost in the key loop: a
non-finite q row is its tile's own; a non-finite value row that a program loads
reaches its out through the products (p v, 0 * inf and 0 * NaN included); a
non-finite key row can leave every out finite (a -inf logit only drops the
key), hence k's own sum. A value row that no
program loads changes nothing and is not reported. In the rule's variant a key row whose
k holds a NaN or an infinity gets a NaN logit, so a query attending it gets a NaN out and lse
whatever the signs (a -inf logit would otherwise drop the key); a non-finite
value row reaches the out of every query attending it through the products,
and an out that is not finite becomes NaN. Where a chunk is masked (causal,
padding, past the span) a query multiplies by rows it does not attend: there
non-finite k, v (forward, dq) and q, dout (dK/dV) elements read as 0, the
forward marks the value rows it zeroed for the queries that do attend them,
and dK/dV keeps a masked pair's ds at 0. So no NaN reaches a query, or a
gradient, through a pair it does not attend.

Notation: M rows of the tile (BLOCK_M), N elements of a span chunk (BLOCK_N),
D the head dim padded to a power of two (BLOCK_D).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_dropout import dropout_key, dropped
from .triton_spans import selection, span_selection, unmasked_chunks

LOG2E = 1.4426950408889634  # the kernels take scale * LOG2E: base-2 logits


@triton.jit
def _program(tiles, rows, tile, BLOCK_M: tl.constexpr):
    """This program's batch row and its tile number `tile`: (b, head of the rows, span_lo,
    span_hi, cell, (M,) absolute rows, (M,) which are real, first row, last row)."""
    at = tiles + tile * 6
    cell = tl.load(at)
    row_lo = tl.load(at + 1)
    count = tl.load(at + 2)
    offs = tl.arange(0, BLOCK_M)
    ok = offs < count
    t = cell + tl.load(rows + row_lo + offs, mask=ok, other=0)
    first = cell + tl.load(rows + row_lo)
    last = cell + tl.load(rows + row_lo + count - 1)
    return (tl.program_id(1), tl.load(at + 3), tl.load(at + 4), tl.load(at + 5), cell, t, ok,
            first, last)


@triton.jit
def _span(spans, s, cell, first, last, CAUSAL: tl.constexpr, KEY_TILES: tl.constexpr):
    """Span s: its head, first element (absolute), stride, the elements [lo, hi) a tile of
    rows first..last reaches, log2 of how many patterns select each of them (its times;
    the extras add to it, from a times of 1), its extras [extra_lo, extra_hi), and the bits
    of the patterns its times count (fused_plan.TilePlan).

    Causal: query tiles read keys u <= t (up to their last row), key tiles are read
    by queries t >= u (from their first row on)."""
    at = spans + s * 8
    start = cell + tl.load(at + 1)
    stride = tl.load(at + 2)
    lo = 0
    hi = tl.load(at + 3)
    if CAUSAL:
        if KEY_TILES:
            reach = first - start
            lo = tl.where(reach > 0, (reach + stride - 1) // stride, 0)
        else:
            reach = last - start
            hi = tl.minimum(hi, tl.where(reach >= 0, reach // stride + 1, 0))
    bias = tl.log2(tl.load(at + 4).to(tl.float32))
    return (tl.load(at), start, stride, lo, hi, bias, tl.load(at + 5), tl.load(at + 6),
            tl.load(at + 7))


@triton.jit
def _load_rows(ptr, b, t, ok, head, sb, sn, sh, sd, head_dim, BLOCK_D: tl.constexpr):
    """(len(t), D) rows t of x[b, :, head, :]; zeros where not ok or past head_dim."""
    offs_d = tl.arange(0, BLOCK_D)
    at = (ptr + b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * sn + head.to(tl.int64) * sh
          + offs_d[None, :] * sd)
    return tl.load(at, mask=ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)


@triton.jit
def _store_rows(ptr, value, b, t, ok, head, sb, sn, sh, sd, head_dim, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    at = (ptr + b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * sn + head.to(tl.int64) * sh
          + offs_d[None, :] * sd)
    tl.store(at, value.to(ptr.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < head_dim))


@triton.jit
def _row_values(ptr, b, t, ok, head, sb, sn, sh):
    """(len(t),) x[b, t, head] of a (b, n, h) tensor (lse, delta, dlse); 0 where not ok."""
    return tl.load(ptr + b.to(tl.int64) * sb + t.to(tl.int64) * sn + head.to(tl.int64) * sh,
                   mask=ok, other=0.0)


@triton.jit
def _finite(x):
    """Which elements of x are finite (a NaN compares false)."""
    return tl.abs(x.to(tl.float32)) < float("inf")


@triton.jit
def _all_finite(check):
    """Whether the op's check (module docstring) is finite: then q, k and v hold no NaN and
    no infinity that a kernel reads."""
    return _finite(tl.load(check))


@triton.jit
def _nonfinite_rows(x):
    """(R,) int32 of an (R, C) block: 1 where the row holds a NaN or an infinity."""
    return tl.max(tl.where(_finite(x), 0, 1), 1)


@triton.jit
def _rows_at(ptr, b, head, sb, sh, sd, BLOCK_D: tl.constexpr):
    """(1, D) pointers to x[b, 0, head, :]: add row * stride_n for a row's elements."""
    return (ptr + b.to(tl.int64) * sb + head.to(tl.int64) * sh
            + tl.arange(0, BLOCK_D)[None, :] * sd)


@triton.jit
def _share_sum(ptr, b, rows, heads, sb, sn, sh, sd, head_dim, BLOCK_D: tl.constexpr,
               CHUNK: tl.constexpr):
    """The sum of this program's share of x[b] (rows, heads, head_dim): the (row, head)
    pairs cut into equal runs, one per program of the launch's first grid dimension, so
    that its programs together read every element once (rows 0: none). Not pipelined: it
    runs once per program (no buffers beside the key loop's), so each chunk is a round trip
    to memory at the program's end; in chunks of a q tile's shape (CHUNK = BLOCK_M) a share
    is mostly one. (In chunks of 16 pairs, 8 round trips a share, the H200's 1M-token
    forward took 1.1 ms longer than with none, against 0.38 ms for torch's sum of k.)"""
    pairs = rows * heads
    share = tl.cdiv(pairs, tl.num_programs(0))
    lo = tl.program_id(0) * share
    hi = tl.minimum(lo + share, pairs)
    offs_d = tl.arange(0, BLOCK_D)
    base = ptr + b.to(tl.int64) * sb
    total = tl.zeros((CHUNK,), tl.float32)
    for i in tl.range(lo, hi, CHUNK, num_stages=1):
        pair = i + tl.arange(0, CHUNK)
        ok = pair < hi
        at = base + ((pair // heads).to(tl.int64) * sn + (pair % heads).to(tl.int64) * sh)
        x = tl.load(at[:, None] + offs_d[None, :] * sd,
                    mask=ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        total += tl.sum(x.to(tl.float32), 1)
    return tl.sum(total, 0)


@triton.jit
def _key_span(spans, s, cell, first, last, K, V, Mask, b, skb, skh, skd, svb, svh, svd, smb,
              smh, CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Key span s of a query tile (``_span``), with the pointers to its key/value head's rows
    of K, V and the padding mask in batch row b."""
    kv, start, stride, lo, hi, bias, extra_lo, extra_hi, bits = _span(spans, s, cell, first,
                                                                      last, CAUSAL, False)
    return (start, stride, lo, hi, bias, extra_lo, extra_hi, bits,
            _rows_at(K, b, kv, skb, skh, skd, BLOCK_D),
            _rows_at(V, b, kv, svb, svh, svd, BLOCK_D),
            Mask + b.to(tl.int64) * smb + kv.to(tl.int64) * smh)


@triton.jit
def _key_products(q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo,
                  extra_hi, span_counts, span_bits, skn, svn, smn, d_ok, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
                  EXTRAS: tl.constexpr, POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr,
                  SANITIZE: tl.constexpr, KEY_BIAS: tl.constexpr, PATTERNS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Keys c .. c + N of a span against the tile's q rows t: k, v (N, D), the (M, N)
    products q k (unscaled, fp32), the (N,) keys' counts (1 without extras) and pattern
    bits (with dropout: ``selection``), and (N,) 1 for the value rows read as 0 (else 0);
    MASKED: -inf where masked (causal, padding, past hi), else every key is read by every
    row (``unmasked_chunks``) and nothing is masked (rows past the tile's are garbage
    there, never stored). The non-finite rule (module docstring): SANITIZE, a masked
    chunk's non-finite k and v elements read as 0; KEY_BIAS, NaN products for a non-finite
    k row.

    The loads are written out here, not in helpers: in the interpreter a helper call
    costs as much as ten block operations, and this runs once per chunk. The counts and
    bits are one helper, ``selection``, shared with the dK/dV kernel and called only for
    plans with extras, and here only where they differ from chunk to chunk (SPAN_COUNTS:
    they are `span_counts` and `span_bits`, ``span_selection``)."""
    idx = c + tl.arange(0, BLOCK_N)
    u = start + idx * stride
    u64 = u.to(tl.int64)
    load_ok = d_ok
    if MASKED:
        key_ok = idx < hi
        load_ok = key_ok[:, None] & d_ok
    k = tl.load(k_at + u64[:, None] * skn, mask=load_ok, other=0.0)
    v = tl.load(v_at + u64[:, None] * svn, mask=load_ok, other=0.0)
    v_bad = tl.zeros((BLOCK_N,), tl.int32)
    if KEY_BIAS:
        k_bias = tl.where(_nonfinite_rows(k) > 0, float("nan"), 0.0)
    if MASKED and SANITIZE:
        k = tl.where(_finite(k), k, 0.0)
        v_ok = _finite(v)
        v_bad = tl.max(tl.where(v_ok, 0, 1), 1)
        v = tl.where(v_ok, v, 0.0)
    # (M, D) x (D, N) -> (M, N)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if KEY_BIAS:
        qk += k_bias[None, :]
    counts, bits = span_counts, span_bits
    if EXTRAS > 0 and not SPAN_COUNTS:
        counts, bits = selection(extras, extra_lo, extra_hi, idx, span_bits, EXTRAS,
                                 POW2_PERIODS, PATTERNS, BLOCK_N)
    if MASKED:
        valid = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            valid &= u[None, :] <= t[:, None]
        if HAS_MASK:
            ignored = tl.load(mask_at + u64 * smn, mask=key_ok, other=1)
            valid &= (ignored == 0)[None, :]
        qk = tl.where(valid, qk, float("-inf"))
    return k, v, qk, counts, bits, v_bad


@triton.jit
def _softmax_step(q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo,
                  extra_hi, span_counts, skn, svn, smn, d_ok, scale_log2, bias, m_i, l_i, acc, hit,
                  span_bits, seed, b, head, first_row, threshold, keep_scale, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
                  EXTRAS: tl.constexpr, POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr,
                  NONFINITE: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax over one chunk of keys: the new (m_i, l_i, acc, hit). m_i is the
    row max of the scaled products without the counts (a count >= 1 then multiplies a p <= 1:
    the lse holds whatever m is); the span's times enter as bias = log2(times) on its logits
    (a shift of the exp2's argument per row, not a product per pair); hit marks the rows
    that attend a value row read as 0 (NONFINITE). PATTERNS > 0: with dropout
    (``triton_dropout.dropped``; the lse's sum takes every key, dropped or not)."""
    k, v, qk, counts, bits, v_bad = _key_products(
        q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo, extra_hi,
        span_counts, span_bits, skn, svn, smn, d_ok, MASKED, CAUSAL, HAS_MASK, PRECISION,
        EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE, NONFINITE, PATTERNS, BLOCK_N)
    if MASKED and NONFINITE:
        # the attended pairs are the unmasked products (a NaN compares unequal too)
        attends = (qk != float("-inf")) & (v_bad[None, :] > 0)
        hit = tl.maximum(hit, tl.max(tl.where(attends, 1, 0), 1))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    # a row with no key yet keeps max -inf: shift by 0 so that exp2 gives 0, not NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * scale_log2 - (shift - bias)[:, None])
    if EXTRAS > 0:
        p *= counts[None, :]
    alpha = tl.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if PATTERNS > 0:
        u = start + (c + tl.arange(0, BLOCK_N)) * stride
        p = dropped(p, seed, b, head, t + first_row, u + first_row, bits, threshold, keep_scale,
                    PATTERNS, False)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc, hit


@triton.jit(do_not_specialize=["num_tiles", "first_row", "first_head"])
def fused_forward(
    Q, K, V, Out, Lse, Mask, AnyBad, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, slb, sln, slh, smb, smn, smh,
    head_dim, scale_log2, check_rows, kv_heads, threshold, keep_scale, first_row, first_head,
    num_tiles,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, EXTRAS: tl.constexpr,
    POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr, NONFINITE: tl.constexpr,
    REPORT: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out, lse of query tiles: each program one tile of the plain kernel (REPORT: a
    non-finite q row or out element, or one in the program's share of the first check_rows
    rows of K (kv_heads heads), makes AnyBad NaN); NONFINITE, the variant that applies the
    non-finite rule where AnyBad is not finite, its programs each taking every
    num_programs-th of the num_tiles tiles (module docstring). PATTERNS > 0: with attention
    dropout, Seed (int64) its Philox key, first_row and first_head the sequence's row and
    head of the tensors' first (``triton_dropout.dropped``)."""
    if NONFINITE:
        if _all_finite(AnyBad):
            return
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _forward_tile(tile, Q, K, V, Out, Lse, Mask, AnyBad, Seed, tiles, rows, spans, extras,
                          sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd, sob, son, soh,
                          sod, slb, sln, slh, smb, smn, smh, head_dim, scale_log2, check_rows,
                          kv_heads, threshold, keep_scale, first_row, first_head, CAUSAL, HAS_MASK,
                          PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE, REPORT, PATTERNS,
                          BLOCK_M, BLOCK_N, BLOCK_D)
    else:
        _forward_tile(tl.program_id(0), Q, K, V, Out, Lse, Mask, AnyBad, Seed, tiles, rows, spans,
                      extras, sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd, sob, son,
                      soh, sod, slb, sln, slh, smb, smn, smh, head_dim, scale_log2, check_rows,
                      kv_heads, threshold, keep_scale, first_row, first_head, CAUSAL, HAS_MASK,
                      PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE, REPORT, PATTERNS,
                      BLOCK_M, BLOCK_N, BLOCK_D)


@triton.jit
def _forward_tile(
    tile, Q, K, V, Out, Lse, Mask, AnyBad, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, slb, sln, slh, smb, smn, smh,
    head_dim, scale_log2, check_rows, kv_heads, threshold, keep_scale, first_row, first_head,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, EXTRAS: tl.constexpr,
    POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr, NONFINITE: tl.constexpr,
    REPORT: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out, lse of one query tile: the online softmax over its spans' keys, each span's
    whole unmasked chunks first, then the masked rest (the flags: ``fused_forward``)."""
    b, head, span_lo, span_hi, cell, t, row_ok, first, last = _program(tiles, rows, tile,
                                                                       BLOCK_M)
    q = _load_rows(Q, b, t, row_ok, head, sqb, sqn, sqh, sqd, head_dim, BLOCK_D)
    seed = dropout_key(Seed, PATTERNS)
    if REPORT:
        # taken now: nothing of it stays live through the key loop but this scalar (a sum
        # is not finite where an element is not, or where finite ones overflow: then the
        # rule's variant runs for nothing, and gives the same result)
        checked = tl.sum(tl.sum(q.to(tl.float32), 1), 0)
    d_ok = tl.arange(0, BLOCK_D)[None, :] < head_dim
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hit = tl.zeros((BLOCK_M,), tl.int32)
    for s in range(span_lo, span_hi):
        start, stride, lo, hi, bias, extra_lo, extra_hi, bits, k_at, v_at, mask_at = _key_span(
            spans, s, cell, first, last, K, V, Mask, b, skb, skh, skd, svb, svh, svd, smb,
            smh, CAUSAL, BLOCK_D)
        span_counts, span_bits = span_selection(extras, extra_lo, extra_hi, lo, bits, EXTRAS,
                                                POW2_PERIODS, SPAN_COUNTS, PATTERNS, BLOCK_N)
        # query tiles: the masked chunks are the last ones (full_lo is lo); a padding
        # mask masks every chunk (and the unmasked loop is not compiled: fewer registers)
        full_hi = lo
        if not HAS_MASK:
            _, full_hi = unmasked_chunks(lo, hi, start, stride, first, last, CAUSAL, False,
                                         BLOCK_N)
            for c in range(lo, full_hi, BLOCK_N):
                m_i, l_i, acc, hit = _softmax_step(
                    q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo,
                    extra_hi, span_counts, skn, svn, smn, d_ok, scale_log2, bias, m_i, l_i, acc,
                    hit, span_bits, seed, b, first_head + head, first_row, threshold, keep_scale,
                    False, CAUSAL, HAS_MASK, PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS,
                    NONFINITE, PATTERNS, BLOCK_N)
        for c in range(full_hi, hi, BLOCK_N):
            m_i, l_i, acc, hit = _softmax_step(
                q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo, extra_hi,
                span_counts, skn, svn, smn, d_ok, scale_log2, bias, m_i, l_i, acc, hit, span_bits,
                seed, b, first_head + head, first_row, threshold, keep_scale, True, CAUSAL,
                HAS_MASK, PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE, PATTERNS,
                BLOCK_N)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # natural log: (m + log2 l) * ln 2; a row that attends nothing: -inf
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    if REPORT:
        checked += tl.sum(tl.sum(out, 1), 0)
    if NONFINITE:
        # NaN for a non-finite q row (its own) or one that attends a non-finite k (l is
        # NaN); the out too where it attends a non-finite v (hit, else the products)
        bad_lse = (_nonfinite_rows(q) > 0) | (l_i != l_i)
        bad_out = bad_lse | (hit > 0) | (_nonfinite_rows(out) > 0)
        out = tl.where(bad_out[:, None], float("nan"), out)
        lse = tl.where(bad_lse, float("nan"), lse)
    _store_rows(Out, out, b, t, row_ok, head, sob, son, soh, sod, head_dim, BLOCK_D)
    tl.store(Lse + b.to(tl.int64) * slb + t.to(tl.int64) * sln + head.to(tl.int64) * slh, lse,
             mask=row_ok)
    if REPORT:
        # k's share last, when nothing but a scalar is live: before the key loop it moved
        # the loop's spills (sm_90, LongNet's d 128 tile: 76 bytes instead of 64), and
        # with the out live sm_100's d 256 tile spilled
        checked += _share_sum(K, b, check_rows, kv_heads, skb, skn, skh, skd, head_dim,
                              BLOCK_D, BLOCK_M)
        # all programs store the same NaN: no atomics needed
        if not _finite(checked):
            tl.store(AnyBad, float("nan"))


@triton.jit
def _lse_log2(lse):
    """lse in base 2, +inf for rows that attend nothing (their probabilities are then 0)."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _dq_step(q, do, t, row_ok, lse, delta, dq, k_at, v_at, mask_at, extras, start, stride, c,
             hi, extra_lo, extra_hi, span_counts, skn, svn, smn, d_ok, scale_log2, span_bits,
             seed, b, head, first_row, threshold, keep_scale, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
             EXTRAS: tl.constexpr, POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr,
             NONFINITE: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of the tile's rows plus one chunk of keys' share. NONFINITE: a masked chunk's
    non-finite k, v elements read as 0 (a row attending one has a NaN lse or delta already,
    so its dq is NaN; one that does not gets p = 0 times finite numbers). PATTERNS > 0: with
    the forward's dropout, ds = dropped(p) dp - p delta (``triton_dropout.dropped``)."""
    k, v, qk, counts, bits, _ = _key_products(
        q, t, row_ok, k_at, v_at, mask_at, extras, start, stride, c, hi, extra_lo, extra_hi,
        span_counts, span_bits, skn, svn, smn, d_ok, MASKED, CAUSAL, HAS_MASK, PRECISION,
        EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE, False, PATTERNS, BLOCK_N)
    # (M, N): the final softmax's probabilities (counts included; masked: 0)
    p = tl.exp2(qk * scale_log2 - lse[:, None])
    if EXTRAS > 0:
        p *= counts[None, :]
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if PATTERNS > 0:
        u = start + (c + tl.arange(0, BLOCK_N)) * stride
        ds = (dropped(p, seed, b, head, t + first_row, u + first_row, bits, threshold, keep_scale,
                      PATTERNS, False) * dp
              - p * delta[:, None])
    else:
        ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit(do_not_specialize=["first_row", "first_head"])
def fused_dq(
    Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Mask, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, sdob, sdon, sdoh, sdod, slb, sln, slh, sdlb, sdln, sdlh,
    sdqb, sdqn, sdqh, sdqd, smb, smn, smh,
    head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISION: tl.constexpr, EXTRAS: tl.constexpr, POW2_PERIODS: tl.constexpr,
    SPAN_COUNTS: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dq of query tiles, a program per tile, and delta = rowsum(dout * out) - dlse of their
    rows (the dK/dV kernels read it: the query tiles cover every (row, head) once).

    Delta has lse's strides."""
    _dq_tile(tl.program_id(0), Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Mask, Seed, tiles, rows,
             spans, extras, sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd, sob, son,
             soh, sod, sdob, sdon, sdoh, sdod, slb, sln, slh, sdlb, sdln, sdlh, sdqb, sdqn, sdqh,
             sdqd, smb, smn, smh, head_dim, scale_log2, scale, threshold, keep_scale, first_row,
             first_head, CAUSAL, HAS_MASK, HAS_DLSE, PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS,
             False, PATTERNS, BLOCK_M, BLOCK_N, BLOCK_D)


@triton.jit
def _dq_tile(
    tile, Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Mask, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, sdob, sdon, sdoh, sdod, slb, sln, slh, sdlb, sdln, sdlh,
    sdqb, sdqn, sdqh, sdqd, smb, smn, smh,
    head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISION: tl.constexpr, EXTRAS: tl.constexpr, POW2_PERIODS: tl.constexpr,
    SPAN_COUNTS: tl.constexpr, NONFINITE: tl.constexpr, PATTERNS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dq of one query tile (``fused_dq``), and its delta, which the plain kernel
    (not NONFINITE) stores: the rule's variant runs beside dK/dV's, which read it, and computes
    the same numbers (delta does not depend on the rule)."""
    b, head, span_lo, span_hi, cell, t, row_ok, first, last = _program(tiles, rows, tile,
                                                                       BLOCK_M)
    q = _load_rows(Q, b, t, row_ok, head, sqb, sqn, sqh, sqd, head_dim, BLOCK_D)
    do = _load_rows(dOut, b, t, row_ok, head, sdob, sdon, sdoh, sdod, head_dim, BLOCK_D)
    seed = dropout_key(Seed, PATTERNS)
    o = _load_rows(Out, b, t, row_ok, head, sob, son, soh, sod, head_dim, BLOCK_D)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= _row_values(dLse, b, t, row_ok, head, sdlb, sdln, sdlh)
    if not NONFINITE:
        tl.store(Delta + b.to(tl.int64) * slb + t.to(tl.int64) * sln + head.to(tl.int64) * slh,
                 delta, mask=row_ok)
    lse = _lse_log2(_row_values(Lse, b, t, row_ok, head, slb, sln, slh))
    d_ok = tl.arange(0, BLOCK_D)[None, :] < head_dim
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(span_lo, span_hi):
        start, stride, lo, hi, bias, extra_lo, extra_hi, bits, k_at, v_at, mask_at = _key_span(
            spans, s, cell, first, last, K, V, Mask, b, skb, skh, skd, svb, svh, svd, smb,
            smh, CAUSAL, BLOCK_D)
        # the span's times on its logits (fused_forward): on the lse, once per span
        lse_span = lse - bias
        span_counts, span_bits = span_selection(extras, extra_lo, extra_hi, lo, bits, EXTRAS,
                                                POW2_PERIODS, SPAN_COUNTS, PATTERNS, BLOCK_N)
        full_hi = lo  # as in fused_forward
        if not HAS_MASK:
            _, full_hi = unmasked_chunks(lo, hi, start, stride, first, last, CAUSAL, False,
                                         BLOCK_N)
            for c in range(lo, full_hi, BLOCK_N):
                dq = _dq_step(q, do, t, row_ok, lse_span, delta, dq, k_at, v_at, mask_at, extras,
                              start, stride, c, hi, extra_lo, extra_hi, span_counts, skn, svn, smn,
                              d_ok, scale_log2, span_bits, seed, b, first_head + head, first_row,
                              threshold, keep_scale, False, CAUSAL, HAS_MASK, PRECISION, EXTRAS,
                              POW2_PERIODS, SPAN_COUNTS, NONFINITE, PATTERNS, BLOCK_N)
        for c in range(full_hi, hi, BLOCK_N):
            dq = _dq_step(q, do, t, row_ok, lse_span, delta, dq, k_at, v_at, mask_at, extras, start,
                          stride, c, hi, extra_lo, extra_hi, span_counts, skn, svn, smn, d_ok,
                          scale_log2, span_bits, seed, b, first_head + head, first_row, threshold,
                          keep_scale, True, CAUSAL, HAS_MASK, PRECISION, EXTRAS, POW2_PERIODS,
                          SPAN_COUNTS, NONFINITE, PATTERNS, BLOCK_N)
    _store_rows(dQ, dq * scale, b, t, row_ok, head, sdqb, sdqn, sdqh, sdqd, head_dim, BLOCK_D)


@triton.jit
def _dkdv_step(k, v, u, live, dk, dv, q_at, do_at, lse_at, delta_at, extras, start, stride, c,
               hi, bias, extra_lo, extra_hi, span_counts, sqn, sdon, sln, d_ok, scale_log2,
               span_bits, seed, b, head, first_row, threshold, keep_scale, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr, EXTRAS: tl.constexpr,
               POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr, NONFINITE: tl.constexpr,
               PATTERNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv of the tile's key rows plus one chunk of queries' share; MASKED as in
    ``_key_products`` (else every query of the chunk reads every key row: no mask).
    NONFINITE: in a masked chunk non-finite q, dout elements read as 0 and a masked pair's
    ds is 0 (its query's lse or delta may be NaN). PATTERNS > 0: with the forward's dropout
    (``triton_dropout.dropped``), dv from the dropped p, ds = dropped(p) dp - p delta."""
    # no helper calls here but the counts' (see _key_products)
    idx = c + tl.arange(0, BLOCK_N)
    t = start + idx * stride
    t64 = t.to(tl.int64)
    if MASKED:
        q_ok = idx < hi
        q = tl.load(q_at + t64[:, None] * sqn, mask=q_ok[:, None] & d_ok, other=0.0)
        do = tl.load(do_at + t64[:, None] * sdon, mask=q_ok[:, None] & d_ok, other=0.0)
        lse = tl.load(lse_at + t64 * sln, mask=q_ok, other=0.0)
        delta = tl.load(delta_at + t64 * sln, mask=q_ok, other=0.0)
        if NONFINITE:
            q = tl.where(_finite(q), q, 0.0)
            do = tl.where(_finite(do), do, 0.0)
    else:
        q = tl.load(q_at + t64[:, None] * sqn, mask=d_ok, other=0.0)
        do = tl.load(do_at + t64[:, None] * sdon, mask=d_ok, other=0.0)
        lse = tl.load(lse_at + t64 * sln)
        delta = tl.load(delta_at + t64 * sln)
    # the span's times (bias, see fused_forward) enter in the fused multiply-add to base 2;
    # a query that attends nothing has lse -inf: +inf, so that its p is 0. In an unmasked
    # chunk of the plain kernel a query attends every key of the tile, so lse is -inf only
    # where all its logits are (an overflow), and clamping it to -FLT_MAX keeps those p at 0
    # in one instruction (a NaN lse comes of a non-finite input: the rule's variant, which
    # turns it as a masked chunk does, then overwrites the tile)
    lse = lse * 1.4426950408889634 - bias
    if MASKED or NONFINITE:
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    else:
        lse = tl.maximum(lse, -3.4028234663852886e38)
    # (M keys, N queries): the probabilities, with the queries' counts
    qk = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    p = tl.exp2(qk * scale_log2 - lse[None, :])
    counts, bits = span_counts, span_bits
    if EXTRAS > 0:
        if not SPAN_COUNTS:
            counts, bits = selection(extras, extra_lo, extra_hi, idx, span_bits, EXTRAS,
                                     POW2_PERIODS, PATTERNS, BLOCK_N)
        p *= counts[None, :]
    if MASKED:
        valid = live[:, None] & q_ok[None, :]
        if CAUSAL:
            valid &= u[:, None] <= t[None, :]
        p = tl.where(valid, p, 0.0)
    if PATTERNS > 0:
        kept = dropped(p, seed, b, head, t + first_row, u + first_row, bits, threshold, keep_scale,
                       PATTERNS, True)
        dv = tl.dot(kept.to(do.dtype), do, dv, input_precision=PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = kept * dp - p * delta[None, :]
    else:
        dv = tl.dot(p.to(do.dtype), do, dv, input_precision=PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = p * (dp - delta[None, :])
    if MASKED and NONFINITE:
        ds = tl.where(valid, ds, 0.0)
    dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["first_row", "first_head"])
def fused_dkdv(
    Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sdob, sdon, sdoh, sdod, slb, sln, slh, sdkb, sdkn, sdkh, sdkd,
    sdvb, sdvn, sdvh, sdvd, smb, smn, smh,
    head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, EXTRAS: tl.constexpr,
    POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr, PATTERNS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dK, dV of key tiles, a program per tile. Delta has lse's strides."""
    _dkdv_tile(tl.program_id(0), Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Seed, tiles, rows, spans,
               extras, sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd, sdob, sdon, sdoh,
               sdod, slb, sln, slh, sdkb, sdkn, sdkh, sdkd, sdvb, sdvn, sdvh, sdvd, smb, smn, smh,
               head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head, CAUSAL,
               HAS_MASK, PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS, False, PATTERNS, BLOCK_M,
               BLOCK_N, BLOCK_D)


@triton.jit(do_not_specialize=["num_query_tiles", "num_key_tiles", "first_row", "first_head"])
def fused_backward_rule(
    Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, dK, dV, Mask, AnyBad, Seed,
    query_tiles, query_rows, query_spans, query_extras,
    key_tiles, key_rows, key_spans, key_extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, sdob, sdon, sdoh, sdod, slb, sln, slh, sdlb, sdln, sdlh,
    sdqb, sdqn, sdqh, sdqd, sdkb, sdkn, sdkh, sdkd, sdvb, sdvn, sdvh, sdvd, smb, smn, smh,
    head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head, num_query_tiles,
    num_key_tiles,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISION: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_D: tl.constexpr,
    QUERY_EXTRAS: tl.constexpr, QUERY_POW2_PERIODS: tl.constexpr,
    QUERY_SPAN_COUNTS: tl.constexpr, QUERY_BLOCK_M: tl.constexpr, QUERY_BLOCK_N: tl.constexpr,
    KEY_EXTRAS: tl.constexpr, KEY_POW2_PERIODS: tl.constexpr, KEY_SPAN_COUNTS: tl.constexpr,
    KEY_BLOCK_M: tl.constexpr, KEY_BLOCK_N: tl.constexpr,
):
    """The backward's variant for the non-finite rule: dq of the query tiles, then dK, dV of
    the key tiles, each program every num_programs-th tile of each (module docstring), as
    one launch after the plain dq and dK/dV kernels, whose delta it reads (the plain dq
    kernel's: the rule does not change it). One launch, not one per kernel: a finite call
    then pays a single launch that reads AnyBad and returns. The two plans' tiles come in
    their widest heights (QUERY_BLOCK_M, KEY_BLOCK_M): a narrower tile is the same tile
    with fewer of its rows real."""
    if _all_finite(AnyBad):
        return
    for tile in range(tl.program_id(0), num_query_tiles, tl.num_programs(0)):
        _dq_tile(tile, Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Mask, Seed, query_tiles,
                 query_rows, query_spans, query_extras, sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb,
                 svn, svh, svd, sob, son, soh, sod, sdob, sdon, sdoh, sdod, slb, sln, slh, sdlb,
                 sdln, sdlh, sdqb, sdqn, sdqh, sdqd, smb, smn, smh, head_dim, scale_log2, scale,
                 threshold, keep_scale, first_row, first_head, CAUSAL, HAS_MASK, HAS_DLSE,
                 PRECISION, QUERY_EXTRAS, QUERY_POW2_PERIODS, QUERY_SPAN_COUNTS, True, PATTERNS,
                 QUERY_BLOCK_M, QUERY_BLOCK_N, BLOCK_D)
    for tile in range(tl.program_id(0), num_key_tiles, tl.num_programs(0)):
        _dkdv_tile(tile, Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Seed, key_tiles, key_rows,
                   key_spans, key_extras, sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh,
                   svd, sdob, sdon, sdoh, sdod, slb, sln, slh, sdkb, sdkn, sdkh, sdkd, sdvb, sdvn,
                   sdvh, sdvd, smb, smn, smh, head_dim, scale_log2, scale, threshold, keep_scale,
                   first_row, first_head, CAUSAL, HAS_MASK, PRECISION, KEY_EXTRAS, KEY_POW2_PERIODS,
                   KEY_SPAN_COUNTS, True, PATTERNS, KEY_BLOCK_M, KEY_BLOCK_N, BLOCK_D)


@triton.jit
def _dkdv_tile(
    tile, Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Seed, tiles, rows, spans, extras,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sdob, sdon, sdoh, sdod, slb, sln, slh, sdkb, sdkn, sdkh, sdkd,
    sdvb, sdvn, sdvh, sdvd, smb, smn, smh,
    head_dim, scale_log2, scale, threshold, keep_scale, first_row, first_head,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, EXTRAS: tl.constexpr,
    POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr, NONFINITE: tl.constexpr,
    PATTERNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dK, dV of one key tile (rows of one key/value head): over the spans of query rows
    that read them, for every query head of its GQA group; written once. Per span the
    masked chunks (causal: the first ones, queries before the tile's last row; the last,
    partial one) and the unmasked ones between them (the flags: ``fused_dkdv``)."""
    b, kv, span_lo, span_hi, cell, u, row_ok, first, last = _program(tiles, rows, tile,
                                                                     BLOCK_M)
    k = _load_rows(K, b, u, row_ok, kv, skb, skn, skh, skd, head_dim, BLOCK_D)
    v = _load_rows(V, b, u, row_ok, kv, svb, svn, svh, svd, head_dim, BLOCK_D)
    seed = dropout_key(Seed, PATTERNS)
    live = row_ok
    if HAS_MASK:
        # an ignored key is in no softmax: its gradients are 0
        live &= _row_values(Mask, b, u, row_ok, kv, smb, smn, smh) == 0
    d_ok = tl.arange(0, BLOCK_D)[None, :] < head_dim
    dk = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(span_lo, span_hi):
        head, start, stride, lo, hi, bias, extra_lo, extra_hi, bits = _span(
            spans, s, cell, first, last, CAUSAL, True)
        q_at = _rows_at(Q, b, head, sqb, sqh, sqd, BLOCK_D)
        do_at = _rows_at(dOut, b, head, sdob, sdoh, sdod, BLOCK_D)
        # lse and delta share their strides
        lse_at = Lse + b.to(tl.int64) * slb + head.to(tl.int64) * slh
        delta_at = Delta + b.to(tl.int64) * slb + head.to(tl.int64) * slh
        span_counts, span_bits = span_selection(extras, extra_lo, extra_hi, lo, bits, EXTRAS,
                                                POW2_PERIODS, SPAN_COUNTS, PATTERNS, BLOCK_N)
        # a padding mask masks every chunk (the other loops are not compiled then)
        full_hi = lo
        if not HAS_MASK:
            full_lo, full_hi = unmasked_chunks(lo, hi, start, stride, first, last, CAUSAL,
                                               True, BLOCK_N)
            if CAUSAL:
                for c in range(lo, full_lo, BLOCK_N):
                    dk, dv = _dkdv_step(k, v, u, live, dk, dv, q_at, do_at, lse_at, delta_at,
                                        extras, start, stride, c, hi, bias, extra_lo, extra_hi,
                                        span_counts, sqn, sdon, sln, d_ok, scale_log2, span_bits,
                                        seed, b, first_head + head, first_row, threshold,
                                        keep_scale, True, CAUSAL, PRECISION, EXTRAS, POW2_PERIODS,
                                        SPAN_COUNTS, NONFINITE, PATTERNS, BLOCK_N)
            for c in range(full_lo, full_hi, BLOCK_N):
                dk, dv = _dkdv_step(k, v, u, live, dk, dv, q_at, do_at, lse_at, delta_at, extras,
                                    start, stride, c, hi, bias, extra_lo, extra_hi, span_counts,
                                    sqn, sdon, sln, d_ok, scale_log2, span_bits, seed, b,
                                    first_head + head, first_row, threshold, keep_scale, False,
                                    CAUSAL, PRECISION, EXTRAS, POW2_PERIODS, SPAN_COUNTS, NONFINITE,
                                    PATTERNS, BLOCK_N)
        for c in range(full_hi, hi, BLOCK_N):
            dk, dv = _dkdv_step(k, v, u, live, dk, dv, q_at, do_at, lse_at, delta_at, extras, start,
                                stride, c, hi, bias, extra_lo, extra_hi, span_counts, sqn, sdon,
                                sln, d_ok, scale_log2, span_bits, seed, b, first_head + head,
                                first_row, threshold, keep_scale, True, CAUSAL, PRECISION, EXTRAS,
                                POW2_PERIODS, SPAN_COUNTS, NONFINITE, PATTERNS, BLOCK_N)
    _store_rows(dK, dk * scale, b, u, row_ok, kv, sdkb, sdkn, sdkh, sdkd, head_dim, BLOCK_D)
    _store_rows(dV, dv, b, u, row_ok, kv, sdvb, sdvn, sdvh, sdvd, head_dim, BLOCK_D)
