"""Generation with LongNetLM: one process or the context sharded over ranks; sampling.

Notation: b batch, n prompt tokens (n_p this rank's piece), e embed dim, v
vocabulary, hk key/value heads, d head dim; P ranks; s_i where row i's real
tokens start (its left padding).

The prompt runs through the layers as in a forward (sequence-parallel under
a process group: each rank its ``shard_sequence`` piece), keeping each
layer's keys and values; each new token at position t then runs alone
through the layers against them by the incremental rule
(``decoding.decode``: row t of the causal op over t + 1 positions, which
does not depend on what follows t), so generating with the cache equals
rerunning the whole sequence. Under a group each rank keeps only its rows
of the cache and the partial results merge exactly over the ranks (Note
[sharded generation] in decoding.py); every rank returns the same ids as
one process.

Left-padded prompts (``attention_mask``, zeros then ones per row, as
transformers pads them): row i's real tokens take the positions 0, 1, ...
of the row alone, and its attention runs over its own tokens only, with
segments starting at its first real token (``decoding``'s origins), so each
row generates exactly what it generates alone. Its pad positions compute
nothing that a real token reads.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import validation as check
from ..decoding import CachedRows, CachePlan, decode, origin_runs
from ..distributed import comm
from ..distributed.sharding import piece_lengths, piece_ranges
from .inputs import agree_on_replicated_inputs, check_tokens, digest, left_padding
from .layers import Block


class LayerCache:
    """One layer's cached keys and values on this rank: its prompt piece, then its block of
    new rows (Note [sharded generation]); (b, rows, hk, d) each."""

    def __init__(self, plan: CachePlan, k: Tensor, v: Tensor) -> None:
        self.plan = plan
        start, stop = plan.prompt
        self.prompt = CachedRows(k, v, start, stop - start)
        self.block = plan.empty_block(k, v)

    def store(self, t: int, k: Tensor, v: Tensor) -> None:
        """Keep the row of position t (k, v (b, 1, hk, d)) if it falls in this rank's block."""
        self.block = self.plan.store(self.block, t, k[:, 0], v[:, 0])

    def rows(self) -> List[CachedRows]:
        return [self.prompt, self.block]


