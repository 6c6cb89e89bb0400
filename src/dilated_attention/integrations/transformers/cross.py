"""Cross-attention layers: which calls are cross-attention, and running them as sdpa does.

Note [cross-attention]
    Dilated segments are positions of one sequence; cross-attention (the
    decoder's queries against the encoder's keys) has none, so a
    cross-attention call runs transformers' own sdpa function with the mask
    sdpa would get: the same values as ``attn_implementation="sdpa"``. The
    rest of an encoder-decoder (the encoder's self-attention, the decoder's
    causal self-attention, with its cache in ``generate``) runs dilated
    attention.

    Telling the calls apart: Bart's one attention class (and its copies:
    mBART, Marian, Pegasus, Whisper, ...) serves both, the call passes the
    same keywords, and equal lengths or one query against the encoder look
    like self-attention or decoding. transformers itself tells them apart by
    the layer's name in the model (``encoder_attn``), which the attention
    function never sees. What it does see, in a model whose config has
    cross-attention layers (``is_encoder_decoder``, ``add_cross_attention``):

    ========================================  ===================================
    the layer and its mask                    the call
    ========================================  ===================================
    class named ``...CrossAttention``, or     cross-attention
    ``is_cross_attention = True``
    a causal mask (the mask function's        self-attention: transformers builds
    ``Causal``, ``PackedDocuments``, causal   cross-attention masks bidirectional
    ``Window``, or its 2-D keep-mask)         (``create_bidirectional_mask``)
    ``is_decoder = False``, any other mask    the encoder's self-attention
    ``is_decoder = True``, ``is_causal`` not  cross-attention: a decoder's
    True, a bidirectional mask or none        self-attention gets a causal mask
    a prepared mask (4-D or float tensor)     self-attention, which refuses it
    anything else                             refused: nothing says which
    ========================================  ===================================

    ``is_decoder`` is what Bart's family, Whisper, Speech2Text, NLLB-MoE,
    PegasusX (and T5, refused for its position bias) set on each attention
    layer (tests/test_hf.py checks the rule against the layers' names in all
    but T5); a model whose layers do not say (Moonshine) is refused, never
    guessed. A model without
    cross-attention layers runs every call as self-attention.

    Under sequence parallelism cross-attention is refused: each rank holds
    its slice of the encoder's output, and a query attends all of it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...distributed import comm
from .masks import Bidirectional, Causal, PackedDocuments, Window
from .refusals import CROSS_ATTENTION_FLAGS, Refused, check_kwargs, describe


def mask_says_causal(mask) -> Optional[bool]:
    """True when the mask function built a causal mask, False a bidirectional one, None when
    the layer got no mask of its (None) or one it cannot read."""
    if isinstance(mask, (Causal, PackedDocuments)):
        return True
    if isinstance(mask, Window):
        return mask.right == 0
    if isinstance(mask, Bidirectional):
        return False
    # the mask function returns a padded causal mask as the bare (b, k_len) keep-mask
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.dtype == torch.bool:
        return True
    return None


def is_cross_attention(module, mask) -> bool:
    """Whether this call of the attention function is cross-attention (Note
    [cross-attention]); raises when nothing says."""
    name = type(module).__name__
    if "CrossAttention" in name or getattr(module, "is_cross_attention", False) is True:
        return True
    config = getattr(module, "config", None)
    flags = [f"config.{key} = True" for key in CROSS_ATTENTION_FLAGS
             if getattr(config, key, False) is True]
    # a mask it cannot honour: the self-attention path raises its reason. A tensor other than
    # the keep-mask is a prepared (4-D or float) mask the model passed on unread, which says
    # nothing about the call: read by is_decoder, a decoder's self-attention given one was
    # reported as cross-attention or as a layer that sets no is_decoder
    if not flags or mask_says_causal(mask) or isinstance(mask, (Refused, Tensor)):
        return False
    decoder = getattr(module, "is_decoder", None)
    if decoder is False:
        return False
    if decoder is True and getattr(module, "is_causal", None) is not True:
        return True
    # what the layer says, as it is: a decoder's layer flagged causal but given no causal mask
    # reaches here as well as one that sets no is_decoder
    said = ("sets no is_decoder" if decoder is None else
            f"has is_decoder = {decoder!r} and is_causal = {getattr(module, 'is_causal', None)!r}")
    raise NotImplementedError(
        f"{name} in a model with {' and '.join(flags)}: cannot tell whether this call is the "
        f"encoder's self-attention or cross-attention (one class serves both; the layer "
        f"{said}, and its mask is {describe(mask)}, not causal). Dilated "
        f"attention runs self-attention only, and running cross-attention as self-attention "
        f"would be silently wrong; use attn_implementation='sdpa' (or 'eager') for this model")


def attend_cross(module, query: Tensor, key: Tensor, value: Tensor, mask, dropout: float,
                 scaling: Optional[float], is_causal: Optional[bool], kwargs, group):
    """A cross-attention call through transformers' sdpa function: q (b, h, nq, d), k, v (b,
    hk, nk, d) -> (out (b, nq, h, d), None), with the mask sdpa's mask function would build."""
    if comm.is_distributed(group):
        raise NotImplementedError(
            f"{type(module).__name__}: cross-attention under sequence parallelism (each rank "
            f"holds its slice of the encoder's output, and every query attends all of it): run "
            f"encoder-decoder models on one process, with a name registered without group=")
    check_kwargs(kwargs)
    if isinstance(mask, Bidirectional):
        # sdpa's bidirectional mask: (b, 1, nq, nk) True where a key is kept; None unpadded
        mask = None if mask.inner is None else mask.inner[:, None, None, :]
    elif mask is not None:
        raise ValueError(f"attention_mask of the cross-attention layer {type(module).__name__} "
                         f"must be the model's bidirectional mask over the encoder's keys, got "
                         f"{describe(mask)}")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)
