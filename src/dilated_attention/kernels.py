"""Local attention kernels that return the log-sum-exp.

Every kernel here computes plain softmax attention between one block of
queries and one block of keys and returns ``(out, lse)``; the backward takes
the *final* (merged) ``out`` and ``lse`` so that a caller who merged several
blocks gets exact gradients without differentiating any kernel's lse.

Notation (used in every docstring and shape comment of the package):
    b: batch, n: query rows, m: key rows, h: query heads, hk: key/value heads,
    g = h // hk: query heads per key/value head, d: head dim.

Layout is ``(b, n, h, d)`` everywhere; ``lse`` is ``(b, n, h)`` in float32
(float64 for float64 inputs). ``causal=True`` means the square lower
triangle (n == m, query i sees keys 0..i); callers never need another mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import fused  # its tile tables (no triton: that is imported by its launches)
from .backends import select_backend

# Rows per block of the pure-PyTorch kernel: big enough to amortise Python
# overhead, small enough that a (b, hk, g, rows, rows) fp32 score block stays
# in the tens of MiB.
_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How every kernel launch of one call computes, as one value.

    causal: the op's causal flag (a launch over a key block that lies wholly
    before its queries runs unmasked: see `for_launch`); scale: the softmax
    scale; backend: a resolved name from backends.BACKENDS (not "auto" once a call is
    validated); dropout_p, seed: attention dropout, its masks drawn from
    `seed` plus the launch id so that backward replays them.
    """

    causal: bool
    scale: float
    backend: str = "auto"
    dropout_p: float = 0.0
    seed: int = 0

    def for_launch(self, launch: int, *, causal: Optional[bool] = None) -> "KernelOptions":
        """The options of launch number `launch` (its own dropout seed), maybe unmasked."""
        # not dataclasses.replace: one per launch, 1.3 us against the constructor's 0.7
        return KernelOptions(self.causal if causal is None else causal, self.scale,
                             self.backend, self.dropout_p, self.seed + launch)

    def for_rank(self, rank: int, *, head_parallel: bool = False) -> "KernelOptions":
        """The options of a rank's launches: its own dropout streams (Note [dropout streams]).
        head_parallel: `rank` is a head-parallel (Ulysses) rank, else a sequence rank."""
        stride = _HEAD_RANK_SEED_STRIDE if head_parallel else _SEQUENCE_RANK_SEED_STRIDE
        return dataclasses.replace(self, seed=self.seed + rank * stride)


