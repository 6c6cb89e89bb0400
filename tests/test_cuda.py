"""CUDA kernels against the fp64 reference (skipped without a GPU).

Run on an H100 (torch 2.11.0+cu130): 29 passed, 4 skipped (cuDNN and flash
take no float32). On a GPU machine:

    python -m pytest -q tests/test_cuda.py
"""

import pytest
import torch

from dilated_attention import dilated_attention, recommended_dtype, ring_attention
from reference import close, grads, reference_attention, reference_dilated_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HALF = (torch.float16, torch.bfloat16)


def _supported(backend: str, dtype: torch.dtype) -> bool:
    if backend == "cuda_flash":
        return dtype in HALF and torch.cuda.get_device_capability() >= (8, 0)
    if backend == "cuda_cudnn":
        return dtype in HALF and torch.cuda.get_device_capability() >= (9, 0)
    if dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    return True


def _inputs(n: int, h: int, hk: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # (b, n, h, d): the tested copy in `dtype` on the GPU, and the reference's
    # float64 copy of the SAME rounded values, so only the kernel's error counts
    dev = [
        torch.randn(2, n, heads, 64, generator=gen).to("cuda", dtype).requires_grad_()
        for heads in (h, hk, hk)
    ]
    ref = [x.detach().cpu().double().requires_grad_() for x in dev]
    return ref, dev


@pytest.mark.parametrize(
    "backend", ["auto", "cuda_cudnn", "cuda_flash", "cuda_efficient", "blockwise"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_on_cuda_matches_reference(backend, dtype, causal) -> None:
    if not _supported(backend, dtype):
        pytest.skip(f"{backend} does not run {dtype} on this GPU")
    # GQA, a tail segment, rates that do not divide the heads
    ref_in, dev_in = _inputs(1000, 6, 2, dtype)
    segs, rates = [128, 512, 2048], [1, 2, 3]
    out, lse = dilated_attention(
        *dev_in, segs, rates, is_causal=causal, return_lse=True, backend=backend
    )
    ref_out, ref_lse = reference_dilated_attention(*ref_in, segs, rates, causal=causal)
    close(out.cpu(), ref_out, dtype, "out")
    close(lse.cpu(), ref_lse, dtype, "lse")
    dout = torch.randn_like(ref_out)
    got = grads([out], [dout.to(out)], dev_in)
    want = grads([ref_out], [dout], ref_in)
    for name, g, w in zip("qkv", got, want):
        close(g.cpu(), w, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_at_one_rank_on_cuda_matches_reference(dtype) -> None:
    if not _supported("auto", dtype):
        pytest.skip(f"{dtype} not supported")
    ref_in, dev_in = _inputs(777, 4, 4, dtype, seed=1)
    out = ring_attention(*dev_in, is_causal=True)
    ref_out, _ = reference_attention(*ref_in, causal=True)
    close(out.cpu(), ref_out, dtype, "out")


@pytest.mark.parametrize("backend", ["auto", "blockwise"])
def test_float32_inputs_under_autocast_run_in_its_dtype(backend) -> None:
    """Under CUDA bf16 autocast, float32 inputs: the op on their bf16 roundings (the fused
    kernel for auto), bit for bit, forward and backward (tests/test_autocast.py on CPU)."""
    if not _supported(backend, torch.bfloat16):
        pytest.skip("bfloat16 not supported")
    _, dev_in = _inputs(777, 4, 2, torch.float32, seed=2)
    rounded = [x.detach().bfloat16().requires_grad_() for x in dev_in]
    call = dict(segment_lengths=[128, 256], dilation_rates=[1, 2], is_causal=True,
                backend=backend)
    want = dilated_attention(*rounded, **call)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, rounded, dout)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dilated_attention(*dev_in, **call)
        got_grads = torch.autograd.grad(out, dev_in, dout)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got, w in zip(got_grads, want_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, w.float(), rtol=0, atol=0)


def test_recommended_dtype_follows_compute_capability() -> None:
    capability = torch.cuda.get_device_capability()
    if capability >= (8, 0):
        assert recommended_dtype("cuda") == torch.bfloat16
    elif capability >= (7, 0):
        assert recommended_dtype("cuda") == torch.float16
    else:
        assert recommended_dtype("cuda") == torch.float32


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_kernel_on_cuda_matches_eager_merge(acc_dtype) -> None:
    """merge_ on CUDA runs the Triton kernel where triton is installed: exact to fp32
    rounding against the eager chain, rows with no keys included; a half-precision
    accumulator (the output itself) rounds once, as the fp32 accumulator written out."""
    triton = pytest.importorskip("triton")  # noqa: F841
    from unittest import mock

    from dilated_attention import merge, merge_kernel

    gen = torch.Generator().manual_seed(0)
    # (b, segments, rows, heads, d), a strided view: every other row of a (b, n, h, d) tensor
    acc_full = torch.randn(2, 512, 6, 64, generator=gen).cuda()
    lse_full = 3 * torch.randn(2, 512, 6, generator=gen).cuda()
    lse_full[:, ::7] = -float("inf")
    acc_full[:, ::7] = 0.0
    out = torch.randn(2, 4, 64, 6, 64, generator=gen).cuda().to(
        torch.float32 if acc_dtype == torch.float32 else acc_dtype)
    lse = 3 * torch.randn(2, 4, 64, 6, generator=gen).cuda()
    lse[:, :, ::5] = -float("inf")

    def view(x):  # (b, n, h, ...) -> (b, 4, 64, h, ...): rows 0, 2, ... of 128-row segments
        return x.unflatten(1, (4, 128))[:, :, ::2]

    results = []
    for use_kernel, dtype in ((True, acc_dtype), (False, acc_dtype), (True, torch.float32)):
        # the same values in each run: the fp32 run's accumulator holds the rounded ones
        acc, acc_lse = acc_full.to(acc_dtype).to(dtype).clone(), lse_full.clone()
        with mock.patch.dict(merge.MERGE_KERNEL, {"cuda": use_kernel}), \
                mock.patch.object(merge_kernel, "merge_", wraps=merge_kernel.merge_) as spy:
            merge.merge_(view(acc), view(acc_lse), out, lse)
        assert spy.called == use_kernel
        results.append((acc, acc_lse))
    (got, got_lse), (want, want_lse), (fp32, fp32_lse) = results
    assert not torch.isnan(got).any() and torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    ulps = 4 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got_lse, want_lse, rtol=ulps, atol=ulps)
    if acc_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=ulps, atol=ulps)
    else:
        assert torch.equal(got, fp32.to(acc_dtype))  # rounded once
        info = torch.finfo(acc_dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=info.eps,
                                   atol=info.smallest_normal * info.eps)
