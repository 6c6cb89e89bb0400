"""LongNet models: a decoder-only language model and the encoder-decoder.

Notation: b batch, n tokens (this rank's piece under sequence parallelism),
e embed dim, f feed-forward dim, v vocabulary, h query heads, hk key/value
heads, d head dim, L layers.

Both models are MAGNETO transformers (Wang et al., 2022, arXiv 2210.06423)
with dilated self-attention, as in LongNet (Ding et al., 2023) and
torchscale: pre-norm residual blocks, a "sub-LN" LayerNorm inside the
attention (before its output projection) and inside the feed-forward
(before its second linear), and the MAGNETO gain gamma on the value/output
projections and both feed-forward linears.

NOTE: deviations from the paper / torchscale: absolute positions (learned
or sinusoidal) instead of xPos; xavier-normal initialisation with gain
gamma instead of torchscale's default init rescaled by gamma; the
encoder-decoder's cross-attention is plain dense attention over the whole
encoder output.

Sequence parallelism (``process_group=``): each rank passes its own
contiguous piece of every sequence (pieces may differ in length or be
empty). Embeddings, norms, feed-forwards, the head and the token losses work
on the local piece; only the dilated attention communicates (plus one tiny
agreement of piece lengths for the global positions and one all-reduce of
(loss sum, token count)). Parameters are replicated. The loss's value is
the global one; its gradient is scaled by the group size P so that each
rank's backward yields P times the gradient through its own tokens and an
AVERAGE over the sequence-parallel ranks is the full gradient: after
``backward`` call ``dilated_attention.all_reduce_gradients(model,
process_group)``, or wrap the model in DDP over the sequence-parallel (or
data x sequence) ranks, or FSDP2 over a mesh that includes them
(Note [gradients across ranks] in distributed/sharding.py). While training
(gradients enabled) every forward checks, inside its agreement, that the
ranks hold the same parameters: a step whose gradients were not reduced
over the sequence-parallel ranks (or models built from different seeds)
is an error on every rank, not a silent divergence. The encoder-decoder
also gathers the encoder output on every rank for its cross-attention
(O(N e) memory per rank).
"""

from __future__ import annotations

import math
import numbers
import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import validation as check
from .dilated import cached_dilated_attention
from .distributed import comm
from .distributed.sharding import gather_pieces, local_part, sharded_within, sum_across_ranks
from .distributed.strategy import check_strategy
from .kernels import lse_dtype
from .modules import MultiheadDilatedAttention

IGNORE_INDEX = -100

_ACTIVATIONS = types.MappingProxyType({"gelu": F.gelu, "relu": F.relu, "silu": F.silu})
_POSITIONS = ("sinusoidal", "learned")


