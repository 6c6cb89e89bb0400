"""The local kernels and the log-sum-exp merge against dense float64 attention.

Notation: b batch, n query rows, m key rows, h query heads, hk key/value
heads, d head dim; layout (b, n, h, d), kernel lse (b, n, h).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from dilated_attention.kernels import KernelOptions, attention_backward, attention_forward
from dilated_attention.merge import empty_accumulators, merge_
from reference import close, grads, reference_attention

CPU_BACKENDS = ("cpu_flash", "blockwise")

# (b, n, m, h, hk, d, causal): causal is the square lower triangle (n == m)
SHAPES = [
    (2, 7, 7, 4, 4, 8, True),
    (1, 13, 13, 6, 2, 4, True),  # GQA
    (2, 5, 9, 3, 1, 8, False),  # MQA, more keys than queries
    (1, 9, 3, 4, 2, 5, False),  # fewer keys than queries
    (1, 1, 1, 2, 1, 3, True),
    (1, 600, 600, 2, 1, 8, True),  # several blockwise tiles: diagonal tiles are partly masked
    (1, 530, 1100, 2, 2, 4, False),
]


def make(shape, dtype, seed=0):
    b, n, m, h, hk, d, causal = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = randn(b, n, h, d), randn(b, m, hk, d), randn(b, m, hk, d)
    return q, k, v, randn(b, n, h, d), randn(b, n, h)


def shape_id(shape) -> str:
    return "b{}-n{}-m{}-h{}-hk{}-d{}-causal{}".format(*shape)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["dout", "dout+dlse"])
def test_kernel_matches_dense_reference(shape, dtype, backend, with_dlse) -> None:
    causal = shape[-1]
    scale = 0.37
    q, k, v, dout, dlse = make(shape, dtype)
    out, lse = attention_forward(q, k, v, KernelOptions(causal, scale, backend))
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == q.shape[:3]

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, causal=causal, scale=scale)
    close(out, ref_out, dtype, "out")
    close(lse.transpose(1, 2), ref_lse, dtype, "lse")  # (b, n, h) -> (b, h, n)

    got = attention_backward(
        dout, q, k, v, out, lse, KernelOptions(causal, scale, backend),
        dlse=dlse if with_dlse else None,
    )
    upstream = [dout.double()] + ([dlse.double().transpose(1, 2)] if with_dlse else [])
    want = grads([ref_out, ref_lse][: len(upstream)], upstream, leaves)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        close(g, w, dtype, f"d{name}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merging_key_blocks_equals_attention_over_all_keys(dtype, backend) -> None:
    """Forward per key block + merge_ = attention over the union; each block's backward
    given the merged out/lse returns its share of the exact gradients."""
    shape = (2, 11, 17, 6, 3, 8, False)
    q, k, v, dout, dlse = make(shape, dtype, seed=1)
    blocks = [(0, 5), (5, 6), (6, 17)]
    acc_out, acc_lse = empty_accumulators(q.shape, dtype, q.device)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert acc_out.dtype == acc_lse.dtype == acc_dtype
    for k0, k1 in blocks:
        out_i, lse_i = attention_forward(
            q, k[:, k0:k1], v[:, k0:k1], KernelOptions(False, 0.5, backend)
        )
        merge_(acc_out, acc_lse, out_i, lse_i)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, causal=False, scale=0.5)
    close(acc_out, ref_out, dtype, "merged out")
    close(acc_lse.transpose(1, 2), ref_lse, dtype, "merged lse")

    out = acc_out.to(dtype)
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for k0, k1 in blocks:
        dq_i, dk_i, dv_i = attention_backward(
            dout, q, k[:, k0:k1], v[:, k0:k1], out, acc_lse, KernelOptions(False, 0.5, backend),
            dlse=dlse,
        )
        dq += dq_i
        dk.append(dk_i)
        dv.append(dv_i)
    want = grads([ref_out, ref_lse], [dout.double(), dlse.double().transpose(1, 2)], leaves)
    for name, g, w in zip("qkv", (dq, torch.cat(dk, 1), torch.cat(dv, 1)), want):
        close(g, w, dtype, f"d{name}")


def test_merge_rows_without_keys() -> None:
    """-inf on one side leaves the other side; -inf on both stays (0, -inf), never NaN."""
    acc_out, acc_lse = empty_accumulators((1, 3, 2, 4), torch.float32, "cpu")
    # (b, n, h, d): a block where row 0 has keys, rows 1 and 2 have none
    out_a = torch.randn(1, 3, 2, 4)
    lse_a = torch.tensor([[[0.5, -1.0], [-math.inf, -math.inf], [-math.inf, -math.inf]]])
    out_a[:, 1:] = 0.0
    merge_(acc_out, acc_lse, out_a, lse_a)
    assert_close(acc_out, out_a)
    assert_close(acc_lse, lse_a)
    # a second block giving row 1 (not row 2) some keys, and row 0 none
    out_b = torch.randn(1, 3, 2, 4)
    lse_b = torch.tensor([[[-math.inf, -math.inf], [2.0, 0.0], [-math.inf, -math.inf]]])
    out_b[:, 0] = 0.0
    out_b[:, 2] = 0.0
    merge_(acc_out, acc_lse, out_b, lse_b)
    assert not torch.isnan(acc_out).any() and not torch.isnan(acc_lse).any()
    assert_close(acc_out[:, 0], out_a[:, 0])
    assert_close(acc_out[:, 1], out_b[:, 1])
    assert (acc_out[:, 2] == 0).all()
    assert_close(acc_lse[:, :2], torch.tensor([[[0.5, -1.0], [2.0, 0.0]]]))
    assert (acc_lse[:, 2] == -math.inf).all()


def test_merge_is_exact_to_fp32_at_large_lse() -> None:
    """Partials whose lse is ~200 (scores that large, fp32): the merged out is their exact
    merge to a few ulps of out. The merged lse is rounded to half an ulp of 200 (7.6e-6, 64
    ulps of 1); weights taken against it would scale every merged row by that error."""
    gen = torch.Generator().manual_seed(0)
    # (rows, h, d) outputs and (rows, h) lse of two partials, in fp32
    outs = [torch.randn(64, 4, 32, generator=gen) for _ in range(2)]
    lses = [200 + torch.randn(64, 4, generator=gen) for _ in range(2)]
    acc_out, acc_lse = empty_accumulators((64, 4, 32), torch.float32, "cpu")
    for out_i, lse_i in zip(outs, lses):
        merge_(acc_out, acc_lse, out_i, lse_i)
    # the merge of the same fp32 values in float64
    lse = torch.logaddexp(*(x.double() for x in lses))
    want = sum(torch.exp(x.double() - lse)[..., None] * o.double() for o, x in zip(outs, lses))
    eps = torch.finfo(torch.float32).eps
    assert_close(acc_out.double(), want, rtol=4 * eps, atol=4 * eps)
    assert_close(acc_lse.double(), lse, rtol=eps, atol=0.0)


def test_merge_low_precision_blocks_into_fp32() -> None:
    """bf16 partial outputs merge into fp32 accumulators, in place."""
    q, k, v, _, _ = make((1, 6, 8, 2, 2, 4, False), torch.bfloat16, seed=2)
    acc_out, acc_lse = empty_accumulators(q.shape, q.dtype, q.device)
    assert acc_out.dtype == torch.float32
    for k0, k1 in [(0, 3), (3, 8)]:
        out_i, lse_i = attention_forward(q, k[:, k0:k1], v[:, k0:k1], KernelOptions(False, 0.5))
        merge_(acc_out, acc_lse, out_i, lse_i)
    ref_out, ref_lse = reference_attention(q, k, v, causal=False, scale=0.5)
    close(acc_out, ref_out, torch.bfloat16, "merged out")
    close(acc_lse.transpose(1, 2), ref_lse, torch.bfloat16, "merged lse")


@pytest.mark.parametrize("backend", ["cpu_flash", "blockwise"])
def test_head_dim_not_unit_stride_is_exact(backend: str) -> None:
    """The CPU flash op, called directly, is wrong when head_dim has stride != 1: we copy."""
    torch.manual_seed(0)
    # (b, n, h, d) values stored d-major, so the last dim has stride b * n * h
    q, k, v = (
        torch.randn(8, 2, 37, 3, dtype=torch.float64).permute(1, 2, 3, 0).requires_grad_()
        for _ in range(3)
    )
    assert q.stride(-1) != 1
    out, lse = attention_forward(q, k, v, KernelOptions(True, 0.3, backend))
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, scale=0.3)
    assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    # (b, h, n) -> (b, n, h)
    assert_close(lse, ref_lse.transpose(1, 2), rtol=1e-9, atol=1e-9)
    dout = torch.randn_like(ref_out)
    got = attention_backward(dout, q, k, v, out, lse, KernelOptions(True, 0.3, backend))
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.fixture
def default_dtype():
    """Set torch's default dtype for one test (`default_dtype(dtype)`); restored after it."""
    saved = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(saved)


