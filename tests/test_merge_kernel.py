"""The Triton merge kernel (merge_kernel.py) in Triton's interpreter, against the eager merge.

The kernel is what ``merge.merge_`` runs on a GPU; here it runs on CPU tensors
(TRITON_INTERPRET=1 when the module is imported), so CI checks the same code:
exact to fp32 rounding against the eager chain and against float64, rows with
no keys (-inf) on either side, strided views, and the half-precision output
that is its own accumulator (policy.in_output), which must round once.
"""

from __future__ import annotations

import importlib
import math
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

from dilated_attention import dilated_attention, merge, policy

triton = pytest.importorskip("triton")

# fp32 rounding: a few units in the last place of the values merged (|out| ~ 1..4)
ULPS = 4 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def kernel():
    """merge_kernel imported (again, if need be) with TRITON_INTERPRET=1: interpreted. A
    module that was compiled for a GPU is compiled again afterwards, so that later tests
    in this process (tests/test_cuda.py) run the real kernel."""
    from dilated_attention import merge_kernel

    compiled = type(merge_kernel._merge_kernel).__name__ != "InterpretedFunction"
    if compiled:
        with mock.patch.dict("os.environ", {"TRITON_INTERPRET": "1"}):
            importlib.reload(merge_kernel)
    yield merge_kernel
    if compiled:
        with mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}):
            importlib.reload(merge_kernel)


def sides(shape, acc_dtype=torch.float32, out_dtype=torch.float32, seed=0):
    """(acc_out, acc_lse, out, lse) with rows of no keys: -inf on the accumulator side
    (out 0 there, as the identity holds), on the new side, and on both."""
    gen = torch.Generator().manual_seed(seed)
    acc_out = torch.randn(shape, generator=gen)
    acc_lse = 3 * torch.randn(shape[:-1], generator=gen)
    out = torch.randn(shape, generator=gen)
    lse = 3 * torch.randn(shape[:-1], generator=gen)
    rows = acc_lse.view(-1).numel()
    empty_acc = torch.arange(rows) % 5 == 0  # every 15th row: both sides empty
    empty_new = torch.arange(rows) % 3 == 0
    acc_lse.view(-1)[empty_acc] = -math.inf
    acc_out.view(-1, shape[-1])[empty_acc] = 0.0
    lse.view(-1)[empty_new] = -math.inf
    return acc_out.to(acc_dtype), acc_lse, out.to(out_dtype), lse


def reference(acc_out, acc_lse, out, lse):
    """The merge in float64: (out, lse)."""
    a, b = acc_lse.double(), lse.double()
    new = torch.logaddexp(a, b)
    safe = new.masked_fill(new == -math.inf, 0.0)
    merged = acc_out.double() * torch.exp(a - safe)[..., None] + \
        out.double() * torch.exp(b - safe)[..., None]
    return merged, new


def eager(acc_out, acc_lse, out, lse):
    """merge.merge_'s eager chain on copies (the kernel switched off)."""
    acc_out, acc_lse = acc_out.clone(), acc_lse.clone()
    with mock.patch.dict(merge.MERGE_KERNEL, {"cpu": False}):
        merge.merge_(acc_out, acc_lse, out, lse)
    return acc_out, acc_lse


def fused(kernel, acc_out, acc_lse, out, lse):
    acc_out, acc_lse = acc_out.clone(), acc_lse.clone()
    assert kernel.supports(acc_out, acc_lse, out, lse)
    kernel.merge_(acc_out, acc_lse, out, lse)
    return acc_out, acc_lse


