"""Generation for transformers models with the context sharded over ranks.

    name = register(segment_lengths=[2048, 4096], dilation_rates=[1, 2], group=pg)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    ids = generate(model, input_ids, group=pg, max_new_tokens=64)  # the same inputs on every rank

returns on every rank of `pg` the ids that ``model.generate(input_ids,
max_new_tokens=64, do_sample=False)`` returns on one process with the
backend registered without a group, while each rank holds about 1/P of the
key/value cache.

How transformers (5.x) generates: ``model.generate`` runs one forward over
the whole prompt (query length = key length: the prefill), then one forward
per new token (query length 1), passing the same cache object to every
forward; each attention layer hands the cache its new keys and values and
calls the attention function with what the cache returns. This module keeps
that loop and changes three things around it for the duration of the call:

- the cache: a ``ShardedCache`` (cache.py) whose layers keep this rank's
  rows only (Note [sharded generation] in decoding.py) and count the tokens
  of the whole sequence, so that transformers' positions and masks are the
  global ones;
- the prefill: a forward pre-hook hands the model this rank's slice of
  input_ids, attention_mask and the GLOBAL position_ids (what
  ``shard_inputs`` does for training), so the prompt runs sequence-parallel
  through the registered attention function; a forward hook broadcasts the
  last position's logits from the rank holding it, so every rank picks the
  same first token. A prompt shorter than the ranks runs whole on every rank
  instead (a transformers attention layer cannot run zero tokens), each
  keeping its piece;
- each decoding step: every rank runs the new token through the model
  (layers are replicated); the owner of its position keeps its key/value
  row; the attention function finds the layer's rows in the cache
  (``backend.serving``), computes this rank's partial and merges it over the
  ranks: one all-gather per layer, whatever the context length.

One agreement first checks that every rank passed the same input_ids, mask,
max_new_tokens and generate arguments (and, when sampling, the same torch
random state) and holds the same parameters: a mismatch is a ValueError on
every rank, not ranks that generate different text.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ... import validation as check
from ...decoding import CachePlan
from ...distributed import comm
from ...distributed.sharding import piece_lengths
from ...models.inputs import agree_on_replicated_inputs, check_tokens, digest, left_padding
from .backend import backend_of, serving

# generate() arguments that would replace what this function sets up, or need a cache that
# moves rows (beams, assistants) or outputs of the prefill that no rank holds whole
REFUSED_GENERATE_KWARGS = {
    "cache": "the sharded cache is this function's",
    "past_key_values": "the sharded cache is this function's",
    "cache_implementation": "the sharded cache is this function's",
    "prefill_chunk_size": "the prompt runs sequence-parallel, not in chunks",
    "assistant_model": "assisted decoding rolls the cache back",
    "prompt_lookup_num_tokens": "assisted decoding rolls the cache back",
    "inputs_embeds": "pass input_ids",
    "position_ids": "generate computes them from attention_mask",
    "output_attentions": "dilated attention never forms the attention weights",
    "output_hidden_states": "each rank holds its own rows of the prompt's hidden states",
}


# generation_config settings that the refused keywords of the same name also set
CONFIGURED_REFUSALS = ("prefill_chunk_size", "output_attentions", "output_hidden_states")


def setting(model, generate_kwargs: Dict[str, Any], name: str):
    """The value of generation setting `name` that ``model.generate(**generate_kwargs)`` uses:
    the keyword, else the ``generation_config`` passed, else ``model.generation_config``
    (transformers' order: a config's unset fields are None); None where none sets it."""
    if name in generate_kwargs:
        return generate_kwargs[name]
    for config in (generate_kwargs.get("generation_config"),
                   getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def generate(model, input_ids: Tensor, *, group: comm.GroupLike, max_new_tokens: int,
             attention_mask: Optional[Tensor] = None, **generate_kwargs):
    """``model.generate`` with the prompt and the key/value cache sharded over `group`.

    Args:
        model: a transformers causal LM whose attention runs the function of
            ``register(..., group=group)``; every rank holds the same
            parameters.
        input_ids: (b, n) the whole prompt, the same on every rank.
        group: the process group (or 1-D DeviceMesh) the backend was
            registered with; None or one rank is plain ``model.generate``.
        max_new_tokens: how many tokens to generate (it also sizes each
            rank's block of the cache).
        attention_mask: (b, n) 0/1, 0 for left padding, as for
            ``model.generate``.
        generate_kwargs: passed on to ``model.generate`` (do_sample, top_k,
            eos_token_id, return_dict_in_generate, ...), the same on every
            rank; ``REFUSED_GENERATE_KWARGS`` and beam search are refused.
            Sampling draws from torch's random state, which must be the
            same on every rank (seed every rank alike).

    Returns:
        What ``model.generate`` returns, the same on every rank.
    """
    group = comm.resolve_group(group, "group")
    backend = backend_of(model)

    def config() -> Dict[str, Any]:
        _check_model(model, backend, group)
        check_prompt(input_ids, attention_mask, _vocab_size(model))
        new = check.check_positive_int("max_new_tokens", max_new_tokens)
        for name in sorted(generate_kwargs):
            if name in REFUSED_GENERATE_KWARGS:
                raise ValueError(f"generate(..., group=) does not take {name}=: "
                                 f"{REFUSED_GENERATE_KWARGS[name]}")
        # what generate will do: a keyword, else a generation_config's setting (the one
        # passed, then the model's), as transformers reads them
        for name in CONFIGURED_REFUSALS:
            if setting(model, generate_kwargs, name):
                raise ValueError(f"generate(..., group=) does not take {name}="
                                 f"{setting(model, generate_kwargs, name)!r} (set in a "
                                 f"generation_config): {REFUSED_GENERATE_KWARGS[name]}")
        if setting(model, generate_kwargs, "use_cache") not in (None, True):
            raise ValueError("generate(..., group=) generates with the sharded cache: "
                             "use_cache must be True (also in generation_config and "
                             "model.generation_config)")
        beams = setting(model, generate_kwargs, "num_beams")
        if beams not in (None, 1):
            raise NotImplementedError(f"beam search reorders the cache, which sharded "
                                      f"generation keeps in place: pass num_beams=1 (got "
                                      f"num_beams={beams!r}, from the keyword, generation_config "
                                      f"or model.generation_config)")
        sampling = bool(setting(model, generate_kwargs, "do_sample"))
        return {"input_ids": digest(input_ids),
                "attention_mask": None if attention_mask is None else digest(attention_mask),
                "max_new_tokens": new, "generate_kwargs": _plain(generate_kwargs),
                "random state": _random_state(input_ids.device) if sampling else None}

    agree_on_replicated_inputs(group, config, model)
    if not comm.is_distributed(group):
        return model.generate(input_ids, attention_mask=attention_mask,
                              max_new_tokens=max_new_tokens, **generate_kwargs)
    return _sharded(model, backend, input_ids, attention_mask, max_new_tokens, group,
                    generate_kwargs)


def _sharded(model, backend, input_ids: Tensor, attention_mask: Optional[Tensor],
             max_new_tokens: int, group, generate_kwargs):
    from .cache import ShardedCache  # imports transformers

    size, rank = comm.group_size(group), comm.group_rank(group)
    n = input_ids.shape[1]
    # the last new token is never fed back: n + max_new_tokens - 1 rows
    plan = CachePlan.of(n, max_new_tokens - 1, size, rank)
    whole = n < size
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = ShardedCache(layers, plan, n, backend.group, None if whole else backend.group)
    holder = max(p for p, length in enumerate(piece_lengths(n, size)) if length)
    hooks = [
        model.register_forward_pre_hook(
            functools.partial(_prefill_piece, cache, plan.prompt, whole), with_kwargs=True),
        model.register_forward_hook(
            functools.partial(_share_first_logits, cache, holder, group), with_kwargs=True),
    ]
    try:
        with serving(cache):
            return model.generate(input_ids, attention_mask=attention_mask,
                                  max_new_tokens=max_new_tokens, **{cache_keyword(model): cache},
                                  **generate_kwargs)
    finally:
        for hook in hooks:
            hook.remove()


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` from transformers 5.24,
    ``past_key_values`` before (5.24 still takes it, with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prefill_piece(cache, piece: Tuple[int, int], whole: bool, module, args,
                   kwargs) -> Optional[Tuple[tuple, dict]]:
    """Forward pre-hook: every forward sets the cache's phase; the prefill gets this rank's
    slice of the sequence inputs (their global positions included)."""
    cache.decoding = cache.get_seq_length() > 0
    if cache.decoding or whole:
        return None
    start, stop = piece
    kwargs = {name: x[..., start:stop]
              if name in ("input_ids", "attention_mask", "position_ids") and isinstance(x, Tensor)
              else x for name, x in kwargs.items()}
    return args, kwargs


def _share_first_logits(cache, holder: int, group, module, args, kwargs, output):
    """Forward hook: after the prefill, every rank takes the last position's logits from the
    rank holding it (the same bits everywhere, so every rank picks the same token)."""
    if cache.decoding:
        return None
    last = output.logits[:, -1:].contiguous()  # (b, 1, v)
    output.logits = comm.broadcast_(last, holder, group)
    return output


def check_prompt(input_ids: Tensor, attention_mask: Optional[Tensor],
                 vocab_size: Optional[int] = None) -> None:
    """input_ids (b, n) int64 or int32 ids, n >= 1, in [0, vocab_size) when given; attention_mask
    None or (b, n) of 0s and 1s, each row's padding on its left and a real token in each
    row (generate continues a row at its end; the decoding steps refuse a hole, but only
    after the prompt has run)."""
    # as LongNetLM's generate checks its tokens
    check_tokens("input_ids", input_ids, vocab_size)
    if input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one token per row, got shape "
                         f"{tuple(input_ids.shape)}")
    # as LongNetLM's generate checks its mask: 0s and 1s, padding on the left, a real token
    # in every row
    left_padding(attention_mask, input_ids, "input_ids")


def _check_model(model, backend, group) -> None:
    if backend is None:
        raise ValueError(
            "model must run the dilated attention function: build it with "
            "attn_implementation=register(..., group=group) (or call "
            "model.set_attn_implementation(name))"
        )
    if comm.resolve_group(backend.group) is not group:
        raise ValueError(
            f"the model's attention function was registered with group={backend.group!r}, not "
            f"the group generate was given ({group!r}): register the backend with the group "
            f"that generates"
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise NotImplementedError(
            f"{type(model).__name__}.forward takes no position_ids: sharded generation feeds "
            f"each rank its slice of the prompt at its global positions"
        )
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    other = sorted(set(layer_types or ()) - {"full_attention", "sliding_attention"})
    if other:
        raise NotImplementedError(f"sharded generation runs full-attention and sliding-window "
                                  f"layers, got layer types {other}")


def _vocab_size(model) -> Optional[int]:
    """How many ids the model's input embeddings hold (None: no nn.Embedding to ask)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def _plain(kwargs: Dict[str, Any]) -> Tuple[Tuple[str, str], ...]:
    """generate's keyword arguments as comparable values: plain values by repr, tensors by
    digest, other objects by type (their reprs may hold memory addresses)."""
    def value(x) -> str:
        if isinstance(x, Tensor):
            return digest(x)
        if x is None or isinstance(x, (bool, int, float, str)):
            return repr(x)
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(map(value, x)) + "]"
        return type(x).__name__

    return tuple((name, value(kwargs[name])) for name in sorted(kwargs))


def _random_state(device: torch.device) -> str:
    """A digest of the random state sampling draws from."""
    if device.type == "cuda":
        return digest(torch.cuda.get_rng_state(device))
    return digest(torch.get_rng_state())
