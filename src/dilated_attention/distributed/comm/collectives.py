"""Collectives, counted, with uneven pieces and grids; every one is a no-op for a local group."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .counting import nbytes, record
from .groups import (Grid, Group, global_rank, group_rank, group_size, is_distributed,
                     moves_data, plain)
from .release import released_on_return

# The flat-buffer collectives: torch 2.13 deprecates the *_tensor names for
# *_single ones that older releases (this package supports >= 2.9) lack.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(
    x: Tensor, group: Group, *, dim: int = 0, sizes: Optional[Sequence[int]] = None
) -> Tensor:
    """Every rank's `x` concatenated along `dim`, in group-rank order.

    `sizes` (every rank's length along `dim`, e.g. from ``agree``) allows
    uneven pieces; without it all pieces must have x's shape. A Grid gathers
    in piece order (within the heads group, then those blocks in the sequence
    group).
    """
    group = plain(group)
    if not is_distributed(group):
        return x
    if isinstance(group, Grid):
        heads, sequence = group.shape
        sizes = [x.shape[dim]] * heads * sequence if sizes is None else list(sizes)
        # sizes by piece s * U + u -> the heads group's pieces, then the blocks' lengths
        s = group.coordinate[1]
        block = all_gather(x, group.heads, dim=dim, sizes=sizes[s * heads:(s + 1) * heads])
        blocks = [sum(sizes[t * heads:(t + 1) * heads]) for t in range(sequence)]
        return all_gather(block, group.sequence, dim=dim, sizes=blocks)
    size, rank = group_size(group), group_rank(group)
    sizes = [x.shape[dim]] * size if sizes is None else list(sizes)
    if len(sizes) != size or sizes[rank] != x.shape[dim]:
        raise ValueError(
            f"all_gather: sizes {sizes} must list {size} lengths with this rank's ({rank}) "
            f"length {x.shape[dim]}"
        )
    longest = max(sizes)
    # (..., n_rank, ...) -> (n_rank, ...) padded to (longest, ...): one buffer shape for all
    front = x.movedim(dim, 0)
    if front.shape[0] < longest:
        pad = front.new_zeros((longest - front.shape[0],) + tuple(front.shape[1:]))
        front = torch.cat([front, pad])
    front = front.contiguous()
    out = front.new_empty((size * longest,) + tuple(front.shape[1:]))
    if longest > 0:
        record("all_gather", 1, nbytes(front) * (size - 1))
        if moves_data(out, front):
            with released_on_return(group, out, front):
                all_gather_flat(out, front, group=group)
    # (size * longest, ...) -> pieces of their true lengths, back along dim
    pieces = [out[r * longest : r * longest + n] for r, n in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim)


def all_reduce_(x: Tensor, group: Group, *, op: str = "sum") -> Tensor:
    """In-place all-reduce ("sum", "max", "min", "avg") of `x`; returns x."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops and op != "avg":
        raise ValueError(f"op must be one of 'sum', 'max', 'min', 'avg', got {op!r}")
    group = plain(group)
    if not is_distributed(group) or x.numel() == 0:
        return x
    if isinstance(group, Grid):
        for dim_group in (group.heads, group.sequence):
            all_reduce_(x, dim_group, op="sum" if op == "avg" else op)
        return x.div_(group_size(group)) if op == "avg" else x
    size = group_size(group)
    record("all_reduce", 1, 2 * (size - 1) * nbytes(x) // size)
    # gloo has no AVG: sum, then divide
    if moves_data(x):
        with released_on_return(group, x):
            dist.all_reduce(x, op=ops["sum" if op == "avg" else op], group=group)
    if op == "avg":
        x.div_(size)
    return x


def reduce_scatter(
    x: Tensor, group: Group, *, dim: int = 0, sizes: Optional[Sequence[int]] = None
) -> Tensor:
    """Sum `x` over ranks and return this rank's piece along `dim`.

    `sizes` (every rank's piece length, summing to x.shape[dim]) allows
    uneven pieces; without it x.shape[dim] must divide evenly. A Grid sums
    over the sequence group into blocks, then over the heads group into pieces.
    """
    group = plain(group)
    if not is_distributed(group):
        return x
    total = x.shape[dim]
    if isinstance(group, Grid):
        heads, sequence = group.shape
        if sizes is None:
            if total % (heads * sequence):
                raise ValueError(f"reduce_scatter: length {total} does not divide over "
                                 f"{heads * sequence} ranks")
            sizes = [total // (heads * sequence)] * heads * sequence
        sizes, s = list(sizes), group.coordinate[1]
        blocks = [sum(sizes[t * heads:(t + 1) * heads]) for t in range(sequence)]
        block = reduce_scatter(x, group.sequence, dim=dim, sizes=blocks)
        return reduce_scatter(block, group.heads, dim=dim, sizes=sizes[s * heads:(s + 1) * heads])
    size, rank = group_size(group), group_rank(group)
    if sizes is None:
        if total % size:
            raise ValueError(f"reduce_scatter: length {total} does not divide over {size} ranks")
        sizes = [total // size] * size
    sizes = list(sizes)
    if len(sizes) != size or sum(sizes) != total:
        raise ValueError(f"reduce_scatter: sizes {sizes} must be {size} lengths summing to {total}")
    longest = max(sizes)
    # (..., total, ...) -> (total, ...) -> (size * longest, ...) padded per rank
    front = x.movedim(dim, 0)
    pieces = list(torch.split(front, sizes))
    padded = [
        torch.cat([p, p.new_zeros((longest - p.shape[0],) + tuple(p.shape[1:]))])
        if p.shape[0] < longest
        else p
        for p in pieces
    ]
    inp = torch.cat(padded).contiguous()
    out = inp.new_empty((longest,) + tuple(inp.shape[1:]))
    if longest > 0:
        record("reduce_scatter", 1, nbytes(out) * (size - 1))
        if moves_data(out, inp):
            with released_on_return(group, out, inp):
                reduce_scatter_flat(out, inp, group=group)
    return out[: sizes[rank]].movedim(0, dim)


def broadcast_(x: Tensor, src: int, group: Group) -> Tensor:
    """In place: every rank's `x` becomes group rank `src`'s; returns x."""
    if not is_distributed(group) or x.numel() == 0:
        return x
    if isinstance(group, Grid):
        raise ValueError("broadcast_ takes a process group, not a grid of two")
    size = group_size(group)
    if group_rank(group) == src:
        record("broadcast", 1, (size - 1) * nbytes(x))
    if moves_data(x):
        with released_on_return(group, x):
            dist.broadcast(x, global_rank(group, src), group=group)
    return x


def barrier(group: Group) -> None:
    group = plain(group)
    if isinstance(group, Grid):
        for dim_group in (group.heads, group.sequence):
            barrier(dim_group)
    elif is_distributed(group):
        dist.barrier(group=group)


def all_to_all(sends: Sequence[Tensor], recv_shapes: Sequence[Sequence[int]],
               group: Group) -> Tensor:
    """Send ``sends[p]`` to group rank p; return what every rank sent here, as one buffer.

    One ``all_to_all_single`` over flat buffers with split sizes, so pieces
    may differ in size (or be empty). ``recv_shapes[p]`` is the shape rank p
    sends here (both sides derive every size from the agreed call). Returns
    the flat receive buffer: rank p's piece follows rank p - 1's, so pieces
    laid out rows-first are one (rows, ...) tensor by a plain view.
    Counted as one message; bytes are what this rank sends to the others.
    """
    size, rank = group_size(group), group_rank(group)
    if len(sends) != size or len(recv_shapes) != size:
        raise ValueError(f"all_to_all: {len(sends)} sends and {len(recv_shapes)} receive "
                         f"shapes for a group of {size} ranks")
    numels = [math.prod(shape) for shape in recv_shapes]
    recv = torch.empty(sum(numels), dtype=sends[0].dtype, device=sends[0].device)
    if not is_distributed(group):
        return recv.copy_(sends[0].reshape(-1))
    send = torch.cat([x.reshape(-1) for x in sends])
    record("all_to_all", 1, sum(nbytes(x) for p, x in enumerate(sends) if p != rank))
    if moves_data(recv, send):
        with released_on_return(group, recv, send):
            dist.all_to_all_single(recv, send, output_split_sizes=numels,
                                   input_split_sizes=[x.numel() for x in sends], group=group)
    return recv
