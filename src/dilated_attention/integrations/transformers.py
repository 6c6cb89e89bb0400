"""A Hugging Face transformers attention backend running every attention layer through `dilated_attention`.

    from dilated_attention.integrations.transformers import register
    name = register(segment_lengths=[2048, 4096], dilation_rates=[1, 2])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

``register`` puts two functions under one name into transformers' registries
(transformers >= 5, the ``[hf]`` extra; nothing here imports transformers
before ``register`` is called):

- the attention function (``transformers.AttentionInterface``), which each
  attention layer calls with q (b, h, n, d) and k, v (b, hk, n, d);
- the mask function (``transformers.masking_utils.AttentionMaskInterface``),
  which the model calls once per forward to build what its layers receive
  as ``attention_mask``. Without it transformers passes ``attention_mask=None``
  to a custom backend: padding would be dropped without a word.

What the attention function honours, and what it refuses (an error naming
the argument, never a silent fallback):

| input | handled as |
| --- | --- |
| q, k, v (b, h, n, d) | transposed views (b, n, h, d), no copy; hk < h is GQA, K/V never repeated |
| ``scaling`` | the softmax scale |
| ``dropout`` | attention dropout while ``module.training``; 0 in evaluation |
| ``is_causal`` (or ``module.is_causal``) | causal or not |
| 2-D padding ``attention_mask`` | ``key_padding_mask`` (left or right padding) |
| ``position_ids`` that restart (no padding; one process) | packed documents -> ``cu_seqlens`` |
| ``cu_seq_lens_q`` = ``cu_seq_lens_k`` | packed documents -> ``cu_seqlens`` (global ones under sequence parallelism) |
| one new token against a KV cache | exact decoding (Note [generation]) |
| ``use_cache``, ``max_length_q/k``, ``num_items_in_batch``, ``output_hidden_states``, ``output_router_logits`` | no effect on attention |
| a 4-D mask, a float mask, a mask function other than causal within documents (sliding window, chunks, image-token blocks), ``sliding_window``, ``softcap``, ``s_aux`` (sinks), ``seq_idx``, ``output_attentions=True``, any other keyword | refused |
| q_len != k_len other than decoding one token (chunked prefill, cross-attention), a static or sliding-window cache, decoding with padding | refused |

Note [what the mask function returns]
    None when no key is padded and the mask is plain causal (or
    bidirectional); the (b, k_len) bool keep-mask when some key is padded
    (the form transformers' flash-attention mask takes, so model code
    treats it as it treats that one); ``_Documents`` when transformers'
    packed-sequence detection (use_cache=False, restarting position_ids)
    wrapped the causal mask, holding the document starts read from that
    mask; ``_Refused`` for anything dilated attention cannot express. The
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

Note [generation]
    ``generate()`` with the default dynamic cache works exactly: the prompt
    (q_len = k_len) runs through ``dilated_attention``; each new token (q_len
    = 1, k_len = t + 1) runs through ``cached_dilated_attention``, which
    equals row t of the causal op over the t + 1 positions (causal dilated
    attention of a prefix does not depend on what follows), so generated
    logits equal the full forward's. Refused while decoding: padding (a
    left-padded batch), a pre-allocated (static) or sliding-window cache
    (keys the mask function cannot place), sequence parallelism, more than
    one new token, gradients, dropout.

Sequence-parallel fine-tuning (``register(..., group=pg)``): every rank
feeds its own contiguous slice of ``input_ids`` with the GLOBAL
``position_ids``; its logits are its rows of the single-process logits.
``shard_inputs`` builds a rank's inputs and targets (packed documents as
global ``cu_seq_lens_q/k``: a rank cannot tell a document starting at its
first row from transformers' default positions 0 .. n-1, so restarting
position_ids alone are an error there), ``causal_lm_loss`` the token-weighted
loss over all ranks, with LongNetLM's gradient convention; after
``backward`` average the parameter gradients over the sequence-parallel
ranks with ``dilated_attention.all_reduce_gradients(model, pg)`` (or wrap the
model in DDP / FSDP2 over ranks that include them; Note [gradients across
ranks] in distributed/sharding.py). Each call costs one
small agreement collective (validation, padding and document facts of every
rank) besides the op's own.

Notation: b batch, n rows (this rank's under sequence parallelism), N the
whole sequence, h heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .. import validation as check
from ..dilated import cached_dilated_attention
from ..distributed import comm
from ..distributed.sharding import shard_sequence
from ..distributed.strategy import check_strategy
from ..functional import dilated_attention
from ..models import IGNORE_INDEX, token_mean_loss

# Keywords transformers' attention layers pass on to the attention function
# (its `**kwargs`), by what happens to them. Any other keyword is an error:
# a new one may carry meaning that silently ignoring it would lose.
USED_KWARGS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k"})
IGNORED_KWARGS = frozenset({
    "use_cache",             # the layer has already updated its cache
    "max_length_q",          # kernel sizing hints that come with cu_seq_lens_*
    "max_length_k",
    "num_items_in_batch",    # for the loss
    "output_hidden_states",  # outputs, not attention
    "output_router_logits",
})
# Accepted only with these values (what a model passes when the feature is off).
OFF_KWARGS = {"output_attentions": (None, False), "sliding_window": (None,), "softcap": (None,),
              "s_aux": (None,), "seq_idx": (None,)}
ACCEPTED_KWARGS = USED_KWARGS | IGNORED_KWARGS | frozenset(OFF_KWARGS)

# Keywords transformers passes to a mask function besides the ones it names.
MASK_KWARGS = frozenset({"allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype",
                         "config", "use_vmap", "device", "local_size"})

# transformers treats names containing these specially (hub kernels, its own
# sdpa/flash/flex checks, the paged prefix).
RESERVED_NAME_PARTS = ("flash", "sdpa", "flex_attention", "eager", "paged", "/", "|")

REFUSED_HINTS = {
    "sliding_window": "set config.sliding_window = None (and use_sliding_window=False where the "
                      "model has it) to replace the window by the dilated pattern",
    "output_attentions": "dilated attention never forms the attention weights",
}


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "dilated_attention.integrations.transformers needs transformers>=5: "
            "pip install 'dilated-attention[hf]'"
        ) from exc
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"dilated_attention.integrations.transformers needs transformers>=5, found "
            f"{transformers.__version__}"
        )
    return transformers


# --------------------------------------------------------------------------
# Registering


def register(name: str = "dilated_attention", *, segment_lengths: Sequence[int],
             dilation_rates: Sequence[int], group=None, strategy: str = "auto") -> str:
    """Make ``attn_implementation=name`` run dilated attention; returns `name`.

    Registers the attention function and its mask function under `name`
    (registering the same name again replaces its settings). Then
    ``AutoModelForCausalLM.from_config(config, attn_implementation=name)``
    or ``model.set_attn_implementation(name)`` routes every attention
    layer through ``dilated_attention(q, k, v, segment_lengths,
    dilation_rates, group=group)``. With `group`, every rank registers the
    same settings and feeds its own slice of the sequence (``shard_inputs``).
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
    options = (("strategy", check_strategy(strategy)),)
    tf.AttentionInterface.register(name, _Backend(segs, rates, group, options))
    AttentionMaskInterface.register(name, build_mask)
    return name


