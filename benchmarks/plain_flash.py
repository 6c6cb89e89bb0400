"""A plain flash-attention forward in Triton: the yardstick of the fused kernel's key loop.

``sass_loops.py --reference`` compiles it with the fused forward's tile (rows, chunk,
warps, stages) and prints its chunk loop beside the fused one's: what the same Triton
emits for one chunk of dense attention (no spans, dilation, masks or counts), so the
difference is what the fused kernel adds per chunk. Never launched: it only compiles.
"""

import triton
import triton.language as tl


@triton.jit
def plain_flash_forward(Q, K, V, Out, stride_n, stride_h, n, scale_log2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out = softmax(Q K^T * scale) V for one tile of BLOCK_M rows of one head; q, k, v,
    out (n, h, BLOCK_D) with n a multiple of both blocks (no masks)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64) * stride_h
    d = tl.arange(0, BLOCK_D)
    # (M, D)
    q = tl.load(Q + head + rows[:, None].to(tl.int64) * stride_n + d[None, :])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for c in range(0, n, BLOCK_N):
        keys = (c + tl.arange(0, BLOCK_N)).to(tl.int64)
        # (N, D)
        k = tl.load(K + head + keys[:, None] * stride_n + d[None, :])
        v = tl.load(V + head + keys[:, None] * stride_n + d[None, :])
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + head + rows[:, None].to(tl.int64) * stride_n + d[None, :],
             out.to(Out.dtype.element_ty))