@dataclass
class LongNetConfig:
    """Hyper-parameters of LongNetLM and LongNet.

    ``from_name("base")`` is the paper's base size (LongNet, section 4 and
    appendix: 12 layers, width 768, 12 heads, feed-forward 3072, segments
    2048..32768 with rates 1..12; the paper tokenises with tiktoken
    cl100k_base, 100,277 ids). ``from_name("tiny")`` is a model for tests and
    CPU demos.

    num_layers is the decoder depth; num_encoder_layers is used by the
    encoder-decoder ``LongNet`` only. max_seq_len bounds the global positions
    of ``positions="learned"`` (sinusoidal positions have no bound).
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
    max_seq_len: int = 8192
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    tie_embeddings: bool = True
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "ffn_dim",
                     "num_encoder_layers", "max_seq_len"):
            check.check_optional_positive_int(name, getattr(self, name))
        check.check_optional_positive_int("num_kv_heads", self.num_kv_heads)
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
        if self.positions not in _POSITIONS:
            raise ValueError(f"positions must be one of {_POSITIONS}, got {self.positions!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(_ACTIVATIONS)}, got {self.activation!r}"
            )
        check.check_dropout(self.dropout, "dropout")
        check.check_dropout(self.attention_dropout, "attention_dropout")
        for name in ("bias", "tie_embeddings", "checkpoint_activations"):
            check.check_bool(name, getattr(self, name))

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LongNetConfig":
        """A preset ("base" or "tiny"), with any field overridden by keyword."""
        if name not in _PRESETS:
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


# --------------------------------------------------------------------------
# Building blocks


class FeedForward(nn.Module):
    """fc1, activation, sub-LN, fc2 (MAGNETO), with gain gamma on fc1 and fc2."""

    def __init__(self, config: LongNetConfig, gamma: float, factory: dict) -> None:
        super().__init__()
        e, f = config.embed_dim, config.ffn_dim
        self.fc1 = nn.Linear(e, f, bias=config.bias, **factory)
        self.norm = nn.LayerNorm(f, eps=config.layer_norm_eps, **factory)
        self.fc2 = nn.Linear(f, e, bias=config.bias, **factory)
        self.activation = _ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_normal_(fc.weight, gain=gamma)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

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
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        # (b, h, n, d) -> (b, n, e)
        return self.out_proj(out.transpose(1, 2).flatten(-2))


@dataclass
class KVCache:
    """Projected keys and values of one layer for generation: (b, capacity, hk, d)."""

    k: Tensor
    v: Tensor


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
            **factory,
        )
        self.cross_norm = nn.LayerNorm(e, eps=eps, **factory) if cross_attention else None
        self.cross_attn = CrossAttention(config, factory) if cross_attention else None
        self.ffn_norm = nn.LayerNorm(e, eps=eps, **factory)
        self.ffn = FeedForward(config, gamma, factory)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None,
                cu_seqlens: Optional[Tuple[int, ...]] = None) -> Tensor:
        """x (b, n, e) [, memory (b, m, e)] -> (b, n, e); cu_seqlens: packed documents."""
        h = self.attn_norm(x)
        attn, _ = self.self_attn(h, h, h, is_causal=self.causal, cu_seqlens=cu_seqlens)
        x = x + self.dropout(attn)
        return self._after_self_attention(x, memory)

    def decode(self, x: Tensor, cache: KVCache, start: int) -> Tensor:
        """Positions [start, start + n) of a causal block, keys/values cached.

        x (b, n, e) -> (b, n, e). With start == 0 (the prompt) the full op
        runs; later tokens attend the cache by the incremental rule.
        """
        attn = self.self_attn
        h = self.attn_norm(x)
        q, k, v = attn.project_qkv(h, h, h)
        n = x.shape[1]
        cache.k[:, start : start + n] = k
        cache.v[:, start : start + n] = v
        if start == 0:
            out = attn.attention(q, k, v, is_causal=True)
        else:
            scale = attn.attention.scale
            out = torch.cat(
                [
                    cached_dilated_attention(
                        q[:, i : i + 1],
                        cache.k[:, : start + i + 1],
                        cache.v[:, : start + i + 1],
                        attn.segment_lengths,
                        attn.dilation_rates,
                        scale=scale,
                    )
                    for i in range(n)
                ],
                dim=1,
            )
        x = x + self.dropout(attn.project_out(out))
        return self._after_self_attention(x, None)

    def _after_self_attention(self, x: Tensor, memory: Optional[Tensor]) -> Tensor:
        if self.cross_attn is not None:
            x = x + self.dropout(self.cross_attn(self.cross_norm(x), memory))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Positions(nn.Module):
    """Absolute position embeddings for global positions [start, start + n)."""

    def __init__(self, config: LongNetConfig, factory: dict) -> None:
        super().__init__()
        self.kind = config.positions
        self.embed_dim = config.embed_dim
        self.max_seq_len = config.max_seq_len
        self.table = None
        if self.kind == "learned":
            self.table = nn.Embedding(config.max_seq_len, config.embed_dim, **factory)
            nn.init.normal_(self.table.weight, std=config.embed_dim**-0.5)

    def forward(self, positions: Tensor, like: Tensor) -> Tensor:
        """(n,) positions -> (n, e) embeddings in like's dtype/device.

        The caller checks positions against max_seq_len (on every rank at once).
        """
        if self.table is not None:
            return self.table(positions)
        # float64 angles: exact for positions far beyond 2^24, then one cast
        pos = positions.to(torch.float64)
        half = self.embed_dim // 2
        freq = torch.exp(
            torch.arange(half, device=like.device, dtype=torch.float64)
            * (-math.log(10000.0) / half)
        )
        angles = pos[:, None] * freq[None, :]
        # (n, e/2) sin and (n, e/2) cos -> (n, e), zero-padded for odd e
        out = torch.cat([angles.sin(), angles.cos()], dim=-1)
        if out.shape[-1] < self.embed_dim:
            out = F.pad(out, (0, self.embed_dim - out.shape[-1]))
        return out.to(like.dtype)


def _magneto_gamma(decoder_layers: int, encoder_layers: int = 0) -> Tuple[float, float]:
    """MAGNETO gains (encoder, decoder), as torchscale: decoder-only sqrt(log 2L)."""
    if encoder_layers == 0:
        return 0.0, math.sqrt(math.log(2 * decoder_layers))
    enc = math.sqrt(math.log(3 * decoder_layers) * math.log(2 * encoder_layers) / 3)
    dec = math.sqrt(math.log(3 * decoder_layers))
    return enc, dec


_ID_DTYPES = (torch.int64, torch.int32)


def _check_tokens(name: str, tokens: Tensor, vocab_size: int) -> None:
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, seq_len), got shape {tuple(tokens.shape)}")
    if tokens.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must hold integer token ids (int64 or int32), got {tokens.dtype}")
    if tokens.device.type != "meta" and tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be ids in [0, {vocab_size}), got values in [{lo}, {hi}]")


def _check_targets(targets: Tensor, tokens: Tensor, vocab_size: int, name: str) -> None:
    """Targets: tokens' shape, int ids in [0, vocab) or IGNORE_INDEX (checked before the
    forward, so that a bad id is an error on every rank, not in one rank's loss)."""
    if not isinstance(targets, Tensor) or targets.shape != tokens.shape:
        shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"{name} must have tokens' shape {tuple(tokens.shape)}, got {shape}")
    if targets.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must hold int64 or int32 ids, got {targets.dtype}")
    if targets.device.type != "meta" and targets.numel():
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
        if bool(bad.any()):
            value = int(targets[bad][0])
            raise ValueError(
                f"{name} must be ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored), got "
                f"{value}"
            )


