"""Adapters to other libraries; each imports its library lazily, inside its functions.

- ``integrations.transformers``: a Hugging Face transformers attention backend
  (``register``) and sequence-parallel fine-tuning helpers (``shard_inputs``,
  ``causal_lm_loss``); needs the ``[hf]`` extra.
"""