@pytest.mark.parametrize("shape", [(37, 64), (2, 19, 3, 48), (2, 3, 11, 4, 72), (5, 1)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", ["cpu", "cuda", 128])
def test_kernel_matches_eager_merge(kernel, shape, out_dtype, block):
    """fp32 accumulators, any number of leading dims (up to 4), head dims that are not a
    power of two, a launch output in the input dtype; programs of the CPU's rows (one for
    these shapes), the GPU's (several, the last one partial), or a few rows each."""
    args = sides(shape, out_dtype=out_dtype)
    elements = kernel.BLOCK_ELEMENTS.get(block, block)
    with mock.patch.dict(kernel.BLOCK_ELEMENTS, {"cpu": elements}):
        got_out, got_lse = fused(kernel, *args)
    want_out, want_lse = eager(*args)
    ref_out, ref_lse = reference(*args)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any()
    assert_close(got_lse, want_lse, rtol=ULPS, atol=ULPS)
    assert_close(got_out, want_out, rtol=ULPS, atol=ULPS)
    assert_close(got_out.double(), ref_out, rtol=ULPS, atol=ULPS)
    assert_close(got_lse.double(), ref_lse, rtol=ULPS, atol=ULPS)
    # rows that no side has keys for stay the identity
    empty = torch.isinf(ref_lse)
    assert (got_out[empty] == 0).all() and (got_lse[empty] == -math.inf).all()


def test_kernel_exact_at_large_lse(kernel):
    """Both sides' lse near 200 (scores that large): out exact to fp32 rounding against
    float64, as the eager chain; weights taken against the rounded merged lse would scale
    each row by up to half an ulp of 200 (7.6e-6)."""
    acc_out, acc_lse, out, lse = sides((2, 19, 3, 48))
    args = (acc_out, acc_lse + 200, out, lse + 200)
    got_out, got_lse = fused(kernel, *args)
    ref_out, ref_lse = reference(*args)
    assert_close(got_out.double(), ref_out, rtol=ULPS, atol=ULPS)
    assert_close(got_lse.double(), ref_lse, rtol=ULPS, atol=0.0)
    assert_close(eager(*args)[0].double(), ref_out, rtol=ULPS, atol=ULPS)


def test_kernel_on_strided_views(kernel):
    """The accumulator as launches.merge_rows reads it: an as_strided view (b, segments,
    rows, heads, d) of every other row of a (b, n, h, d) tensor, heads of one offset."""
    acc_out, acc_lse, _, _ = sides((2, 32, 6, 16))
    _, _, out, lse = sides((2, 2, 8, 3, 16), seed=1)
    b, n, h, d = acc_out.shape

    def view(x):  # (b, n, h, ...) -> (b, 2, 8, 3, ...): rows 0, 2, ... of heads 0, 2, 4
        st = x.stride()
        return x.as_strided((b, 2, 8, 3) + x.shape[3:],
                            (st[0], 16 * st[1], 2 * st[1], 2 * st[2]) + st[3:])

    got_out, got_lse = acc_out.clone(), acc_lse.clone()
    kernel.merge_(view(got_out), view(got_lse), out, lse)
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    eager_out, eager_lse = eager(view(acc_out), view(acc_lse), out, lse)
    view(want_out).copy_(eager_out)
    view(want_lse).copy_(eager_lse)
    assert_close(got_out, want_out, rtol=ULPS, atol=ULPS)
    assert_close(got_lse, want_lse, rtol=ULPS, atol=ULPS)
    # entries outside the view are untouched
    untouched = torch.ones(b, n, h, dtype=torch.bool)
    view(untouched).fill_(False)
    assert torch.equal(got_out[untouched], acc_out[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_output_as_accumulator_rounds_once(kernel, dtype):
    """An output in half precision that is its own accumulator (policy.in_output): the
    merge is computed in fp32 and rounded once, so it is bit for bit the fp32 accumulator
    written out, and within one rounding of the eager chain's result."""
    acc_out, acc_lse, out, lse = sides((3, 40, 4, 64), out_dtype=dtype)
    first = acc_out.to(dtype)  # the first write landed exactly in the output
    in_output, lse_half = fused(kernel, first, acc_lse, out, lse)
    in_fp32, lse_fp32 = fused(kernel, first.float(), acc_lse, out, lse)
    assert in_output.dtype == dtype
    assert torch.equal(in_output, in_fp32.to(dtype))
    assert torch.equal(lse_half, lse_fp32)
    want, _ = eager(first, acc_lse, out, lse)
    # one rounding apart: a unit in the last place (of a subnormal, for tiny values)
    info = torch.finfo(dtype)
    assert_close(in_output.float(), want.float(), rtol=info.eps,
                 atol=info.smallest_normal * info.eps)


@pytest.mark.parametrize("strided", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_with_kernel_merges(kernel, strided, dtype):
    """The whole op with every merge in the kernel (views, gathered selections, a segment
    split over blocks): what the eager merges give, to fp32 rounding; in bf16 the output
    that accumulates in itself stays bit for bit the fp32 accumulators' result."""
    gen = torch.Generator().manual_seed(3)
    # (b, n, h, d); 16-row blocks: 8- and 16-row segments in whole blocks, 48-row segments
    # of rate 4 cut by block borders (fp32 accumulators there)
    q, k, v = (torch.randn(2, 64, 4, 16, generator=gen).to(dtype) for _ in range(3))
    segments, rates = [8, 16, 48], [1, 2, 4]

    def run(use_kernel, half_in_output=True):
        with mock.patch.dict(merge.MERGE_KERNEL, {"cpu": use_kernel}), \
                mock.patch.dict(policy.STRIDED_VIEWS, {"cpu": strided}), \
                mock.patch.dict(policy.ROWS_PER_BLOCK, {"cpu": 16}), \
                mock.patch.object(policy, "in_output", policy.in_output
                                  if half_in_output else lambda writes, dtype: False):
            return dilated_attention(q, k, v, segments, rates, return_lse=True)

    calls = []
    with mock.patch.object(kernel, "merge_", wraps=kernel.merge_) as spy:
        got_out, got_lse = run(True)
        calls = spy.call_count
    assert calls > 0
    want_out, want_lse = run(False)
    tol = ULPS if dtype == torch.float32 else torch.finfo(dtype).eps
    assert_close(got_out, want_out, rtol=tol, atol=tol)
    assert_close(got_lse, want_lse, rtol=ULPS, atol=ULPS)
    if dtype != torch.float32:
        fp32_out, fp32_lse = run(True, half_in_output=False)
        assert torch.equal(got_out, fp32_out) and torch.equal(got_lse, fp32_lse)


def test_eager_chain_where_the_kernel_does_not_apply(kernel):
    """float64 accumulators and shapes of more than 4 leading dims stay on the eager chain."""
    acc_out, acc_lse, out, lse = (x.double() for x in sides((7, 8)))
    assert not kernel.supports(acc_out, acc_lse, out, lse)
    acc = torch.zeros(1, 1, 1, 1, 2, 3)
    assert not kernel.supports(acc, torch.zeros(acc.shape[:-1]), acc, torch.zeros(acc.shape[:-1]))
    with mock.patch.dict(merge.MERGE_KERNEL, {"cpu": True}), \
            mock.patch.object(kernel, "merge_", side_effect=AssertionError("kernel called")):
        merge.merge_(acc_out, acc_lse, out, lse)
    assert_close(acc_out, reference(*(x.double() for x in sides((7, 8))))[0])


def test_half_output_rounds_ties_to_even(kernel) -> None:
    """Equal lse on both sides weighs each 1/2, and half the sum of two bf16 values is often
    halfway between two bf16 numbers: the in-output store rounds as torch does (to even),
    bit for bit the fp32 merge cast to bf16."""
    gen = torch.Generator().manual_seed(0)
    acc, new = (torch.randn(4096, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    zeros = torch.zeros(4096)
    in_fp32 = acc.float()
    kernel.merge_(in_fp32, zeros.clone(), new, zeros)
    in_out = acc.clone()
    kernel.merge_(in_out, zeros.clone(), new, zeros)
    assert torch.equal(in_out, in_fp32.to(torch.bfloat16))
    # the smallest tie: 1 and 1 + 2^-7 merge to 1 + 2^-8, which rounds to 1
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    kernel.merge_(one, torch.zeros(1), torch.full((1, 1), 1 + 2**-7, dtype=torch.bfloat16),
                  torch.zeros(1))
    assert one.item() == 1.0
