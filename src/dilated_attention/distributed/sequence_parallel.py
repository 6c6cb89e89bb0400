"""Sequence-parallel dilated attention: the sequence is split over the ranks of a group.

Notation: b batch, n rows of this rank, h query heads, hk key/value heads,
d head dim; P ranks, rank p holds global rows [S_p, S_p + N_p) (any lengths,
empty pieces allowed), N = sum_p N_p; a pattern is (w, r) with W = min(w,
document length) on the GLOBAL sequence, as on one device.

Each rank runs the plan of its rows (Note [plan] in plan.py): segments inside
its piece cost no communication; a segment that spans ranks is cut into
parts, and each part's queries read the selected key/value rows of the other
parts, fetched from their owners (only the (row, kv head) pairs some head of
the receiving part reads travel). The launches themselves run in
launches.py, on this rank's rows and on the received buffers alike. This
module moves the buffers (``Exchange``): the first round is posted before
any local launch and waited on only when the first block that needs it
comes up, so the transfer overlaps the local work.

The backward fetches the remote keys again (nothing but the inputs is
saved), keeps dq local and sends the dK/dV of remote keys home, where they
are summed into the key rows' accumulators.

With the fused kernel (``FusedPiece``), a rank's local launches are one fused
call per chunk instead, over its own pairs (its rows against its own keys),
run while the first round is in flight; the launches on received keys merge
into its outputs (launches.forward_beside / backward_beside), and so do those
between a zigzag rank's two chunks (a segment over both).

Memory: ``dilated-attention estimate`` measures this code itself, run on meta
tensors with a fake process group (tools/estimate, Note [estimate]): no model
of it to keep in step.

Dropout (p > 0) replays the same masks in backward: every launch gets seed +
rank * 2**32 + its launch id on the computing rank (Note [dropout streams] in
kernels.py). The launches' masks are NOT those of the single-device op (blocks
are cut differently); a ``FusedPiece``'s are, for its pairs, under the same
key (Note [fused dropout] in fused.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .. import fused, launches
from ..kernels import KernelOptions, save_for_backward, saved_for_backward
from ..patterns import Heads, Patterns, Segments, gather
from ..layout import Documents, Layout
from ..plan import Launch, Plan, Transfer, make_plan
from ..validation import check_first_order
from . import comm
from .key_rounds import KeyRounds


def pack(x: Tensor, transfer: Transfer) -> Tensor:
    """Transfer's selected rows of x (b, n, hk, ...): (b, columns, ...), pair after pair."""
    keys = transfer.keys
    part = Segments(keys.local, 1, keys.stop - keys.start)
    columns = []
    for g in transfer.groups:
        # (b, n, hk, ...) -> (b, kv_rows, hkv, ...) -> (b, hkv * kv_rows, ...)
        selected = gather(x, part, g.kv_heads, g.kv_index, g.kv_stride)
        columns.append(selected.transpose(1, 2).flatten(1, 2))
    return torch.cat(columns, dim=1)


class Exchange(KeyRounds):
    """The plan's transfers over `group` (see launches.RemoteKeys), in KeyRounds' wire
    format: a transfer's k and v are its selected (row, kv head) pairs, (columns, d).

    What the posted round holds during the local launches is its receive buffers and
    one packed buffer per distinct send (``Round.packed``: a part that every other rank
    reads whole is packed once, not once per reader); the sends are freed when the
    round has arrived.
    """

    def __init__(self, plan: Plan, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                 group: Any, kv_grad: bool = True) -> None:
        d = k.shape[3]
        super().__init__(
            k, v, key_mask, group,
            sent=[[(t.queries.rank, (t.columns, d)) for t in r.sends] for r in plan.rounds],
            received=[[(t.keys.rank, (t.columns, d)) for t in r.recvs] for r in plan.rounds],
            kv_grad=kv_grad)
        self.plan = plan

    def parcels(self, index: int) -> List[List[Tensor]]:
        rnd = self.plan.rounds[index]
        mask = None
        if self.key_mask is not None:
            # (b, n) -> (b, n, hk) like k, so that it packs as k does
            mask = self.key_mask[:, :, None].expand(-1, -1, self.k.shape[2])
        packed: Dict[int, List[Tensor]] = {}
        for i, (t, first) in enumerate(zip(rnd.sends, rnd.packed)):
            if first == i:
                packed[i] = self.wire(pack(self.k, t), pack(self.v, t),
                                      None if mask is None else pack(mask, t))
        # the same content for several readers: one buffer, sent to each
        return [packed[first] for first in rnd.packed]

    def keys(self) -> Iterator[Tuple[int, List[Tuple[Transfer, Tensor, Optional[Tensor]]]]]:
        for index, received in self.arrivals():
            yield index, [(t, buf, mask)
                          for t, (buf, mask) in zip(self.plan.rounds[index].recvs, received)]
            del received

    def send_home(self, round_index: int, grads: List[Tensor]) -> List[Tuple[Transfer, Tensor]]:
        """dK/dV of the received transfers go home; ours come back from their readers."""
        return list(zip(self.plan.rounds[round_index].sends, self.homes(round_index, grads)))