def _pick_targets(targets: Optional[Tensor], labels: Optional[Tensor]) -> Tuple[Optional[Tensor],
                                                                                 str]:
    """`labels` is `targets` under the name transformers users know; not both."""
    if targets is not None and labels is not None:
        raise ValueError("pass targets or labels (the same argument), not both")
    return (labels, "labels") if labels is not None else (targets, "targets")


def _document_starts(position_ids: Optional[Tensor], tokens: Tensor,
                     max_seq_len: Optional[int]) -> Dict[str, object]:
    """This rank's facts from position_ids (b, n) or (n,): where documents start, the largest
    position; the rows of a batch must agree (documents are shared by every row)."""
    if position_ids is None:
        return {"doc_starts": (), "max_position": None}
    if not isinstance(position_ids, Tensor) or position_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"position_ids must be an int64 or int32 tensor, got "
                        f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[1] != tokens.shape[1]:
        raise ValueError(
            f"position_ids must be (batch, seq_len) or (seq_len,) matching tokens "
            f"{tuple(tokens.shape)}, got {tuple(position_ids.shape)}"
        )
    if not bool((position_ids == position_ids[:1]).all()):
        raise ValueError("position_ids must be the same in every batch row (packed documents "
                         "are shared by the batch)")
    row = position_ids[0]
    if row.numel() and int(row.min()) < 0:
        raise ValueError(f"position_ids must be >= 0, got {int(row.min())}")
    return {"doc_starts": tuple((row == 0).nonzero().flatten().tolist()),
            "max_position": int(row.max()) if row.numel() else None}


