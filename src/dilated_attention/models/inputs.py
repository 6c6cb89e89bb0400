"""The models' inputs, checked on every rank at once: token ids, targets, documents, replicas.

Under sequence parallelism one agreement collective per forward carries
every rank's input facts (``agree_on_inputs``), so a bad input on one rank
is an error on every rank, never a hang; while training (and generation's
one agreement, ``agree_on_replicated_inputs``) it also compares checksums of
the ranks' parameters (``_replica_checksums``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import validation as check
from ..distributed import comm
from ..distributed.gradients import local_part, sharded_within
from .loss import IGNORE_INDEX

_ID_DTYPES = (torch.int64, torch.int32)


def _reads_values(ids: Tensor) -> bool:
    """Whether an id check may read the ids: not on meta tensors, and not while torch.compile
    traces (a host read there is a graph break before every layer; the embedding and the loss
    index with the ids either way, as the attention op skips its data checks, docs/compile.md)."""
    return ids.device.type != "meta" and bool(ids.numel()) and not torch.compiler.is_compiling()


def check_tokens(name: str, tokens: Tensor, vocab_size: Optional[int]) -> None:
    """Token ids (b, n) for an embedding of `vocab_size` rows (None: not known here), as
    nn.Embedding takes them (int64 or int32): every model's and transformers helper's check
    of its ids, errors naming `name`."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, seq_len), got shape {tuple(tokens.shape)}")
    if tokens.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must hold integer token ids (int64 or int32), got {tokens.dtype}")
    if vocab_size is not None and _reads_values(tokens):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be ids in [0, {vocab_size}), got values in [{lo}, {hi}]")


def check_targets(targets: Tensor, tokens: Tensor, vocab_size: int, name: str) -> None:
    """Targets: tokens' shape, int ids in [0, vocab) or IGNORE_INDEX (checked before the
    forward, so that a bad id is an error on every rank, not in one rank's loss)."""
    if not isinstance(targets, Tensor) or targets.shape != tokens.shape:
        shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"{name} must have tokens' shape {tuple(tokens.shape)}, got {shape}")
    if targets.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must hold int64 or int32 ids, got {targets.dtype}")
    if _reads_values(targets):
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
        if bool(bad.any()):
            value = int(targets[bad][0])
            raise ValueError(
                f"{name} must be ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored), got "
                f"{value}"
            )


