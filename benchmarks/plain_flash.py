"""Plain flash attention in Triton, forward, dq and dK/dV: the yardsticks of the fused
kernels' chunk loops.

``sass_loops.py --reference`` compiles each with the tile of its fused counterpart (rows,
chunk, warps, stages) and prints its chunk loop beside the fused one's: what the same
Triton emits for one chunk of dense attention (no spans, dilation, masks or counts), so
the difference is what the fused kernels add per chunk. The backward is the fused one's
split (dq over query tiles, dK/dV over key tiles, each recomputing the probabilities
from the lse). Never launched: they only compile.

Notation: n rows, h heads, d = BLOCK_D; q, k, v, out, dout (n, h, d) with n a multiple
of both blocks (no masks); lse and delta (n, h) float32, lse in base 2 and scaled.
"""

import triton
import triton.language as tl


@triton.jit
def _rows(ptr, head, rows, stride_n, stride_h, BLOCK_D: tl.constexpr):
    """(R, D) pointers to x[rows, head, :] of an (n, h, d) tensor."""
    return (ptr + head.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_n
            + tl.arange(0, BLOCK_D)[None, :])


@triton.jit
def _per_row(ptr, head, rows):
    """(R,) pointers to x[rows, head] of an (n, h) tensor."""
    return ptr + rows * tl.num_programs(1) + head


@triton.jit
def plain_flash_forward(Q, K, V, Out, stride_n, stride_h, n, scale_log2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out = softmax(Q K^T * scale) V for one tile of BLOCK_M rows of one head."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    # (M, D)
    q = tl.load(_rows(Q, head, rows, stride_n, stride_h, BLOCK_D))
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for c in range(0, n, BLOCK_N):
        keys = c + tl.arange(0, BLOCK_N)
        # (N, D)
        k = tl.load(_rows(K, head, keys, stride_n, stride_h, BLOCK_D))
        v = tl.load(_rows(V, head, keys, stride_n, stride_h, BLOCK_D))
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(_rows(Out, head, rows, stride_n, stride_h, BLOCK_D), out.to(Out.dtype.element_ty))


@triton.jit
def plain_flash_dq(Q, K, V, DO, Lse, Delta, DQ, stride_n, stride_h, n, scale_log2,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq of one tile of BLOCK_M query rows of one head, over every key."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    q = tl.load(_rows(Q, head, rows, stride_n, stride_h, BLOCK_D))
    do = tl.load(_rows(DO, head, rows, stride_n, stride_h, BLOCK_D))
    lse = tl.load(_per_row(Lse, head, rows))
    delta = tl.load(_per_row(Delta, head, rows))
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for c in range(0, n, BLOCK_N):
        keys = c + tl.arange(0, BLOCK_N)
        k = tl.load(_rows(K, head, keys, stride_n, stride_h, BLOCK_D))
        v = tl.load(_rows(V, head, keys, stride_n, stride_h, BLOCK_D))
        # (M, N)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    tl.store(_rows(DQ, head, rows, stride_n, stride_h, BLOCK_D), dq.to(DQ.dtype.element_ty))


@triton.jit
def plain_flash_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, stride_n, stride_h, n, scale_log2,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dk, dv of one tile of BLOCK_M key rows of one head, over every query."""
    keys = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    k = tl.load(_rows(K, head, keys, stride_n, stride_h, BLOCK_D))
    v = tl.load(_rows(V, head, keys, stride_n, stride_h, BLOCK_D))
    dk = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for c in range(0, n, BLOCK_N):
        rows = c + tl.arange(0, BLOCK_N)
        q = tl.load(_rows(Q, head, rows, stride_n, stride_h, BLOCK_D))
        do = tl.load(_rows(DO, head, rows, stride_n, stride_h, BLOCK_D))
        lse = tl.load(_per_row(Lse, head, rows))
        delta = tl.load(_per_row(Delta, head, rows))
        # (M keys, N queries)
        p = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])
        dv = tl.dot(p.to(do.dtype), do, dv)
        ds = p * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk = tl.dot(ds.to(q.dtype), q, dk)
    tl.store(_rows(DK, head, keys, stride_n, stride_h, BLOCK_D), dk.to(DK.dtype.element_ty))
    tl.store(_rows(DV, head, keys, stride_n, stride_h, BLOCK_D), dv.to(DV.dtype.element_ty))
