"""Split a full sequence into per-rank pieces, put it back together, sum across ranks.

Two layouts of a sequence of N rows over P ranks:

- ``"contiguous"``: rank p holds rows [S_p, S_p + N_p), pieces as even as
  possible, the first N mod P ranks one row longer (the layout every
  sequence-parallel op accepts; its pieces may also be any lengths).
- ``"zigzag"``: N is cut into 2P equal chunks and rank p holds chunks p and
  2P-1-p, concatenated; it balances causal work for the dense ring (see
  Note [zigzag] in ring.py). Needs N divisible by 2P.

Training with replicated parameters needs two reductions over the ranks of
the sequence-parallel group: the token-weighted loss (`sum_across_ranks`)
and the parameter gradients (`all_reduce_gradients`, after backward, or
DDP / FSDP2 over ranks that include the group); Note [gradients across
ranks] says why the second one averages.

Note [gradients across ranks]
    Sequence parallelism splits one sequence over P ranks: rank p's backward
    yields g_p, the gradient of the global loss L through its own tokens,
    and the gradient of L is the SUM g_0 + ... + g_{P-1}. Data parallelism
    (DDP, FSDP2) reduces gradients by AVERAGING over its ranks. The two are
    made to agree the way Megatron-LM's context parallelism and torchtitan
    do it: every rank computes the same L from the summed (loss, count),
    so the adjoint of that sum (the sum of every rank's incoming gradient)
    is P times this rank's own; `sum_across_ranks` returns it without
    communicating. Each rank's backward then yields P g_p, and any average
    over a set of ranks that includes the sequence-parallel group gives the
    right gradient:

        DDP over the sequence group        mean_p P g_p = sum_p g_p
        DDP / FSDP2 over data x sequence   mean_{d,p} P g_{d,p} = mean_d grad L_d
        all_reduce_gradients(model, pg)    the same average, in place

    (mean_d grad L_d: the data-parallel replicas' losses averaged, as DDP
    does; it equals the token mean of the whole batch when every replica
    has as many targets.) A reduction over the data-parallel ranks alone
    (DDP or FSDP2 on the "dp" mesh dimension) leaves P g_p on each
    sequence rank: follow it with ``all_reduce_gradients(model, sp_group)``.
    With one process P = 1 and nothing changes.

Notation: b batch, n rows, h heads, d head dim; the sequence dim is 1 in
the (b, n, h, d) layout and is an argument here.
"""

from __future__ import annotations

import hashlib
from typing import List, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..layout import Layout
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
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must index a dimension of x with shape {tuple(x.shape)}, got {dim}")
    return dim % x.dim()