def _dropout_factors(q: torch.Tensor, k: torch.Tensor, opts: KernelOptions) -> torch.Tensor:
    """(b, h, n, m): the factors the forward applied to each probability, read off the forward.

    With v the identity (d == m), out[b, i, h, j] is the dropped-and-scaled
    probability of key j, so dividing by the undropped probability gives the
    forward's own factor: 0 or 1 / (1 - p).
    """
    b, m, hk, d = k.shape
    assert d == m
    # (m, m) identity -> (b, m, hk, d): key j carries the unit vector e_j
    eye = torch.eye(m, dtype=k.dtype)[None, :, None, :].expand(b, m, hk, d)
    scaled, _ = attention_forward(q, k, eye, opts)
    probs, _ = reference_attention(q, k, eye, scale=opts.scale)
    # (b, n, h, m) -> (b, h, n, m)
    return (scaled / probs).transpose(1, 2)


@pytest.mark.parametrize("default", [torch.float32, torch.bfloat16, torch.float64])
def test_dropout_gradients_use_the_forward_mask_and_scale(default, default_dtype) -> None:
    """fp64 dropout gradients equal the reference with the forward's own mask, whatever
    torch's default dtype (the backward once scaled in the default dtype: 1e-3 off in bf16)."""
    p = 0.3
    q, k, v, dout, dlse = make((1, 8, 8, 4, 2, 8, False), torch.float64, seed=3)
    opts = KernelOptions(False, 0.4, "blockwise", dropout_p=p, seed=11)
    default_dtype(default)
    out, lse = attention_forward(q, k, v, opts)
    factors = _dropout_factors(q, k, opts)
    keep = factors * (1 - p)
    assert_close(keep, keep.round(), rtol=0, atol=1e-12)
    assert 0 < keep.round().mean() < 1
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, scale=0.4, dropout=factors)
    assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    got = attention_backward(dout, q, k, v, out, lse, opts, dlse=dlse)
    want = grads([ref_out, ref_lse], [dout, dlse.transpose(1, 2)], leaves)
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