class Sampling(NamedTuple):
    """How the next id is drawn from the last position's logits, and when a row stops."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos: Tuple[int, ...]  # ids that end a row (none: rows run to max_new_tokens)
    pad: int  # the id written after a row's end


@torch.no_grad()
def generate(model: nn.Module, tokens: Tensor, max_new_tokens: int, *,
             attention_mask: Optional[Tensor], temperature: float, top_k: Optional[int],
             top_p: Optional[float], eos_token_id: Union[int, Sequence[int], None],
             pad_token_id: Optional[int], use_cache: bool,
             generator: Optional[torch.Generator]) -> Tensor:
    """``LongNetLM.generate``: tokens (b, n) -> (b, n + steps), steps <= max_new_tokens,
    dropout off."""
    origins, sampling = _agree(model, tokens, attention_mask, max_new_tokens, temperature,
                               top_k, top_p, eos_token_id, pad_token_id, use_cache, generator)
    if sampling.temperature == 0.0 and (sampling.top_k is not None or sampling.top_p is not None) \
            and comm.group_rank(model.process_group) == 0:
        # as transformers' generate warns for top_k/top_p without do_sample
        warnings.warn(f"temperature=0 decodes greedily: top_k={sampling.top_k} and "
                      f"top_p={sampling.top_p} apply only when sampling (temperature > 0)",
                      UserWarning, stacklevel=3)
    was_training = model.training
    model.eval()
    try:
        return _generate(model, tokens, origins, max_new_tokens, sampling, use_cache, generator)
    finally:
        model.train(was_training)


def _token_ids(name: str, ids, vocab_size: int, *, several: bool = True) -> Tuple[int, ...]:
    """An id (or, if `several`, a non-empty sequence of ids), each in [0, vocab_size)."""
    what = "an int id or a non-empty sequence of them" if several else "one int id"
    many = ids if several and isinstance(ids, (list, tuple)) else (ids,)
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in many):
        raise TypeError(f"{name} must be {what}, got {ids!r}")
    if not many or not all(0 <= i < vocab_size for i in many):
        raise ValueError(f"{name} must be {what} in [0, {vocab_size}), got {ids!r}")
    return tuple(int(i) for i in many)


def _check_top_p(top_p) -> Optional[float]:
    if top_p is None:
        return None
    return check.check_real("top_p", top_p, "a float in (0, 1] or None", lambda p: 0 < p <= 1)


def _check_whole_parameters(model: nn.Module) -> None:
    """Generation runs the blocks' parts itself, outside their forward, so FSDP2's hooks never
    gather a fully_shard-ed module's parameters: a DTensor parameter would meet plain tensors
    inside a layer (torch's "mixed torch.Tensor and DTensor" error). Say so, and what to do."""
    name = next((n for n, p in model.named_parameters() if hasattr(p, "device_mesh")), None)
    if name is not None:
        raise ValueError(
            f"generate needs every parameter whole on this rank, but {name!r} is a DTensor "
            f"(sharded by FSDP2's fully_shard, or by tensor parallelism): generation runs the "
            f"layers outside their forward, where fully_shard gathers them. Call unshard() on "
            f"every fully_shard-ed module first (e.g. `for m in [*model.layers, model]: "
            f"m.unshard()`, then reshard() after), or generate from a model that holds the "
            f"full state dict"
        )


def _agree(model: nn.Module, tokens: Tensor, attention_mask, max_new_tokens, temperature, top_k,
           top_p, eos_token_id, pad_token_id, use_cache,
           generator) -> Tuple[Optional[Tuple[int, ...]], Sampling]:
    """Check the arguments, and under a group that every rank passed the same ones and holds
    the same parameters: one agreement, so a mistake on one rank is an error on all.
    Returns where each row's real tokens start (None: no padding) and the sampling."""
    vocab = model.config.vocab_size

    def config() -> dict:
        _check_whole_parameters(model)
        check_tokens("tokens", tokens, vocab)
        if 0 in tokens.shape:
            raise ValueError(f"tokens must hold at least one row and one id per row, got shape "
                             f"{tuple(tokens.shape)}")
        origins = left_padding(attention_mask, tokens)
        new = check.check_positive_int("max_new_tokens", max_new_tokens)
        check.check_real("temperature", temperature, "a finite float >= 0",
                         lambda t: math.isfinite(t) and t >= 0)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r} "
                            f"({type(generator).__name__})")
        k = check.check_optional_positive_int("top_k", top_k)
        eos = () if eos_token_id is None else _token_ids("eos_token_id", eos_token_id, vocab)
        pad = (eos[:1] or (0,)) if pad_token_id is None else \
            _token_ids("pad_token_id", pad_token_id, vocab, several=False)
        check.check_bool("use_cache", use_cache)
        longest = tokens.shape[1] - min(origins or (0,))  # the longest row's real tokens
        if model.config.positions == "learned" and longest + new > model.config.max_seq_len:
            raise ValueError(
                f"generating {new} tokens after a prompt of {longest} makes sequences of "
                f"{longest + new} tokens, past max_seq_len={model.config.max_seq_len} of the "
                f"learned position table"
            )
        # every rank must compute on the same prompt and draw the same samples
        return {"tokens": digest(tokens),
                "attention_mask": None if attention_mask is None else digest(attention_mask),
                "max_new_tokens": new, "temperature": float(temperature), "top_k": k,
                "top_p": _check_top_p(top_p), "eos_token_id": eos, "pad_token_id": pad[0],
                "use_cache": use_cache,
                "sampling state": _sampling_state(tokens, generator) if temperature else None,
                "origins": origins}

    agreed = agree_on_replicated_inputs(model.process_group, config, model)
    return agreed["origins"], Sampling(agreed["temperature"], agreed["top_k"], agreed["top_p"],
                                       agreed["eos_token_id"], agreed["pad_token_id"])


def _sampling_state(tokens: Tensor, generator: Optional[torch.Generator]) -> str:
    """A digest of the generator that sampling draws from (the device's default one)."""
    if generator is not None:
        state = generator.get_state()
    elif tokens.device.type == "cuda":
        state = torch.cuda.get_rng_state(tokens.device)
    else:
        state = torch.get_rng_state()
    return digest(state)


def _generate(model, tokens, origins, max_new_tokens, sampling: Sampling, use_cache,
              generator) -> Tensor:
    group = model.process_group
    n = tokens.shape[1]
    plan = None
    if use_cache:
        # the last new token is never fed back: n + max_new_tokens - 1 rows
        plan = CachePlan.of(n, max_new_tokens - 1, comm.group_size(group), comm.group_rank(group))
    hidden, caches = prefill(model, tokens, plan, origins)
    out = tokens
    eos = torch.tensor(sampling.eos, dtype=tokens.dtype, device=tokens.device)
    ended = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for step in range(max_new_tokens):
        logits = model.logits(model.norm(hidden))
        nxt = sample(logits, sampling, generator).to(out.dtype)
        if sampling.eos:
            # a row that ended writes pad ids (still drawn: the other rows' draws stay those
            # of their run alone); every rank holds the same ids, so all stop together
            nxt = nxt.masked_fill(ended, sampling.pad)
            ended |= torch.isin(nxt, eos)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if step + 1 == max_new_tokens or (sampling.eos and bool(ended.all())):
            break
        if use_cache:
            hidden = decode_token(model, nxt, out.shape[1] - 1, caches, origins)
        else:
            hidden, _ = prefill(model, out, None, origins)
    return out