# --------------------------------------------------------------------------
# The mask function (Note [what the mask function returns])


@dataclasses.dataclass(frozen=True)
class _Documents:
    """transformers' packed-sequence mask: where this rank's documents start (local rows > 0)."""

    starts: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A mask dilated attention cannot express; the attention function raises `reason`."""

    reason: str


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[Tensor] = None, **kwargs):
    """The mask function registered with the attention function (see the module docstring)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    unknown = sorted(set(kwargs) - MASK_KWARGS)
    if unknown:
        raise TypeError(f"the dilated_attention mask function got unexpected keyword arguments "
                        f"{unknown} from transformers; update the integration before using them")
    if kwargs.get("use_vmap"):
        # transformers sets use_vmap when a model overlays its own mask function
        # (or_mask_function / and_mask_function), which need not accept index tensors
        return _Refused("the model combines the causal mask with its own mask function "
                        "(or_mask_function / and_mask_function, e.g. for image tokens)")
    # A cache's layout is the same on every rank, so these may raise here
    # (generate() also calls .contiguous() on what a static cache's mask returns).
    if kv_offset != 0:
        raise NotImplementedError(f"a KV cache that drops old keys (kv_offset = "
                                  f"{int(kv_offset)}: a sliding-window cache) is not supported")
    # q_offset is a 0-d tensor for a static cache
    seen = int(q_offset) + q_length
    if seen != kv_length:
        raise NotImplementedError(
            f"a KV cache whose keys are not the {seen} tokens seen so far (kv_length = "
            f"{kv_length}: a pre-allocated static cache) is not supported; use the default "
            f"dynamic cache"
        )
    if kwargs.get("local_size") is not None:
        return _Refused(f"a sliding window or chunks of {kwargs['local_size']} keys; "
                        f"{REFUSED_HINTS['sliding_window']}")
    keep = _keep_mask(attention_mask, batch_size, kv_length)
    if isinstance(keep, _Refused):
        return keep
    if mask_function is None or mask_function is causal_mask_function \
            or mask_function is bidirectional_mask_function:
        return keep
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    starts = _read_documents(mask_function, batch_size, q_length, int(q_offset), device)
    if isinstance(starts, _Refused):
        return starts
    if not starts:  # causal attention over one document, however it was written
        return keep
    if keep is not None:
        return _Refused("padding together with transformers' packed-sequence mask")
    return _Documents(starts)