@dataclasses.dataclass(frozen=True)
class FusedPiece:
    """This rank's own pairs (its rows against its own keys) in fused-kernel calls instead
    of the plan's local launches (fused.py, ``piece``): the call over the whole sequence
    (patterns, heads, documents, `total` rows), one fused call per window of the rank's
    rows. `windows`: (first global row, local lo, local hi) each; a contiguous piece is one
    window, a zigzag rank's two chunks two (one where they touch). `crossing`: the plan's
    launches between two windows (a segment over both chunks), which run beside the fused
    calls as the launches on received keys do (launches.forward_beside). `dropout`: the
    fused kernels' (Note [fused dropout] in fused.py; each window's masks count from its
    first row), drawn by the forward and kept for the backward."""

    patterns: Patterns
    heads: Heads
    documents: Documents
    total: int
    windows: Tuple[Tuple[int, int, int], ...]
    crossing: Tuple[Launch, ...] = ()
    dropout: Optional[fused.Dropout] = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, patterns: Patterns, heads: Heads, documents: Documents, layout: Layout,
           rank: int, plan: Plan) -> "FusedPiece":
        windows: List[Tuple[int, int, int]] = []
        for c in layout.of_rank(rank):
            if (windows and windows[-1][2] == c.local
                    and windows[-1][0] + windows[-1][2] - windows[-1][1] == c.start):
                first, lo, _ = windows.pop()  # globally next to the chunk before
                windows.append((first, lo, c.local + c.stop - c.start))
            else:
                windows.append((c.start, c.local, c.local + c.stop - c.start))
        if len(windows) <= 1:
            return cls(patterns, heads, documents, layout.total, tuple(windows) or ((0, 0, 0),))
        return cls(patterns, heads, documents, layout.total, tuple(windows),
                   _crossing(plan, [(lo, hi) for _, lo, hi in windows]))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, opts: KernelOptions,
                key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        # (b, n, h, d), (b, n, h): each window's call writes its rows, in place
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for first, lo, hi in self.windows:
            rows = slice(lo, hi)
            fused.forward(q[:, rows], k[:, rows], v[:, rows], self.patterns,
                          piece=(first, self.total), into=(out[:, rows], lse[:, rows]),
                          dropout=self.dropout, **self._options(opts, key_mask, rows))
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 lse: Tensor, dlse: Optional[Tensor], opts: KernelOptions,
                 key_mask: Optional[Tensor], kv_grad: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of the rank's own pairs; without `kv_grad` (no rank differentiates k or
        v) dq alone, no dK/dV kernel, and dk, dv unwritten (zeros where the crossing
        launches beside add what is then dropped)."""
        dq = torch.empty_like(q)
        dkv = torch.zeros_like if self.crossing and not kv_grad else torch.empty_like
        dk, dv = dkv(k), dkv(v)
        for first, lo, hi in self.windows:
            rows = slice(lo, hi)
            into = (dq[:, rows], *((dk[:, rows], dv[:, rows]) if kv_grad else (None, None)))
            fused.backward(dout[:, rows], q[:, rows], k[:, rows], v[:, rows], out[:, rows],
                           lse[:, rows], None if dlse is None else dlse[:, rows],
                           self.patterns, piece=(first, self.total), into=into,
                           dropout=self.dropout, **self._options(opts, key_mask, rows))
        return dq, dk, dv

    def own_keys(self, k: Tensor, v: Tensor,
                 key_mask: Optional[Tensor]) -> Optional[launches.OwnKeys]:
        """The crossing launches, as the beside paths run them (None: there are none)."""
        return launches.OwnKeys(k, v, key_mask, self.crossing) if self.crossing else None

    def _options(self, opts: KernelOptions, key_mask: Optional[Tensor], rows: slice):
        return dict(causal=opts.causal, scale=opts.scale, heads=self.heads,
                    documents=self.documents,
                    key_mask=None if key_mask is None else key_mask[:, rows])


def _crossing(plan: Plan, windows: List[Tuple[int, int]]) -> Tuple[Launch, ...]:
    """The plan's local launches whose query rows and key rows lie in different windows
    (local rows [lo, hi)): a block never straddles two chunks (plan._blocks_of)."""
    lo_of = {block.index: block.lo for block in plan.blocks}

    def window(block: int) -> int:
        return next(i for i, (lo, hi) in enumerate(windows) if lo <= lo_of[block] < hi)

    return tuple(launch for block in plan.blocks for launch in block.forward
                 if window(launch.q_blocks[0]) != window(launch.k_blocks[0]))


def sp_forward(q: Tensor, k: Tensor, v: Tensor, plan: Plan, opts: KernelOptions, group: Any,
               key_mask: Optional[Tensor] = None,
               piece: Optional[FusedPiece] = None) -> Tuple[Tensor, Tensor]:
    """q (b, n, h, d), k/v (b, n, hk, d) pieces -> out (b, n, h, d), lse (b, n, h) fp32;
    with a `piece`, the rank's own pairs in the fused kernel."""
    exchange = Exchange(plan, k, v, key_mask, group)
    if piece is None:
        return launches.forward(q, k, v, plan, opts, key_mask=key_mask, remote=exchange)
    own = functools.partial(piece.forward, q, k, v, opts, key_mask)
    return launches.forward_beside(q, plan, opts, own, exchange,
                                   local=piece.own_keys(k, v, key_mask))