def left_padding(attention_mask: Optional[Tensor], tokens: Tensor,
                 tokens_name: str = "tokens") -> Optional[Tuple[int, ...]]:
    """Where each row's real tokens start under a left-padding mask (b, n) (1 = real token,
    0 = padding before it, as transformers' ``generate`` pads); None without padding. The
    mask is checked by ``validation.check_attention_mask`` (`tokens_name`: the ids' name)."""
    mask = check.check_attention_mask(attention_mask, tokens, tokens_name)
    if mask is None:
        return None
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        row = int((mask[:, 1:] < mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"attention_mask must pad on the left (zeros, then ones): row {row} "
                         f"has padding after a real token; generation continues each row at "
                         f"its end")
    if mask.shape[1] and not bool(mask[:, -1].all()):
        row = int((mask[:, -1] == 0).nonzero()[0])
        raise ValueError(f"attention_mask: row {row} is all padding; each row needs at least "
                         f"one real token")
    starts = tuple((mask.shape[1] - mask.sum(1)).tolist())
    return starts if any(starts) else None


def pick_targets(targets: Optional[Tensor], labels: Optional[Tensor]) -> Tuple[Optional[Tensor],
                                                                                 str]:
    """`labels` is `targets` under the name transformers users know; not both."""
    if targets is not None and labels is not None:
        raise ValueError("pass targets or labels (the same argument), not both")
    return (labels, "labels") if labels is not None else (targets, "targets")


def document_starts(position_ids: Optional[Tensor], tokens: Tensor,
                     max_seq_len: Optional[int]) -> Dict[str, object]:
    """This rank's facts from position_ids (b, n) or (n,): where documents start, the largest
    position; the rows of a batch must agree (documents are shared by every row)."""
    if position_ids is None:
        return {"doc_starts": (), "max_position": None, "position_ids": False}
    position_ids = check.check_position_ids(position_ids, *tokens.shape[:2])
    if not bool((position_ids == position_ids[:1]).all()):
        raise ValueError("position_ids must be the same in every batch row (packed documents "
                         "are shared by the batch)")
    row = position_ids[0]
    if row.numel() and int(row.min()) < 0:
        raise ValueError(f"position_ids must be >= 0, got {int(row.min())}")
    return {"doc_starts": tuple((row == 0).nonzero().flatten().tolist()),
            "max_position": int(row.max()) if row.numel() else None, "position_ids": True}


def agree_on_inputs(
    group, names: Tuple[str, ...], inputs: Callable[[], Tuple[Tensor, ...]], *, has_targets: bool,
    facts: Callable[[], Dict[str, object]] = dict, fact_keys: Tuple[str, ...] = (),
    shared: Callable[[], Dict[str, object]] = dict, model: Optional[nn.Module] = None,
) -> Tuple[int, Dict[str, Tuple[int, ...]], List[Dict[str, object]]]:
    """Validate this rank's inputs and learn every rank's piece lengths (and `facts`).

    `inputs` validates and returns the (b, n) tensors called `names` (and checks
    any other argument: what raises here raises on every rank); `facts`
    returns this rank's own values under `fact_keys` (they may differ between
    ranks); `shared` returns values that must be equal on every rank. Returns this rank's
    group rank, {name: every rank's n} and every rank's agreed dict. Under
    sequence parallelism this is ONE agreement collective, entered even when
    this rank's inputs are bad (so every rank raises instead of waiting),
    which also checks that the batch sizes match and that every rank passed
    targets or none did (only then do all ranks enter the loss all-reduce),
    and, for `model` while gradients are enabled, that every rank holds the
    same parameters (`_replica_checksums`).
    """

    def local() -> dict:
        shapes = dict(zip(names, (tuple(x.shape) for x in inputs())))
        return {"targets_passed": has_targets, **shared(), **facts(),
                "replica": _replica_checksums(model, group),
                **{f"{k}_batch": s[0] for k, s in shapes.items()},
                **{f"{k}_len": s[1] for k, s in shapes.items()}}

    infos = comm.agree(group, local,
                       per_rank=tuple(f"{k}_len" for k in names) + fact_keys + ("replica",))
    _check_replicas(infos, model, group)
    lengths = {k: tuple(i[f"{k}_len"] for i in infos) for k in names}
    return comm.group_rank(group), lengths, infos


def config_fields(config) -> Dict[str, object]:
    """A model config's fields as agreement values ("config.<name>"): ranks built with other
    settings (another checkpoint mode: another backward's collectives) raise on every rank,
    naming the field, instead of waiting in a collective the others never enter."""
    return {f"config.{field.name}": getattr(config, field.name)
            for field in dataclasses.fields(config)}


def agree_on_replicated_inputs(group, config: Callable[[], Dict[str, object]],
                               model: nn.Module) -> Dict[str, object]:
    """Validate inputs that every rank passes whole (generation's prompt); return the agreed dict.

    `config` validates and returns plain values (tensors as `digest`s) that
    every rank must share. Under sequence parallelism this is ONE agreement
    collective, entered even when this rank's inputs are bad, which also
    checks that every rank holds the same parameters of `model`
    (`_replica_checksums`, one read of them): ranks that computed on
    different prompts or weights would return different results silently.
    """
    infos = comm.agree(group, lambda: {**config(), "replica": _replica_checksums(model, group)},
                       per_rank=("replica",))
    _check_replicas(infos, model, group)
    return infos[0]


def digest(x: Tensor) -> str:
    """A short hash of a tensor's dtype, shape and values: equal tensors, equal digests."""
    data = x.detach().cpu().contiguous()
    h = hashlib.sha256(f"{data.dtype} {tuple(data.shape)}".encode())
    h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()[:16]


def _replica_params(model: nn.Module, group) -> List[Tuple[str, Tensor]]:
    """The (name, local tensor) of each parameter that every rank of `group` must hold alike.

    A DTensor (FSDP2) counts by its local shard; one sharded over ranks of
    `group` itself is left out (its shards differ by design, and FSDP2
    keeps them consistent).
    """
    out = []
    for name, p in model.named_parameters():
        if sharded_within(p, group):
            continue
        p = local_part(p)
        if p.device.type != "meta" and p.numel():
            out.append((name, p.detach()))
    return out


def _replica_checksums(model: Optional[nn.Module], group) -> Optional[Tuple[int, ...]]:
    """A checksum of each of `_replica_params` under sequence parallelism (None without).

    The sum of a parameter's bits read as int32, wrapping: exact and independent of the
    summation order, so equal parameters give equal checksums on every rank (a float sum
    could differ with the thread count). Costs one read of the parameters (LongNetLM's base
    size, 162M float32 parameters: about 0.03 s on one CPU thread, BENCHMARKS.md) and a host
    sync, so the models do it on two training forwards only (the first, for a model built
    differently on some rank, and the first after an optimizer step, for a gradient reduction
    that misses the sequence ranks) and once per ``generate`` call.
    """
    if model is None or not comm.is_distributed(group):
        return None
    sums = []
    for _, p in _replica_params(model, group):
        raw = p.reshape(-1).view(torch.uint8)
        # int32 sums run at memory speed; int64 accumulation of narrower ints is ~20x slower
        sums.append(raw.view(torch.int32).sum(dtype=torch.int32).long() if raw.numel() % 4 == 0
                    else raw.sum(dtype=torch.int64))
    return tuple(torch.stack(sums).tolist()) if sums else None


def _check_replicas(infos: List[Dict[str, object]], model: Optional[nn.Module], group) -> None:
    """Raise if the ranks' parameters differ; every rank sees every checksum, so all raise.

    Skipped when some rank has no checksums (gradients disabled there: the
    attention op's own agreement on requires_grad reports that).
    """
    first = infos[0]["replica"]
    if any(info["replica"] is None for info in infos):
        return
    for r, info in enumerate(infos[1:], start=1):
        if info["replica"] == first:
            continue
        names = [name for (name, _), a, b in zip(_replica_params(model, group), first,
                                                 info["replica"]) if a != b]
        raise ValueError(
            f"the parameters differ between the ranks of process_group (rank 0 and rank {r}, "
            f"first {names[0] if names else 'the parameter list'!r}); sequence-parallel ranks "
            f"must hold the same parameters. Either the ranks built the model differently "
            f"(seed its construction alike on every rank), or the last step's gradients were "
            f"not reduced over the sequence-parallel ranks: after backward call "
            f"all_reduce_gradients(model, process_group), or wrap the model in DDP over the "
            f"data x sequence ranks (not the data-parallel ranks alone), or fully_shard it on a "
            f"mesh that includes the sequence-parallel ranks (docs/training.md, Training: "
            f"gradients across ranks)"
        )


def documents_of(infos, pieces: Tuple[int, ...], total: int) -> Optional[Tuple[int, ...]]:
    """The agreed document boundaries: given as cu_seqlens, or where position_ids restart."""
    given = infos[0]["cu_seqlens"]
    if given is not None:
        return check.check_documents(given, total)
    starts = sorted({0} | {sum(pieces[:r]) + s for r, i in enumerate(infos)
                           for s in i["doc_starts"]})
    if len(starts) == 1 and not any(i["doc_starts"] for i in infos):
        return None  # no position_ids: one sequence
    return tuple(starts) + (total,)
