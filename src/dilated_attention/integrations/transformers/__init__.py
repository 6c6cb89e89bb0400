"""A Hugging Face transformers attention backend: every attention layer runs `dilated_attention`.

    from dilated_attention.integrations.transformers import register
    name = register(segment_lengths=[2048, 4096], dilation_rates=[1, 2])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

| file | job |
| --- | --- |
| ``backend.py`` | ``register``; the attention function; decoding one token (Note [generation]) |
| ``masks.py`` | the mask function (Note [what the mask function returns]) |
| ``cross.py`` | which calls are cross-attention, run as sdpa (Note [cross-attention]) |
| ``documents.py`` | packed documents from position_ids, cu_seq_lens and masks, agreed over ranks |
| ``refusals.py`` | what is honoured, what is refused, and the hints |
| ``training.py`` | sequence-parallel fine-tuning: ``shard_inputs``, ``causal_lm_loss``, ``causal_lm_parts`` |
| ``generation.py`` | ``generate``: the prompt and the key/value cache sharded over ranks |
| ``cache.py`` | the cache of sharded generation: a transformers ``Cache`` of this rank's rows |

Sequence-parallel fine-tuning (``register(..., group=pg)``): every rank feeds
its own contiguous slice of ``input_ids`` with the GLOBAL ``position_ids``
(``shard_inputs``) and computes the loss with ``causal_lm_loss`` (from the
hidden states and ``lm_head`` of ``causal_lm_parts``: without the logits).
Sharded generation: ``generate(model, input_ids, group=pg, max_new_tokens=...)``
on every rank returns what ``model.generate`` returns on one process.
"""

from .backend import register
from .generation import generate
from .training import causal_lm_loss, causal_lm_parts, shard_inputs

__all__ = ["register", "generate", "shard_inputs", "causal_lm_loss", "causal_lm_parts"]
