"""Exact dilated (LongNet) attention and ring attention for very long sequences."""

from .dilated import dilated_attention

__all__ = ["dilated_attention"]
__version__ = "0.1.0"