def _keep_mask(attention_mask, batch: int, kv_length: int):
    """The (b, kv_length) bool keep-mask, None when nothing is padded, or _Refused."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 \
            or attention_mask.dtype.is_floating_point:
        return _Refused(f"a padding mask that is not a 2-D 0/1 mask: "
                        f"{_describe(attention_mask)}")
    if tuple(attention_mask.shape) != (batch, kv_length):
        return _Refused(f"a padding mask of shape {tuple(attention_mask.shape)} for "
                        f"(batch, kv_length) = {(batch, kv_length)}")
    keep = attention_mask.to(torch.bool)
    return None if bool(keep.all()) else keep


def _read_documents(mask_function, batch: int, q_length: int, q_offset: int, device):
    """Document starts (rows > 0) of a causal-within-documents mask function, or _Refused.

    Reads the function on O(n) (query, key) pairs per batch row, which
    separates causal attention within documents from sliding windows,
    chunks and bidirectional blocks (Note [what the mask function returns]).
    """
    b = torch.arange(batch, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)

    def allowed(q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # (m,) index pairs -> (b, m) bool
        out = mask_function(b, head, q_idx[None], kv_idx[None])
        return torch.as_tensor(out, device=device).expand(batch, q_idx.numel())

    t = torch.arange(q_offset, q_offset + q_length, device=device)
    if q_offset > 0:
        # decoding: the new rows must see every key up to themselves
        last = t[-1:].expand(q_offset + q_length)
        if bool(allowed(last, torch.arange(q_offset + q_length, device=device)).all()):
            return ()
        return _Refused("a mask that hides earlier keys from the new token (a sliding window "
                        "or chunked attention)")
    if not bool(allowed(t, t).all()):
        return _Refused("a mask in which a query cannot see its own key")
    if q_length == 1:
        return ()
    if bool(allowed(t[:-1], t[1:]).any()):
        return _Refused("a mask in which a query sees a later key (bidirectional blocks)")
    cut = ~allowed(t[1:], t[:-1])  # (b, n - 1): query t + 1 cannot see key t
    if bool((cut != cut[:1]).any()):
        return _Refused("documents that differ between batch rows (dilated attention shares "
                        "cu_seqlens across the batch)")
    starts = cut[0].nonzero().flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=starts.dtype, device=device), starts])
    first = bounds[torch.searchsorted(bounds, t, right=True) - 1]  # each row's document start
    if not bool(allowed(t, first).all()):
        return _Refused("a mask in which a query cannot see the first key of its document "
                        "(a sliding window or chunked attention)")
    later = first > 0
    if bool(allowed(t[later], first[later] - 1).any()) \
            or bool(allowed(t[later], torch.zeros_like(first[later])).any()):
        return _Refused("a mask in which a query sees keys of an earlier document")
    return tuple(starts.tolist())


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _show(x) -> str:
    """A value for an error message: short 1-D tensors by value, other tensors by shape."""
    if isinstance(x, Tensor):
        return check.brief(x.tolist()) if x.dim() == 1 else _describe(x)
    return repr(x)


# --------------------------------------------------------------------------
# The attention function


@dataclasses.dataclass(frozen=True)
class _Backend:
    """The attention function registered under a name: the settings of `register`."""

    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    group: Any
    options: Tuple[Tuple[str, Any], ...]  # passed on to dilated_attention (strategy)

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                 dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs) -> Tuple[Tensor, None]:
        """transformers' attention-function signature: q (b, h, n, d), k, v (b, hk, n, d) ->
        (out (b, n, h, d), no weights)."""
        # (b, h, n, d) -> (b, n, h, d): views; the op takes strided q, k, v
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        training = bool(getattr(module, "training", False))
        # transformers' own backends read the layer's flag when the call gives none
        causal_arg = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        nq, nk = q.shape[1], k.shape[1]
        decoding = nq == 1 and nk > 1

        def config() -> Dict[str, Any]:
            _check_kwargs(kwargs)
            causal = check.check_bool("is_causal", causal_arg)
            p = check.check_dropout(dropout, "dropout") if training else 0.0
            mask = _read_mask(attention_mask, q.shape[0], nk)
            if decoding:
                _check_decoding(self.group, causal, mask, kwargs, p, (query, key, value))
            elif nq != nk:
                raise NotImplementedError(
                    f"query length {nq} != key length {nk}: only one new token at a time can "
                    f"attend a KV cache (no chunked prefill or speculative decoding), and "
                    f"cross-attention is not supported"
                )
            return {"causal": causal, "dropout": p, "cu_seqlens": _explicit_documents(kwargs),
                    "n": nk, "padded": isinstance(mask, Tensor),
                    "overlay": mask.starts if isinstance(mask, _Documents) else None,
                    **_position_facts(kwargs.get("position_ids"), q.shape[0], nk, decoding)}

        infos = comm.agree(self.group, config, per_rank=_PER_RANK)
        if decoding:
            out = cached_dilated_attention(q, k, v, self.segment_lengths, self.dilation_rates,
                                           scale=scaling)
            return out, None
        call = infos[0]
        rank = comm.group_rank(self.group)
        padded = any(info["padded"] for info in infos)
        documents = _documents(infos, call["cu_seqlens"], use_positions=not padded,
                               distributed=comm.is_distributed(self.group))
        key_padding_mask = None
        if padded:
            # every rank passes a mask when any rank has one (the op agrees on it)
            keep = attention_mask if infos[rank]["padded"] else None
            key_padding_mask = (~keep if keep is not None
                                else torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device))
        out = dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, is_causal=call["causal"],
            scale=scaling, dropout_p=call["dropout"], group=self.group, cu_seqlens=documents,
            key_padding_mask=key_padding_mask, **dict(self.options),
        )
        return out, None


# what may differ between the ranks of a sequence-parallel call
_PER_RANK = ("n", "padded", "overlay", "first", "last", "restarts", "same_rows")


def _check_kwargs(kwargs: Dict[str, Any]) -> None:
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
            raise NotImplementedError(f"{name}={_show(value)} is not supported: {hint}")
    q_cu, k_cu = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if (q_cu is None) != (k_cu is None) or (
            q_cu is not None and check.check_cu_seqlens(q_cu) != check.check_cu_seqlens(k_cu)):
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k must be given together and be equal "
                         f"(self-attention), got {_show(q_cu)} and {_show(k_cu)}")


def _read_mask(attention_mask, batch: int, nk: int):
    """What the mask function sent: None, a (b, nk) bool keep-mask or _Documents; else raise."""
    if attention_mask is None or isinstance(attention_mask, _Documents):
        return attention_mask
    if isinstance(attention_mask, _Refused):
        raise NotImplementedError(f"attention_mask: dilated attention cannot honour "
                                  f"{attention_mask.reason}")
    if isinstance(attention_mask, Tensor) and attention_mask.dtype == torch.bool \
            and tuple(attention_mask.shape) == (batch, nk):
        return attention_mask
    raise ValueError(
        f"attention_mask must be a 2-D padding mask (a model built with this backend's name "
        f"makes one from the 2-D attention_mask it is given), got {_describe(attention_mask)} "
        f"for (batch, key length) = {(batch, nk)}; 4-D and float masks cannot be expressed as "
        f"causal attention, documents and key padding"
    )


def _check_decoding(group, causal: bool, mask, kwargs, dropout_p: float, tensors) -> None:
    """One new token against a KV cache (Note [generation]): what must hold."""
    problems = []
    if comm.is_distributed(group):
        problems.append("sequence parallelism (group=)")
    if not causal:
        problems.append("is_causal=False")
    if isinstance(mask, Tensor):
        problems.append("a padding mask (generate without padding, one prompt at a time)")
    if isinstance(mask, _Documents) or kwargs.get("cu_seq_lens_q") is not None:
        problems.append("packed documents")
    if dropout_p > 0:
        problems.append(f"dropout {dropout_p}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        problems.append("gradients (decoding is inference only)")
    if problems:
        raise NotImplementedError(
            f"decoding one token against a KV cache is not supported with {', '.join(problems)}"
        )


def _explicit_documents(kwargs) -> Optional[Tuple[int, ...]]:
    return check.check_cu_seqlens(kwargs.get("cu_seq_lens_q"))


def restarts(position_ids: Tensor) -> Tensor:
    """(b, n) -> (b, n - 1) bool: True where a position is not its predecessor's + 1.

    transformers' rule for packed documents (a new document starts there);
    for documents that restart at 0 it agrees with flash-attention's.
    """
    return position_ids[:, 1:] != position_ids[:, :-1] + 1


def _position_facts(position_ids, batch: int, n: int, decoding: bool) -> Dict[str, Any]:
    """This rank's position_ids as plain values: first and last of each row, local restarts."""
    none = {"first": None, "last": None, "restarts": (), "same_rows": True, "rows": None}
    if position_ids is None or decoding:
        return none
    if not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point \
            or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got "
                        f"{_describe(position_ids)}")
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[1] != n \
            or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be (batch, seq_len) or (1, seq_len) for "
                         f"{(batch, n)}, got shape {tuple(position_ids.shape)}")
    if n == 0:
        return {**none, "rows": position_ids.shape[0]}
    restart = restarts(position_ids)
    return {
        "first": tuple(position_ids[:, 0].tolist()),
        "last": tuple(position_ids[:, -1].tolist()),
        "restarts": tuple((restart.any(0).nonzero().flatten() + 1).tolist()),
        "same_rows": bool((position_ids == position_ids[:1]).all()),
        "rows": position_ids.shape[0],
    }


