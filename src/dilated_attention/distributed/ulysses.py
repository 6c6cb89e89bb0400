"""Head-parallel (Ulysses) attention: an all-to-all from rows to heads, and back.

Notation: b batch, U ranks of a head group, n_v the rows rank v holds, N = sum_v n_v
(their pieces concatenated in rank order: a contiguous block of the sequence), h query
heads, hk key/value heads, g = h / hk, d head dim.

Each rank of the group holds its own rows of every head. One all-to-all turns
(my rows, all heads) into (all N rows, my heads): rank u receives query heads
[u h/U, (u+1) h/U) and the key/value heads those read. The attention then runs on N
rows for h / U heads -- locally, or sequence-parallel over another group (the second
dimension of a 2-D mesh) -- with every head's *global* index, so the dilation offsets
(global head mod r) are those of one device. A second all-to-all brings out and lse back
to (my rows, all heads).

GQA: when U divides hk, rank u gets hk / U key/value heads, none twice. Otherwise a
key/value head read by the query heads of several ranks goes to each of them (only the
ones a rank reads: at most ceil(h/U / g) + 1), and in backward their dK/dV are summed
at the head's owner. Query heads must divide over U (a clear error otherwise).

Wire format: a rank's piece for rank v is (n, b, heads of v, ...) -- rows first -- so the
pieces a rank receives, in rank order, are one (N, b, heads, ...) buffer without a copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence, Tuple

import torch
from torch import Tensor

from ..patterns import Heads
from ..validation import check_first_order
from . import comm


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """Which heads each of `ranks` head-parallel ranks computes."""

    ranks: int
    heads: int
    kv_heads: int

    @classmethod
    def of(cls, ranks: int, heads: int, kv_heads: int) -> "HeadSplit":
        if heads % ranks:
            raise ValueError(
                f"{heads} query heads cannot be split over {ranks} head-parallel ranks: the "
                f"head-parallel group size must divide the query heads (use a smaller head "
                f"dimension of the mesh, or strategy='exchange')"
            )
        return cls(ranks, heads, kv_heads)

    def query(self, rank: int) -> range:
        per = self.heads // self.ranks
        return range(rank * per, (rank + 1) * per)

    def kv(self, rank: int) -> range:
        """The key/value heads rank `rank`'s query heads read (contiguous)."""
        g, q = self.heads // self.kv_heads, self.query(rank)
        return range(q.start // g, (q.stop - 1) // g + 1)

    def local_heads(self, rank: int) -> Heads:
        """`Heads` of rank `rank` after the all-to-all: global offsets, local kv indices."""
        g, q, kv = self.heads // self.kv_heads, self.query(rank), self.kv(rank)
        return Heads(q.start, tuple(j // g - kv.start for j in q))


def _rows_to_heads(x: Tensor, heads: Sequence[range], lengths: Sequence[int],
                   group: Any) -> Tensor:
    """x (b, n, H, ...) -> (b, N, heads[me], ...): every rank's rows of my heads.

    heads[v]: the heads (of H) rank v receives; lengths[v]: rank v's rows.
    """
    me = comm.group_rank(group)
    b, rest = x.shape[0], tuple(x.shape[3:])
    mine = len(heads[me])
    # (b, n, H, ...) -> per destination v (n, b, |heads[v]|, ...), rows first
    sends = [x[:, :, r.start:r.stop].transpose(0, 1) for r in heads]
    buffer = comm.all_to_all(sends, [(n, b, mine) + rest for n in lengths], group)
    # the pieces in rank order: (N, b, heads, ...) -> (b, N, heads, ...)
    return buffer.view((sum(lengths), b, mine) + rest).transpose(0, 1)


def _heads_to_rows(y: Tensor, heads: Sequence[range], lengths: Sequence[int], group: Any,
                   total_heads: int) -> Tensor:
    """The inverse: y (b, N, heads[me], ...) -> (b, n, H, ...), summing heads received twice.

    Rank v sends back the rows of this rank's piece for heads[v]; a head that
    several ranks held (a replicated key/value head) is summed.
    """
    me = comm.group_rank(group)
    b, rest = y.shape[0], tuple(y.shape[3:])
    starts = [sum(lengths[:v]) for v in range(len(lengths))]
    # (b, N, heads, ...) -> per destination v its rows (n_v, b, heads, ...)
    sends = [y[:, s:s + n].transpose(0, 1) for s, n in zip(starts, lengths)]
    shapes = [(lengths[me], b, len(r)) + rest for r in heads]
    buffer = comm.all_to_all(sends, shapes, group)
    pieces = [flat.view(shape) for flat, shape in
              zip(buffer.split([math.prod(s) for s in shapes]), shapes)]
    if all(heads[v].stop == heads[v + 1].start for v in range(len(heads) - 1)):
        # disjoint consecutive heads (queries, outputs): (n, b, H, ...) by concatenation
        out = torch.cat(pieces, dim=2)
    else:
        out = y.new_zeros((lengths[me], b, total_heads) + rest)
        for r, piece in zip(heads, pieces):
            out[:, :, r.start:r.stop] += piece
    # (n, b, H, ...) -> (b, n, H, ...)
    return out.transpose(0, 1)


class _InputsToHeads(torch.autograd.Function):
    """q and the stacked k, v to heads (`_rows_to_heads`); backward `_heads_to_rows` of the
    gradients some rank needs (those of replicated kv heads summed). One node for both: it
    exists on every rank where q, k or v requires grad, which every rank agreed on (not
    which of them). `grads` (agreed: which of q and k/v some rank differentiates) decides
    which all-to-alls its backward makes, the same on every rank: one for a gradient some
    rank needs (a rank whose own input takes none sends its share, as zeros where it did
    not reach the loss, and autograd drops what comes back), none for a gradient no rank
    needs (its output is not differentiable: the attention does not compute it)."""

    @staticmethod
    def forward(ctx, q, kv, q_heads, kv_heads, lengths, group, grads):
        ctx.args = (q_heads, kv_heads, lengths, group, q.shape[2], kv.shape[2], grads)
        ctx.set_materialize_grads(False)
        outputs = (_rows_to_heads(q, q_heads, lengths, group),
                   _rows_to_heads(kv, kv_heads, lengths, group))
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in outputs]
        ctx.mark_non_differentiable(*(x for x, used in zip(outputs, grads) if not used))
        return outputs

    @staticmethod
    def backward(ctx, dq, dkv):
        q_heads, kv_heads, lengths, group, q_total, kv_total, grads = ctx.args
        check_first_order("Ulysses (head-parallel) attention")
        results = []
        for used, grad, (shape, dtype, device), heads, total in zip(
                grads, (dq, dkv), ctx.shapes, (q_heads, kv_heads), (q_total, kv_total)):
            if not used:
                results.append(None)
                continue
            if grad is None:  # this rank's loss does not reach it; another rank's does
                grad = torch.zeros(shape, dtype=dtype, device=device)
            results.append(_heads_to_rows(grad, heads, lengths, group, total))
        return (*results, None, None, None, None, None)


class _OutputToRows(torch.autograd.Function):
    """out and lse back to this rank's rows (`_heads_to_rows`, disjoint heads); backward
    `_rows_to_heads` of both gradients. One node for both: its backward runs whenever either
    reaches the loss, so every rank of the group makes the same all-to-alls."""

    @staticmethod
    def forward(ctx, out, lse, heads, lengths, group, total):
        ctx.args = (heads, lengths, group)
        ctx.set_materialize_grads(False)
        out, lse = (_heads_to_rows(out, heads, lengths, group, total),
                    _heads_to_rows(lse, heads, lengths, group, total))
        ctx.shapes = (out.shape, out.dtype), (lse.shape, lse.dtype)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        heads, lengths, group = ctx.args
        check_first_order("Ulysses (head-parallel) attention")
        # Which of the two gradients exist is agreed (one flag each): one that no rank has
        # stays None (a zero dlse would cost every backward launch the lse-gradient
        # columns); one that some rank has, the others send as zeros, so that every rank
        # makes the same all-to-alls. Meta gradients (a shape-only run: estimate's dry
        # run) keep their flags on the host, where they can be read.
        grads = [dout, dlse]
        device = (dout if dout is not None else dlse).device
        flags = torch.tensor([dout is not None, dlse is not None], dtype=torch.int32,
                             device="cpu" if device.type == "meta" else device)
        used = comm.all_reduce_(flags, group, op="max").tolist()
        for i, ((shape, dtype), grad) in enumerate(zip(ctx.shapes, grads)):
            if used[i] and grad is None:
                grads[i] = torch.zeros(shape, dtype=dtype, device=device)
        dout, dlse = (None if g is None else _rows_to_heads(g, heads, lengths, group)
                      for g in grads)
        return dout, dlse, None, None, None, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, key_mask, group: Any,
                      lengths: Sequence[int], attend, *,
                      grads: Tuple[bool, bool] = (True, True)) -> Tuple[Tensor, Tensor]:
    """Attention over the rows of a head-parallel group, computed head-parallel.

    q (b, n, h, d), k/v (b, n, hk, d): this rank's rows; lengths: every group
    rank's rows, in rank order (their pieces are consecutive in the sequence).
    ``attend(q, k, v, heads, key_mask)`` computes the attention of all N rows for
    the heads this rank holds after the exchange (q (b, N, h/U, d), `heads` their
    ``Heads``, key_mask (b, N) or None) and returns (out, lse) for them.
    Returns this rank's out (b, n, h, d) and lse (b, n, h). Differentiable. `grads`:
    whether some rank of the group differentiates q, and k or v (agreed on every rank,
    ``functional._differentiated``); the backward sends no gradient that no rank needs.
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    split = HeadSplit.of(size, q.shape[2], k.shape[2])
    q_heads = [split.query(u) for u in range(size)]
    kv_heads = [split.kv(u) for u in range(size)]
    lengths = tuple(lengths)
    # k and v travel together: (b, n, hk, d) x 2 -> (b, n, hk, 2, d)
    kv = torch.stack([k, v], dim=3)
    q_u, kv_u = _InputsToHeads.apply(q, kv, tuple(q_heads), tuple(kv_heads), lengths, group,
                                     tuple(grads))
    del kv  # its copy is on the wire; do not hold it through the attention
    k_u, v_u = kv_u.unbind(3)
    mask = None
    if key_mask is not None:
        # (b, n) -> (b, N): the keys' mask rows of the whole block (as uint8: gloo sends it)
        mask = comm.all_gather(key_mask.to(torch.uint8), group, dim=1, sizes=lengths).bool()
    out_u, lse_u = attend(q_u, k_u, v_u, split.local_heads(rank), mask)
    return _OutputToRows.apply(out_u, lse_u, tuple(q_heads), lengths, group, q.shape[2])
