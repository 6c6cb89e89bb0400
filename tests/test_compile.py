"""The single-device op under torch.compile: one graph, no breaks, same results."""

import pytest
import torch

from dilated_attention import dilated_attention, recommended_dtype


@pytest.mark.parametrize("causal", [False, True])
def test_fullgraph_compile_matches_eager(causal: bool) -> None:
    """fullgraph=True raises on any graph break; outputs and gradients equal eager mode."""
    torch.manual_seed(0)
    # (b, n, h, d) with GQA, a tail segment and rates that do not divide h
    q = torch.randn(1, 300, 6, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 300, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 300, 2, 16, dtype=torch.float64, requires_grad=True)

    def attend(q, k, v):
        return dilated_attention(q, k, v, [64, 128], [1, 4], is_causal=causal, return_lse=True)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    out_c, lse_c = compiled(q, k, v)
    out_e, lse_e = attend(q, k, v)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    torch.testing.assert_close(lse_c, lse_e, rtol=0, atol=0)
    dout = torch.randn_like(out_e)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    grads_e = torch.autograd.grad(out_e, (q, k, v), dout)
    for got, want in zip(grads_c, grads_e):
        # the traced backward may sum dq over patterns in another order: fp64 rounding
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_recommended_dtype_off_cuda_is_float32() -> None:
    assert recommended_dtype("cpu") == torch.float32
    assert recommended_dtype(torch.device("meta")) == torch.float32