def _documents(infos: List[Dict[str, Any]], explicit: Optional[Tuple[int, ...]], *,
               use_positions: bool, distributed: bool) -> Optional[Tuple[int, ...]]:
    """The global document boundaries [0, c1, ..., N] (None: one document), from every rank's facts.

    Sources: cu_seq_lens_q (global), transformers' packed-sequence mask and
    position_ids (read only without padding, as transformers does: the
    positions of a left-padded row restart too); where several speak they
    must agree. Under sequence parallelism documents must be declared in
    cu_seq_lens_q (``shard_inputs`` does): a rank that was given no
    position_ids gets 0 .. n-1 from transformers, and its restart at the
    piece border would otherwise pass for a document start. Every rank
    reads every rank's facts, so an error is raised on all of them.
    """
    lengths = [info["n"] for info in infos]
    offsets = [sum(lengths[:p]) for p in range(len(infos))]
    total = sum(lengths)
    starts: Set[int] = set()
    if use_positions:
        starts = _position_restarts(infos, offsets)
    for p, info in enumerate(infos):
        if info["overlay"] is None:
            continue
        ours = {s - offsets[p] for s in starts if offsets[p] < s < offsets[p] + lengths[p]}
        if set(info["overlay"]) != ours:
            raise ValueError(
                f"transformers' packed-sequence mask starts documents at rows "
                f"{check.brief(sorted(info['overlay']))} of rank {p}'s piece, but its "
                f"position_ids restart at {check.brief(sorted(ours))}"
            )
    if explicit is not None:
        if explicit[-1] != total:
            raise ValueError(f"cu_seq_lens_q must end at the sequence length {total}, got "
                             f"{check.brief(explicit)}")
        stray = sorted(starts - set(explicit))
        if stray:
            raise ValueError(
                f"position_ids restart at rows {check.brief(stray)}, which cu_seq_lens_q = "
                f"{check.brief(explicit)} does not list as document starts"
            )
        return explicit if len(explicit) > 2 else None
    if not starts:
        return None
    if distributed:
        raise ValueError(
            f"position_ids restart at rows {check.brief(sorted(starts))} of the whole sequence: "
            f"under sequence parallelism pass every rank its rows of the GLOBAL position_ids, "
            f"and cu_seq_lens_q/cu_seq_lens_k for packed documents (shard_inputs does both)"
        )
    if not all(info["same_rows"] for info in infos):
        raise ValueError("position_ids restart (packed documents) but differ between batch "
                         "rows; documents are shared by the batch: pass one row of "
                         "position_ids, or cu_seq_lens_q/cu_seq_lens_k")
    return (0, *sorted(starts), total)