def test_dropout_mask_does_not_depend_on_the_default_dtype(default_dtype) -> None:
    """The same seed drops the same scores under any default dtype (uniforms drawn in fp32)."""
    q, k, v, _, _ = make((1, 40, 40, 2, 2, 4, True), torch.float32, seed=4)
    opts = KernelOptions(True, 0.5, "blockwise", dropout_p=0.5, seed=5)
    want, _ = attention_forward(q, k, v, opts)
    for default in (torch.bfloat16, torch.float64):
        default_dtype(default)
        got, _ = attention_forward(q, k, v, opts)
        assert torch.equal(got, want), default


def test_dropout_streams_of_other_ranks_and_launches_differ() -> None:
    """Note [dropout streams]: the masks of another sequence rank (seed + 2^32), head-parallel
    rank (+ 2^48) or launch (+ 1) are other masks. A CPU generator keeps its seed's low 32
    bits, so a sum seeded every rank's masks alike; they each keep about 1 - p of the scores."""
    q, k, _, _, _ = make((1, 16, 16, 2, 2, 16, False), torch.float64, seed=6)
    seed = 12345
    masks = {}
    for offset in (0, 1, 1 << 32, 1 << 48, (1 << 48) + (1 << 32)):
        opts = KernelOptions(False, 0.5, "blockwise", dropout_p=0.5, seed=seed + offset)
        masks[offset] = (_dropout_factors(q, k, opts) > 0)
    for offset, keep in masks.items():
        assert 0.4 < keep.double().mean() < 0.6, offset
        for other, kept in masks.items():
            if other != offset:
                assert 0.35 < (keep != kept).double().mean() < 0.65, (offset, other)
