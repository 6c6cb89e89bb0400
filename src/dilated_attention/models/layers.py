"""The LongNet models' layers: feed-forward, cross-attention, the transformer block, positions.

Notation: b batch, n tokens (this rank's piece under sequence parallelism),
m encoder tokens, e embed dim, f feed-forward dim, h query heads, hk
key/value heads, d head dim.

MAGNETO (Wang et al., 2022, arXiv 2210.06423) blocks with dilated
self-attention, as in LongNet (Ding et al., 2023) and torchscale: pre-norm
residual blocks, a "sub-LN" LayerNorm inside the attention (before its
output projection) and inside the feed-forward (before its second linear),
and the MAGNETO gain gamma on the value/output projections and both
feed-forward linears.

NOTE: deviations from the paper / torchscale: absolute positions (learned
or sinusoidal) or rotary ones (RoPE without xPos's decay) instead of xPos; xavier-normal initialisation with gain
gamma instead of torchscale's default init rescaled by gamma; the
encoder-decoder's cross-attention is plain dense attention over the whole
encoder output.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules import MultiheadDilatedAttention
from ..rotary import rotary_tables
from .checkpointing import run_in_chunks
from .config import ACTIVATIONS, LongNetConfig


class FeedForward(nn.Module):
    """fc1, activation, sub-LN, fc2 (MAGNETO), with gain gamma on fc1 and fc2."""

    def __init__(self, config: LongNetConfig, gamma: float, factory: dict) -> None:
        super().__init__()
        e, f = config.embed_dim, config.ffn_dim
        self.fc1 = nn.Linear(e, f, bias=config.bias, **factory)
        self.norm = nn.LayerNorm(f, eps=config.layer_norm_eps, **factory)
        self.fc2 = nn.Linear(f, e, bias=config.bias, **factory)
        self.activation = ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)
        self.gamma = gamma
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_normal_(fc.weight, gain=self.gamma)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)
        self.norm.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        """(b, n, e) -> (b, n, e)."""
        return self.fc2(self.norm(self.dropout(self.activation(self.fc1(x)))))


class CrossAttention(nn.Module):
    """Dense attention of decoder queries over the whole encoder output.

    No sub-LN and gain 1, as torchscale's encoder-decoder attention.
    """

    def __init__(self, config: LongNetConfig, factory: dict) -> None:
        super().__init__()
        e, h = config.embed_dim, config.num_heads
        self.num_heads = h
        self.num_kv_heads = h if config.num_kv_heads is None else config.num_kv_heads
        self.head_dim = e // h
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(e, e, bias=config.bias, **factory)
        self.k_proj = nn.Linear(e, kv_dim, bias=config.bias, **factory)
        self.v_proj = nn.Linear(e, kv_dim, bias=config.bias, **factory)
        self.out_proj = nn.Linear(e, e, bias=config.bias, **factory)
        self.dropout = config.attention_dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_normal_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        """x (b, n, e) attends memory (b, m, e) -> (b, n, e)."""
        group = self.num_heads // self.num_kv_heads
        # (b, n, e) -> (b, h, n, d): SDPA takes heads second
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        # (b, m, e) -> (b, hk, m, d), then (b, h, m, d): query head j reads kv head j // group
        k = self.k_proj(memory).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(memory).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        if group > 1:
            # copies of the memory's heads, not enable_gqa: SDPA's memory-efficient kernel
            # (fp32 on a GPU) does not take it, and its math kernel would hold every score
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        # (b, h, n, d) -> (b, n, e)
        return self.out_proj(out.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    """Pre-norm transformer block: dilated self-attention, [cross-attention], feed-forward."""

    def __init__(
        self,
        config: LongNetConfig,
        *,
        gamma: float,
        causal: bool,
        cross_attention: bool,
        factory: dict,
        process_group,
        strategy: str = "auto",
    ) -> None:
        super().__init__()
        e, eps = config.embed_dim, config.layer_norm_eps
        self.causal = causal
        self.attn_norm = nn.LayerNorm(e, eps=eps, **factory)
        self.self_attn = MultiheadDilatedAttention(
            e,
            config.num_heads,
            config.segment_lengths,
            config.dilation_rates,
            num_kv_heads=config.num_kv_heads,
            dropout=config.attention_dropout,
            bias=config.bias,
            layer_norm=True,
            layer_norm_eps=eps,
            gamma_init=gamma,
            process_group=process_group,
            strategy=strategy,
            backend=config.backend,
            **factory,
        )
        self.cross_norm = nn.LayerNorm(e, eps=eps, **factory) if cross_attention else None
        self.cross_attn = CrossAttention(config, factory) if cross_attention else None
        self.ffn_norm = nn.LayerNorm(e, eps=eps, **factory)
        self.ffn = FeedForward(config, gamma, factory)
        self.ffn_chunk_bytes = config.ffn_chunk_bytes
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self) -> None:
        for part in (self.attn_norm, self.self_attn, self.cross_norm, self.cross_attn,
                     self.ffn_norm, self.ffn):
            if part is not None:
                part.reset_parameters()

    def forward(self, x: Tensor, memory: Optional[Tensor] = None,
                cu_seqlens: Optional[Tuple[int, ...]] = None,
                rotary: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        """x (b, n, e) [, memory (b, m, e)] -> (b, n, e); cu_seqlens: packed documents;
        rotary: the rows' rotary tables (positions="rotary")."""
        h = self.attn_norm(x)
        attn, _ = self.self_attn(h, h, h, is_causal=self.causal, cu_seqlens=cu_seqlens,
                                 rotary=rotary)
        x = x + self.dropout(attn)
        return self.after_attention(x, memory)

    def after_attention(self, x: Tensor, memory: Optional[Tensor]) -> Tensor:
        """The block after its self-attention's residual: [cross-attention,] feed-forward."""
        if self.cross_attn is not None:
            x = x + self.dropout(self.cross_attn(self.cross_norm(x), memory))
        return x + self.dropout(self.feed_forward(x))

    def feed_forward(self, x: Tensor) -> Tensor:
        """ffn(ffn_norm(x)): (b, n, e) -> (b, n, e); in training over chunks of rows whose
        (b, rows, ffn_dim) intermediate takes at most ffn_chunk_bytes, when set (Note
        [checkpoint modes] in checkpointing.py)."""
        if self.ffn_chunk_bytes is None:
            return self._ffn_rows(x)
        row_bytes = x.shape[0] * self.ffn.fc1.out_features * x.element_size()
        return run_in_chunks(self._ffn_rows, x, self.ffn_chunk_bytes, row_bytes)

    def _ffn_rows(self, x: Tensor) -> Tensor:
        return self.ffn(self.ffn_norm(x))


