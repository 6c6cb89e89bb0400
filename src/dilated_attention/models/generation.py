"""Generation with LongNetLM: a key/value cache per layer, decoding, sampling.

Notation: b batch, n tokens, e embed dim, v vocabulary, hk key/value heads,
d head dim.

The prompt runs through the full causal op; each new token at position t
then attends the cache by the incremental rule (``cached_dilated_attention``:
row t of the causal op over t + 1 positions, which does not depend on what
follows t), so generating with the cache equals rerunning the whole sequence.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor, nn

from .. import validation as check
from ..dilated import cached_dilated_attention
from ..distributed import comm
from .inputs import check_tokens
from .layers import Block


@dataclass
class KVCache:
    """Projected keys and values of one layer for generation: (b, capacity, hk, d)."""

    k: Tensor
    v: Tensor


@torch.no_grad()
def generate(model: nn.Module, tokens: Tensor, max_new_tokens: int, *, temperature: float,
             top_k: Optional[int], use_cache: bool,
             generator: Optional[torch.Generator]) -> Tensor:
    """``LongNetLM.generate``: tokens (b, n) -> (b, n + max_new_tokens), dropout off."""
    if comm.is_distributed(model.process_group):
        raise ValueError("generate runs on one process; build the model without process_group")
    check_tokens("tokens", tokens, model.config.vocab_size)
    if tokens.shape[1] == 0:
        raise ValueError(
            f"tokens must hold at least one id per row, got shape {tuple(tokens.shape)}"
        )
    max_new_tokens = check.check_positive_int("max_new_tokens", max_new_tokens)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite float >= 0, got {temperature}")
    top_k = check.check_optional_positive_int("top_k", top_k)
    check.check_bool("use_cache", use_cache)
    total = tokens.shape[1] + max_new_tokens
    if model.config.positions == "learned" and total > model.config.max_seq_len:
        raise ValueError(
            f"generating to {total} tokens exceeds max_seq_len={model.config.max_seq_len}"
        )
    was_training = model.training
    model.eval()
    try:
        return _generate(model, tokens, max_new_tokens, temperature, top_k, use_cache, generator)
    finally:
        model.train(was_training)


def _generate(model, tokens, max_new_tokens, temperature, top_k, use_cache, generator) -> Tensor:
    out = tokens
    caches = new_caches(model, tokens, tokens.shape[1] + max_new_tokens) if use_cache else None
    logits = decode(model, tokens, caches, 0) if use_cache else model(tokens)[0]
    for step in range(max_new_tokens):
        nxt = _sample(logits[:, -1], temperature, top_k, generator)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if step + 1 == max_new_tokens:
            break
        if use_cache:
            logits = decode(model, nxt[:, None], caches, out.shape[1] - 1)
        else:
            logits = model(out)[0]
    return out


def new_caches(model: nn.Module, tokens: Tensor, capacity: int) -> List[KVCache]:
    """One empty cache per layer for tokens' batch, `capacity` positions long."""
    attn = model.layers[0].self_attn
    ref = model.embed.weight
    shape = (tokens.shape[0], capacity, attn.num_kv_heads, attn.head_dim)
    return [KVCache(ref.new_zeros(shape), ref.new_zeros(shape)) for _ in range(len(model.layers))]


def decode(model: nn.Module, tokens: Tensor, caches: List[KVCache], start: int) -> Tensor:
    """Logits (b, n, v) of tokens (b, n) at positions [start, start + n), caching k/v."""
    x = model.embed_at(tokens, torch.arange(start, start + tokens.shape[1], device=tokens.device))
    for layer, cache in zip(model.layers, caches):
        x = _decode_block(layer, x, cache, start)
    return model.logits(model.norm(x))


def _decode_block(block: Block, x: Tensor, cache: KVCache, start: int) -> Tensor:
    """Positions [start, start + n) of a causal block, keys/values cached.

    x (b, n, e) -> (b, n, e). With start == 0 (the prompt) the full op runs;
    later tokens attend the cache by the incremental rule.
    """
    attn = block.self_attn
    h = block.attn_norm(x)
    q, k, v = attn.project_qkv(h, h, h)
    n = x.shape[1]
    cache.k[:, start : start + n] = k
    cache.v[:, start : start + n] = v
    if start == 0:
        out = attn.attention(q, k, v, is_causal=True)
    else:
        out = torch.cat(
            [
                cached_dilated_attention(
                    q[:, i : i + 1], cache.k[:, : start + i + 1], cache.v[:, : start + i + 1],
                    attn.segment_lengths, attn.dilation_rates, scale=attn.attention.scale,
                )
                for i in range(n)
            ],
            dim=1,
        )
    x = x + block.dropout(attn.project_out(out))
    return block.after_attention(x, None)


def _sample(logits: Tensor, temperature: float, top_k: Optional[int], generator) -> Tensor:
    """Next ids (b,) from last-position logits (b, v): greedy at temperature 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
