"""The mask function registered with the attention function.

Note [what the mask function returns]
    ``CAUSAL`` when no key is padded and the mask is plain causal (not
    None: a model whose layers compute attention themselves, never calling
    the attention function (Bloom, MPT), reads None as "no mask" and would
    run bidirectional; every object below raises when used as a tensor or
    indexed, naming the cause; the model types known to read the mask
    themselves (Bloom, MPT, GPT-NeoX-Japanese, XGLM, and sparse-attention
    indexers: config.index_topk or indexer_budget) are refused from their
    config, padded or not); the (b, k_len)
    bool keep-mask when some key is padded (the form transformers'
    flash-attention mask takes, so model code treats it as it treats that
    one); ``Bidirectional`` holding one of these when the mask is plain
    bidirectional (an encoder: BERT, RoBERTa, ModernBERT's global layers; a
    decoder with ``config.is_causal = False``: some layers,
    StableLM's, keep ``is_causal = True`` and pass no flag, so the mask is
    what says it, as it is for eager attention); ``PackedDocuments`` when transformers'
    packed-sequence detection (use_cache=False, restarting position_ids)
    wrapped the causal mask, holding the document starts read from that
    mask; ``Window`` when the model builds a sliding-window mask (it passes
    ``local_size``; Mistral, Qwen2, Gemma 3's local layers), holding the
    window's reaches read from the mask and one of the above;
    ``Refused`` for anything dilated attention cannot express. The
    mask function does not raise on what may differ between ranks (the
    data): under sequence parallelism one rank raising while the others
    wait in a collective would hang them, so the attention function raises
    instead, inside its cross-rank agreement. A cache it cannot use is the
    same on every rank and raises at once.

    transformers describes a mask as a function of (batch, head, q, kv)
    indices. Plain causal and bidirectional are recognised by identity;
    any other function is read on O(n) index pairs (each query against
    itself, its neighbours, its document's first key, the key before it and
    key 0), which tells causal-within-documents apart from sliding windows,
    chunks and bidirectional blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .refusals import MASK_KWARGS, Refused, describe

_NOT_CALLED = ("this model uses the attention mask in its own code: it computes attention in its "
               "own layers and never calls transformers' AttentionInterface (Bloom, MPT, "
               "GPT-NeoX-Japanese, XGLM), or selects keys with it (the sparse-attention indexers "
               "of DeepSeek V3.2, GLM-MoE-DSA, AXK2, dots3, HY V4, Qwen4-Exp): the "
               "dilated_attention backend cannot run in it; use attn_implementation='eager' (or "
               "'sdpa') for this model")

# model types whose layers compute attention themselves from the mask (never calling the
# attention function): refused from their config, padded or not (a padded batch's keep-mask
# is a tensor, which their code would misread as a 4-D mask with a shape error)
_OWN_ATTENTION_MODELS = frozenset({"bloom", "mpt", "gpt_neox_japanese", "xglm"})


def _check_config(config) -> None:
    """Raise for a model that reads the mask itself (Note [what the mask function returns]).
    A config is the same on every rank, so raising here cannot leave a rank waiting."""
    model_type = getattr(config, "model_type", None)
    if model_type in _OWN_ATTENTION_MODELS:
        raise NotImplementedError(f"{model_type}: {_NOT_CALLED}")
    for key in ("index_topk", "indexer_budget"):
        if getattr(config, key, None) is not None:
            raise NotImplementedError(
                f"{model_type} (config.{key} = {getattr(config, key)}): sparse attention that "
                f"selects each query's keys from the mask in its own indexer (DeepSeek V3.2's "
                f"and its relatives', Qwen4-Exp's) and attends only those, which dilated "
                f"attention cannot honour; use attn_implementation='eager' (or 'sdpa') for this "
                f"model")


class _ForTheAttentionFunction:
    """What only the attention function reads: used as a tensor (by a model's own attention
    code) it raises, where treating it as "no mask" would be silently wrong."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # NotImplementedError: a TypeError in `tensor + mask` would become NotImplemented
        raise NotImplementedError(_NOT_CALLED)

    def __getitem__(self, index):
        # a model indexing its 4-D mask (DeepSeek V3.2's indexer: attention_mask[:, 0])
        raise NotImplementedError(_NOT_CALLED)

    def __getattr__(self, name: str):
        raise AttributeError(f"no attribute {name!r}: the mask of the dilated_attention "
                             f"backend reached the model's own code: {_NOT_CALLED}")


