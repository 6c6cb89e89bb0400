"""torch.nn modules over the dilated attention op.

Notation: b batch, n sequence, e embed dim, h query heads, hk key/value
heads, d = e // h head dim.

``DilatedAttention`` is the op as a module (q, k, v already split into
heads). ``MultiheadDilatedAttention`` takes ``nn.MultiheadAttention``'s forward
arguments (batch-first by default) for self-attention with a bool key padding
mask (its docstring lists the differences): input projections, dilated
attention, the MAGNETO "sub-LN" LayerNorm before the output projection (as
LongNet / torchscale do), output projection.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence, Tuple

import torch
import torch.types
from torch import Tensor, nn

from . import validation as check
from .functional import (GroupLike, autocast_dtype, check_group_type, dilated_attention,
                         fail_on_every_rank)
from .rotary import check_tables, rotate


def deepcopy_sharing_group(module: nn.Module, memo: dict) -> nn.Module:
    """`copy.deepcopy(module)` as nn.Module's (EMA copies, torch.optim.swa_utils.AveragedModel),
    except that the copy shares ``module.process_group``: a ProcessGroup cannot be copied,
    and the copy runs over the same ranks (as a deep-copied DDP module does). For the
    ``__deepcopy__`` of modules that hold a group."""
    if module.process_group is not None:
        memo.setdefault(id(module.process_group), module.process_group)
    copied = type(module).__new__(type(module))
    memo[id(module)] = copied
    copied.__setstate__(copy.deepcopy(module.__dict__, memo))
    return copied


class DilatedAttention(nn.Module):
    """Exact LongNet dilated attention over (b, n, h, d) inputs.

    Args:
        segment_lengths, dilation_rates: one (w, r) pair per pattern, r <= w.
        dropout: attention dropout probability, applied in training mode only.
        scale: softmax scale, default 1/sqrt(head_dim).
        process_group: sequence parallelism: a torch.distributed group or 1-D
            DeviceMesh (each rank passes its own contiguous piece of the
            sequence), or a 2-D DeviceMesh (head-parallel x sequence-parallel,
            see ``dilated_attention``). None runs locally.
        strategy: "auto", "exchange" or "ulysses" (see ``dilated_attention``).
        backend: the kernel, as for ``dilated_attention`` ("auto", or e.g.
            "triton" for every pattern in one fused kernel); checked against
            the inputs' device and dtype at each call.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        dropout: float = 0.0,
        scale: Optional[float] = None,
        process_group: GroupLike = None,
        strategy: str = "auto",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.segment_lengths, self.dilation_rates = check.check_patterns(
            segment_lengths, dilation_rates
        )
        self.dropout = check.check_dropout(dropout, "dropout")
        # head_dim is unknown until forward: validate with a dummy dim, keep the user's value
        if scale is not None:
            check.check_scale(scale, 1)
        self.scale = None if scale is None else float(scale)
        # its kind now (a wrong one was accepted until the first call named it "group")
        check_group_type(process_group, "process_group")
        self.process_group = process_group
        self.strategy = check.check_strategy(strategy)
        self.backend = check.check_backend(backend)

    def __deepcopy__(self, memo: dict) -> "DilatedAttention":
        return deepcopy_sharing_group(self, memo)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, *,
                key_padding_mask: Optional[Tensor] = None, cu_seqlens=None) -> Tensor:
        """q (b, n, h, d), k/v (b, n, hk, d) -> out (b, n, h, d).

        key_padding_mask (b, n) bool, True = ignore that key; cu_seqlens: packed
        document boundaries (see ``dilated_attention``).
        """
        return dilated_attention(
            q,
            k,
            v,
            self.segment_lengths,
            self.dilation_rates,
            is_causal=is_causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            group=self.process_group,
            key_padding_mask=key_padding_mask,
            cu_seqlens=cu_seqlens,
            strategy=self.strategy,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        parts = [
            f"segment_lengths={list(self.segment_lengths)}",
            f"dilation_rates={list(self.dilation_rates)}",
        ]
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.scale is not None:
            parts.append(f"scale={self.scale}")
        if self.process_group is not None:
            parts.append("process_group=<set>")
        if self.strategy != "auto":
            parts.append(f"strategy={self.strategy!r}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)


class MultiheadDilatedAttention(nn.Module):
    """Batch-first multi-head dilated attention, called as nn.MultiheadAttention is.

    ``forward(query, key, value)`` with (b, n, e) inputs returns ``(out, None)``
    like ``nn.MultiheadAttention(batch_first=True)`` with ``need_weights=False``;
    ``batch_first=False`` takes and returns (n, b, e), as torch's default.
    Keys and values project to ``num_kv_heads`` heads (GQA/MQA when fewer than
    ``num_heads``); the op broadcasts them without copies.

    The forward takes ``nn.MultiheadAttention``'s arguments in its order
    (``key_padding_mask``, ``need_weights``, ``attn_mask``, ``is_causal``), but
    it is not a replacement for it everywhere:

    - self-attention only: query, key and value of one shape, batched (3-D);
      no kdim/vdim, no unbatched (n, e) inputs;
    - ``key_padding_mask`` must be bool (True = ignore that key): float
      (additive) and integer masks are a TypeError;
    - an empty batch (0 rows) is a ValueError (nn.MultiheadAttention returns an empty
      output);
    - ``attn_mask`` is refused (the dilation patterns are the mask: use
      ``is_causal``, ``key_padding_mask`` or ``cu_seqlens``), and
      ``need_weights`` must be False (the default here);
    - separate q/k/v projections and the sub-LN: no ``in_proj_weight`` /
      ``in_proj_bias``, so an ``nn.MultiheadAttention`` state_dict does not
      load;
    - it is not a ``self_attn`` for torch's transformer layers:
      ``nn.TransformerEncoderLayer`` reads ``in_proj_bias`` on its evaluation
      fast path and passes ``src_key_padding_mask`` on as a float mask,
      ``nn.TransformerEncoder`` reads ``_qkv_same_embed_dim``, and both layer
      classes pass a causal mask as ``attn_mask``, each an error here.

    NOTE: MAGNETO (Wang et al., 2022, arXiv 2210.06423) as used by LongNet:
    a LayerNorm ("sub-LN") on the attention output before ``out_proj``, and
    xavier-normal initialisation with gain ``gamma_init`` on the value and
    output projections, gain 1 on query and key; biases zero. The models
    pass the MAGNETO gamma for their depth (e.g. sqrt(log(2 L)) for an
    L-layer decoder); the default 1.0 is plain xavier initialisation.

    Args:
        embed_dim: e, model width; divisible by num_heads.
        num_heads: h, query heads.
        segment_lengths, dilation_rates: the dilation patterns.
        num_kv_heads: hk, key/value heads, dividing num_heads (default h).
        dropout: attention dropout, training mode only.
        scale: softmax scale, default 1/sqrt(head_dim).
        bias: biases on the four projections.
        layer_norm: the MAGNETO sub-LN before out_proj (False omits it).
        layer_norm_eps: its epsilon.
        gamma_init: MAGNETO gain for v_proj and out_proj.
        device, dtype: for every parameter, like torch.nn.
        process_group, strategy: sequence parallelism (see DilatedAttention).
        backend: the attention kernel (see DilatedAttention).
        batch_first: inputs and output (b, n, e) (the default); False: (n, b, e),
            as ``nn.MultiheadAttention``'s default. key_padding_mask is (b, n) either way.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        num_kv_heads: Optional[int] = None,
        dropout: float = 0.0,
        scale: Optional[float] = None,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device: torch.types.Device = None,
        dtype: Optional[torch.dtype] = None,
        process_group: GroupLike = None,
        strategy: str = "auto",
        backend: str = "auto",
        batch_first: bool = True,
    ) -> None:
        super().__init__()
        embed_dim = check.check_positive_int("embed_dim", embed_dim)
        num_heads = check.check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        num_kv_heads = check.check_optional_positive_int("num_kv_heads", num_kv_heads)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        check.check_bool("bias", bias)
        check.check_bool("layer_norm", layer_norm)
        self.batch_first = check.check_bool("batch_first", batch_first)
        gamma_init = check.check_positive_float("gamma_init", gamma_init)
        layer_norm_eps = check.check_positive_float("layer_norm_eps", layer_norm_eps)
        check.check_module_dtype(dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = float(gamma_init)
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, dropout=dropout, scale=scale,
            process_group=process_group, strategy=strategy, backend=backend,
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """MAGNETO initialisation (see the class docstring)."""
        nn.init.xavier_normal_(self.q_proj.weight, gain=1.0)
        nn.init.xavier_normal_(self.k_proj.weight, gain=1.0)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    @property
    def segment_lengths(self) -> Tuple[int, ...]:
        return self.attention.segment_lengths

    @property
    def dilation_rates(self) -> Tuple[int, ...]:
        return self.attention.dilation_rates

    def project_qkv(
        self, query: Tensor, key: Tensor, value: Tensor,
        rotary: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """(b, n, e) inputs -> q (b, n, h, d), k and v (b, n, hk, d); q and k turned by the
        `rotary` tables when given."""
        if rotary is not None:
            check_tables(rotary, query.shape[0], query.shape[1], self.head_dim, query.device)
            # self-attention's key has query's rows; another key is checked on its own
            if key.shape[:2] != query.shape[:2]:
                check_tables(rotary, key.shape[0], key.shape[1], self.head_dim, key.device)
        return self._project_qkv(query, key, value, rotary)

    def _project_qkv(self, query: Tensor, key: Tensor, value: Tensor,
                     rotary: Optional[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor, Tensor]:
        """``project_qkv`` with the tables already checked (by forward or project_qkv)."""
        # (b, n, e) -> (b, n, h, d)
        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))
        # (b, n, e) -> (b, n, hk, d)
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        return q, k, v

    def project_out(self, attn: Tensor) -> Tensor:
        """Attention output (b, n, h, d) -> (b, n, e): sub-LN, then out_proj."""
        # (b, n, h, d) -> (b, n, e)
        x = attn.flatten(-2)
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cu_seqlens=None,
        rotary: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> Tuple[Tensor, None]:
        """query, key, value (b, n, e) -> (out (b, n, e), None); (n, b, e) each when not
        batch_first.

        The arguments come in ``nn.MultiheadAttention``'s order.
        key_padding_mask (b, n) bool: True = ignore that key. cu_seqlens:
        packed documents (see ``dilated_attention``). rotary: rotary
        position embeddings, the (cos, sin) that ``rotary_tables`` returns
        for the rows' positions (global ones under sequence parallelism),
        turning the projected queries and keys (Llama's convention). key and value must
        have query's length: dilated attention is self-attention over one
        sequence (positions define the segments). Attention weights are
        never materialised, so ``need_weights`` must be False (the default
        here, unlike ``nn.MultiheadAttention``), and an ``attn_mask`` is
        refused: dilated attention's pattern is its mask.
        """
        try:
            # bools, as is_causal: a None or 0 here is a mistake to name, not a False
            if check.check_bool("need_weights", need_weights):
                raise ValueError(
                    "need_weights=True is not supported: dilated attention never "
                    "materialises the attention weights; pass need_weights=False"
                )
            if attn_mask is not None:
                raise ValueError(
                    "attn_mask is not supported: the dilation patterns are the attention mask; "
                    "use is_causal, key_padding_mask or cu_seqlens"
                )
            check.check_bool("is_causal", is_causal)
            check.check_bool("average_attn_weights", average_attn_weights)
            self._check_inputs(query, key, value)
            if rotary is not None:
                batch, rows = (0, 1) if self.batch_first else (1, 0)
                check_tables(rotary, query.shape[batch], query.shape[rows], self.head_dim,
                             query.device)
        except (TypeError, ValueError) as error:
            # the other ranks wait in the op's agreement collective: fail there, on all of
            # them (with no process group this just raises `error`)
            fail_on_every_rank(self.attention.process_group, error)
        if not self.batch_first:
            # (n, b, e) -> (b, n, e): views, the op reads them strided
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        # the tables were checked above, once for q and k
        q, k, v = self._project_qkv(query, key, value, rotary)
        attn = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask,
                              cu_seqlens=cu_seqlens)
        out = self.project_out(attn)
        # (b, n, e) -> (n, b, e) when not batch_first
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        weight = self.q_proj.weight
        if weight.dtype not in check.FLOAT_DTYPES:
            # the constructor refuses such a dtype; .to(dtype) after it does not
            raise TypeError(f"the module's parameters are {weight.dtype} (after .to()?): "
                            f"dilated attention runs float64, float32, float16 or bfloat16")
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                layout = "batch, seq_len" if self.batch_first else "seq_len, batch"
                raise ValueError(
                    f"{name} must be ({layout}, embed_dim={self.embed_dim}), got shape "
                    f"{tuple(x.shape)}"
                )
            # checked here, not left to the projection: an error there would strike one
            # rank only while the others wait in the attention's collectives
            # under torch.autocast the projections cast both to autocast's dtype
            if x.dtype != weight.dtype and not (
                    autocast_dtype(weight.device.type, x.dtype)
                    and autocast_dtype(weight.device.type, weight.dtype)):
                raise TypeError(
                    f"{name} must have the module's dtype {weight.dtype}, got {x.dtype}"
                )
            if x.device != weight.device:
                raise ValueError(
                    f"{name} must be on the module's device {weight.device}, got {x.device}"
                )
        if not (query.shape == key.shape == value.shape):
            raise ValueError(
                f"query, key and value must have the same shape, got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        # named here: the op's error would name q and its projected (b, n, h, d) shape
        if query.shape[0 if self.batch_first else 1] == 0:
            layout = "batch, seq_len" if self.batch_first else "seq_len, batch"
            raise ValueError(f"query must have a non-empty batch ({layout}, embed_dim), got "
                             f"shape {tuple(query.shape)}")

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, gamma_init={self.gamma_init}"
            + ("" if self.batch_first else ", batch_first=False")
        )