# Note [dropout streams]
#     A call draws one seed (functional.dropout_seed, agreed over its ranks). Launch i of
#     sequence rank s under head-parallel rank u draws its masks from
#         seed + u * 2^48 + s * 2^32 + i
#     (KernelOptions.for_rank, for_launch), and score block (qi, ki) of the launch from a
#     generator seeded with a 64-bit hash of (that seed, qi, ki) (_block_seed): every bit
#     of the hash depends on every input, as it must, for a CPU generator keeps only its
#     seed's low 32 bits (a plain sum seeded every rank's masks alike). The streams stay
#     apart while a rank makes fewer than 2^32 launches per call and a head-parallel rank
#     has fewer than 2^16 sequence ranks. The fused kernel's launches (backend "triton")
#     take that seed as their Philox key (fused.launch_seed; Note [fused dropout]).
_SEQUENCE_RANK_SEED_STRIDE = 1 << 32
_HEAD_RANK_SEED_STRIDE = 1 << 48
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints in which each output bit depends
    on every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _block_seed(seed: int, qi: int, ki: int) -> int:
    """The generator seed of score block (qi, ki) of the launch seeded `seed`."""
    golden = 0x9E3779B97F4A7C15
    return _mix64((_mix64((_mix64(seed & _MASK64) + golden + qi) & _MASK64) + golden + ki)
                  & _MASK64)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps and merge accumulators for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def records_backward(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records the backward running now, through any of `tensors`: grad
    mode is on inside a backward only under create_graph=True (double backward)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def input_sums(*tensors: Tensor) -> Tensor:
    """The sum of each tensor (one dtype and device), in lse_dtype, as one vector on their
    device: one of them is a NaN or an infinity where a tensor holds one. One reduction per
    tensor and nothing else (the cheapest full read: 1.6x faster than aminmax on CPU,
    measured at 16K x 12 x 64 fp32, one thread: 9.5 against 15 ms): one launch per tensor on
    a GPU (the fused kernels check their inputs themselves: fused.new_check). A sum of
    finite entries that overflows (entries near the dtype's largest) also says non-finite,
    which costs the caller its exact path, never a wrong result."""
    sums = torch.empty(len(tensors), dtype=lse_dtype(tensors[0].dtype),
                       device=tensors[0].device)
    with torch.no_grad():  # an out= argument takes no autograd history
        for i, x in enumerate(tensors):
            torch.sum(x, dim=list(range(x.dim())), dtype=sums.dtype, out=sums[i])
    return sums


def _launch_backend(opts: KernelOptions, q: Tensor, masked: bool) -> str:
    """The kernel of one launch: the call's, chosen once by `select_backend` when the public op
    validated the call; "auto" (a caller that chose none, e.g. decoding) is resolved here."""
    if opts.backend != "auto":
        return opts.backend
    return select_backend(q.device, q.dtype, dropout_p=opts.dropout_p, masked=masked)


def _dense_dropout(opts: KernelOptions, device: torch.device) -> Optional[fused.Dropout]:
    """The fused kernel's dropout of one launch: one pattern under the launch's own seed
    (Note [dropout streams]), drawn again alike by its backward."""
    if opts.dropout_p == 0.0:
        return None
    return fused.Dropout.of(opts.dropout_p, 1, fused.launch_seed(opts.seed, device))


def attention_forward(q: Tensor, k: Tensor, v: Tensor, opts: KernelOptions, *,
                      key_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention of one block: q (b, n, h, d), k/v (b, m, hk, d).

    Returns ``out`` (b, n, h, d) in q's dtype and ``lse`` (b, n, h). Requires
    m >= 1, and n == m when causal. ``key_mask`` (b, m, hk) bool, True =
    ignore that key for the query heads of that kv head; a query left with
    no key gets out 0 and lse -inf.
    """
    causal, scale, dropout_p, seed = opts.causal, opts.scale, opts.dropout_p, opts.seed
    backend = _launch_backend(opts, q, key_mask is not None)
    if backend == "triton":
        # reads any strides in place
        return fused.dense_forward(q, k, v, causal=causal, scale=scale, key_mask=key_mask,
                                   dropout=_dense_dropout(opts, q.device))
    q, k, v = _unit_last_stride(q, k, v)
    if backend == "cpu_flash":
        # (b, n, h, d) -> (b, h, n, d): the op takes heads second, as a free view
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
            attn_mask=_additive_mask(key_mask, q), scale=scale,
        )
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
        if key_mask is not None:
            # the op returns lse 0 (and out 0) for a query that sees no key
            lse = lse.masked_fill(_no_keys(key_mask, q.shape[1], q.shape[2], causal), -math.inf)
        return out, lse
    if backend == "cuda_flash":
        k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
        )[:2]
        return out.transpose(1, 2), lse.transpose(1, 2)
    if backend == "cuda_cudnn":
        k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
            False, scale=scale,
        )[:2]
        # lse (b, h, n, 1) -> (b, n, h)
        return out.transpose(1, 2), lse.squeeze(-1).transpose(1, 2)
    if backend == "cuda_efficient":
        k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
            scale=scale,
        )[:2]
        # its lse is padded to a multiple of 32 rows
        return out.transpose(1, 2), lse[:, :, : q.shape[1]].transpose(1, 2)
    if backend == "flash_attn":
        from flash_attn.flash_attn_interface import _flash_attn_forward

        # flash-attn >= 2.7 keywords; it broadcasts K/V heads itself (GQA)
        out, lse = _flash_attn_forward(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
            window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        )[:2]
        # lse (b, h, n) -> (b, n, h)
        return out, lse.transpose(1, 2)
    return _blockwise_forward(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p, seed=seed,
                              key_mask=key_mask)


def _additive_mask(key_mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """key_mask (b, m, hk) -> (b, h, 1, m) in q's dtype: -inf where ignored, else 0."""
    if key_mask is None:
        return None
    h, hk = q.shape[2], key_mask.shape[2]
    # (b, m, hk) -> (b, hk, 1, m) -> (b, h, 1, m): query head j reads kv head j // (h // hk)
    mask = key_mask.permute(0, 2, 1).unsqueeze(2).repeat_interleave(h // hk, dim=1)
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask, -math.inf)


def _no_keys(key_mask: Tensor, n: int, h: int, causal: bool) -> Tensor:
    """(b, n, h) bool: the queries that see no unmasked key (key_mask (b, m, hk))."""
    visible = ~key_mask
    hk = key_mask.shape[2]
    if causal:
        # query i sees keys 0..i: none visible before the first visible key
        first = torch.where(visible.any(1), visible.int().argmax(1), key_mask.shape[1])  # (b, hk)
        none = torch.arange(n, device=key_mask.device)[None, :, None] < first[:, None, :]
    else:
        none = (~visible.any(1))[:, None, :].expand(-1, n, -1)
    # (b, n, hk) -> (b, n, h)
    return none.repeat_interleave(h // hk, dim=2)


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    opts: KernelOptions,
    *,
    dlse: Optional[Tensor] = None,
    key_mask: Optional[Tensor] = None,
    kv_grad: bool = True,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients (dq, dk, dv) of one block, given the final ``out``/``lse``.

    ``out`` and ``lse`` are the merged results of all blocks a query saw, so
    the softmax recomputed here is the global one restricted to this block.
    ``dlse`` (b, n, h), when given, is the gradient flowing into ``lse``;
    ``key_mask`` as for `attention_forward`. Without `kv_grad` (the caller drops dk and
    dv) the fused kernel computes dq alone (dk, dv None); the others compute all three.
    """
    causal, scale, dropout_p, seed = opts.causal, opts.scale, opts.dropout_p, opts.seed
    # Grad mode is on inside a backward only under create_graph=True (double backward): then
    # autograd records this computation, and only the pure-PyTorch kernel is built from ops
    # it can differentiate (the fused kernels' backward ops have no derivative). Any kernel's
    # backward computes the same gradients from the final out and lse, so the blockwise
    # kernel stands in for whichever kernel ran the forward.
    recorded = records_backward(dout, q, k, v, out, lse, dlse)
    backend = "blockwise" if recorded else _launch_backend(opts, q, key_mask is not None)
    if backend == "triton":
        return fused.dense_backward(dout, q, k, v, out, lse, dlse, causal=causal, scale=scale,
                                    key_mask=key_mask, dropout=_dense_dropout(opts, q.device),
                                    kv_grad=kv_grad)
    dout, q, k, v, out = _unit_last_stride(dout, q, k, v, out)
    if key_mask is not None:
        # a query that sees no key anywhere (lse -inf) has probabilities exp(s - inf) = 0
        lse = lse.masked_fill(lse == -math.inf, math.inf)
    if backend == "blockwise":
        return _blockwise_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, dropout_p=dropout_p, seed=seed,
            dlse=dlse, key_mask=key_mask,
        )
    if dlse is not None:
        # dS = P * (dP - delta + dlse): append a ones column to v and a dlse
        # column to dout (so dP gains + dlse), pass out with a zero column (so
        # delta is unchanged), pad q and k with zeros (scores unchanged). The
        # padding is a whole multiple of 8 columns: the CUDA kernels need an
        # aligned head dim.
        d = v.shape[-1]
        width = 8 - d % 8
        ones = torch.ones_like(v[..., :1])
        q, k = _pad_last(q, width), _pad_last(k, width)
        v = _pad_last(v, width, first=ones)
        out = _pad_last(out.to(q.dtype), width)
        dout = _pad_last(dout.to(q.dtype), width, first=dlse.unsqueeze(-1).to(q.dtype))
        dq, dk, dv = attention_backward(
            dout, q, k, v, out, lse, dataclasses.replace(opts, backend=backend), key_mask=key_mask
        )
        return dq[..., :d], dk[..., :d], dv[..., :d]
    out = out.to(q.dtype)
    dout = dout.to(q.dtype)
    if backend == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse.transpose(1, 2).to(lse_dtype(q.dtype)), 0.0, causal,
            attn_mask=_additive_mask(key_mask, q), scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if backend == "flash_attn":
        from flash_attn.flash_attn_interface import _flash_attn_backward

        # flash-attn broadcasts K/V heads itself (GQA): dk/dv come back per kv head. Its
        # default backward adds dq up with atomics (bits vary run to run); a caller who
        # asked torch for deterministic algorithms gets its deterministic one.
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            dout.contiguous(), q, k, v, out, lse.transpose(1, 2).float().contiguous(), dq, dk, dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
            window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return dq, dk, dv
    # The aten CUDA ops are called with equal head counts (their GQA support is
    # unverified here: no GPU yet); the repeat copies only this launch's
    # gathered K/V, never the caller's tensors.
    hk = k.shape[2]
    k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    b, n, h, _ = q.shape
    m = k.shape[1]
    if backend == "cuda_flash":
        # no cumulative sequence lengths (None: not a varlen call); the philox seed and
        # offset are read only with dropout, which this kernel is never called with
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse.transpose(1, 2).float().contiguous(), None, None, n, m,
            0.0, causal, unused, unused, scale=scale,
        )
    elif backend == "cuda_cudnn":
        # cuDNN reads out and dout in q's layout; philox seed/offset only with dropout
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        lse_bhn1 = lse.transpose(1, 2).float().unsqueeze(-1).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous().transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
            v.transpose(1, 2), out.contiguous().transpose(1, 2), lse_bhn1, unused, unused, None,
            None, None, n, m, 0.0, causal, scale=scale,
        )
    elif backend == "cuda_efficient":
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        # (b, n, h) -> (b, h, n) padded to a multiple of 32 rows, as the op expects
        lse_bhn = lse.transpose(1, 2).float()
        lse_bhn = torch.nn.functional.pad(lse_bhn, (0, (-n) % 32)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
            out.transpose(1, 2), lse_bhn, empty, empty, 0.0, [True, True, True, False], causal,
            scale=scale,
        )
    else:
        raise ValueError(f"unknown backend {backend!r}")
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    return dq.transpose(1, 2), _sum_kv_groups(dk, hk), _sum_kv_groups(dv, hk)


def _unit_last_stride(*xs: Tensor) -> Tuple[Tensor, ...]:
    """`xs` with head_dim stride 1: the fused kernels assume it.

    The CPU flash op (called directly, without SDPA's input checks) silently
    returns wrong results when the last dim is strided, e.g. for a view of a
    tensor stored head_dim-major. A copy is made only where needed.
    """
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _repeat_kv(x: Tensor, h: int) -> Tensor:
    """(b, m, hk, d) -> (b, m, h, d) for kernels without native GQA."""
    hk = x.shape[2]
    return x if hk == h else x.repeat_interleave(h // hk, dim=2)


def _sum_kv_groups(dx: Tensor, hk: int) -> Tensor:
    """(b, m, h, d) -> (b, m, hk, d): sum the gradients of repeated heads."""
    b, m, h, d = dx.shape
    return dx if h == hk else dx.view(b, m, hk, h // hk, d).sum(3)


def _pad_last(x: Tensor, width: int, first: Optional[Tensor] = None) -> Tensor:
    """(..., d) -> (..., d + width): zero columns, the first one `first` if given."""
    pad = torch.nn.functional.pad(x, (0, width))
    if first is not None:
        pad[..., x.shape[-1] : x.shape[-1] + 1] = first
    return pad


# --------------------------------------------------------------------------
# Pure-PyTorch blockwise kernel: any device, any float dtype, dropout.


def _dropout_scale(shape, p: float, seed: int, qi: int, ki: int, device,
                   dtype: torch.dtype) -> Tensor:
    """Score block (qi, ki)'s dropout factors in `dtype`: 0 where dropped, else 1 / (1 - p).

    Forward and backward both multiply by this one tensor, so they apply the
    same rounded scale. The uniforms are drawn in float32 whatever torch's
    default dtype is: under a half-precision default the keep rate would drift
    (bf16 uniforms are coarse) and the masks would change with the setting.
    """
    gen = None
    if torch.device(device).type != "meta":  # meta (estimate's dry runs) has no generator
        gen = torch.Generator(device=device)
        gen.manual_seed(_block_seed(seed, qi, ki))
    keep = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= p
    return keep.to(dtype) * (1.0 / (1.0 - p))


def _blocks(n: int):
    return [(s, min(s + _BLOCK, n)) for s in range(0, n, _BLOCK)]


def _heads_last_mask(key_mask: Optional[Tensor]) -> Optional[Tensor]:
    """key_mask (b, m, hk) -> (b, hk, 1, 1, m): broadcast over the g heads and query rows."""
    return None if key_mask is None else key_mask.permute(0, 2, 1)[:, :, None, None, :]


def autocast_dtype(device_type: str, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype torch.autocast, if on for `device_type`, casts a `dtype` tensor to before a
    matrix product or an attention; None where it is off or leaves `dtype` alone (float64,
    integers)."""
    # (checked every call: the cheap tests first, 0.2 us when autocast is off)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return None  # e.g. meta tensors: no autocast to ask about
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _without_autocast(kernel):
    """The blockwise kernel computes in its own accumulator dtype (``lse_dtype``) whatever
    torch.autocast is on around the call, the op's backward included: autocast would run
    its matrix products in half precision."""

    @functools.wraps(kernel)
    def run(first: Tensor, *args, **kwargs):
        kind = first.device.type
        if autocast_dtype(kind, first.dtype) is not None:
            with torch.autocast(kind, enabled=False):
                return kernel(first, *args, **kwargs)
        return kernel(first, *args, **kwargs)

    return run


@_without_autocast
def _blockwise_forward(q, k, v, *, causal, scale, dropout_p, seed, key_mask=None):
    b, n, h, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    g = h // hk
    acc = lse_dtype(q.dtype)
    # (b, n, h, d) -> (b, hk, g, n, d) so that K/V broadcast over the g heads
    qf = q.to(acc).unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)  # (b, hk, 1, m, d)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    mask = _heads_last_mask(key_mask)
    out = torch.empty(b, hk, g, n, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hk, g, n, dtype=acc, device=q.device)
    for qi, (q0, q1) in enumerate(_blocks(n)):
        row_max = torch.full((b, hk, g, q1 - q0, 1), -math.inf, dtype=acc, device=q.device)
        row_sum = torch.zeros_like(row_max)
        o = torch.zeros(b, hk, g, q1 - q0, d, dtype=acc, device=q.device)
        for ki, (k0, k1) in enumerate(_blocks(m)):
            if causal and k0 >= q1:
                break
            s = _block_scores(qf, kf, mask, (q0, q1), (k0, k1), causal=causal, scale=scale)
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            # a row with no key yet keeps max -inf: shift by 0 so exp gives 0, not NaN
            shift = new_max.masked_fill(new_max == -math.inf, 0.0)
            p = torch.exp(s - shift)
            correction = torch.exp(row_max - shift)
            row_sum = row_sum * correction + p.sum(-1, keepdim=True)
            if dropout_p > 0.0:
                p = p * _dropout_scale(p.shape, dropout_p, seed, qi, ki, q.device, acc)
            o = o * correction + p @ vf[:, :, :, k0:k1]
            row_max = new_max
        # a row with no key at all: out 0, lse -inf
        out[:, :, :, q0:q1] = o / row_sum.masked_fill(row_sum == 0, 1.0)
        lse[:, :, :, q0:q1] = (row_max + torch.log(row_sum)).squeeze(-1)
    # (b, hk, g, n, d) -> (b, n, h, d)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, n, h, d).to(q.dtype)
    return out, lse.permute(0, 3, 1, 2).reshape(b, n, h)


def _block_scores(qf: Tensor, kf: Tensor, mask: Optional[Tensor], rows: Tuple[int, int],
                  keys: Tuple[int, int], *, causal: bool, scale: float) -> Tensor:
    """Scaled logits of the query rows [q0, q1) against the keys [k0, k1), -inf where the
    causal bound or the key mask hides a key: (b, hk, g, q1 - q0, k1 - k0)."""
    (q0, q1), (k0, k1) = rows, keys
    s = (qf[:, :, :, q0:q1] @ kf[:, :, :, k0:k1].transpose(-1, -2)) * scale
    if causal and k1 > q0:
        s = s.masked_fill(_causal_mask(q0, q1, k0, k1, qf.device), -math.inf)
    if mask is not None:
        s = s.masked_fill(mask[..., k0:k1], -math.inf)
    return s


def _causal_mask(q0, q1, k0, k1, device) -> Tensor:
    rows = torch.arange(q0, q1, device=device).unsqueeze(1)
    cols = torch.arange(k0, k1, device=device).unsqueeze(0)
    return cols > rows


@_without_autocast
def _blockwise_backward(dout, q, k, v, out, lse, *, causal, scale, dropout_p, seed, dlse,
                        key_mask=None):
    b, n, h, d = q.shape
    m, hk = k.shape[1], k.shape[2]
    g = h // hk
    acc = lse_dtype(q.dtype)

    def heads_first(x):  # (b, n, h, d) -> (b, hk, g, n, d)
        return x.to(acc).unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)

    qf, of, dof = heads_first(q), heads_first(out), heads_first(dout)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)  # (b, hk, 1, m, d)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    # (b, n, h) -> (b, hk, g, n, 1)
    lsef = lse.to(acc).unflatten(2, (hk, g)).permute(0, 2, 3, 1).unsqueeze(-1)
    delta = (dof * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(acc).unflatten(2, (hk, g)).permute(0, 2, 3, 1).unsqueeze(-1)
    mask = _heads_last_mask(key_mask)
    dq = torch.zeros_like(qf)
    dk = torch.zeros(b, hk, m, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for qi, (q0, q1) in enumerate(_blocks(n)):
        for ki, (k0, k1) in enumerate(_blocks(m)):
            if causal and k0 >= q1:
                break
            s = _block_scores(qf, kf, mask, (q0, q1), (k0, k1), causal=causal, scale=scale)
            p = torch.exp(s - lsef[:, :, :, q0:q1])
            dp = dof[:, :, :, q0:q1] @ vf[:, :, :, k0:k1].transpose(-1, -2)
            if dropout_p > 0.0:
                keep = _dropout_scale(p.shape, dropout_p, seed, qi, ki, q.device, acc)
                dv[:, :, k0:k1] += ((p * keep).transpose(-1, -2) @ dof[:, :, :, q0:q1]).sum(2)
                dp = dp * keep
            else:
                dv[:, :, k0:k1] += (p.transpose(-1, -2) @ dof[:, :, :, q0:q1]).sum(2)
            ds = p * (dp - delta[:, :, :, q0:q1]) * scale
            dq[:, :, :, q0:q1] += ds @ kf[:, :, :, k0:k1]
            dk[:, :, k0:k1] += (ds.transpose(-1, -2) @ qf[:, :, :, q0:q1]).sum(2)
    # (b, hk, g, n, d) -> (b, n, h, d);  (b, hk, m, d) -> (b, m, hk, d)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, n, h, d).to(q.dtype)
    dk = dk.permute(0, 2, 1, 3).to(k.dtype)
    dv = dv.permute(0, 2, 1, 3).to(v.dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------
# The ops' thin autograd Functions share this: each saves q, k, v and its
# final (out, lse), and its backward reruns the op's launches with them.


def save_for_backward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, result: Tuple[Tensor, Tensor],
                      args: Any, *more: Tensor) -> Tuple[Tensor, Tensor]:
    """In an op's ``forward(ctx, ...)``: keep q, k, v, out, lse, `more` tensors and `args`;
    return (out, lse).

    Gradients are not materialised: backward gets None for an output that
    did not reach the loss (`saved_for_backward` turns a None ``dout`` into
    zeros; a None ``dlse`` means no lse term).
    """
    out, lse = result
    ctx.save_for_backward(q, k, v, out, lse, *more)
    ctx.args = args
    ctx.set_materialize_grads(False)
    return out, lse


def saved_for_backward(ctx: Any, dout: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """In an op's ``backward(ctx, dout, dlse)``: (dout, q, k, v, out, lse, *more), dout never
    None."""
    q, k, v, out, lse, *more = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return (dout, q, k, v, out, lse, *more)