@dataclasses.dataclass(frozen=True)
class Causal(_ForTheAttentionFunction):
    """transformers' plain causal mask, nothing padded."""


CAUSAL = Causal()


@dataclasses.dataclass(frozen=True)
class PackedDocuments(_ForTheAttentionFunction):
    """transformers' packed-sequence mask: where this rank's documents start (local rows > 0)."""

    starts: Tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Bidirectional(_ForTheAttentionFunction):
    """transformers' plain bidirectional mask: every query sees every key; `inner` is the
    (b, k_len) keep-mask, or None when nothing is padded."""

    inner: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class Window(_ForTheAttentionFunction):
    """transformers' sliding-window mask, read and checked: query t sees the keys [t - left,
    t + right] of its document; `inner` is what the mask says besides (None, the (b, k_len)
    keep-mask, or PackedDocuments).

    `one_row`: read off a sequence of one row (a one-token input, or a sequence-parallel
    rank's piece of one row), which has no later key: the mask cannot say whether the window
    reaches ahead, and reads as causal. The attention function then asks the layer
    (``facing``): the reading must be the one its other ranks make, and the one the layer's
    `sliding_window` keyword describes. (Probing a key past the sequence would index
    transformers' packed-sequence table out of range under torch.compile.)"""

    left: int
    right: int
    inner: Any = None
    one_row: bool = False

    def facing(self, causal: bool) -> "Window":
        """The window a layer with this causal flag runs: a one-row reading of a
        bidirectional layer reaches ahead as far as back, size = left + 1 keys each way."""
        if not self.one_row or causal:
            return self
        return Window(self.left + 1, self.left + 1, self.inner)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask: Optional[Tensor] = None, **kwargs):
    """The mask function registered with the attention function (see the module docstring)."""
    mask = _build_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                       attention_mask, **kwargs)
    return CAUSAL if mask is None else mask