def prefill(model: nn.Module, tokens: Tensor, plan: Optional[CachePlan],
            origins: Optional[Tuple[int, ...]] = None) -> Tuple[Tensor, List[LayerCache]]:
    """The whole sequence tokens (b, n) through the layers, this rank's piece under a group.

    Returns the final hidden state of the last position (b, e), the same on
    every rank, and with a plan each layer's cache of this rank's piece.
    origins: where each row's real tokens start (left padding).
    """
    group = model.process_group
    n = tokens.shape[1]
    (start, stop), = piece_ranges(n, comm.group_size(group), comm.group_rank(group))
    rows = torch.arange(start, stop, device=tokens.device)
    if origins is not None:
        # (b, n_p): each row's positions count from its first real token; pads sit at 0
        rows = (rows - torch.tensor(origins, device=rows.device)[:, None]).clamp(min=0)
    x = model.embed_at(tokens[:, start:stop], rows)
    rotary = model.rotary_at(rows, x)
    caches = []
    for block in model.layers:
        attn = block.self_attn
        h = block.attn_norm(x)
        q, k, v = attn.project_qkv(h, h, h, rotary)
        if plan is not None:
            caches.append(LayerCache(plan, k, v))
        out = _prompt_attention(attn.attention, q, k, v, start, origins)
        x = x + block.dropout(attn.project_out(out))
        x = block.after_attention(x, None)
    return _last_row(x, n, group), caches


def _prompt_attention(attention: nn.Module, q: Tensor, k: Tensor, v: Tensor, start: int,
                      origins: Optional[Tuple[int, ...]]) -> Tensor:
    """Causal attention of this rank's rows [start, start + n_p) (q (b, n_p, h, d)), each
    batch row over its own tokens only: rows sharing an origin s attend [s, n) as one
    sequence (one call of the op, sequence-parallel under a group); pads get zeros."""
    if origins is None:
        return attention(q, k, v, is_causal=True)
    out = torch.zeros_like(q)
    for lo, hi, origin in origin_runs(origins, q.shape[0]):
        # this rank's rows at or after the origin: a suffix of its piece (maybe empty)
        first = min(max(origin - start, 0), q.shape[1])
        out[lo:hi, first:] = attention(q[lo:hi, first:], k[lo:hi, first:], v[lo:hi, first:],
                                       is_causal=True)
    return out


def _last_row(x: Tensor, n: int, group) -> Tensor:
    """Row n - 1 of the sequence's hidden states (b, e), on every rank: the rank holding it
    broadcasts it (identical bits everywhere, so every rank computes the same logits)."""
    if not comm.is_distributed(group):
        return x[:, -1]
    holder = max(p for p, length in enumerate(piece_lengths(n, comm.group_size(group)))
                 if length)
    row = x[:, -1].contiguous() if comm.group_rank(group) == holder else \
        x.new_empty((x.shape[0], x.shape[2]))
    return comm.broadcast_(row, holder, group)


def decode_token(model: nn.Module, token: Tensor, t: int, caches: List[LayerCache],
                 origins: Optional[Tuple[int, ...]] = None) -> Tensor:
    """The final hidden state (b, e) of token (b,) at position t, its keys and values cached."""
    position = torch.tensor([t], device=token.device)
    if origins is not None:
        # (b, 1): each row's own position
        position = (position - torch.tensor(origins, device=token.device))[:, None]
    x = model.embed_at(token[:, None], position)
    rotary = model.rotary_at(position, x)
    for block, cache in zip(model.layers, caches):
        x = _decode_block(block, x, t, cache, model.process_group, origins, rotary)
    return x[:, -1]


def _decode_block(block: Block, x: Tensor, t: int, cache: LayerCache, group,
                  origins: Optional[Tuple[int, ...]],
                  rotary: Optional[Tuple[Tensor, Tensor]]) -> Tensor:
    """x (b, 1, e) at position t -> (b, 1, e): the block with its attention over the cache
    (q and k turned by the position's rotary tables, if any; the cache keeps turned keys)."""
    attn = block.self_attn
    h = block.attn_norm(x)
    q, k, v = attn.project_qkv(h, h, h, rotary)
    cache.store(t, k, v)
    out = decode(q, cache.rows(), t, (attn.segment_lengths, attn.dilation_rates),
                 scale=attn.attention.scale, group=group, origins=origins)
    x = x + block.dropout(attn.project_out(out))
    return block.after_attention(x, None)


def sample(logits: Tensor, sampling: Sampling, generator) -> Tensor:
    """Next ids (b,) from last-position logits (b, v): greedy at temperature 0; else drawn
    from softmax(logits / T), kept to the top_k logits, then to the nucleus: the fewest most
    probable ids whose probabilities sum to top_p or more."""
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # the largest logit at 0 before dividing: the others go to -inf, not past +inf, at
    # temperatures so small that logit / temperature overflows
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        # an id goes when the more probable ones already reach top_p (the first never does)
        beyond = (ordered.cumsum(-1) - ordered) >= sampling.top_p
        probs = probs.masked_fill(beyond.scatter(-1, order, beyond), 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
