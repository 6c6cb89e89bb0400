"""Exact dilated (LongNet) attention and ring attention for very long sequences."""

from .distributed.gradients import all_reduce_gradients
from .distributed.sharding import shard_sequence, unshard_sequence
from .functional import dilated_attention, ring_attention
from .backends import recommended_dtype
from .models import LongNet, LongNetConfig, LongNetLM
from .modules import DilatedAttention, MultiheadDilatedAttention
from .rotary import apply_rotary, rotary_tables

__all__ = [
    "dilated_attention",
    "recommended_dtype",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "rotary_tables",
    "apply_rotary",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "all_reduce_gradients",
    "LongNetConfig",
    "LongNetLM",
    "LongNet",
]
__version__ = "0.1.0"
