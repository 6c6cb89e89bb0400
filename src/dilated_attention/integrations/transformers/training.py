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
[gradients across ranks] in distributed/gradients.py).

Long sequences: the logits of n tokens take n v floats (the loss upcasts them
to fp32). ``causal_lm_parts`` splits a causal LM into its body and its
``lm_head``; ``causal_lm_loss(hidden_states, targets, pg, lm_head=lm_head)``
then computes the same loss over chunks of rows, never holding the logits
(Note [chunked head loss] in models/loss.py).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ... import validation as check
from ...distributed import comm
from ...distributed.sharding import shard_sequence
from ...models.inputs import check_targets, check_tokens
from ...models.loss import (IGNORE_INDEX, LOSS_CHUNK_BYTES, chunked_token_mean_loss,
                            token_mean_loss)
from .documents import restarts
from .refusals import describe


def shard_inputs(input_ids: Tensor, group: comm.GroupLike, *, labels: Optional[Tensor] = None,
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
        attention_mask: (b, N) padding mask of 0s and 1s (bool, integer or
            float), or None.

    One small agreement collective checks the arguments' shapes and dtypes
    on every rank (a mistake on one rank is a ``ValueError`` on all of them;
    the values are not compared).

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
    if isinstance(position_ids, Tensor) and position_ids.dim() == 1:
        position_ids = position_ids[None]

    def checks() -> Dict[str, object]:
        # inside one agreement: an argument bad on one rank only raises on every rank (the
        # others would wait in the model's first agreement until the timeout)
        check_tokens("input_ids", input_ids, None)  # as the models check theirs
        b, n = input_ids.shape
        ranks = comm.group_size(comm.resolve_group(group))
        if n < ranks:
            raise ValueError(
                f"input_ids has {n} tokens for {ranks} sequence-parallel ranks: a rank would "
                f"get an empty piece, which transformers' models cannot run (their attention "
                f"layers reshape (batch, 0, -1, head_dim)); pass at least {ranks} tokens or use "
                f"fewer ranks"
            )
        if labels is not None and (not isinstance(labels, Tensor)
                                   or tuple(labels.shape) != (b, n)):
            raise ValueError(f"labels must be ({b}, {n}) like input_ids "
                             f"{tuple(input_ids.shape)}, got {describe(labels)}")
        # positions and the padding mask as the attention and generate check them
        if position_ids is not None:
            check.check_position_ids(position_ids, b, n)
        check.check_attention_mask(attention_mask, input_ids, "input_ids")
        # shapes and dtypes: the same batch on every rank (its values are not compared)
        return {name: None if x is None else (tuple(x.shape), x.dtype)
                for name, x in (("input_ids", input_ids), ("labels", labels),
                                ("position_ids", position_ids),
                                ("attention_mask", attention_mask))}

    comm.agree(group, checks)
    b, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None]
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


def causal_lm_loss(outputs: Tensor, targets: Tensor, group: comm.GroupLike, *,
                   lm_head: Optional[nn.Linear] = None,
                   chunk_bytes: int = LOSS_CHUNK_BYTES) -> Tensor:
    """Token-weighted mean cross-entropy over every rank's (outputs, targets) of `shard_inputs`.

    `outputs` are the logits (b, n, v) (``model(**inputs).logits``) or,
    with `lm_head` (the model's ``nn.Linear`` head, see
    ``causal_lm_parts``), the final hidden states (b, n, e) that lm_head
    maps to the logits: the loss then runs over chunks of rows whose fp32
    logits take at most `chunk_bytes`, recomputed in backward, and the
    (b, n, v) logits never exist (same value and gradients, to rounding).

    Targets are ids in [0, vocab) or -100 (ignored); anything else is a
    ``ValueError`` on every rank (one small agreement collective checks the
    arguments first, as the models' forward does), as are ranks whose
    outputs differ in dtype or vocabulary size.
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
    def checks() -> Dict[str, object]:
        # inside the agreement: a mistake on one rank raises on every rank (no rank left
        # waiting in the loss's all-reduce)
        width = None
        if lm_head is not None:
            if not isinstance(lm_head, nn.Linear):
                raise TypeError(f"lm_head must be the model's torch.nn.Linear head, got "
                                f"{type(lm_head).__name__}")
            width = lm_head.in_features
        if not isinstance(outputs, Tensor) or not isinstance(targets, Tensor) \
                or outputs.dim() != 3 or tuple(targets.shape) != tuple(outputs.shape[:2]) \
                or width not in (None, outputs.shape[2]):
            what = "logits (batch, seq_len, vocab)" if lm_head is None else \
                f"hidden states (batch, seq_len, {width}) for lm_head"
            raise ValueError(f"outputs must be the {what} and targets (batch, seq_len), got "
                             f"{describe(outputs)} and {describe(targets)}")
        # ids or IGNORE_INDEX: the chunked loss would read any other negative as id 0
        vocab = outputs.shape[2] if lm_head is None else lm_head.out_features
        check_targets(targets, targets, vocab, "targets")
        # the all-reduce below sums in the outputs' accumulator dtype: ranks whose dtypes differ
        # would enter it with tensors of other sizes (gloo aborts the process)
        return {"outputs.dtype": outputs.dtype, "vocab": vocab}

    comm.agree(group, checks)
    if lm_head is None:
        return token_mean_loss(outputs, targets.long(), group)
    return chunked_token_mean_loss(outputs, lm_head.weight, targets.long(), group,
                                   bias=lm_head.bias, chunk_bytes=chunk_bytes,
                                   training=lm_head.training)


# Config fields with which a causal LM's forward changes the logits after lm_head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "lm_head_multiplier")


def causal_lm_parts(model: nn.Module) -> Tuple[nn.Module, nn.Linear]:
    """(body, lm_head) of a transformers causal LM whose logits are
    ``lm_head(body(**inputs).last_hidden_state)``, for ``causal_lm_loss(..., lm_head=)``.

        body, lm_head = causal_lm_parts(model)
        hidden = body(**inputs).last_hidden_state
        loss = causal_lm_loss(hidden, targets, pg, lm_head=lm_head)

    That is the forward of the Llama-style ``...ForCausalLM`` classes
    (Llama, Mistral, Qwen2/3, Phi-3, ...; tested: Llama), whose body is
    ``model.base_model`` and whose head ``model.get_output_embeddings()`` is
    an ``nn.Linear``. Refused with a ValueError: a model without such a
    head or body, and configs that scale or cap the logits after the head
    (Gemma 2/3 ``final_logit_softcapping``, Cohere ``logit_scale``, Granite
    ``logits_scaling``, Falcon-H1 ``lm_head_multiplier``): for those
    compute ``model(**inputs).logits``. The body runs without the outer
    model's module hooks: under FSDP2 the chunked loss reads
    ``lm_head.weight`` directly, so use it with DDP or
    ``all_reduce_gradients``, not with a sharded head.
    """
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", model)
    if not isinstance(head, nn.Linear) or body is model:
        raise ValueError(f"causal_lm_parts: {name} has no nn.Linear output head "
                         f"(get_output_embeddings()) and base_model body; pass "
                         f"model(**inputs).logits to causal_lm_loss instead")
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value is not None and value != 1:
            raise ValueError(f"causal_lm_parts: {name} transforms its logits after lm_head "
                             f"({field}={value!r}); pass model(**inputs).logits to "
                             f"causal_lm_loss instead")
    return body, head
