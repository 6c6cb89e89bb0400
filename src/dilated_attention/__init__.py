"""Exact dilated (LongNet) attention and ring attention for very long sequences."""

from .dilated import dilated_attention
from .kernels import recommended_dtype
from .models import LongNet, LongNetConfig, LongNetLM
from .modules import DilatedAttention, MultiheadDilatedAttention
from .ring import ring_attention
from .sharding import shard_sequence, unshard_sequence

__all__ = [
    "dilated_attention",
    "recommended_dtype",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "LongNetConfig",
    "LongNetLM",
    "LongNet",
]
__version__ = "0.1.0"
