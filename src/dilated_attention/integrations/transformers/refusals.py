"""What the transformers backend honours and what it refuses, with hints.

Every input reaches dilated attention or is refused with an error naming the
argument, never silently dropped:

| input | handled as |
| --- | --- |
| q, k, v (b, h, n, d) | transposed views (b, n, h, d), no copy; hk < h is GQA, K/V never repeated |
| ``scaling`` | the softmax scale |
| ``dropout`` | attention dropout while ``module.training``; 0 in evaluation |
| ``is_causal`` (or ``module.is_causal``) | causal or not (the mask says bidirectional too: encoders, ``config.is_causal = False``) |
| 2-D padding ``attention_mask`` | ``key_padding_mask`` (left or right padding); a left-padded row whose first real token has position 0 (``generate``'s numbering) is computed as the row alone (padding.py) |
| ``position_ids`` that restart (no padding; one process) | packed documents -> ``cu_seqlens`` |
| ``cu_seq_lens_q`` = ``cu_seq_lens_k`` | packed documents -> ``cu_seqlens`` (global ones under sequence parallelism) |
| ``sliding_window`` and the model's sliding-window mask (Mistral, Qwen2, Gemma 3's local layers; ModernBERT's two-sided one, whose layers pass its reach + 1, flash-attn's convention) | exact windowed attention through ``ring_attention(window_size=...)``, one process or sequence-parallel (the halo exchange); the layers without a window keep the dilated patterns (Note [sliding-window layers] in backend.py) |
| one new token against a KV cache | exact decoding, left-padded batches and ``generate(..., group=)`` included (Note [generation] in backend.py); a sliding-window layer attends the window's keys, whatever the cache kept besides (transformers' sliding-window cache, and ``generate(..., group=)``'s sharded cache, whose ranks merge their keys of the window) |
| ``use_cache``, ``max_length_q/k``, ``num_items_in_batch``, ``output_hidden_states``, ``output_router_logits`` | no effect on attention |
| ``encoder_hidden_states=None`` (BERT's, RoBERTa's self-attention), ``deterministic=False`` (ModernBERT: flash-attn's deterministic backward not asked for) | nothing asked |
| a 4-D mask, a float mask, a mask function other than causal within documents or a sliding window (image-token blocks, Llama 4's chunked attention), ``softcap``, ``s_aux`` and ``sinks`` (sinks), ``position_bias``, ``seq_idx``, ``output_attentions=True``, ``encoder_hidden_states`` given, ``deterministic=True`` (use ``torch.use_deterministic_algorithms``), any other keyword; attention dropout on a sliding-window layer | refused |
| cross-attention (a layer class named ``...CrossAttention``, flagged ``is_cross_attention``, or, in a model with cross-attention layers, told apart by its mask and ``is_decoder``: Note [cross-attention] in cross.py) | transformers' sdpa with sdpa's mask; refused under sequence parallelism, and where nothing tells the kinds apart |
| q_len != k_len other than decoding one token (chunked prefill, cross-attention), a static cache, a sliding-window cache that keeps fewer keys than the window, decoding with padding after a row's first real token | refused |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from torch import Tensor

from ... import validation as check

# Keywords transformers' attention layers pass on to the attention function
# (its `**kwargs`), by what happens to them. Any other keyword is an error:
# a new one may carry meaning that silently ignoring it would lose.
USED_KWARGS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "sliding_window"})


IGNORED_KWARGS = frozenset({
    "use_cache",             # the layer has already updated its cache
    "max_length_q",          # kernel sizing hints that come with cu_seq_lens_*
    "max_length_k",
    "num_items_in_batch",    # for the loss
    "output_hidden_states",  # outputs, not attention
    "output_router_logits",
})


# Accepted only with these values (what a model passes when the feature is off).
# encoder_hidden_states: BERT's and RoBERTa's self-attention pass None (their cross-attention
# layers take it as an argument and pass keys of the other sequence instead: run as sdpa,
# cross.py). deterministic: ModernBERT passes config.deterministic_flash_attn, flash-attn's
# switch for a backward without atomic adds; it changes no value, only run-to-run
# reproducibility, which our kernels take from torch.use_deterministic_algorithms instead.
OFF_KWARGS = {"output_attentions": (None, False), "softcap": (None,), "s_aux": (None,),
              "seq_idx": (None,), "sinks": (None,), "position_bias": (None,),
              "encoder_hidden_states": (None,), "deterministic": (None, False)}


ACCEPTED_KWARGS = USED_KWARGS | IGNORED_KWARGS | frozenset(OFF_KWARGS)


# Keywords transformers passes to a mask function besides the ones it names.
MASK_KWARGS = frozenset({"allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype",
                         "config", "use_vmap", "device", "local_size"})


# transformers treats names containing these specially (hub kernels, its own
# sdpa/flash/flex checks, the paged prefix).
RESERVED_NAME_PARTS = ("flash", "sdpa", "flex_attention", "eager", "paged", "/", "|")


# Config flags of a model with cross-attention layers (cross.py tells its calls apart).
CROSS_ATTENTION_FLAGS = ("is_encoder_decoder", "add_cross_attention")


CROSS_ATTENTION = ("keys and values of another sequence passed to a self-attention layer; "
                   "cross-attention layers run transformers' sdpa (cross.py), their calls "
                   "take the encoder's states as keys and values, not this keyword")


REFUSED_HINTS = {
    "output_attentions": "dilated attention never forms the attention weights; for them run "
                         "the model with attn_implementation='eager' "
                         "(model.set_attn_implementation('eager'))",
    "softcap": "logit soft-capping (Gemma 2's config.attn_logit_softcapping) bends every score "
               "before the softmax, and the kernels compute plain softmax attention",
    "s_aux": "attention sinks (gpt-oss, DeepSeek V4, MiMo-V2-Flash, Granite SWA; zeros too) "
             "add a learned logit to every softmax's denominator, and the kernels compute plain "
             "softmax attention",
    "sinks": "attention sinks computed per token (Inkling 2) add a logit to every softmax's "
             "denominator, and the kernels compute plain softmax attention",
    "position_bias": "a learned bias added to every score (T5's and Inkling's relative positions) "
                     "changes each query's weights, and the kernels add no bias to the scores",
    "encoder_hidden_states": CROSS_ATTENTION,
    "deterministic": "flash-attn's deterministic backward (ModernBERT's "
                     "config.deterministic_flash_attn) is a switch of flash-attn's kernels; "
                     "set it to False and call torch.use_deterministic_algorithms(True), which "
                     "the kernels of dilated attention follow",
}


@dataclasses.dataclass(frozen=True)
class Refused:
    """A mask dilated attention cannot express; the attention function raises `reason`."""

    reason: str


def check_kwargs(kwargs: Dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - ACCEPTED_KWARGS)
    if unknown:
        raise TypeError(
            f"the dilated_attention attention function got unexpected keyword arguments "
            f"{unknown} from the model; their meaning cannot be honoured or ignored safely"
        )
    for name, allowed in OFF_KWARGS.items():
        value = kwargs.get(name)
        if not any(value is a for a in allowed):
            hint = REFUSED_HINTS.get(name, "dilated attention does not support it")
            raise NotImplementedError(f"{name}={show(value)} is not supported: {hint}")
    q_cu, k_cu = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if (q_cu is None) != (k_cu is None) or (
            q_cu is not None and check.check_cu_seqlens(q_cu, "cu_seq_lens_q")
            != check.check_cu_seqlens(k_cu, "cu_seq_lens_k")):
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k must be given together and be equal "
                         f"(self-attention), got {show(q_cu)} and {show(k_cu)}")


def describe(x) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def show(x) -> str:
    """A value for an error message: short 1-D tensors by value, other tensors by shape."""
    if isinstance(x, Tensor):
        return check.brief(x.tolist()) if x.dim() == 1 else describe(x)
    return repr(x)