def shard_sequence(x: Tensor, group: comm.GroupLike, *, layout: str = "contiguous",
                   dim: int = 1) -> Tensor:
    """This rank's piece of the full tensor `x` (every rank passes the same x).

    Differentiable; for the contiguous layout the piece may share x's memory.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    ranges = piece_ranges(x.shape[dim], comm.group_size(group), comm.group_rank(group), layout)
    pieces = [x.narrow(dim, start, stop - start) for start, stop in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(x_local: Tensor, group: comm.GroupLike, *, layout: str = "contiguous",
                     dim: int = 1) -> Tensor:
    """The full tensor on every rank, from every rank's piece (uneven contiguous pieces too).

    One agreement collective (shapes, dtype, layout; each rank's length)
    and one all-gather. Differentiable: the backward sums the gradients of
    all ranks' copies and returns this rank's rows (a reduce-scatter).
    """

    def config():
        d = _check_dim(x_local, dim)
        check_layout(layout)
        shape = list(x_local.shape)
        shape[d] = None  # the sequence length may differ between ranks
        return {"layout": layout, "dim": d, "shape": tuple(shape), "dtype": x_local.dtype,
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


class _SumAcrossRanks(torch.autograd.Function):
    """Sum over ranks; the gradient is P times the incoming one (Note [gradients across ranks]).

    The adjoint of an all-reduce is an all-reduce of the incoming gradients.
    Every rank computes the same loss from the summed tensor and runs the
    same backward, so those gradients are equal and their sum is P times
    this rank's: no collective in backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.size = comm.group_size(group)
        return comm.all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.size if ctx.size > 1 else grad, None


def sum_across_ranks(x: Tensor, group) -> Tensor:
    """The sum of every rank's `x` (same shape everywhere), on every rank; differentiable.

    For a loss built from per-rank partial sums (e.g. token loss and token
    count) that every rank computes alike from the sum: each rank's
    backward then yields P times the gradient of the global loss through
    its own terms (P the group size), so that averaging the parameter
    gradients over the group (`all_reduce_gradients`, DDP, FSDP2) completes
    it (Note [gradients across ranks]).
    """
    return _SumAcrossRanks.apply(x, group)


def local_part(t: Tensor) -> Tensor:
    """A plain tensor itself; a DTensor's (FSDP2's sharded parameters and gradients) local
    shard, a view."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def sharded_within(t: Tensor, group) -> bool:
    """True for a DTensor sharded over a mesh that holds other ranks of `group` (so those
    ranks hold other shards of it); False for a plain tensor."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None or not comm.is_distributed(group):
        return False
    others = comm.members(group) - comm.members(None)  # None: this rank alone
    return bool(set(mesh.mesh.flatten().tolist()) & others)


# Path components that wrappers insert into parameter names (DDP and FSDP1: "module",
# "_fsdp_wrapped_module"; torch.compile: "_orig_mod"; activation checkpointing:
# "_checkpoint_wrapped_module"): a rank that wrapped its model holds the same parameters
# as one that did not.
_WRAPPER_COMPONENTS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _trainable(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _parameter_key(name: str, p: Tensor) -> Tuple[str, Tuple[int, ...], str]:
    """(name without wrapper components, local shape, dtype): what must match across ranks."""
    local = local_part(p)
    plain = ".".join(c for c in name.split(".") if c not in _WRAPPER_COMPONENTS)
    return plain, tuple(local.shape), str(local.dtype).replace("torch.", "")


def _checksum(keys: Sequence[Tuple[str, Tuple[int, ...], str]]) -> str:
    return hashlib.sha256(repr(list(keys)).encode()).hexdigest()[:16]


def _first_difference(lists: Sequence[Sequence[Tuple[str, Tuple[int, ...], str]]]) -> str:
    """The first parameter position at which the ranks' lists differ, each rank's entry."""
    at = next(i for i in range(max(map(len, lists)))
              if len({keys[i] if i < len(keys) else None for keys in lists}) > 1)

    def entry(keys) -> str:
        if at >= len(keys):
            return f"no parameter (it has {len(keys)})"
        name, shape, dtype = keys[at]
        return f"{name!r} {shape} {dtype}"

    listing = "; ".join(f"rank {r}: {entry(keys)}" for r, keys in enumerate(lists))
    return (f"all_reduce_gradients: the ranks of `group` hold different parameters, "
            f"whose gradients would be averaged with unrelated ones; the first difference is "
            f"trainable parameter #{at} ({listing})")


def all_reduce_gradients(module: nn.Module, group: comm.GroupLike) -> None:
    """Average the parameter gradients over the ranks of `group`, in place.

    After ``loss.backward()`` of a sequence-parallel model (a LongNetLM or
    LongNet with ``process_group=``, or a transformers model with
    ``causal_lm_loss``), each rank holds P times the gradient through its
    own tokens; the average over the sequence-parallel group is the full
    gradient, identical on every rank afterwards (Note [gradients across
    ranks]: the same average DDP takes, so either may do it). Pass the data
    x sequence group to reduce over both at once; after DDP or FSDP2 over
    the data-parallel ranks alone, pass the sequence-parallel group.

    FSDP2's sharded (DTensor) gradients are averaged shard by shard, which
    is right when the ranks of `group` hold the same shards (FSDP2
    over another mesh dimension); a gradient sharded over ranks of
    `group` itself is an error on every rank (FSDP2 has averaged it
    already). A parameter without a gradient on this rank counts as zero (so
    every rank reduces the same buffer); one without a gradient on every rank
    keeps none (``.grad`` None, as one process leaves it: an optimizer skips
    it, where a zero gradient would still move it by weight decay or
    momentum).

    Every rank must hold the same trainable parameters in the same order:
    names (wrapper components such as DDP's ``module.`` or torch.compile's
    ``_orig_mod.`` left out, so a wrapped model matches an unwrapped one),
    shapes and dtypes. One small agreement collective compares a checksum
    of that list; where the ranks differ, every rank raises a ValueError
    naming the first differing parameter. Then one all-reduce per dtype.
    """
    group = comm.resolve_group(group, "group")
    if not comm.is_distributed(group):
        _trainable(module)
        return
    named: List[Tuple[str, nn.Parameter]] = []
    keys: List[Tuple[str, Tuple[int, ...], str]] = []

    def parameters() -> dict:
        named.extend(_trainable(module))
        for name, p in named:
            if sharded_within(p, group):
                raise ValueError(
                    f"all_reduce_gradients: parameter {name!r} is sharded (FSDP2) over ranks of "
                    f"`group`, whose gradients fully_shard has averaged already; reduce "
                    f"only over ranks that hold the same shards (the sequence-parallel group "
                    f"when fully_shard runs on the data-parallel mesh dimension), or not at all"
                )
        keys.extend(_parameter_key(name, p) for name, p in named)
        # every rank must reduce the same parameters at the same buffer positions
        return {"parameters": _checksum(keys),
                "gradients": tuple(p.grad is not None for _, p in named)}

    infos = comm.agree(group, parameters, per_rank=("parameters", "gradients"))
    if len({info["parameters"] for info in infos}) > 1:
        # the error path only: every rank's whole list, to name the first difference
        lists = comm.agree(group, {"keys": keys}, per_rank=("keys",))
        raise ValueError(_first_difference([info["keys"] for info in lists]))
    # the parameters with a gradient on some rank (the others keep None everywhere)
    named = [(name, p) for (name, p), *anywhere in zip(named, *(i["gradients"] for i in infos))
             if any(anywhere)]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict = {}
    for _, p in named:
        g = local_part(p.grad)
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for grads in by_dtype.values():
        # one flat buffer per dtype: one collective instead of one per parameter
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_(flat, group, op="avg")
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))
