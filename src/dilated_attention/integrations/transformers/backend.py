"""The attention function, and ``register`` which installs it with its mask function.

``register`` puts two functions under one name into transformers' registries
(transformers >= 5.12, the ``[hf]`` extra; nothing here imports transformers
before ``register`` is called):

- the attention function (``transformers.AttentionInterface``), which each
  attention layer calls with q (b, h, n, d) and k, v (b, hk, n, d);
- the mask function (``transformers.masking_utils.AttentionMaskInterface``,
  masks.py), which the model calls once per forward to build what its
  layers receive as ``attention_mask``. Without it transformers passes
  ``attention_mask=None`` to a custom backend: padding would be dropped
  without a word.

Note [generation]
    ``generate()`` with the default dynamic cache works exactly: the prompt
    (q_len = k_len) runs through ``dilated_attention``; each new token (q_len
    = 1, k_len = t + 1) runs through ``decoding.decode``, which equals row t
    of the causal op over the t + 1 positions (causal dilated attention of a
    prefix does not depend on what follows), so generated logits equal the
    full forward's. Under a group, ``generate(model, ..., group=)``
    (generation.py) shards the cache: it makes its ``ShardedCache`` the
    active one (``serving``), the prompt then runs sequence-parallel, and
    each step's attention function reads this rank's rows from that cache
    and merges its partial over the ranks. Left-padded batches generate
    each row as the row alone (padding.py: generate numbers a row's real
    tokens from 0, and its segments start there too). Refused while
    decoding: padding after a row's first real token (right padding,
    holes), a pre-allocated (static) cache (keys the mask function cannot
    place), sequence parallelism outside that
    ``generate``, more than one new token, gradients, dropout.

Note [sliding-window layers]
    A layer whose mask the model builds as a sliding window (transformers
    passes the mask function ``local_size``: Mistral, Qwen2 with
    use_sliding_window, Gemma 3's local layers, ModernBERT's local layers)
    gets a ``Window`` from the mask function (masks.py), which reads the
    window's reaches off the mask (transformers' causal window of size w:
    the query and the w - 1 keys before it; its bidirectional one of size w:
    w keys on each side, which ModernBERT's layers pass as w + 1). Such a
    layer runs ``ring_attention(window_size=...)``: exact windowed attention
    with the same padding and documents, on one
    process or sequence-parallel (the halo exchange); the layer's
    ``sliding_window`` keyword must agree with its mask. Layers without a
    window (Gemma 3's global ones) keep the registered dilated patterns.
    Decoding a sliding-window layer attends the last w keys of whatever
    cache the model keeps (transformers' sliding-window cache keeps just
    those): exact, as the window holds no more. Under ``generate(...,
    group=)`` the window's keys may lie on several ranks: each rank attends
    those it holds and the partials merge as a dilated step's do (the
    sharded cache keeps every row, not only the window's). Not supported:
    attention dropout on such a layer (ring_attention has none).

Each call costs one small agreement collective (validation, padding and
document facts of every rank) besides the op's own.

Notation: b batch, n rows (this rank's under sequence parallelism), h heads,
hk key/value heads, d head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ... import validation as check
from ...decoding import CachedRows, decode, origin_runs
from ...distributed import comm
from ...functional import dilated_attention, ring_attention
from ...releases import installed_release
from .cross import attend_cross, is_cross_attention, mask_says_causal
from .documents import agreed_documents, explicit_documents, position_facts
from .masks import Bidirectional, Causal, PackedDocuments, Window, build_mask
from .padding import agreed_origins, decoding_origins, first_real_tokens
from .refusals import RESERVED_NAME_PARTS, Refused, check_kwargs, describe


# The oldest transformers release tests/test_hf.py passes with (also 5.23 and 5.24, CI's);
# 5.0-5.3's mask functions take cache_position, not (q_length, q_offset), and 5.4 fails
# elsewhere (docs/transformers.md)
MIN_TRANSFORMERS = (5, 12)


def _transformers():
    wanted = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"dilated_attention.integrations.transformers needs transformers>={wanted}: "
            "pip install 'dilated-attention[hf]'"
        ) from exc
    if installed_release("transformers") < MIN_TRANSFORMERS:
        raise ImportError(
            f"dilated_attention.integrations.transformers needs transformers>={wanted}, found "
            f"{transformers.__version__}"
        )
    return transformers


def register(name: str = "dilated_attention", *, segment_lengths: Sequence[int],
             dilation_rates: Sequence[int], group: comm.GroupLike = None, strategy: str = "auto",
             backend: str = "auto", replace: bool = False) -> str:
    """Make ``attn_implementation=name`` run dilated attention; returns `name`.

    Registers the attention function and its mask function under `name`.
    Then ``AutoModelForCausalLM.from_config(config, attn_implementation=name)``
    or ``model.set_attn_implementation(name)`` routes every attention
    layer through ``dilated_attention(q, k, v, segment_lengths,
    dilation_rates, group=group, strategy=strategy, backend=backend)`` (a
    sliding-window layer through ``ring_attention(..., window_size=...,
    backend=backend)``). With `group`, every rank registers the same settings
    and feeds its own slice of the sequence (``shard_inputs``).

    Models look their attention function up by name at every call, so new
    settings under a name would change every model already built with it:
    registering a name again with other settings is a ValueError unless
    ``replace=True`` (the same settings again return `name`). Register other
    names for models that need other settings.
    """
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    reserved = [part for part in RESERVED_NAME_PARTS if part in name]
    if reserved:
        raise ValueError(
            f"name must not contain {reserved[0]!r} (transformers gives such names special "
            f"treatment), got {name!r}"
        )
    for registry in (tf.AttentionInterface(), AttentionMaskInterface()):
        existing = registry.get(name)
        if existing is not None and not isinstance(existing, _Backend) \
                and existing is not build_mask:
            raise ValueError(f"name {name!r} is already registered in transformers' "
                             f"{type(registry).__name__} by someone else: pick another name")
    segs, rates = check.check_patterns(segment_lengths, dilation_rates)
    comm.resolve_group(group)  # a TypeError/ValueError naming group now, not at a forward
    attention = _Backend(segs, rates, group, check.check_strategy(strategy),
                         check.check_backend(backend))
    current = tf.AttentionInterface().get(name)
    if isinstance(current, _Backend) and current != attention \
            and not check.check_bool("replace", replace):
        raise ValueError(
            f"name {name!r} is already registered with {current.describe()}; models built with "
            f"it would run {attention.describe()} from their next call on: pass replace=True "
            f"to change them all, or register another name for the new settings"
        )
    tf.AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, build_mask)
    return name


@dataclasses.dataclass(frozen=True)
class _Backend:
    """The attention function registered under a name: the settings of `register`."""

    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    group: Any
    strategy: str
    backend: str

    def describe(self) -> str:
        return (f"segment_lengths {list(self.segment_lengths)}, dilation_rates "
                f"{list(self.dilation_rates)}, group {self.group!r}, strategy "
                f"{self.strategy!r}, backend {self.backend!r}")

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                 dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs) -> Tuple[Tensor, None]:
        """transformers' attention-function signature: q (b, h, n, d), k (b, hk, n, d), v (b,
        hk, n, dv) -> (out (b, n, h, dv), no weights)."""
        if self.group is not None and torch.compiler.is_compiling():
            # under torch.compile a call with a group runs eagerly, whole: one graph break (as
            # the ops' calls with a group, functional.py's _eager_across_ranks); traced, its
            # agreement and sharded generation's context variable broke the graph in several
            # places, each piece compiled on its own
            return torch.compiler.disable(self.__call__)(module, query, key, value,
                                                         attention_mask, dropout, scaling,
                                                         is_causal, **kwargs)
        # before any collective: a layer, its config and its mask's kind are alike on every rank
        if is_cross_attention(module, attention_mask):
            return attend_cross(module, query, key, value, attention_mask, dropout, scaling,
                                is_causal, kwargs, self.group)
        # (b, h, n, d) -> (b, n, h, d): views; the op takes strided q, k, v
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        # Note [head dims]: v's head dim (dv) may differ from q's and k's (d)
        d, dv = q.shape[-1], v.shape[-1]
        if scaling is None and dv > d:
            scaling = d ** -0.5  # q's own head dim, not the padded one
        q, k, v = _pad_head(q, dv), _pad_head(k, dv), _pad_head(v, d)
        out = self._attend(module, q, k, v, attention_mask, dropout, scaling, is_causal,
                           (query, key, value), kwargs)
        return out[..., :dv], None

    def _attend(self, module, q: Tensor, k: Tensor, v: Tensor, attention_mask, dropout: float,
                scaling: Optional[float], is_causal: Optional[bool], tensors, kwargs) -> Tensor:
        """`__call__` once q, k and v share one head dim: out (b, n, h, d)."""
        if isinstance(attention_mask, Window):
            # a window read off one row: whether it reaches ahead, the layer says
            attention_mask = attention_mask.facing(
                is_causal if is_causal is not None else getattr(module, "is_causal", True))
        said_causal = mask_says_causal(attention_mask)
        if isinstance(attention_mask, Causal):
            attention_mask = None  # plain causal (Note [what the mask function returns])
        # a sliding-window layer's mask (Note [sliding-window layers]): its window, and the
        # padding or documents it holds besides
        window_mask = attention_mask if isinstance(attention_mask, Window) else None
        if window_mask is not None:
            attention_mask = window_mask.inner
        training = bool(getattr(module, "training", False))
        # transformers' own backends read the layer's flag when the call gives none; the mask
        # says more (Note [what the mask function returns])
        causal_arg = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if isinstance(attention_mask, Bidirectional):
            attention_mask, causal_arg = attention_mask.inner, False
        elif said_causal:
            # eager and sdpa run the causal mask they are given, whatever the flag: the decoder
            # self-attention of NLLB-MoE and PegasusX has is_causal = False
            causal_arg = True
        nq, nk = q.shape[1], k.shape[1]
        # generate(group=) serves only a backend registered with that group, and a call with
        # a group runs eagerly (above): so a compiled call reads nothing here (reading the
        # context variable is a graph break, and inductor's code for the graph resumed after
        # it failed on Bart: NameError on a shape symbol); eager calls read it
        # (tests/test_hf.py runs a step of sharded generation in one process, group None)
        sharded = None if torch.compiler.is_compiling() else _SERVING.get()
        if sharded is not None and sharded.group is not self.group:
            sharded = None  # another model's generation
        # a step of sharded generation: one new token, the cache's rows spread over the ranks
        stepping = sharded is not None and sharded.decoding
        decoding = stepping or (nq == 1 and nk > 1)
        # a prompt shorter than the ranks runs whole on every rank (see generation.py)
        group = sharded.prefill_group if sharded is not None and not stepping else self.group
        layer = _layer_index(module) if stepping else None
        # the keys a step attends: the whole sequence so far, wherever its rows are
        kv_length = sharded.position(layer) + 1 if stepping else nk

        def config() -> Dict[str, Any]:
            check_kwargs(kwargs)
            causal = check.check_bool("is_causal", causal_arg)
            p = check.check_dropout(dropout, "dropout") if training else 0.0
            mask = _read_mask(attention_mask, q.shape[0], kv_length)
            window = _window(window_mask, kwargs.get("sliding_window"))
            if window is not None and p > 0:
                raise NotImplementedError(
                    f"dropout={p} on a sliding-window layer: ring_attention (which computes "
                    f"the window) has no attention dropout; set the model's attention dropout "
                    f"to 0 (config.attention_dropout)")
            if decoding:
                _check_decoding(comm.is_distributed(group) and not stepping, causal, mask, kwargs,
                                p, tensors)
            elif nq != nk:
                raise NotImplementedError(
                    f"query length {nq} != key length {nk}: only one new token at a time can "
                    f"attend a KV cache (no chunked prefill or speculative decoding); "
                    f"cross-attention layers run sdpa, and this call is not one of them"
                )
            facts = position_facts(kwargs.get("position_ids"), q.shape[0], nk, decoding)
            keep = mask if isinstance(mask, Tensor) and not decoding else None
            return {"causal": causal, "dropout": p, "window": window,
                    "cu_seqlens": explicit_documents(kwargs),
                    "n": nk, "padded": isinstance(mask, Tensor),
                    "overlay": mask.starts if isinstance(mask, PackedDocuments) else None, **facts,
                    "real_from": first_real_tokens(keep, _rows(kwargs.get("position_ids")),
                                                   q.shape[0])}

        # a sharded step checks here only: generate agreed on its inputs, which every rank
        # then computes alike (one all-gather per layer is all a step sends)
        infos = [config()] if stepping else comm.agree(group, config, per_rank=_PER_RANK)
        if decoding:
            keep = attention_mask if isinstance(attention_mask, Tensor) else None
            if stepping:
                rows, merge_over = sharded.rows(layer), self.group
                _check_cached_like(rows[0], tensors[1], tensors[2])
                width = q.shape[-1]
                rows = [CachedRows(_pad_head(r.k, width), _pad_head(r.v, width), r.start, r.count)
                        for r in rows]
            else:
                rows, merge_over = [CachedRows(k, v, 0, nk)], None
            # the new token's position among the rows (one process: the cache's last key)
            t = kv_length - 1
            if infos[0]["window"] is not None:
                return _decode_window(q, rows, t, keep, infos[0]["window"], scaling, merge_over)
            origins, keep = decoding_origins(keep, kwargs.get("position_ids"), t)
            patterns = (self.segment_lengths, self.dilation_rates)
            return decode(q, rows, t, patterns, scale=scaling, group=merge_over, origins=origins,
                          keep=keep)
        return self._prompt(q, k, v, attention_mask, scaling, infos, group)

    def _prompt(self, q: Tensor, k: Tensor, v: Tensor, attention_mask, scale: Optional[float],
                infos, group) -> Tensor:
        """Queries against keys of the same rows (q_len = k_len), this rank's under `group`:
        one call of the op, or one per run of left-padded rows sharing an origin
        (padding.py)."""
        call = infos[0]
        rank = comm.group_rank(group)
        padded = any(info["padded"] for info in infos)
        documents = agreed_documents(infos, call["cu_seqlens"], use_positions=not padded,
                                     distributed=comm.is_distributed(group))
        key_padding_mask = None
        if padded:
            # every rank passes a mask when any rank has one (the op agrees on it)
            keep = attention_mask if infos[rank]["padded"] else None
            key_padding_mask = (~keep if keep is not None
                                else torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device))
        if call["window"] is not None:
            # a window does not depend on where a row starts: one call for every row
            return ring_attention(q, k, v, is_causal=call["window"][1] == 0,
                                  window_size=call["window"], scale=scale, group=group,
                                  cu_seqlens=documents, key_padding_mask=key_padding_mask,
                                  backend=self.backend)

        def attend(rows: slice, first: int) -> Tensor:
            return dilated_attention(
                q[rows, first:], k[rows, first:], v[rows, first:], self.segment_lengths,
                self.dilation_rates, is_causal=call["causal"], scale=scale,
                dropout_p=call["dropout"], group=group, cu_seqlens=documents,
                key_padding_mask=None if key_padding_mask is None
                else key_padding_mask[rows, first:], strategy=self.strategy,
                backend=self.backend)

        origins = agreed_origins(infos, q.shape[0]) if padded else None
        if origins is None:
            return attend(slice(None), 0)
        if documents is not None:
            raise NotImplementedError("packed documents together with left-padded rows whose "
                                      "positions start at their first token")
        # each run of rows attends its own suffix of the sequence; its padding gets zeros
        start = sum(info["n"] for info in infos[:rank])
        out = torch.zeros_like(q)
        for lo, hi, origin in origin_runs(origins, q.shape[0]):
            first = min(max(origin - start, 0), q.shape[1])
            out[lo:hi, first:] = attend(slice(lo, hi), first)
        return out


def _check_cached_like(cached: CachedRows, key: Tensor, value: Tensor) -> None:
    """A sharded step reads its rows' keys and values from the cache: they must be what the
    layer passes the attention function (key, value (b, hk, n, d)), head for head. (Every
    rank holds the same model, so every rank raises at the same step, before any message.)"""
    for name, rows, given in (("keys", cached.k, key), ("values", cached.v, value)):
        if rows.shape[2:] != (given.shape[1], given.shape[3]):
            raise NotImplementedError(
                f"sharded generation reads the cached {name} of this rank's rows, but this "
                f"model caches other tensors than its attention takes ((heads, head dim) "
                f"{tuple(rows.shape[2:])} cached, {(given.shape[1], given.shape[3])} attended: "
                f"multi-head latent attention caches its compressed latents, DeepSeek V2/V3); "
                f"generate on one process (group=None)")


def _pad_head(x: Tensor, d: int) -> Tensor:
    """x (..., dx) with zero columns appended up to head dim d (x itself when dx >= d).

    Note [head dims]
        Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, Kimi) passes v
        with a smaller head dim than q and k (128 against 192); the op takes
        one head dim. Zero columns appended to v add zero columns to the
        output, which are cut off again; zero columns appended to q and k
        (when v's head dim is the larger) add nothing to any score. Both are
        exact, gradients included (the scale is q's own, fixed before). The
        cost is the wider tensors: (d - dv) / dv more work on the values,
        and a padded copy of v (of the cache's values when decoding).
    """
    return x if x.shape[-1] >= d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _layer_index(module) -> int:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise NotImplementedError(
            f"sharded generation needs the attention layer's layer_idx (the index of its "
            f"cache), which {type(module).__name__} does not have"
        )
    return layer


def _rows(position_ids) -> Optional[Tensor]:
    """position_ids as (rows, n) (rows 1 or b), once position_facts has checked them."""
    if isinstance(position_ids, Tensor) and position_ids.dim() == 1:
        return position_ids[None]
    return position_ids


# The sharded cache of a running ``generate(model, ..., group=)`` (generation.py): transformers
# hands the attention function the layer, not the cache, so a decoding step finds the layer's
# rows here. Set only for the duration of that call (a ContextVar: threads stay apart).
_SERVING: contextvars.ContextVar[Any] = contextvars.ContextVar("dilated_attention_serving",
                                                                default=None)


@contextlib.contextmanager
def serving(cache) -> Iterator[None]:
    """While the block runs, the attention functions of `cache.group` run its prefill over
    `cache.prefill_group` and, once `cache.decoding`, each step over `cache.rows(layer)`."""
    token = _SERVING.set(cache)
    try:
        yield
    finally:
        _SERVING.reset(token)


def backend_of(model) -> Optional["_Backend"]:
    """The dilated attention function a transformers model runs, or None."""
    import transformers

    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    found = transformers.AttentionInterface().get(name) if isinstance(name, str) else None
    return found if isinstance(found, _Backend) else None


# what may differ between the ranks of a sequence-parallel call
_PER_RANK = ("n", "padded", "overlay", "first", "last", "restarts", "same_rows", "real_from")


def _window(mask: Optional[Window], sliding_window) -> Optional[Tuple[int, int]]:
    """The (left, right) window a layer runs (ring_attention's window_size), from its
    sliding-window mask, checked against the layer's `sliding_window` keyword; None for a
    layer of full attention."""
    if sliding_window is None:
        return None if mask is None else (mask.left, mask.right)
    size = check.check_positive_int("sliding_window", sliding_window)
    if mask is None:
        raise NotImplementedError(
            f"sliding_window={size} reached the attention function without the model's "
            f"sliding-window mask (a model built with this backend's name builds one with its "
            f"mask function); cannot tell which keys the window holds")
    # transformers' causal window holds the query and size - 1 keys before it; its
    # bidirectional one (reach = local_size) is passed as the reach (Muse Glimmer's layers)
    # or, in flash-attn's convention (window_size = (size - 1, size - 1)), as the reach + 1
    # (ModernBERT's, NeoMME's): the mask, which sdpa and eager run, decides
    if size not in ((mask.left + 1,) if mask.right == 0 else (mask.left, mask.left + 1)):
        raise ValueError(f"sliding_window={size} does not match the layer's mask, a window "
                         f"of {mask.left} keys back and {mask.right} ahead")
    return mask.left, mask.right


def _decode_window(q: Tensor, rows: Sequence[CachedRows], t: int, keep: Optional[Tensor],
                   window: Tuple[int, int], scale: Optional[float], group) -> Tensor:
    """One new token at position t of a sliding-window layer: attention over the keys
    [t - left, t] among `rows` (merged over `group`'s ranks when they hold the rows), whatever
    the cache kept besides. A dense pattern of left + 1 rows whose sequence starts at
    t - left is exactly that window (decoding.py's rule: its one segment starts at the
    origin)."""
    left = window[0]
    origins = (max(0, t - left),) * q.shape[0]
    return decode(q, rows, t, ((left + 1,), (1,)), scale=scale, group=group, origins=origins,
                  keep=keep)


def _read_mask(attention_mask, batch: int, nk: int):
    """What the mask function sent: None, a (b, nk) bool keep-mask or PackedDocuments; else
    raise."""
    if attention_mask is None or isinstance(attention_mask, PackedDocuments):
        return attention_mask
    if isinstance(attention_mask, Refused):
        raise NotImplementedError(f"attention_mask: dilated attention cannot honour "
                                  f"{attention_mask.reason}")
    if isinstance(attention_mask, Tensor) and attention_mask.dtype == torch.bool \
            and tuple(attention_mask.shape) == (batch, nk):
        return attention_mask
    raise ValueError(
        f"attention_mask must be a 2-D padding mask (a model built with this backend's name "
        f"makes one from the 2-D attention_mask it is given), got {describe(attention_mask)} "
        f"for (batch, key length) = {(batch, nk)}; 4-D and float masks cannot be expressed as "
        f"causal attention, documents and key padding"
    )


def _check_decoding(unserved_group: bool, causal: bool, mask, kwargs, dropout_p: float,
                    tensors) -> None:
    """One new token against a KV cache (Note [generation]): what must hold."""
    problems = []
    if unserved_group:
        problems.append("sequence parallelism (group=) outside dilated_attention.integrations."
                        "transformers.generate(model, input_ids, group=...), which shards the "
                        "cache")
    if not causal:
        problems.append("is_causal=False")
    if isinstance(mask, PackedDocuments) or kwargs.get("cu_seq_lens_q") is not None:
        problems.append("packed documents")
    if dropout_p > 0:
        problems.append(f"dropout {dropout_p}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        problems.append("gradients (decoding is inference only)")
    if problems:
        raise NotImplementedError(
            f"decoding one token against a KV cache is not supported with {', '.join(problems)}"
        )
