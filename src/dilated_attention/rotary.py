"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864): tables and rotation.

Notation: b batch, n rows, h heads, d head dim (even), i < d / 2 a frequency.

Llama's convention, which transformers' Llama and most checkpoints use: a head's
vector is two halves (x1, x2) = (x[:d/2], x[d/2:]), and position p turns the pair
(x1_i, x2_i) by the angle p * theta^(-2i/d):

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

With queries and keys both turned, a logit q_p . k_s depends on p - s alone, so
dilated attention with rotary positions sees relative positions as dense attention
does. The angles are computed in float64 (positions exact far beyond 2^24, where
float32 would round them), then the tables are cast to the rotated tensors' dtype.
The rotation holds no activation for backward (its gradient is the turn by the
opposite angles), only the tables; tables that take a gradient themselves (computed
from a learned quantity) get it, and then x is kept for backward.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from . import validation as check


def rotary_tables(positions: Tensor, head_dim: int, theta: float = 10000.0,
                  dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """(cos, sin) of the rotary angles at `positions` ((n,) or (b, n) integers; global
    positions under sequence parallelism): each (n, 1, d / 2) or (b, n, 1, d / 2) in
    `dtype`, broadcasting over the heads of q (b, n, h, d) and k (b, n, hk, d)."""
    if not isinstance(positions, Tensor) or positions.dim() not in (1, 2) or \
            positions.dtype.is_floating_point or positions.is_complex() or \
            positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor of shape (n,) or (b, n), got "
                        f"{_describe(positions)}")
    head_dim = _even(check.check_positive_int("head_dim", head_dim))
    theta = check.check_positive_float("theta", theta)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype for the tables, got {dtype!r}")
    # (d/2,) frequencies theta^(-2i/d), float64
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64,
                                          device=positions.device) / head_dim)
    # (..., n) positions -> (..., n, 1, d/2) angles: one row for every head
    angles = (positions.to(torch.float64)[..., None] * frequencies)[..., None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (b, n, h, d) (q or k in the ops' layout) turned by the tables of ``rotary_tables``
    for its n rows; differentiable in x, keeping only the tables for backward (and in the
    tables, keeping x, where they take a gradient)."""
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor (batch, seq_len, heads, head_dim), got "
                         f"{_describe(x)}")
    check_tables((cos, sin), x.shape[0], x.shape[1], x.shape[3], x.device)
    return rotate(x, cos, sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``apply_rotary`` without its checks: for a public entry that checked the tables once
    (``check_tables``) for every tensor it turns, as MultiheadDilatedAttention does for q
    and k."""
    return _Rotation.apply(x, cos, sin)


def _even(head_dim: int) -> int:
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary positions (pairs of halves), got "
                         f"{head_dim}")
    return head_dim


def check_tables(tables, batch: int, rows: int, head_dim: int, device: torch.device) -> None:
    """`tables` must be (cos, sin), each (rows, 1, d / 2) or (batch, rows, 1, d / 2) on
    `device`: a TypeError/ValueError naming ``rotary`` otherwise."""
    if not (isinstance(tables, (tuple, list)) and len(tables) == 2
            and all(isinstance(t, Tensor) for t in tables)):
        what = type(tables).__name__
        if isinstance(tables, (tuple, list)):  # which entry is not a tensor (apply_rotary's)
            what += f" of ({', '.join(type(t).__name__ for t in tables)})"
        raise TypeError(f"rotary must be a pair of tensors (cos, sin) from rotary_tables, got "
                        f"{what}")
    # an odd d splits into unequal halves: the turn would fail deep inside torch (tables for
    # d - 1 have the shape of d's)
    _even(head_dim)
    # a tuple, not a set: hashing a traced (symbolic) length would fix it to its value under
    # torch.compile, one graph per length
    shapes = ((rows, 1, head_dim // 2), (batch, rows, 1, head_dim // 2))
    for name, t in zip(("cos", "sin"), tables):
        if not t.is_floating_point():
            raise TypeError(f"rotary's {name} must be a floating tensor, got {_describe(t)}")
        # each shape compared with ==, not `in`: under torch.compile `in` answered False for
        # a static table beside a length marked dynamic, an error naming equal shapes
        if not any(tuple(t.shape) == shape for shape in shapes):
            raise ValueError(f"rotary's {name} must be of shape ({rows}, 1, {head_dim // 2}) "
                             f"or ({batch}, {rows}, 1, {head_dim // 2}) for {rows} rows of "
                             f"head_dim {head_dim}, got {_describe(t)}")
        if t.device != device:
            raise ValueError(f"rotary's {name} must be on {device}, got {t.device}")


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} of shape {tuple(x.shape)}"
    return type(x).__name__


def _turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(x1 cos - x2 sin, x2 cos + x1 sin) into a new tensor, halves written in place."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # (b, n, h, d) -> two (b, n, h, d/2) views
    x1, x2 = x.chunk(2, dim=-1)
    if torch.compiler.is_compiling():
        # the compiler fuses this into one kernel (and takes no out= into a strided half)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.empty_like(x)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out


class _Rotation(torch.autograd.Function):
    """The turn; its gradient is the turn of the output's gradient by the opposite angles.
    Tables that take a gradient (computed from a learned quantity) get theirs too, from x,
    which is kept for backward only then."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        tables_need = any(ctx.needs_input_grad[1:])
        ctx.save_for_backward(cos, sin, x if tables_need else None)
        return _turn(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin, x = ctx.saved_tensors
        # through the Function again, so that a double backward differentiates it
        dx = _Rotation.apply(grad, cos, -sin) if ctx.needs_input_grad[0] else None
        dcos = dsin = None
        if x is not None:
            # (b, n, h, d) -> halves (b, n, h, d/2): out1 = x1 cos - x2 sin,
            # out2 = x2 cos + x1 sin; summed over the heads (and the batch for (n, 1, d/2)
            # tables) down to the table's shape, in its dtype
            x1, x2 = x.chunk(2, dim=-1)
            g1, g2 = grad.chunk(2, dim=-1)
            dcos = _to_table(g1 * x1 + g2 * x2, cos) if ctx.needs_input_grad[1] else None
            dsin = _to_table(g2 * x1 - g1 * x2, sin) if ctx.needs_input_grad[2] else None
        return dx, dcos, dsin


def _to_table(g: Tensor, table: Tensor) -> Tensor:
    """(b, n, h, d/2) -> table's (n, 1, d/2) or (b, n, 1, d/2): summed over what it broadcast."""
    g = g.sum(dim=2, keepdim=True)
    if table.dim() == 3:
        g = g.sum(dim=0)
    return g.to(table.dtype)