def sp_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                plan: Plan, opts: KernelOptions, group: Any, dlse: Optional[Tensor] = None,
                key_mask: Optional[Tensor] = None, piece: Optional[FusedPiece] = None,
                kv_grad: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of `sp_forward` for this rank's pieces, given its final out and lse;
    without `kv_grad` (no rank differentiates k or v) no dK/dV goes home, and this rank's
    dk, dv are not complete (the caller drops them)."""
    exchange = Exchange(plan, k, v, key_mask, group, kv_grad)
    if piece is None:
        return launches.backward(dout, q, k, v, out, lse, plan, opts, dlse=dlse,
                                 key_mask=key_mask, remote=exchange)
    own = functools.partial(piece.backward, dout, q, k, v, out, lse, dlse, opts, key_mask,
                            kv_grad)
    return launches.backward_beside(dout, q, out, lse, plan, opts, own, exchange, dlse=dlse,
                                    local=piece.own_keys(k, v, key_mask))


class SequenceParallelDilatedAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse; backward is `sp_backward` (a collective: every rank calls it).
    `kv_grad`: whether some rank differentiates k or v (agreed)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, opts, group, key_mask, piece=None, kv_grad=True):
        if piece is not None and opts.dropout_p > 0.0:
            # the fused kernels' dropout key, drawn on the device (Note [fused dropout])
            piece = dataclasses.replace(piece, dropout=fused.Dropout.of(
                opts.dropout_p, len(piece.patterns[0]), fused.new_seed(q.device),
                first_head=piece.heads.first))
        result = sp_forward(q, k, v, plan, opts, group, key_mask, piece)
        return save_for_backward(ctx, q, k, v, result,
                                 (plan, opts, group, key_mask, piece, kv_grad))

    @staticmethod
    def backward(ctx, dout, dlse):
        check_first_order("sequence-parallel dilated attention")
        dout, q, k, v, out, lse = saved_for_backward(ctx, dout)
        plan, opts, group, key_mask, piece, kv_grad = ctx.args
        dq, dk, dv = sp_backward(dout, q, k, v, out, lse, plan, opts, group, dlse, key_mask,
                                 piece, kv_grad)
        if not kv_grad:
            dk = dv = None
        return dq, dk, dv, None, None, None, None, None, None


def sequence_parallel_dilated_attention(
    q: Tensor, k: Tensor, v: Tensor, patterns: Patterns, opts: KernelOptions, group: Any,
    lengths: Tuple[int, ...], *, heads: Optional[Heads] = None, documents: Documents = None,
    key_mask: Optional[Tensor] = None, layout: Optional[Layout] = None, fused_pairs: bool = False,
    kv_grad: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Dilated attention over the sequence split across `group` (differentiable).

    Each rank passes its own rows: q (b, n_p, h, d), k/v (b, n_p, hk, d),
    n_p = lengths[rank] >= 0, contiguous pieces in rank order unless `layout`
    says otherwise. Returns this rank's rows of the single-device out
    (b, n_p, h, d) and lse (b, n_p, h) (fp32; fp64 for fp64). The call must
    already be agreed on every rank (functional.py validates it once, in the
    agreement collective), `opts.seed` included: each rank decorrelates it by
    its rank. Every rank must also run the backward. `fused_pairs`: the rank's own
    pairs run in fused-kernel calls (``FusedPiece``: one per chunk, with the launches
    between a zigzag rank's two chunks beside them); the launches on received keys keep
    `opts.backend`. `kv_grad`: whether some rank differentiates k or v (agreed: the
    backward sends no dK/dV home otherwise).
    """
    rank = comm.group_rank(group)
    heads = heads or Heads.of(q.shape[2], k.shape[2])
    layout = layout or Layout.contiguous(lengths)
    plan = make_plan(layout, patterns, opts.causal, heads, rank, str(q.device), documents)
    opts = opts.for_rank(rank)  # its launch ids overlap the other ranks
    piece = FusedPiece.of(patterns, heads, documents, layout, rank, plan) if fused_pairs else None
    return SequenceParallelDilatedAttentionFunction.apply(q, k, v, plan, opts, group, key_mask,
                                                          piece, kv_grad)