class Positions(nn.Module):
    """Global positions [start, start + n) as embeddings added to the tokens' (sinusoidal or
    learned), or as the self-attentions' rotary tables (rotary)."""

    def __init__(self, config: LongNetConfig, factory: dict) -> None:
        super().__init__()
        self.kind = config.positions
        self.embed_dim = config.embed_dim
        self.head_dim = config.embed_dim // config.num_heads
        self.rope_theta = config.rope_theta
        self.max_seq_len = config.max_seq_len
        self.table = None
        if self.kind == "learned":
            self.table = nn.Embedding(config.max_seq_len, config.embed_dim, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.table is not None:
            nn.init.normal_(self.table.weight, std=self.embed_dim**-0.5)

    def rotary(self, positions: Tensor, like: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """(n,) or (b, n) positions -> the rotary tables (cos, sin) in like's dtype, or None
        when the positions are embeddings."""
        if self.kind != "rotary":
            return None
        return rotary_tables(positions, self.head_dim, self.rope_theta, like.dtype)

    def forward(self, positions: Tensor, like: Tensor) -> Optional[Tensor]:
        """(n,) positions -> (n, e) embeddings in like's dtype/device; (b, n) -> (b, n, e);
        None with rotary positions (nothing is added).

        The caller checks positions against max_seq_len (on every rank at once).
        """
        if self.kind == "rotary":
            return None
        if self.table is not None:
            return self.table(positions)
        # float64 angles: exact for positions far beyond 2^24, then one cast
        pos = positions.to(torch.float64)
        half = self.embed_dim // 2
        freq = torch.exp(
            torch.arange(half, device=like.device, dtype=torch.float64)
            * (-math.log(10000.0) / max(half, 1))  # embed_dim 1: no frequency, a zero
        )
        angles = pos[..., None] * freq
        # (..., n, e/2) sin and (..., n, e/2) cos -> (..., n, e), zero-padded for odd e
        out = torch.cat([angles.sin(), angles.cos()], dim=-1)
        if out.shape[-1] < self.embed_dim:
            out = F.pad(out, (0, self.embed_dim - out.shape[-1]))
        return out.to(like.dtype)


def magneto_gamma(decoder_layers: int, encoder_layers: int = 0) -> Tuple[float, float]:
    """MAGNETO gains (encoder, decoder), as torchscale: decoder-only sqrt(log 2L)."""
    if encoder_layers == 0:
        return 0.0, math.sqrt(math.log(2 * decoder_layers))
    enc = math.sqrt(math.log(3 * decoder_layers) * math.log(2 * encoder_layers) / 3)
    dec = math.sqrt(math.log(3 * decoder_layers))
    return enc, dec
