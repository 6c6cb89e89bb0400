"""Ring attention: exact dense attention over a sequence spread across ranks.

Notation: b batch, n this rank's query rows, m a key block's rows, h query
heads, hk key/value heads, d head dim, P ranks; layout (b, n, h, d).

Every rank holds its piece of q, k, v. The K/V blocks travel around the
ring (rank p sends to p+1, receives from p-1): at step s rank p holds the
block of rank (p - s) mod P, and the transfer of the next block is posted
before this block's compute, so communication overlaps compute. The partial
results of the P blocks are merged with ``merge.merge_`` in fp32. A rank
never holds more than its own block plus the block in flight.

The backward runs the ring again with the final merged ``out``/``lse``
(``kernels.attention_backward`` then recomputes each block's share of the
global softmax exactly): dq accumulates locally, and each block's dK/dV
accumulator travels with it, gaining every rank's contribution, until one
last step brings it home.

Pieces may differ in length and be empty; ranks agree on every length in
the one agreement collective before the ring starts, so receive buffers
have the right shapes.

Note [zigzag]
~~~~~~~~~~~~~
With causal attention and contiguous pieces, rank P-1 computes P blocks and
rank 0 one: the ring is as slow as its busiest rank. The zigzag layout cuts
the sequence into 2P chunks of c rows and gives rank p chunks p and
2P-1-p, concatenated (local rows [0, c) are chunk p, [c, 2c) chunk 2P-1-p).
P = 2, chunks 0..3:

    sequence:  | 0 | 1 | 2 | 3 |        rank 0 holds [0 | 3]
                                        rank 1 holds [1 | 2]

Local order is global order on each rank, so for the block of rank src
seen by rank p (every rank does 2c*c units of work at every step):

    src == p   square causal over all 2c rows (the usual triangle)
    src <  p   all 2c queries see the block's first chunk (chunk src < p)
               fully and its second chunk (2P-1-src > 2P-1-p) not at all
    src >  p   the first query chunk (p < src) sees nothing; the second
               (2P-1-p) sees both chunks of the block fully

           keys of rank src
            [src | 2P-1-src]
    src<p:   ###   ...        q rows [0, 2c)  x  k rows [0, c)
    src>p:   ###   ###        q rows [c, 2c)  x  k rows [0, 2c)
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..kernels import KernelOptions, attention_backward, attention_forward, lse_dtype
from ..kernels import save_for_backward, saved_for_backward
from ..merge import empty_accumulators, merge_
from ..validation import check_first_order
from . import comm

_ALL = slice(None)

# RingComm tag bases, so K/V and dK/dV transfers between the same two ranks
# never pair up with each other.
_KV_TAG, _DKV_TAG = 0, 2


def _block_plan(
    layout: str, causal: bool, rank: int, src: int, n_q: int, n_k: int
) -> Optional[Tuple[slice, slice, bool]]:
    """Which query rows meet which key rows of rank `src`'s block, and whether causally.

    None when the block contributes nothing to this rank's queries.
    """
    if n_q == 0 or n_k == 0:
        return None  # the kernels need at least one key; nothing to do
    if not causal:
        return _ALL, _ALL, False
    if src == rank:
        return _ALL, _ALL, True
    if layout == "contiguous":
        return (_ALL, _ALL, False) if src < rank else None
    half = n_q // 2  # Note [zigzag]
    if src < rank:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def _pass_on(ring: comm.RingComm, rows: int, *blocks: Tensor) -> List[Tensor]:
    """Post sending `blocks` to the next rank and receiving the previous rank's (`rows` rows)."""
    received = [
        # (b, m, hk, d) -> (b, rows, hk, d): the previous rank's block may differ in length
        ring.send_recv(x, x.new_empty((x.shape[0], rows) + tuple(x.shape[2:])))
        for x in blocks
    ]
    ring.commit()
    return received


def _lengths(group, n: int, lengths: Optional[Sequence[int]]) -> List[int]:
    size = comm.group_size(group)
    lengths = [n] * size if lengths is None else list(lengths)
    if len(lengths) != size or lengths[comm.group_rank(group)] != n:
        raise ValueError(
            f"lengths {lengths} must give {size} piece lengths including this rank's ({n})"
        )
    return lengths