def _check_inputs(
    group, names: Tuple[str, ...], inputs: Callable[[], Tuple[Tensor, ...]], *, has_targets: bool,
    facts: Callable[[], Dict[str, object]] = dict, fact_keys: Tuple[str, ...] = (),
    shared: Optional[Dict[str, object]] = None, model: Optional[nn.Module] = None,
) -> Tuple[int, Dict[str, Tuple[int, ...]], List[Dict[str, object]]]:
    """Validate this rank's inputs and learn every rank's piece lengths (and `facts`).

    `inputs` validates and returns the (b, n) tensors called `names`; `facts`
    returns this rank's own values under `fact_keys` (they may differ between
    ranks); `shared` values must be equal on every rank. Returns this rank's
    group rank, {name: every rank's n} and every rank's agreed dict. Under
    sequence parallelism this is ONE agreement collective, entered even when
    this rank's inputs are bad (so every rank raises instead of waiting),
    which also checks that the batch sizes match and that every rank passed
    targets or none did (only then do all ranks enter the loss all-reduce),
    and, for `model` while gradients are enabled, that every rank holds the
    same parameters (`_replica_checksums`).
    """

    def local() -> dict:
        shapes = dict(zip(names, (tuple(x.shape) for x in inputs())))
        return {"targets_passed": has_targets, **(shared or {}), **facts(),
                "replica": _replica_checksums(model, group),
                **{f"{k}_batch": s[0] for k, s in shapes.items()},
                **{f"{k}_len": s[1] for k, s in shapes.items()}}

    infos = comm.agree(group, local,
                       per_rank=tuple(f"{k}_len" for k in names) + fact_keys + ("replica",))
    _check_replicas(infos, model, group)
    lengths = {k: tuple(i[f"{k}_len"] for i in infos) for k in names}
    return comm.group_rank(group), lengths, infos


def _replica_params(model: nn.Module, group) -> List[Tuple[str, Tensor]]:
    """The (name, local tensor) of each parameter that every rank of `group` must hold alike.

    A DTensor (FSDP2) counts by its local shard; one sharded over ranks of
    `group` itself is left out (its shards differ by design, and FSDP2
    keeps them consistent).
    """
    out = []
    for name, p in model.named_parameters():
        if sharded_within(p, group):
            continue
        p = local_part(p)
        if p.device.type != "meta" and p.numel():
            out.append((name, p.detach()))
    return out


def _replica_checksums(model: Optional[nn.Module], group) -> Optional[Tuple[int, ...]]:
    """A checksum of each of `_replica_params`, while training under sequence parallelism.

    The sum of a parameter's bits read as int32, wrapping: exact and
    independent of the summation order, so equal parameters give equal
    checksums on every rank (a float sum could differ with the thread
    count). Costs one read of the parameters (110M float32 parameters,
    LongNet's base size: 0.1 s on one CPU thread) and a host sync, so the
    models do it on their first two training forwards only: enough for a
    model built differently on some rank (the first) and for a gradient
    reduction that misses the sequence ranks (the second).
    """
    if model is None or not comm.is_distributed(group) or not torch.is_grad_enabled():
        return None
    sums = []
    for _, p in _replica_params(model, group):
        raw = p.reshape(-1).view(torch.uint8)
        # int32 sums run at memory speed; int64 accumulation of narrower ints is ~20x slower
        sums.append(raw.view(torch.int32).sum(dtype=torch.int32).long() if raw.numel() % 4 == 0
                    else raw.sum(dtype=torch.int64))
    return tuple(torch.stack(sums).tolist()) if sums else None


