"""Split a full sequence into per-rank pieces, put it back together, sum across ranks.

Two layouts of a sequence of N rows over P ranks:

- ``"contiguous"``: rank p holds rows [S_p, S_p + N_p), pieces as even as
  possible, the first N mod P ranks one row longer (the layout every
  sequence-parallel op accepts; its pieces may also be any lengths).
- ``"zigzag"``: N is cut into 2P equal chunks and rank p holds chunks p and
  2P-1-p, concatenated; it balances causal work for the dense ring (see
  Note [zigzag] in ring.py). Needs N divisible by 2P.

The training reductions over these ranks (the loss sum, the gradient
average) are gradients.py's.

Notation: b batch, n rows, h heads, d head dim; the sequence dim is 1 in
the (b, n, h, d) layout and is an argument here.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from ..layout import Layout
from ..validation import check_int
from . import comm

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def piece_lengths(n: int, world_size: int, layout: str = "contiguous") -> List[int]:
    """The number of rows each rank holds when N = `n` rows are sharded over `world_size`."""
    check_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if n < 0:
        raise ValueError(f"sequence length must be non-negative, got {n}")
    if layout == "zigzag":
        if n % (2 * world_size) or n == 0:
            raise ValueError(
                f"the zigzag layout needs a positive sequence length divisible by 2 * world "
                f"size = {2 * world_size}, got {n}"
            )
        return [n // world_size] * world_size
    base, extra = divmod(n, world_size)
    return [base + (1 if p < extra else 0) for p in range(world_size)]


def piece_ranges(
    n: int, world_size: int, rank: int, layout: str = "contiguous"
) -> List[Tuple[int, int]]:
    """Global row ranges [start, stop) that rank `rank` holds, in its local order."""
    lengths = piece_lengths(n, world_size, layout)
    chunks = Layout.named(layout, lengths).of_rank(rank)
    if not chunks:  # an empty contiguous piece: no rows, where they would start
        start = sum(lengths[:rank])
        return [(start, start)]
    return [(c.start, c.stop) for c in chunks]


def check_piece_lengths(lengths: Sequence[int], layout: str) -> None:
    """Every rank's piece length (agreed) must fit the layout."""
    if layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2 or lengths[0] == 0):
        raise ValueError(
            f"the zigzag layout needs equal, even, non-empty pieces on every rank, got lengths "
            f"{list(lengths)}"
        )


def _check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = check_int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must index a dimension of x with shape {tuple(x.shape)}, got {dim}")
    return dim % x.dim()


def shard_sequence(x: Tensor, group: comm.GroupLike, *, layout: str = "contiguous",
                   dim: int = 1) -> Tensor:
    """This rank's piece of the full tensor `x` (every rank passes the same x).

    Differentiable; for the contiguous layout the piece may share x's memory.
    """
    group = comm.resolve_group(group)  # it sends nothing: no agreement checks the group
    dim = _check_dim(x, dim)
    check_layout(layout)
    ranges = piece_ranges(x.shape[dim], comm.group_size(group), comm.group_rank(group), layout)
    pieces = [x.narrow(dim, start, stop - start) for start, stop in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(x_local: Tensor, group: comm.GroupLike, *, layout: str = "contiguous",
                     dim: int = 1) -> Tensor:
    """The full tensor on every rank, from every rank's piece (uneven contiguous pieces too).

    One agreement collective (shapes, dtype, layout, whether x_local
    requires grad; each rank's length) and one all-gather. Differentiable:
    the backward sums the gradients of all ranks' copies and returns this
    rank's rows (a reduce-scatter).
    """

    def config():
        d = _check_dim(x_local, dim)
        check_layout(layout)
        shape = list(x_local.shape)
        shape[d] = None  # the sequence length may differ between ranks
        return {"layout": layout, "dim": d, "shape": tuple(shape), "dtype": x_local.dtype,
                # the backward is a reduce-scatter: every rank runs it, or none does
                "requires_grad": torch.is_grad_enabled() and x_local.requires_grad,
                "n": x_local.shape[d]}

    infos = comm.agree(group, config, per_rank=("n",))
    d = infos[0]["dim"]
    lengths = [info["n"] for info in infos]
    check_piece_lengths(lengths, layout)
    return _Unshard.apply(x_local, group, layout, d, tuple(lengths))


def gather_pieces(x_local: Tensor, group, lengths: Sequence[int], *, dim: int = 1) -> Tensor:
    """`unshard_sequence` for contiguous pieces whose lengths every rank already knows.

    No agreement collective: `lengths` (every rank's piece length along
    `dim`, e.g. from an earlier agreement) must be right on every rank.
    Differentiable like `unshard_sequence`.
    """
    return _Unshard.apply(x_local, group, "contiguous", dim % x_local.dim(), tuple(lengths))


def _rank_order(layout: str, lengths: Sequence[int]) -> List[int]:
    """The global index of each chunk in rank order (the order an all-gather of pieces holds)."""
    chunks = Layout.named(layout, lengths).chunks
    return sorted(range(len(chunks)), key=lambda i: (chunks[i].rank, chunks[i].local))


def _gather_full(x_local: Tensor, group, layout: str, dim: int, lengths: Sequence[int]) -> Tensor:
    gathered = comm.all_gather(x_local, group, dim=dim, sizes=lengths)
    if layout == "contiguous" or comm.group_size(group) == 1:
        return gathered
    # (.., 2P chunks in rank order, ..) -> (.., chunks in global order, ..)
    order = _rank_order(layout, lengths)
    chunks = gathered.split(gathered.shape[dim] // len(order), dim=dim)
    return torch.cat([chunks[order.index(c)] for c in range(len(order))], dim=dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, group, layout, dim, lengths):
        ctx.args = (group, layout, dim, lengths)
        return _gather_full(x_local, group, layout, dim, lengths)

    @staticmethod
    def backward(ctx, grad_full):
        group, layout, dim, lengths = ctx.args
        size = comm.group_size(group)
        if layout == "zigzag" and size > 1:
            # (.., chunks in global order, ..) -> (.., chunks in rank order, ..)
            chunks = grad_full.split(grad_full.shape[dim] // (2 * size), dim=dim)
            grad_full = torch.cat([chunks[c] for c in _rank_order(layout, lengths)], dim=dim)
        grad = comm.reduce_scatter(grad_full.contiguous(), group, dim=dim, sizes=lengths)
        return grad, None, None, None, None
