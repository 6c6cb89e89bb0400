"""Attention dropout inside the fused kernels (device side): which patterns select a pair,
and the pair's probability with their masks applied. Note [fused dropout] in fused.py says
why one visit of a pair draws one bit per pattern and how the kernels' masks agree; the
kernels (triton_kernels.py) call these where a launch has PATTERNS > 0.

Notation: M rows of the tile, N elements of a span chunk (as in triton_kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dropout_key(Seed, PATTERNS: tl.constexpr):
    """The call's Philox key (int64) with dropout (PATTERNS > 0), else 0, unread."""
    seed = 0
    if PATTERNS > 0:
        seed = tl.load(Seed)
    return seed


@triton.jit
def dropped(p, seed, b, head, t, u, bits, threshold, keep_scale, PATTERNS: tl.constexpr,
            KEY_TILES: tl.constexpr):
    """p (M, N) with attention dropout (Note [fused dropout] in fused.py): each pair's
    probability times (its patterns that keep it) / (its patterns) / (1 - dropout). Pattern
    i keeps the pair where the 31 high bits of Philox word i mod 4 of counter (query row,
    key row, batch row, query head * 8 + i // 4) under the call's key `seed` are at least
    `threshold`: the same bits wherever a kernel visits the pair, and the patterns that
    select it (`bits` (N,), the chunk's elements', triton_spans.selection; their
    count is the pair's: tests/test_fused_plan.py) each draw their own. t the query rows and
    u the key rows of the chunk ((M,) and (N,); KEY_TILES: (N,) and (M,)) and `head` the
    query head, the sequence's (the kernels add Dropout.first_row and first_head).
    PATTERNS: how many patterns the call has, four a Philox call."""
    selected = tl.zeros(bits.shape, tl.float32)  # (N,) the patterns each element's bits name
    for i in tl.static_range(PATTERNS):
        selected += ((bits >> i) & 1).to(tl.float32)
    zero = tl.zeros(p.shape, tl.int32)
    if KEY_TILES:
        query, key = t[None, :] + zero, u[:, None] + zero
    else:
        query, key = t[:, None] + zero, u[None, :] + zero
    batch = zero + b
    mask = bits[None, :] + zero
    kept = tl.zeros(p.shape, tl.float32)
    for group in tl.static_range((PATTERNS + 3) // 4):
        r0, r1, r2, r3 = tl.philox(seed, query, key, batch, zero + (head * 8 + group))
        kept += tl.where(((mask >> 4 * group) & 1 != 0) & ((r0 >> 1).to(tl.int32) >= threshold),
                         1.0, 0.0)
        if 4 * group + 1 < PATTERNS:
            kept += tl.where(((mask >> 4 * group + 1) & 1 != 0)
                             & ((r1 >> 1).to(tl.int32) >= threshold), 1.0, 0.0)
        if 4 * group + 2 < PATTERNS:
            kept += tl.where(((mask >> 4 * group + 2) & 1 != 0)
                             & ((r2 >> 1).to(tl.int32) >= threshold), 1.0, 0.0)
        if 4 * group + 3 < PATTERNS:
            kept += tl.where(((mask >> 4 * group + 3) & 1 != 0)
                             & ((r3 >> 1).to(tl.int32) >= threshold), 1.0, 0.0)
    return p * kept * (keep_scale / selected)[None, :]
