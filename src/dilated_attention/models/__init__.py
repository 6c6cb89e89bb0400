"""The LongNet models: a decoder-only language model and the encoder-decoder.

| file | job |
| --- | --- |
| ``config.py`` | ``LongNetConfig`` and its presets |
| ``layers.py`` | feed-forward, cross-attention, the transformer block, positions |
| ``base.py`` | what both models share: embeddings, head, loss, running the blocks |
| ``checkpointing.py`` | running the blocks in training: activation checkpointing, offload |
| ``lm.py`` | ``LongNetLM`` (decoder-only) |
| ``encoder_decoder.py`` | ``LongNet`` (encoder-decoder) |
| ``generation.py`` | generation with a key/value cache |
| ``loss.py`` | the token-mean loss over every rank, its gradient convention, the chunked loss |
| ``inputs.py`` | the models' inputs checked on every rank at once; the replica check |
"""

from .config import LongNetConfig
from .encoder_decoder import LongNet
from .lm import LongNetLM
from .loss import IGNORE_INDEX, token_mean_loss

__all__ = ["LongNetConfig", "LongNetLM", "LongNet", "IGNORE_INDEX", "token_mean_loss"]
