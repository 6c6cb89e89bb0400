"""What the chunks of a fused plan's span hold, on the device: which patterns select their
elements (the counts the kernels weigh keys by and, with dropout, the patterns' bits) and
which chunks every row of a tile reads in full. The kernels (triton_kernels.py) call these
per span and per chunk; the plan's tables are fused_plan.py's.

Notation: M rows of the tile, N elements of a span chunk (as in triton_kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def selection(extras, extra_lo, extra_hi, idx, span_bits, EXTRAS: tl.constexpr,
              POW2_PERIODS: tl.constexpr, PATTERNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(N,) how many patterns select span elements idx (float): 1 + the span's extras
    (period, phase) with idx mod period == phase; and with dropout (PATTERNS > 0) (N,) int32
    the bits of those patterns (Note [fused dropout] in fused.py): the span's `span_bits`
    and each hitting extra's pattern. Unrolled over the plan's most extras of one span
    (EXTRAS): a loop in the key loop would keep Triton from pipelining its loads.
    POW2_PERIODS (every period a power of two, as rates 1, 2, 4, ... give): idx mod period
    is a bit mask; an integer division per element and extra would cost more than the
    rest of the softmax's arithmetic."""
    count = tl.full((BLOCK_N,), 1.0, tl.float32)
    bits = tl.full((BLOCK_N,), 0, tl.int32) + span_bits
    for j in tl.static_range(EXTRAS):
        e = extra_lo + j
        live = e < extra_hi
        # a span with fewer extras: period 1, phase -1 matches no element
        period = tl.load(extras + 3 * e, mask=live, other=1)
        phase = tl.load(extras + 3 * e + 1, mask=live, other=-1)
        if POW2_PERIODS:
            hit = (idx & (period - 1)) == phase
        else:
            hit = idx % period == phase
        count += tl.where(hit, 1.0, 0.0)
        if PATTERNS > 0:
            pattern = tl.load(extras + 3 * e + 2, mask=live, other=0)
            bits |= tl.where(hit & (pattern < 31), 1 << tl.minimum(pattern, 30), 0)
    return count, bits


@triton.jit
def span_selection(extras, extra_lo, extra_hi, lo, span_bits, EXTRAS: tl.constexpr,
                   POW2_PERIODS: tl.constexpr, SPAN_COUNTS: tl.constexpr,
                   PATTERNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(N,) the counts and bits (``selection``) of every chunk of a span whose chunks
    start at lo + i * BLOCK_N, where every period divides BLOCK_N (SPAN_COUNTS,
    TilePlan.period_lcm): computed once per span, not per chunk (each extra costs a chunk
    about an instruction per pair); else 1 and the span's bits (the steps then compute
    them per chunk, or there are no extras)."""
    counts = tl.full((BLOCK_N,), 1.0, tl.float32)
    bits = tl.full((BLOCK_N,), 0, tl.int32) + span_bits
    if EXTRAS > 0 and SPAN_COUNTS:
        counts, bits = selection(extras, extra_lo, extra_hi, lo + tl.arange(0, BLOCK_N),
                                 span_bits, EXTRAS, POW2_PERIODS, PATTERNS, BLOCK_N)
    return counts, bits


@triton.jit
def unmasked_chunks(lo, hi, start, stride, first, last, CAUSAL: tl.constexpr,
                    KEY_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    """[full_lo, full_hi): the span's whole chunks (from lo, BLOCK_N apart) that every row
    of a tile of rows first..last reads in full, so that they need no mask: no element
    past hi, and under causal no key after the tile's first row (query tiles) or no query
    before its last row (key tiles). The chunks before full_lo and from full_hi on are
    masked. (With a padding mask every chunk is: the kernels do not call this.)"""
    full_lo = lo
    end = hi
    if CAUSAL:
        if KEY_TILES:
            # queries t = start + stride * i >= last
            reach = last - start
            need = tl.minimum(tl.where(reach > 0, (reach + stride - 1) // stride, 0), hi)
            full_lo = lo + tl.maximum(need - lo + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
        else:
            # keys u = start + stride * i <= first
            reach = first - start
            end = tl.minimum(end, tl.where(reach >= 0, reach // stride + 1, 0))
    full_hi = full_lo + tl.maximum(end - full_lo, 0) // BLOCK_N * BLOCK_N
    return full_lo, full_hi
