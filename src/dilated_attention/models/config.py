"""The LongNet models' hyper-parameters and their presets."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.nn.functional as F

from .. import validation as check
from .checkpointing import CHECKPOINT_MODES
from .loss import LOSS_CHUNK_BYTES

ACTIVATIONS = types.MappingProxyType({"gelu": F.gelu, "relu": F.relu, "silu": F.silu})
POSITIONS = ("sinusoidal", "learned", "rotary")


@dataclass
class LongNetConfig:
    """Hyper-parameters of LongNetLM and LongNet.

    ``from_name("base")`` is the paper's base size (LongNet, section 4 and
    appendix: 12 layers, width 768, 12 heads, feed-forward 3072, segments
    2048..32768 with rates 1..12; the paper tokenises with tiktoken
    cl100k_base, 100,277 ids). ``from_name("tiny")`` is a model for tests and
    CPU demos.

    num_layers is the decoder depth; num_encoder_layers is used by the
    encoder-decoder ``LongNet`` only. ``positions``: "sinusoidal" or
    "learned" embeddings added to the tokens' (max_seq_len bounds the global
    positions of "learned"; the others have no bound), or "rotary": each
    self-attention turns its queries and keys by their positions (RoPE,
    Llama's convention, base ``rope_theta``; rotary.py), nothing added to the
    tokens' embeddings.

    Training memory (results are the same whatever they are):
    ``checkpoint`` is "none", "layers" (recompute each block in backward,
    keep only its input) or "offload" ("layers" with the kept inputs in host
    memory), Note [checkpoint modes] in models/checkpointing.py;
    ``loss_chunk_bytes`` bounds one chunk of the logits that the loss
    computes with targets (fp32 for half-precision models), Note [chunked
    head loss] in models/loss.py; ``ffn_chunk_bytes`` (None: off) runs the
    feed-forward over chunks of rows in training, each recomputed in
    backward, bounding one chunk's (b, rows, ffn_dim) intermediate.

    ``backend`` is the dilated self-attention's kernel, as for
    ``dilated_attention`` ("auto": the fastest for the device and dtype,
    docs/backends.md).
    """

    vocab_size: int = 64
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    ffn_dim: int = 256
    segment_lengths: Tuple[int, ...] = (128, 512, 2048)
    dilation_rates: Tuple[int, ...] = (1, 2, 4)
    num_encoder_layers: int = 2
    positions: str = "sinusoidal"
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    tie_embeddings: bool = True
    checkpoint: str = "none"
    loss_chunk_bytes: int = LOSS_CHUNK_BYTES
    ffn_chunk_bytes: Optional[int] = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "ffn_dim",
                     "num_encoder_layers", "max_seq_len", "loss_chunk_bytes"):
            setattr(self, name, check.check_positive_int(name, getattr(self, name)))
        for name in ("num_kv_heads", "ffn_chunk_bytes"):  # None: as many as num_heads; off
            setattr(self, name, check.check_optional_positive_int(name, getattr(self, name)))
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        if self.num_heads % kv:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({kv})"
            )
        self.segment_lengths, self.dilation_rates = check.check_patterns(
            self.segment_lengths, self.dilation_rates
        )
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}"
            )
        # kept as the checks return them (Python numbers, as the ints above): a NumPy value
        # would stay one in the config (json.dumps of its fields fails on it)
        self.layer_norm_eps = check.check_positive_float("layer_norm_eps", self.layer_norm_eps)
        self.rope_theta = check.check_positive_float("rope_theta", self.rope_theta)
        if self.positions == "rotary" and (self.embed_dim // self.num_heads) % 2:
            raise ValueError(f"positions='rotary' needs an even head dim (embed_dim // "
                             f"num_heads), got {self.embed_dim // self.num_heads}")
        self.dropout = check.check_dropout(self.dropout, "dropout")
        self.attention_dropout = check.check_dropout(self.attention_dropout, "attention_dropout")
        for name in ("bias", "tie_embeddings"):
            check.check_bool(name, getattr(self, name))
        check.check_backend(self.backend)
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint must be one of {CHECKPOINT_MODES}, got {self.checkpoint!r}"
            )

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LongNetConfig":
        """A preset ("base" or "tiny"), with any field overridden by keyword."""
        if not isinstance(name, str) or name not in _PRESETS:
            raise ValueError(f"unknown LongNet preset {name!r}; choose one of {tuple(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})


_PRESETS = types.MappingProxyType(
    {
        "base": types.MappingProxyType(
            dict(
                vocab_size=100_277, embed_dim=768, num_layers=12, num_encoder_layers=12,
                num_heads=12, ffn_dim=3072, segment_lengths=(2048, 4096, 8192, 16384, 32768),
                dilation_rates=(1, 2, 4, 6, 12), max_seq_len=32768,
            )
        ),
        "tiny": types.MappingProxyType(
            dict(
                vocab_size=64, embed_dim=64, num_layers=2, num_encoder_layers=2, num_heads=4,
                ffn_dim=256, segment_lengths=(128, 512, 2048), dilation_rates=(1, 2, 4),
                max_seq_len=8192,
            )
        ),
    }
)
