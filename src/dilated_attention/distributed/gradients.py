"""Training over sequence-parallel ranks: the loss's sum across them, the gradients' average.

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
"""

from __future__ import annotations

import hashlib
from typing import List, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import comm


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