def _check_replicas(infos: List[Dict[str, object]], model: Optional[nn.Module], group) -> None:
    """Raise if the ranks' parameters differ; every rank sees every checksum, so all raise.

    Skipped when some rank has no checksums (gradients disabled there: the
    attention op's own agreement on requires_grad reports that).
    """
    first = infos[0]["replica"]
    if any(info["replica"] is None for info in infos):
        return
    for r, info in enumerate(infos[1:], start=1):
        if info["replica"] == first:
            continue
        names = [name for (name, _), a, b in zip(_replica_params(model, group), first,
                                                 info["replica"]) if a != b]
        raise ValueError(
            f"the parameters differ between the ranks of process_group (rank 0 and rank {r}, "
            f"first {names[0] if names else 'the parameter list'!r}); sequence-parallel ranks "
            f"must hold the same parameters. Either the ranks built the model differently "
            f"(seed its construction alike on every rank), or the last step's gradients were "
            f"not reduced over the sequence-parallel ranks: after backward call "
            f"all_reduce_gradients(model, process_group), or wrap the model in DDP over the "
            f"data x sequence ranks (not the data-parallel ranks alone), or fully_shard it on a "
            f"mesh that includes the sequence-parallel ranks (docs/guide.md, Training: "
            f"gradients across ranks)"
        )