def _build_mask(batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset,
                mask_function, attention_mask: Optional[Tensor], **kwargs):
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    unknown = sorted(set(kwargs) - MASK_KWARGS)
    if unknown:
        raise TypeError(f"the dilated_attention mask function got unexpected keyword arguments "
                        f"{unknown} from transformers; update the integration before using them")
    config = kwargs.get("config")
    _check_config(config)
    if kwargs.get("use_vmap"):
        # transformers sets use_vmap when a model overlays its own mask function
        # (or_mask_function / and_mask_function), which need not accept index tensors
        return Refused("the model combines its causal or bidirectional mask with a mask "
                        "function of its own (or_mask_function / and_mask_function: e.g. image "
                        "tokens, or Gemma 3's use_bidirectional_attention)")
    chunk = getattr(config, "attention_chunk_size", None)
    if kwargs.get("local_size") is not None and chunk is not None \
            and int(kwargs["local_size"]) == int(chunk):
        # transformers' chunked mask (create_chunked_causal_mask passes the chunk as local_size);
        # its chunks read as documents that position_ids do not restart, and decoding sees no
        # window: refused by name, in the layers that use it
        return Refused(f"chunked attention (Llama 4's config.attention_chunk_size = {chunk}): "
                       f"each query sees only the keys of its own chunk of {chunk} positions "
                       f"(counted from a row's first real token), which neither the dilated "
                       f"patterns nor a sliding window express; use attn_implementation='eager' "
                       f"or 'sdpa' for this model")
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    # q_offset is a 0-d tensor for a static cache
    q_offset, kv_offset, seen = int(q_offset), int(kv_offset), int(q_offset) + q_length
    window = None
    if kwargs.get("local_size") is not None:
        window = _read_window(mask_function, batch_size, q_length, q_offset,
                              int(kwargs["local_size"]), device)
        if isinstance(window, Refused):
            return window
    if mask_function is bidirectional_mask_function and window is None and q_offset == 0 \
            and kv_offset == 0:
        # every query sees every key: an encoder's mask, or a decoder's over the encoder's keys
        # (cross-attention, whose length may differ: cross.py)
        keep = _keep_mask(attention_mask, batch_size, kv_length)
        return keep if isinstance(keep, Refused) else Bidirectional(keep)
    if kv_offset != 0 and window is None:
        # refused in a layer that uses it: Cohere 2 and Ministral also build the full-attention
        # mask when every layer is a sliding window, from the sliding-window cache's sizes
        return Refused(f"a KV cache that drops old keys (kv_offset = {kv_offset}) outside a "
                       f"sliding-window layer")
    # A cache's layout is the same on every rank, so these may raise here
    # (generate() also calls .contiguous() on what a static cache's mask returns).
    if seen != kv_offset + kv_length:
        if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 \
                and attention_mask.shape[-1] == kv_length:
            # no cache: transformers took kv_length from the user's mask, which may be wrong on
            # one rank only, so the attention function raises it inside its agreement
            return Refused(f"a padding mask of shape {tuple(attention_mask.shape)} for "
                           f"{seen} tokens (batch, seq_len) = {(batch_size, seen)}")
        raise NotImplementedError(
            f"a KV cache whose keys are not the {seen} tokens seen so far (kv_length = "
            f"{kv_length}: a pre-allocated static cache) is not supported; use the default "
            f"dynamic cache"
        )
    if window is not None and kv_offset > max(0, q_offset - window[0]):
        raise NotImplementedError(f"a sliding-window cache that keeps fewer keys than the "
                                  f"window of {window[0] + 1} (kv_offset = {kv_offset} at "
                                  f"position {q_offset})")
    if window is not None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 \
            and attention_mask.shape[-1] == seen:
        attention_mask = attention_mask[:, kv_offset:]  # the keys the cache still holds
    keep = _keep_mask(attention_mask, batch_size, kv_length)
    if isinstance(keep, Refused):
        return keep
    if window is not None:
        left, right, starts = window
        return Window(left, right, _with_documents(keep, starts),
                      one_row=q_length == 1 and q_offset == 0)
    if mask_function is bidirectional_mask_function:
        return Bidirectional(keep)
    if mask_function is None or mask_function is causal_mask_function:
        return keep
    starts = _read_documents(mask_function, batch_size, q_length, q_offset, device)
    if isinstance(starts, Refused):
        return starts
    return _with_documents(keep, starts)


def _with_documents(keep, starts: Tuple[int, ...]):
    """The keep-mask (or None), or PackedDocuments(starts) when the mask packs documents."""
    if not starts:  # one document, however the mask was written
        return keep
    if keep is not None:
        return Refused("padding together with transformers' packed-sequence mask")
    return PackedDocuments(starts)