def _position_restarts(infos: List[Dict[str, Any]], offsets: List[int]) -> Set[int]:
    """Global rows where position_ids restart: inside a piece, or at a border between pieces."""
    found: Set[int] = set()
    before = None  # the last positions of the nearest earlier non-empty piece
    for p, info in enumerate(infos):
        if info["first"] is None:
            continue
        found |= {offsets[p] + i for i in info["restarts"]}
        if before is not None and any(f != b + 1 for f, b in zip(info["first"], before)):
            found.add(offsets[p])
        before = info["last"]
    return found


# --------------------------------------------------------------------------
# Sequence-parallel fine-tuning


def shard_inputs(input_ids: Tensor, group, *, labels: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None,
                 attention_mask: Optional[Tensor] = None) -> Tuple[Dict[str, Tensor],
                                                                    Optional[Tensor]]:
    """This rank's model inputs and loss targets, from the whole batch (the same on every rank).

    Args:
        input_ids: (b, N) token ids of the whole sequence.
        group: the sequence-parallel process group (None: one process).
        labels: (b, N) as transformers takes them (position t is trained to
            predict labels[t + 1]; -100 ignores a token), or None.
        position_ids: (N,), (1, N) or (b, N); default 0 .. N-1. Restarts
            mark packed documents.
        attention_mask: (b, N) 0/1 padding mask, or None.

    Returns:
        (inputs, targets): ``model(**inputs)`` runs this rank's contiguous
        slice with its GLOBAL position_ids (and no KV cache); ``targets``
        (b, n) are this rank's rows of the labels shifted by one across the
        whole sequence, with -100 where the next token starts a new document
        (the position_ids restart) and at the last position, for
        ``causal_lm_loss``; None without labels. Packed documents (restarting
        position_ids, nothing padded) also give ``cu_seq_lens_q`` and
        ``cu_seq_lens_k``, the global document boundaries.
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seq_len) tensor, got "
                         f"{_describe(input_ids)}")
    b, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None]
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    for name, x, rows in (("labels", labels, (b,)), ("position_ids", position_ids, (1, b)),
                          ("attention_mask", attention_mask, (b,))):
        if x is not None and (not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != n
                              or x.shape[0] not in rows):
            raise ValueError(f"{name} must be ({' or '.join(map(str, rows))}, {n}) like "
                             f"input_ids {tuple(input_ids.shape)}, got {_describe(x)}")
    inputs = {"input_ids": shard_sequence(input_ids, group),
              "position_ids": shard_sequence(position_ids, group), "use_cache": False}
    if attention_mask is not None:
        inputs["attention_mask"] = shard_sequence(attention_mask, group)
    restart = restarts(position_ids)
    # the attention function's rule: with padding, restarting positions are not documents
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if not padded and bool(restart.any()):
        if bool((restart != restart[:1]).any()):
            raise ValueError("position_ids restart (packed documents) differently in different "
                             "batch rows; documents are shared by the batch")
        # the GLOBAL boundaries: a rank cannot see a document that starts at its first row
        starts = (restart[0].nonzero().flatten() + 1).tolist()
        cu = torch.tensor([0, *starts, n], dtype=torch.int32, device=input_ids.device)
        inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = cu
    if labels is None:
        return inputs, None
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    # a document's last token must not learn to predict the next document's first
    targets[:, :-1].masked_fill_(restarts(position_ids.expand(b, -1)), IGNORE_INDEX)
    return inputs, shard_sequence(targets, group)


def causal_lm_loss(logits: Tensor, targets: Tensor, group) -> Tensor:
    """Token-weighted mean cross-entropy over every rank's (logits, targets) of `shard_inputs`.

    The same value on every rank, equal to the single-process loss. Every
    rank must call it (one whose targets are all -100 too: no hang). Its
    gradient is P times this rank's share (P ranks in `group`), as
    LongNetLM's loss: after ``loss.backward()`` call
    ``all_reduce_gradients(model, group)``, which averages over the group,
    or let DDP (over the sequence-parallel or data x sequence ranks) or
    FSDP2 (on a mesh that includes them) average. Nothing checks here that
    the ranks' parameters stay equal (the attention backend does not see
    the parameters): LongNetLM's forward does.
    """
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor) \
            or logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be (batch, seq_len, vocab) and targets (batch, seq_len), "
                         f"got {_describe(logits)} and {_describe(targets)}")
    return token_mean_loss(logits, targets.long(), group)
