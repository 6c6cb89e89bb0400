"""Sequence-parallel fine-tuning helpers: each rank's inputs and targets, and the loss.

``register(..., group=pg)`` makes every rank feed its own contiguous slice of
``input_ids`` with the GLOBAL ``position_ids``; its logits are its rows of
the single-process logits. ``shard_inputs`` builds a rank's inputs and
targets (packed documents as global ``cu_seq_lens_q/k``: a rank cannot tell
a document starting at its first row from transformers' default positions
0 .. n-1, so restarting position_ids alone are an error there),
``causal_lm_loss`` the token-weighted loss over all ranks, with LongNetLM's
gradient convention; after ``backward`` average the parameter gradients over
the sequence-parallel ranks with ``dilated_attention.all_reduce_gradients(model,
pg)`` (or wrap the model in DDP / FSDP2 over ranks that include them; Note
[gradients across ranks] in distributed/sharding.py).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ...distributed import comm
from ...distributed.sharding import shard_sequence
from ...models import IGNORE_INDEX, token_mean_loss
from .documents import restarts
from .refusals import describe


def shard_inputs(input_ids: Tensor, group, *, labels: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None,
                 attention_mask: Optional[Tensor] = None) -> Tuple[Dict[str, Tensor],
                                                                    Optional[Tensor]]:
    """This rank's model inputs and loss targets, from the whole batch (the same on every rank).

    Args:
        input_ids: (b, N) token ids of the whole sequence.
        group: the sequence-parallel process group (None: one process).
        labels: (b, N) as transformers takes them (position t is trained to
            predict labels[t + 1]; -100 ignores a token), or None.
        position_ids: (N,), (1, N) or (b, N); default 0 .. N-1. Restarts
            mark packed documents.
        attention_mask: (b, N) 0/1 padding mask, or None.

    Returns:
        (inputs, targets): ``model(**inputs)`` runs this rank's contiguous
        slice with its GLOBAL position_ids (and no KV cache); ``targets``
        (b, n) are this rank's rows of the labels shifted by one across the
        whole sequence, with -100 where the next token starts a new document
        (the position_ids restart) and at the last position, for
        ``causal_lm_loss``; None without labels. Packed documents (restarting
        position_ids, nothing padded) also give ``cu_seq_lens_q`` and
        ``cu_seq_lens_k``, the global document boundaries.
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seq_len) tensor, got "
                         f"{describe(input_ids)}")
    b, n = input_ids.shape
    ranks = comm.group_size(comm.resolve_group(group))
    if n < ranks:
        # the same inputs on every rank: every rank raises here, none waits for an empty one
        raise ValueError(
            f"input_ids has {n} tokens for {ranks} sequence-parallel ranks: a rank would get "
            f"an empty piece, which transformers' models cannot run (their attention layers "
            f"reshape (batch, 0, -1, head_dim)); pass at least {ranks} tokens or use fewer ranks"
        )
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None]
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    for name, x, rows in (("labels", labels, (b,)), ("position_ids", position_ids, (1, b)),
                          ("attention_mask", attention_mask, (b,))):
        if x is not None and (not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != n
                              or x.shape[0] not in rows):
            raise ValueError(f"{name} must be ({' or '.join(map(str, rows))}, {n}) like "
                             f"input_ids {tuple(input_ids.shape)}, got {describe(x)}")
    inputs = {"input_ids": shard_sequence(input_ids, group),
              "position_ids": shard_sequence(position_ids, group), "use_cache": False}
    if attention_mask is not None:
        inputs["attention_mask"] = shard_sequence(attention_mask, group)
    restart = restarts(position_ids)
    # the attention function's rule: with padding, restarting positions are not documents
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if not padded and bool(restart.any()):
        if bool((restart != restart[:1]).any()):
            raise ValueError("position_ids restart (packed documents) differently in different "
                             "batch rows; documents are shared by the batch")
        # the GLOBAL boundaries: a rank cannot see a document that starts at its first row
        starts = (restart[0].nonzero().flatten() + 1).tolist()
        cu = torch.tensor([0, *starts, n], dtype=torch.int32, device=input_ids.device)
        inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = cu
    if labels is None:
        return inputs, None
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    # a document's last token must not learn to predict the next document's first
    targets[:, :-1].masked_fill_(restarts(position_ids.expand(b, -1)), IGNORE_INDEX)
    return inputs, shard_sequence(targets, group)


def causal_lm_loss(logits: Tensor, targets: Tensor, group) -> Tensor:
    """Token-weighted mean cross-entropy over every rank's (logits, targets) of `shard_inputs`.

    The same value on every rank, equal to the single-process loss. Every
    rank must call it (one whose targets are all -100 too: no hang). Its
    gradient is P times this rank's share (P ranks in `group`), as
    LongNetLM's loss: after ``loss.backward()`` call
    ``all_reduce_gradients(model, group)``, which averages over the group,
    or let DDP (over the sequence-parallel or data x sequence ranks) or
    FSDP2 (on a mesh that includes them) average. Nothing checks here that
    the ranks' parameters stay equal (the attention backend does not see
    the parameters): LongNetLM's forward does.
    """
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor) \
            or logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be (batch, seq_len, vocab) and targets (batch, seq_len), "
                         f"got {describe(logits)} and {describe(targets)}")
    return token_mean_loss(logits, targets.long(), group)
