"""Exact dilated (LongNet) attention and ring attention for very long sequences."""

from .dilated import dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = [
    "dilated_attention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
]
__version__ = "0.1.0"