def token_mean_loss(logits: Tensor, targets: Tensor, group) -> Tensor:
    """Cross-entropy averaged over every non-ignored token of every rank.

    Targets are aligned with the logits (position t predicts targets[t]);
    every rank of `group` calls it, a rank without targets too. When no rank
    has a target that is not ignored the loss is 0 (not 0/0 = NaN), still
    connected to the logits, so ``backward`` gives zero gradients. Under a
    group of P ranks the value is the global mean on every rank and the
    gradient is P times this rank's share of it, so that averaging the
    gradients over the group (all_reduce_gradients, DDP, FSDP2) sums the
    shares (Note [gradients across ranks] in distributed/sharding.py).
    """
    acc = lse_dtype(logits.dtype)
    # (b, n, v) -> (b * n, v)
    total = F.cross_entropy(
        logits.to(acc).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (targets != IGNORE_INDEX).sum().to(acc)
    summed = sum_across_ranks(torch.stack([total, count]), group)
    # count 0 means total 0 (an empty sum): 0 / 1 instead of NaN; count >= 1 is unchanged
    return summed[0] / summed[1].clamp(min=1)


# --------------------------------------------------------------------------
# Models


class _LongNetBase(nn.Module):
    def __init__(self, config: LongNetConfig, device, dtype, process_group, strategy) -> None:
        super().__init__()
        if not isinstance(config, LongNetConfig):
            raise TypeError(f"config must be a LongNetConfig, got {type(config).__name__}")
        self.config = config
        self.process_group = process_group
        self.strategy = check_strategy(strategy)
        # the first training forwards compare parameter checksums across the ranks
        # (_replica_checksums): a missed gradient reduction shows at the second
        self._replica_checks_left = 2
        self._factory = {"device": device, "dtype": dtype}
        e = config.embed_dim
        self.embed = nn.Embedding(config.vocab_size, e, **self._factory)
        nn.init.normal_(self.embed.weight, std=e**-0.5)
        self.positions = Positions(config, self._factory)
        self.head = None
        if not config.tie_embeddings:
            self.head = nn.Linear(e, config.vocab_size, bias=False, **self._factory)
            nn.init.normal_(self.head.weight, std=e**-0.5)

    def _replica_check(self) -> Optional[nn.Module]:
        """This model while it still compares its parameters across ranks (the first two
        training forwards under a group: one read of every parameter each), else None."""
        if self._replica_checks_left and torch.is_grad_enabled() and \
                comm.is_distributed(self.process_group):
            self._replica_checks_left -= 1
            return self
        return None

    def _blocks(self, n: int, *, gamma: float, causal: bool, cross: bool) -> nn.ModuleList:
        return nn.ModuleList(
            Block(self.config, gamma=gamma, causal=causal, cross_attention=cross,
                  factory=self._factory, process_group=self.process_group,
                  strategy=self.strategy)
            for _ in range(n)
        )

    def _norm(self) -> nn.LayerNorm:
        return nn.LayerNorm(self.config.embed_dim, eps=self.config.layer_norm_eps, **self._factory)

    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """(b, n) ids at positions (n,) -> (b, n, e)."""
        x = self.embed(tokens)
        return x + self.positions(positions, x)

    def _check_positions(self, largest: Optional[int]) -> None:
        """Positions past a learned table: an error on every rank (the caller agreed `largest`)."""
        if self.positions.table is not None and largest is not None and \
                largest >= self.config.max_seq_len:
            raise ValueError(
                f"positions up to {largest} exceed max_seq_len={self.config.max_seq_len} of the "
                f"learned position table"
            )

    def _run(self, layers: nn.ModuleList, x: Tensor, memory: Optional[Tensor] = None,
             cu_seqlens: Optional[Tuple[int, ...]] = None) -> Tensor:
        use_checkpoint = self.config.checkpoint_activations and torch.is_grad_enabled()
        for layer in layers:
            if use_checkpoint:
                x = checkpoint(layer, x, memory, cu_seqlens, use_reentrant=False)
            else:
                x = layer(x, memory, cu_seqlens)
        return x

    def _logits(self, x: Tensor) -> Tensor:
        """(b, n, e) -> (b, n, v)."""
        if self.head is None:
            return F.linear(x, self.embed.weight)
        return self.head(x)

    def _loss(self, logits: Tensor, targets: Optional[Tensor]) -> Optional[Tensor]:
        if targets is None:
            return None
        return token_mean_loss(logits, targets.long(), self.process_group)


class LongNetLM(_LongNetBase):
    """Decoder-only LongNet language model.

    ``forward(tokens, targets=None)`` with tokens (b, n) int ids returns
    ``(logits (b, n, v), loss)``; loss is None without targets, else the mean
    cross-entropy over every target that is not ``IGNORE_INDEX`` (-100),
    over the whole sequence of all ranks (0, with zero gradients, when every
    target is ignored). Targets are aligned with tokens (shift them
    yourself: targets[:, i] is the token after tokens[:, i]).

    With ``process_group`` set, tokens/targets are this rank's contiguous
    piece of each sequence, logits are this piece's, and the loss is the
    global one on every rank (its gradient P times this rank's share:
    average the gradients over the group, see the module docstring). Every
    rank must pass targets, or none.
    """

    def __init__(
        self, config: LongNetConfig, *, device=None, dtype=None, process_group=None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(config, device, dtype, process_group, strategy)
        _, gamma = _magneto_gamma(config.num_layers)
        self.layers = self._blocks(config.num_layers, gamma=gamma, causal=True, cross=False)
        self.norm = self._norm()

    def forward(
        self, tokens: Tensor, targets: Optional[Tensor] = None, *, labels: Optional[Tensor] = None,
        cu_seqlens=None, position_ids: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """tokens (b, n) -> (logits (b, n, v), loss or None).

        Packed documents: ``cu_seqlens`` (global boundaries [0, c1, ..., N],
        shared by the batch) or ``position_ids`` that restart at 0 where a
        document starts ((b, n) or (n,), this rank's rows of the global
        positions). Attention stays inside each document and positions
        restart at each document's start (with position_ids: they are the
        positions). ``labels`` is another name for ``targets``.
        """
        targets, target_name = _pick_targets(targets, labels)
        vocab = self.config.vocab_size

        def inputs() -> Tuple[Tensor, ...]:
            _check_tokens("tokens", tokens, vocab)
            if targets is not None:
                _check_targets(targets, tokens, vocab, target_name)
            if cu_seqlens is not None and position_ids is not None:
                raise ValueError("pass cu_seqlens or position_ids (restarting at 0), not both")
            return (tokens,)

        rank, lengths, infos = _check_inputs(
            self.process_group, ("tokens",), inputs, has_targets=targets is not None,
            facts=lambda: _document_starts(position_ids, tokens, self.config.max_seq_len),
            fact_keys=("doc_starts", "max_position"),
            shared={"cu_seqlens": check.check_cu_seqlens(cu_seqlens)}, model=self._replica_check(),
        )
        pieces = lengths["tokens"]
        start, total = sum(pieces[:rank]), sum(pieces)
        documents = _documents_of(infos, pieces, total)
        positions = self._positions_of(tokens, start, documents, position_ids, infos)
        x = self._run(self.layers, self._embed(tokens, positions), cu_seqlens=documents)
        logits = self._logits(self.norm(x))
        return logits, self._loss(logits, targets)

    def _positions_of(self, tokens: Tensor, start: int, documents: Optional[Tuple[int, ...]],
                      position_ids: Optional[Tensor], infos) -> Tensor:
        """(n,) this rank's positions: given, restarting per document, or global."""
        if position_ids is not None:
            self._check_positions(max((i["max_position"] for i in infos
                                       if i["max_position"] is not None), default=None))
            return (position_ids if position_ids.dim() == 1 else position_ids[0]).long()
        n = tokens.shape[1]
        rows = torch.arange(start, start + n, device=tokens.device)
        if documents is None:
            self._check_positions(sum(i["tokens_len"] for i in infos) - 1)
            return rows
        cu = torch.tensor(documents, device=tokens.device)
        # each row minus the start of its document
        doc_start = cu[torch.searchsorted(cu, rows, right=True) - 1]
        self._check_positions(max(e - s for s, e in zip(documents[:-1], documents[1:])) - 1)
        return rows - doc_start

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        use_cache: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> Tensor:
        """Extend tokens (b, n) by max_new_tokens ids -> (b, n + max_new_tokens).

        temperature 0 is greedy; > 0 samples from softmax(logits / T),
        restricted to the top_k logits when given (generator seeds it).
        With use_cache (default) each new token runs one position through
        the layers against cached keys/values (exact: the same result as
        rerunning the whole sequence, which use_cache=False does).
        Dropout is off during generation; one process only.
        """
        if comm.is_distributed(self.process_group):
            raise ValueError("generate runs on one process; build the model without process_group")
        _check_tokens("tokens", tokens, self.config.vocab_size)
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
        if self.config.positions == "learned" and total > self.config.max_seq_len:
            raise ValueError(
                f"generating to {total} tokens exceeds max_seq_len={self.config.max_seq_len}"
            )
        was_training = self.training
        self.eval()
        try:
            return self._generate(tokens, max_new_tokens, temperature, top_k, use_cache, generator)
        finally:
            self.train(was_training)

    def _generate(self, tokens, max_new_tokens, temperature, top_k, use_cache, generator) -> Tensor:
        out = tokens
        caches = self._new_caches(tokens, tokens.shape[1] + max_new_tokens) if use_cache else None
        logits = self._decode(tokens, caches, 0) if use_cache else self(tokens)[0]
        for step in range(max_new_tokens):
            nxt = _sample(logits[:, -1], temperature, top_k, generator)
            out = torch.cat([out, nxt[:, None]], dim=1)
            if step + 1 == max_new_tokens:
                break
            if use_cache:
                logits = self._decode(nxt[:, None], caches, out.shape[1] - 1)
            else:
                logits = self(out)[0]
        return out

    def _new_caches(self, tokens: Tensor, capacity: int) -> List[KVCache]:
        attn = self.layers[0].self_attn
        ref = self.embed.weight
        shape = (tokens.shape[0], capacity, attn.num_kv_heads, attn.head_dim)
        return [
            KVCache(ref.new_zeros(shape), ref.new_zeros(shape)) for _ in range(len(self.layers))
        ]

    def _decode(self, tokens: Tensor, caches: List[KVCache], start: int) -> Tensor:
        """Logits (b, n, v) of tokens (b, n) at positions [start, start + n), caching k/v."""
        x = self._embed(tokens, torch.arange(start, start + tokens.shape[1], device=tokens.device))
        for layer, cache in zip(self.layers, caches):
            x = layer.decode(x, cache, start)
        return self._logits(self.norm(x))


class LongNet(_LongNetBase):
    """Encoder-decoder LongNet: dilated self-attention in both stacks.

    ``forward(src_tokens, tgt_tokens, targets=None)`` -> ``(logits (b, n_tgt,
    v), loss)``. The encoder attends bidirectionally, the decoder causally,
    then (plain dense attention) over the whole encoder output. Source and
    target share the token embedding (and the head when tied).

    With ``process_group`` set, src/tgt/targets are this rank's pieces; the
    encoder output is gathered on every rank for the cross-attention. The
    loss and its gradients follow LongNetLM's convention.
    """

    def __init__(
        self, config: LongNetConfig, *, device=None, dtype=None, process_group=None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(config, device, dtype, process_group, strategy)
        enc_gamma, dec_gamma = _magneto_gamma(config.num_layers, config.num_encoder_layers)
        self.encoder = self._blocks(
            config.num_encoder_layers, gamma=enc_gamma, causal=False, cross=False
        )
        self.encoder_norm = self._norm()
        self.decoder = self._blocks(config.num_layers, gamma=dec_gamma, causal=True, cross=True)
        self.decoder_norm = self._norm()

    def forward(
        self, src_tokens: Tensor, tgt_tokens: Tensor, targets: Optional[Tensor] = None, *,
        labels: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        group = self.process_group
        targets, target_name = _pick_targets(targets, labels)
        vocab = self.config.vocab_size

        def inputs() -> Tuple[Tensor, ...]:
            _check_tokens("src_tokens", src_tokens, vocab)
            _check_tokens("tgt_tokens", tgt_tokens, vocab)
            if src_tokens.shape[0] != tgt_tokens.shape[0]:
                # cross-attention would broadcast a batch of 1 silently
                raise ValueError(
                    f"src_tokens and tgt_tokens must have the same batch size, got "
                    f"{src_tokens.shape[0]} and {tgt_tokens.shape[0]}"
                )
            if targets is not None:
                _check_targets(targets, tgt_tokens, vocab, target_name)
            return src_tokens, tgt_tokens

        rank, lengths, _ = _check_inputs(group, ("src", "tgt"), inputs,
                                         has_targets=targets is not None, model=self._replica_check())
        src_start = sum(lengths["src"][:rank])
        tgt_start = sum(lengths["tgt"][:rank])
        self._check_positions(max(sum(lengths["src"]), sum(lengths["tgt"])) - 1)
        device = src_tokens.device
        src_pos = torch.arange(src_start, src_start + src_tokens.shape[1], device=device)
        tgt_pos = torch.arange(tgt_start, tgt_start + tgt_tokens.shape[1], device=device)
        memory = self.encoder_norm(self._run(self.encoder, self._embed(src_tokens, src_pos)))
        if comm.is_distributed(group):
            memory = gather_pieces(memory, group, lengths["src"])
        x = self._run(self.decoder, self._embed(tgt_tokens, tgt_pos), memory)
        logits = self._logits(self.decoder_norm(x))
        return logits, self._loss(logits, targets)


def _documents_of(infos, pieces: Tuple[int, ...], total: int) -> Optional[Tuple[int, ...]]:
    """The agreed document boundaries: given as cu_seqlens, or where position_ids restart."""
    given = infos[0]["cu_seqlens"]
    if given is not None:
        if given[-1] != total:
            raise ValueError(f"cu_seqlens must end at the sequence length {total}, got "
                             f"{given[-1]}")
        return given
    starts = sorted({0} | {sum(pieces[:r]) + s for r, i in enumerate(infos)
                           for s in i["doc_starts"]})
    if len(starts) == 1 and not any(i["doc_starts"] for i in infos):
        return None  # no position_ids: one sequence
    return tuple(starts) + (total,)


def _sample(logits: Tensor, temperature: float, top_k: Optional[int], generator) -> Tensor:
    """Next ids (b,) from last-position logits (b, v)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


__all__ = ["LongNetConfig", "LongNetLM", "LongNet", "IGNORE_INDEX"]
