"""Train a small Hugging Face Llama with dilated attention, on one process or sequence-parallel.

The model is a transformers LlamaForCausalLM built from a config (random
weights, nothing downloaded) whose attention layers run through
``dilated_attention`` (``integrations.transformers.register``). The task, the
arguments and the training loop are those of examples/train_long_context.py:
a key written as a run of --key-len tokens at the start, random filler, a
QUERY id. Here the answer (the key) follows the query, as a language model
writes it, and only the query position is trained, to predict it. Only the
sparsest pattern (segment 2048, rate 4) reaches from the query back to the
key, so beating chance (1 / --keys) means dilated attention carried the
information across the sequence.

    python examples/finetune_hf.py                            # one process
    python examples/finetune_hf.py --world-size 2             # the sequence split over 2 gloo ranks
    python examples/finetune_hf.py --world-size 2 --compare   # and diff the loss against 1 process
    python examples/finetune_hf.py --packed 4                 # 4 documents a sequence

With --world-size P every rank registers the backend with the process group,
feeds its own contiguous slice of each sequence with the GLOBAL position_ids
(``shard_inputs``), computes the token-weighted loss over all ranks
(``causal_lm_loss`` from the body's hidden states and ``lm_head``, split by
``causal_lm_parts``: over chunks of rows, without the logits; ranks without a
query position have no target) and
averages the gradients (``all_reduce_gradients``: each rank's backward
yields P times its own tokens' part, Note [gradients across ranks]). With --packed K the
documents' position_ids restart at 0, which makes them independent
sequences (``shard_inputs`` passes their boundaries as cu_seq_lens_q/k).
--checkpoint layers (or offload, the same on a CPU model) turns on
transformers' activation checkpointing (``activation_checkpointing_enable``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Tuple

import torch

from dilated_attention.integrations.transformers import (causal_lm_loss, causal_lm_parts, register,
                                                          shard_inputs)
from dilated_attention.models import IGNORE_INDEX
# the task, its arguments and the training loop, from the example next to this one (a
# script's folder is on sys.path, in spawned ranks too)
from train_long_context import (VOCAB, accuracy, compare, fit, make_packed_batch, parse_args,
                                report, train_distributed)

SEGMENT_LENGTHS, DILATION_RATES = [128, 512, 2048], [1, 2, 4]  # rates <= heads


def build_model(args: argparse.Namespace, group):
    """A 2-layer Llama (4 heads, 2 key/value heads) whose attention is dilated."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    # one name per group: a name's settings hold for every model built with it
    name = register("dilated_attention" if group is None else "dilated_attention_sp",
                    segment_lengths=SEGMENT_LENGTHS, dilation_rates=DILATION_RATES, group=group)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len + max(args.packed, 1),
                         tie_word_embeddings=True)
    torch.manual_seed(args.seed)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(config, attn_implementation=name,
                                            dtype=getattr(torch, args.dtype))


def recall_batch(args: argparse.Namespace,
                 step: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(b, seq_len + documents) ids, labels and position_ids (None for one document).

    Every document of the task is followed by its answer, the key its query
    asks for; the answers are the only labels (position t learns labels[t + 1]:
    the query learns the answer).
    """
    tokens, targets, cu = make_packed_batch(args, step)
    bounds = cu or [0, tokens.shape[1]]
    ids, labels, positions = [], [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        answer = targets[:, e - 1 : e]  # the target at the document's query
        ids += [tokens[:, s:e], answer]
        labels += [torch.full_like(tokens[:, s:e], IGNORE_INDEX), answer]
        positions.append(torch.arange(e - s + 1))
    position_ids = torch.cat(positions)[None] if cu else None
    return torch.cat(ids, dim=1), torch.cat(labels, dim=1), position_ids


def evaluate(model, args: argparse.Namespace, group) -> float:
    """Recall accuracy at the query positions on held-out batches."""

    def predict(batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        ids, labels, pos = recall_batch(args, batch)
        inputs, targets = shard_inputs(ids, group, labels=labels, position_ids=pos)
        return model(**inputs).logits, targets

    return accuracy(model, args, group, predict)


def train(args: argparse.Namespace, group=None) -> Dict[str, object]:
    """Train on this process's slice of every sequence; returns the loss curve and accuracy."""
    model = build_model(args, group).train()
    if args.checkpoint != "none":
        # transformers' own activation checkpointing; its offload=True pins host memory,
        # which needs an accelerator: on this CPU model "offload" is "layers", as for LongNet
        model.activation_checkpointing_enable({"use_reentrant": False})
    body, lm_head = causal_lm_parts(model)  # the Llama body and its nn.Linear head

    def batch_loss(step: int) -> torch.Tensor:
        ids, labels, pos = recall_batch(args, step)
        inputs, targets = shard_inputs(ids, group, labels=labels, position_ids=pos)
        return causal_lm_loss(body(**inputs).last_hidden_state, targets, group, lm_head=lm_head)

    result = fit(model, args, group, batch_loss)
    return {**result, "accuracy": evaluate(model, args, group)}


def _train_rank(group, args: argparse.Namespace) -> Dict[str, object]:
    return train(args, group)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    if args.check_unpacked:
        sys.exit("finetune_hf.py: --check-unpacked is train_long_context.py's; "
                 "tests/test_hf.py checks packed documents against documents alone")
    if args.mesh:
        sys.exit("finetune_hf.py: --mesh is train_long_context.py's (docs/training.md shows "
                 "DDP and FSDP2 with a transformers model)")
    chance = 1.0 / args.keys
    documents = max(args.packed, 1)
    print(f"task: {documents} document(s) per sequence, each recalls the key written at its "
          f"start ({args.key_len} tokens) at its query; chance {chance:.3f}")
    if args.world_size == 1:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        result = train(args)
    else:
        result = train_distributed(args, _train_rank)
    report(f"{args.world_size} process(es)", result, chance)
    if args.compare and args.world_size > 1:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        compare(result, train(args), args, chance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