def _keep_mask(attention_mask, batch: int, kv_length: int):
    """The (b, kv_length) bool keep-mask, None when nothing is padded, or Refused."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 \
            or attention_mask.dtype.is_floating_point:
        return Refused(f"a padding mask that is not a 2-D 0/1 mask: "
                        f"{describe(attention_mask)}")
    if tuple(attention_mask.shape) != (batch, kv_length):
        return Refused(f"a padding mask of shape {tuple(attention_mask.shape)} for "
                        f"(batch, kv_length) = {(batch, kv_length)}")
    keep = attention_mask.to(torch.bool)
    return None if bool(keep.all()) else keep


def _reader(mask_function, batch: int, device):
    """allowed(q_idx (m,), kv_idx (m,)) -> (b, m) bool: the mask function on index pairs."""
    b = torch.arange(batch, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)

    def allowed(q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mask_function(b, head, q_idx[None], kv_idx[None])
        return torch.as_tensor(out, device=device).expand(batch, q_idx.numel())

    return allowed


def _read_window(mask_function, batch: int, q_length: int, q_offset: int, size: int,
                 device) -> Union[Refused, Tuple[int, int, Tuple[int, ...]]]:
    """(left, right, document starts) of a sliding-window mask of `size` (transformers'
    ``local_size``), or Refused.

    transformers' causal sliding window lets query t see keys (t - size, t]
    (reaches size - 1 and 0), its bidirectional one keys with |t - u| <= size;
    either may be cut by packed documents. The function is read on O(n)
    (query, key) pairs per batch row: its own key, both ends of its window,
    their midpoints and the key past each end, so chunked attention and
    other masks that pass `size` are told apart (chunks of `size` keys read as
    windows within documents of one chunk each; transformers' own chunked mask,
    Llama 4's, is refused before, from the config).
    """
    allowed = _reader(mask_function, batch, device)
    t = torch.arange(q_offset, q_offset + q_length, device=device)
    total = q_offset + q_length  # keys 0 .. total - 1 exist
    if not bool(allowed(t, t).all()):
        return Refused("a mask in which a query cannot see its own key")
    # decoding sees no key after the new token: a causal window; nor does one row alone
    # (Window.one_row)
    ahead = q_length > 1 and bool(allowed(t[:-1], t[:-1] + 1).any())
    left, right = (size, size) if ahead else (size - 1, 0)
    starts = torch.zeros(0, dtype=torch.long, device=device)
    if q_offset == 0 and q_length > 1 and left > 0:
        cut = ~allowed(t[1:], t[:-1])  # (b, n - 1): query t + 1 cannot see key t
        if bool((cut != cut[:1]).any()):
            return Refused("documents that differ between batch rows (dilated attention "
                           "shares cu_seqlens across the batch)")
        starts = cut[0].nonzero().flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long, device=device), starts,
                        torch.full((1,), total, device=device)])
    doc = torch.searchsorted(bounds, t, right=True) - 1
    lo = torch.maximum(bounds[doc], t - left)
    hi = torch.minimum(bounds[doc + 1] - 1, t + right)
    seen = [lo, hi, (lo + t) // 2, (t + hi) // 2]
    unseen = [(lo - 1, lo > 0), (hi + 1, hi + 1 < total)]
    if not all(bool(allowed(t, u).all()) for u in seen) or \
            any(bool(allowed(t[where], u[where]).any()) for u, where in unseen):
        return Refused(f"a mask given local_size={size} that is not transformers' sliding "
                       f"window of {size} keys (within documents)")
    return left, right, tuple(starts.tolist())


def _read_documents(mask_function, batch: int, q_length: int, q_offset: int, device):
    """Document starts (rows > 0) of a causal-within-documents mask function, or Refused.

    Reads the function on O(n) (query, key) pairs per batch row, which
    separates causal attention within documents from sliding windows,
    chunks and bidirectional blocks (Note [what the mask function returns]).
    """
    allowed = _reader(mask_function, batch, device)
    t = torch.arange(q_offset, q_offset + q_length, device=device)
    if q_offset > 0:
        # decoding: the new rows must see every key up to themselves
        last = t[-1:].expand(q_offset + q_length)
        if bool(allowed(last, torch.arange(q_offset + q_length, device=device)).all()):
            return ()
        return Refused("a mask that hides earlier keys from the new token (a sliding window "
                        "or chunked attention)")
    if not bool(allowed(t, t).all()):
        return Refused("a mask in which a query cannot see its own key")
    if q_length == 1:
        return ()
    if bool(allowed(t[:-1], t[1:]).any()):
        return Refused("a mask in which a query sees a later key (bidirectional blocks)")
    cut = ~allowed(t[1:], t[:-1])  # (b, n - 1): query t + 1 cannot see key t
    if bool((cut != cut[:1]).any()):
        return Refused("documents that differ between batch rows (dilated attention shares "
                        "cu_seqlens across the batch)")
    starts = cut[0].nonzero().flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=starts.dtype, device=device), starts])
    first = bounds[torch.searchsorted(bounds, t, right=True) - 1]  # each row's document start
    if not bool(allowed(t, first).all()):
        return Refused("a mask in which a query cannot see the first key of its document "
                        "(a sliding window or chunked attention)")
    later = first > 0
    if bool(allowed(t[later], first[later] - 1).any()) \
            or bool(allowed(t[later], torch.zeros_like(first[later])).any()):
        return Refused("a mask in which a query sees keys of an earlier document")
    return tuple(starts.tolist())