def ring_forward(
    group,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    opts: KernelOptions,
    *,
    layout: str = "contiguous",
    lengths: Optional[Sequence[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d), lse (b, n, h) fp32.

    `lengths`: every rank's piece length (default: all equal to this one's).
    Every rank of `group` must call this with agreed arguments.
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    n = q.shape[1]
    lengths = _lengths(group, n, lengths)
    if size == 1:
        # one block: the kernel's own result, with no fp32 accumulator and no merge
        return attention_forward(q, k, v, opts)
    ring = comm.RingComm(group, tag=_KV_TAG)
    acc_out, acc_lse = empty_accumulators(q.shape, q.dtype, q.device)
    k_cur, v_cur = k, v
    for step in range(size):
        src = (rank - step) % size
        if step + 1 < size:
            # post the next block's transfer before this block's compute
            k_next, v_next = _pass_on(ring, lengths[(rank - step - 1) % size], k_cur, v_cur)
        plan = _block_plan(layout, opts.causal, rank, src, n, lengths[src])
        if plan is not None:
            rows, keys, block_causal = plan
            out_b, lse_b = attention_forward(
                q[:, rows], k_cur[:, keys], v_cur[:, keys],
                dataclasses.replace(opts, causal=block_causal),
            )
            merge_(acc_out[:, rows], acc_lse[:, rows], out_b, lse_b)
        if step + 1 < size:
            ring.wait()
            k_cur, v_cur = k_next, v_next
    return acc_out.to(q.dtype), acc_lse


def ring_backward(
    group,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    opts: KernelOptions,
    *,
    layout: str = "contiguous",
    lengths: Optional[Sequence[int]] = None,
    dlse: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of this rank's piece, given the final out and lse of `ring_forward`.

    ``dlse`` (b, n, h), when given, is the gradient flowing into ``lse``.
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    n = q.shape[1]
    lengths = _lengths(group, n, lengths)
    if size == 1:
        return attention_backward(dout, q, k, v, out, lse, opts, dlse=dlse)
    acc = lse_dtype(q.dtype)
    kv_ring = comm.RingComm(group, tag=_KV_TAG)
    dkv_ring = comm.RingComm(group, tag=_DKV_TAG)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    dk_in = dv_in = None  # the current block's dK/dV from the ranks before this one
    for step in range(size):
        src = (rank - step) % size
        if step + 1 < size:
            k_next, v_next = _pass_on(kv_ring, lengths[(rank - step - 1) % size], k_cur, v_cur)
        plan = _block_plan(layout, opts.causal, rank, src, n, lengths[src])
        grads = None
        if plan is not None:
            rows, keys, block_causal = plan
            dq_b, dk_b, dv_b = attention_backward(
                dout[:, rows], q[:, rows], k_cur[:, keys], v_cur[:, keys], out[:, rows],
                lse[:, rows], dataclasses.replace(opts, causal=block_causal),
                dlse=None if dlse is None else dlse[:, rows],
            )
            dq[:, rows] += dq_b
            grads = (keys, dk_b, dv_b)
        if step > 0:
            dkv_ring.wait()  # dk_in/dv_in of this block have arrived
        dk_acc, dv_acc = dk_in, dv_in
        if dk_acc is None:  # step 0: this rank's own block starts from zero
            dk_acc = torch.zeros(k_cur.shape, dtype=acc, device=q.device)
            dv_acc = torch.zeros(v_cur.shape, dtype=acc, device=q.device)
        if grads is not None:
            keys, dk_b, dv_b = grads
            dk_acc[:, keys] += dk_b
            dv_acc[:, keys] += dv_b
        # this block's dK/dV go to the next rank, which holds the block at the
        # next step; after the last step that rank is the block's home, and
        # what arrives here is this rank's own complete dK/dV
        dk_in, dv_in = _pass_on(dkv_ring, lengths[(rank - step - 1) % size], dk_acc, dv_acc)
        if step + 1 < size:
            kv_ring.wait()
            k_cur, v_cur = k_next, v_next
    dkv_ring.wait()
    return dq.to(q.dtype), dk_in.to(k.dtype), dv_in.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `ring_backward` (a collective: every rank runs it)."""

    @staticmethod
    def forward(ctx, q, k, v, opts, group, layout, lengths):
        result = ring_forward(group, q, k, v, opts, layout=layout, lengths=lengths)
        return save_for_backward(ctx, q, k, v, result, (opts, group, layout, lengths))

    @staticmethod
    def backward(ctx, dout, dlse):
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        opts, group, layout, lengths = ctx.args
        if comm.is_distributed(group):
            check_first_order("ring_attention with a group of several ranks")
        dq, dk, dv = ring_backward(group, dout, q, k, v, out, lse, opts, layout=layout,
                                   lengths=lengths, dlse=dlse)
        return dq, dk, dv, None, None, None, None
