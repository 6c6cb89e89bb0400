"""backend="triton": the fused kernel against the float64 reference, and its errors.

On a machine without a GPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton),
which costs about a millisecond per block operation: the cases are small
(N <= 128, a few heads) and each checks out, lse and every gradient at once.
bf16 is not tested here: the interpreter's bf16 matrix products are wrong.

Notation: b batch, n rows, h query heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Tuple

import pytest
import torch

from dilated_attention import MultiheadDilatedAttention, dilated_attention, fused
from dilated_attention.backends import select_backend
from dilated_attention.patterns import Heads
from dist_harness import SharedSpawn
from reference import (attention_with_counts, close, dilated_counts, grads,
                       reference_window_attention)

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and no TRITON_INTERPRET (tests/conftest.py sets it)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    causal: bool
    h: int = 4
    hk: int = 2
    d: int = 8
    b: int = 1
    dtype: torch.dtype = torch.float32
    scale: Optional[float] = None
    cu_seqlens: Optional[Tuple[int, ...]] = None
    masked: bool = False
    with_lse: bool = True  # return_lse and an lse gradient; else out only
    seed: int = 0


CASES = {
    "longnet-gqa-causal": Case(64, (16, 32, 64), (1, 2, 4), True, b=2),
    "longnet-fp16": Case(64, (16, 32, 64), (1, 2, 4), False, d=16, dtype=torch.float16,
                         with_lse=False),
    "rates-without-1-mqa": Case(64, (8, 16), (2, 4), False, hk=1, with_lse=False),
    "duplicates-long-segment": Case(50, (10, 10, 200), (2, 2, 3), True, h=3, hk=3, d=5,
                                    scale=0.7),
    "lcm-not-power-of-two": Case(45, (9, 18, 30), (3, 6, 5), False, h=3, hk=1),
    # an extra of period 3 (rate 3 on rate 1's keys): the kernels' modulo by division
    "period-three-causal": Case(54, (18, 54), (1, 3), True, h=3, hk=3, with_lse=False),
    "documents-and-padding": Case(80, (8, 32), (1, 2), True, h=2, hk=1,
                                  cu_seqlens=(0, 20, 20, 57, 80), masked=True),
    "fp16-causal-documents": Case(48, (8, 16), (1, 2), True, d=16, dtype=torch.float16,
                                  cu_seqlens=(0, 30, 48)),
    "dense-multi-chunk": Case(128, (128,), (1,), True, h=2, hk=1),
    # spans whose only extra, a duplicate's, became times 2 beside spans with extras
    "duplicates-and-extras": Case(64, (8, 8, 32), (2, 2, 4), True),
    # classes of 48 and 16 rows per cell of 64: tiles of 32 rows, and of 16 in a launch apart
    "narrow-tiles": Case(192, (64, 128), (1, 4), True, h=2, hk=1, masked=True),
}


def inputs(case: Case):
    """q, k, v (leaves, case.dtype), dout (b, n, h, d), dlse (b, h, n), key padding mask."""
    gen = torch.Generator().manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(case.b, case.n, case.h, case.d)
    k, v = randn(case.b, case.n, case.hk, case.d), randn(case.b, case.n, case.hk, case.d)
    mask = None
    if case.masked:
        mask = torch.rand(case.b, case.n, generator=gen) < 0.3
        mask[:, 3:9] = True  # a run of ignored keys: some rows attend nothing at all
    leaves = [x.to(case.dtype).to(DEVICE).requires_grad_() for x in (q, k, v)]
    dout = randn(case.b, case.n, case.h, case.d).to(case.dtype).to(DEVICE)
    dlse = randn(case.b, case.h, case.n).to(DEVICE)
    return leaves, dout, dlse, None if mask is None else mask.to(DEVICE)


def reference(case: Case, leaves, mask, first_head: int = 0):
    """out (b, n, h, d), lse (b, h, n) in float64 and its inputs, from the count matrix."""
    q, k, v = (x.detach().cpu().double().requires_grad_() for x in leaves)
    counts = dilated_counts(case.n, case.h, case.segment_lengths, case.dilation_rates,
                            case.causal, case.cu_seqlens, first_head=first_head)
    if mask is not None:
        # (h, n, n) -> (b, h, n, n) with ignored key columns zeroed
        counts = counts[None].masked_fill(mask.cpu()[:, None, None, :], 0)
    out, lse = attention_with_counts(q, k, v, counts, case.scale)
    return (q, k, v), out, lse


def check(case: Case, attend) -> None:
    """`attend(q, k, v, mask) -> (out, lse (b, h, n) or None)` against the reference."""
    leaves, dout, dlse, mask = inputs(case)
    out, lse = attend(*leaves, mask)
    ref_leaves, ref_out, ref_lse = reference(case, leaves, mask)
    assert out.dtype == case.dtype and out.shape == leaves[0].shape
    close(out.cpu(), ref_out, case.dtype, "out")
    outputs, upstream, ref_outputs = [out], [dout], [ref_out]
    if lse is not None:
        assert lse.dtype == torch.float32
        close(lse.cpu(), ref_lse, case.dtype, "lse")
        outputs, upstream, ref_outputs = [out, lse], [dout, dlse], [ref_out, ref_lse]
    got = grads(outputs, upstream, leaves)
    want = grads(ref_outputs, [x.cpu().double() for x in upstream], ref_leaves)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == case.dtype, name
        close(g.cpu(), w, case.dtype, f"d{name}")


def op(case: Case, backend: str = "triton"):
    def attend(q, k, v, mask):
        result = dilated_attention(
            q, k, v, list(case.segment_lengths), list(case.dilation_rates),
            is_causal=case.causal, scale=case.scale, return_lse=case.with_lse,
            cu_seqlens=case.cu_seqlens, key_padding_mask=mask, backend=backend)
        return result if case.with_lse else (result, None)
    return attend


@pytest.mark.filterwarnings("ignore:dilated attention with segment_lengths")
@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name: str) -> None:
    check(CASES[name], op(CASES[name]))


@pytest.mark.parametrize("name", ["longnet-gqa-causal", "documents-and-padding",
                                  "period-three-causal", "lcm-not-power-of-two", "longnet-fp16",
                                  "duplicates-and-extras"])
def test_split_spans_match_reference(name: str, monkeypatch) -> None:
    """Every span with extras split into spans without (split_keys 1; Note [fused kernel],
    "Split spans"; times up to 3 in the first): the kernels, compiled without counts, take
    each piece's times on its logits (log2 times), in every kernel."""
    plan = fused.tile_plan
    monkeypatch.setattr(fused, "tile_plan",
                        lambda *args, **kwargs: plan(*args, **{**kwargs, "split_keys": 1}))
    check(CASES[name], op(CASES[name]))


def test_narrow_and_wide_launches_in_one_call(monkeypatch) -> None:
    """Note [fused kernel], "Narrow tiles": the tiles of 16 rows launch apart from the 32-row
    ones, in each kernel (dq's delta written by both before dK/dV reads it)."""
    case = CASES["narrow-tiles"]
    sizes = fused.TileSizes(*[fused.KernelTiles(32, 32, 4)] * 3)
    monkeypatch.setattr(fused, "tile_sizes", lambda device, dtype, head_dim, dropout=False: sizes)
    for kernel in KERNEL_ROLES:
        plan = fused.tile_plan(case.n, (case.segment_lengths, case.dilation_rates),
                               Heads.of(case.h, case.hk), case.hk, case.causal, None,
                               **sizes.plan(kernel))
        assert [height for height, _ in plan.heights] == [32, 16], kernel
    check(case, op(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots are wrong in the interpreter")
@pytest.mark.parametrize("name", ["longnet-gqa-causal", "documents-and-padding"])
def test_bfloat16_on_cuda(name: str) -> None:
    case = dataclasses.replace(CASES[name], dtype=torch.bfloat16, d=16)
    check(case, op(case))


def test_unread_rows_get_zeros_and_minus_inf() -> None:
    """Rows no pattern selects: tiles with no span write out 0 and lse -inf (no zero
    fill), and their gradients are 0."""
    case = Case(24, (8,), (4,), False, h=2, hk=1)
    leaves, _, _, _ = inputs(case)
    with pytest.warns(UserWarning, match="unread"):
        out, lse = op(case)(*leaves, None)
    empty = dilated_counts(case.n, case.h, (8,), (4,), False).sum(-1) == 0  # (h, n)
    assert empty.any()
    assert bool((out.detach().permute(0, 2, 1, 3)[:, empty.to(DEVICE)] == 0).all())
    assert bool((lse.detach()[:, empty.to(DEVICE)] == -math.inf).all())


def test_heads_of_a_ulysses_rank() -> None:
    """A head-parallel rank's slice of heads (offsets from model head 3, query heads
    reading key/value heads unevenly), through the single-device op that Ulysses runs."""
    from dilated_attention.dilated import dilated_attention_local
    from dilated_attention.kernels import KernelOptions

    case = Case(40, (8, 16), (2, 4), True, h=3, hk=2)
    heads = Heads(3, (1, 1, 0))
    leaves, dout, dlse, _ = inputs(case)
    out, lse = dilated_attention_local(*leaves, (case.segment_lengths, case.dilation_rates),
                                       KernelOptions(True, 0.35, "triton"), heads=heads)
    q, k, v = (x.detach().cpu().double().requires_grad_() for x in leaves)
    counts = dilated_counts(case.n, case.h, case.segment_lengths, case.dilation_rates, True,
                            first_head=3)
    # query head j reads kv head kv_of[j]: give the reference one kv head per query head
    kv = list(heads.kv_of)
    ref_out, ref_lse = attention_with_counts(q, k[:, :, kv], v[:, :, kv], counts, 0.35)
    close(out.cpu(), ref_out, case.dtype, "out")
    close(lse.transpose(1, 2).cpu(), ref_lse, case.dtype, "lse")
    got = grads([out, lse], [dout, dlse.transpose(1, 2)], leaves)
    want = grads([ref_out, ref_lse], [dout.cpu().double(), dlse.cpu()], [q, k, v])
    for name, g, w in zip("qkv", got, want):
        close(g.cpu(), w, case.dtype, f"d{name}")


def test_strided_inputs_are_read_in_place() -> None:
    """q, k, v sliced from one packed (b, n, 3, h, d) projection, and (b, h, n, d) storage
    seen as (b, n, h, d): the kernels read their strides, bit for bit what contiguous
    copies give, out, lse and the gradients."""
    case = Case(24, (8, 16), (1, 2), True, h=2, hk=2, b=2)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(case.b, case.n, 3, case.h, case.d, generator=gen).to(DEVICE)
    dout = torch.randn(case.b, case.n, case.h, case.d, generator=gen).to(DEVICE)

    def run(q, k, v):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = op(case)(*leaves, None)
        return (out, lse) + grads([out], [dout], leaves)

    packed = qkv.unbind(2)
    transposed = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in packed]
    want = run(*(x.contiguous() for x in packed))
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), run(*packed), want):
        assert torch.equal(got, w), name
    assert not packed[0].is_contiguous() and not transposed[0].is_contiguous()
    out, lse = op(case)(*transposed, None)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_module_matches_auto_backend() -> None:
    """MultiheadDilatedAttention(backend="triton") against backend="auto" with the same
    weights: outputs and every parameter's gradient."""
    torch.manual_seed(0)
    kwargs = dict(embed_dim=32, num_heads=4, segment_lengths=[8, 16], dilation_rates=[1, 2],
                  num_kv_heads=2, device=DEVICE)
    fused = MultiheadDilatedAttention(**kwargs, backend="triton")
    auto = MultiheadDilatedAttention(**kwargs)
    auto.load_state_dict(fused.state_dict())
    x = torch.randn(1, 37, 32, device=DEVICE)
    results = []
    for module in (fused, auto):
        out, _ = module(x, x, x, is_causal=True)
        out.square().sum().backward()
        results.append((out, {name: p.grad for name, p in module.named_parameters()}))
    (out_f, grads_f), (out_a, grads_a) = results
    torch.testing.assert_close(out_f, out_a, rtol=1e-5, atol=1e-5)
    for name, g in grads_f.items():
        torch.testing.assert_close(g, grads_a[name], rtol=1e-4, atol=1e-5, msg=name)
    assert "backend='triton'" in repr(fused)


def test_a_repeated_call_matches_the_reference_again() -> None:
    """A call's second time launches the compiled kernels that triton_launch kept from the
    first (on a GPU; interpreted kernels launch as they are): out, lse and every gradient
    match fp64 again."""
    case = CASES["documents-and-padding"]
    check(case, op(case))
    check(case, op(case))
    if torch.cuda.is_available():
        from dilated_attention import triton_kernels, triton_launch

        assert triton_launch.launcher(triton_kernels.fused_forward)._compiled


def test_double_backward() -> None:
    """create_graph=True: the forward runs the fused kernel, the recorded backward the
    blockwise launches (the fused backward has no derivative); both orders match fp64."""
    case = Case(16, (4, 8), (1, 2), True, h=2, hk=1)
    leaves, dout, _, _ = inputs(case)
    out = op(case)(*leaves, None)[0]
    first = torch.autograd.grad((out * dout).sum(), leaves, create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in first), leaves)
    ref_leaves, ref_out, _ = reference(case, leaves, None)
    ref_first = torch.autograd.grad((ref_out * dout.cpu().double()).sum(), ref_leaves,
                                    create_graph=True)
    ref_second = torch.autograd.grad(sum(g.square().sum() for g in ref_first), ref_leaves)
    for name, g, w in zip("qkvqkv", first + second, ref_first + ref_second):
        close(g.detach().cpu(), w.detach(), case.dtype, f"d{name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_a_training_step() -> None:
    """On one GPU the op reads nothing back (the non-finite check stays on the device), so
    torch.cuda.make_graphed_callables captures its forward and backward, and the replays
    equal eager calls bit for bit: the way to take the host's time out of short calls."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # (b, n, h, d), (b, n, hk, d)
    q = torch.randn(1, 500, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 500, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    dout = torch.randn_like(q)

    def attend(q, k, v):
        return dilated_attention(q, k, v, [128, 256], [1, 2], is_causal=True, backend="triton")

    leaves = [x.requires_grad_() for x in (q, k, v)]
    graphed = torch.cuda.make_graphed_callables(attend, tuple(leaves))
    for _ in range(2):  # the second replay reuses the graphs' memory
        for x in leaves:
            x.grad = None
        eager = attend(*leaves)
        eager.backward(dout)
        want = [eager.detach()] + [x.grad for x in leaves]
        for x in leaves:
            x.grad = None
        out = graphed(*leaves)
        out.backward(dout)
        for name, got, wanted in zip(("out", "dq", "dk", "dv"),
                                     [out.detach()] + [x.grad for x in leaves], want):
            assert torch.equal(got, wanted), name


# (tensor, row, head, element, value): a NaN and infinities of both signs in q, k and v
PLANTED = [("v", 5, 1, 2, math.nan), ("k", 17, 0, 1, math.inf), ("k", 30, 1, 0, -math.inf),
           ("q", 40, 2, 3, math.nan), ("v", 44, 0, 5, math.inf)]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
@pytest.mark.parametrize("causal,masked", [(True, False), (False, True)],
                         ids=["causal", "padding"])
def test_nonfinite_inputs_reach_exactly_the_rows_that_attend_them(causal, masked,
                                                                  monkeypatch) -> None:
    """The kernels apply docs/spec.md's non-finite rule themselves (the op reads nothing
    back: no device sync; their variant for the rule runs where a flag on the device says
    so). A NaN or an infinity in a k or v row gives NaN out (and, for k, NaN lse) to exactly
    the rows that attend it, whichever sign its logit has (a -inf logit would otherwise drop
    the key); a non-finite q row to its own row; every other row is exact. The gradients of
    rows and keys that no such row touches are exact too: a masked pair (causal, padding,
    past a span) carries no NaN into them."""
    from dilated_attention import functional

    def no_check(*tensors):
        raise AssertionError("the op read its inputs for non-finite numbers")

    monkeypatch.setattr(functional, "_all_finite", no_check)
    case = Case(64, (16, 32), (1, 2), causal, h=4, hk=2, masked=masked)
    leaves, dout, dlse, mask = inputs(case)
    planted = {"q": leaves[0], "k": leaves[1], "v": leaves[2]}
    with torch.no_grad():
        for name, row, head, element, value in PLANTED:
            planted[name][0, row, head, element] = value
    if masked:
        mask[0, 44] = True  # the infinite value row is ignored: it reaches no row
    out, lse = op(case)(*leaves, mask)

    counts = dilated_counts(case.n, case.h, case.segment_lengths, case.dilation_rates, causal)
    if masked:
        counts = counts.masked_fill(mask[0].cpu()[None, None, :], 0)
    kv_of = torch.tensor(Heads.of(case.h, case.hk).kv_of)

    def rows_reading(name):  # (n, h): the rows whose attention reads a planted `name` row
        hits = torch.zeros(case.n, case.h, dtype=torch.bool)
        for planted_name, row, head, _, _ in PLANTED:
            if planted_name == name:
                hits |= (counts[:, :, row] > 0).T & (kv_of == head)[None, :]
        return hits

    bad_q = torch.zeros(case.n, case.h, dtype=torch.bool)
    bad_q[40, 2] = True
    nan_lse = bad_q | rows_reading("k")
    nan_out = nan_lse | rows_reading("v")
    assert nan_out.any() and not nan_out.all()
    got_out = out.detach()[0].cpu()  # (n, h, d)
    assert torch.equal(torch.isnan(got_out).all(-1), nan_out)
    assert torch.equal(torch.isnan(got_out).any(-1), nan_out)
    assert torch.equal(torch.isnan(lse.detach()[0].cpu()).T, nan_lse)

    # the rest against the reference on inputs whose planted rows are zeroed
    clean = [torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0, neginf=0.0).requires_grad_()
             for x in leaves]
    ref_leaves, ref_out, ref_lse = reference(case, clean, mask)
    fine = ~nan_out
    close(got_out[fine], ref_out[0][fine], case.dtype, "out")
    close(lse.detach()[0].cpu().T[~nan_lse], ref_lse[0].T[~nan_lse], case.dtype, "lse")
    got = grads([out, lse], [dout, dlse], leaves)
    want = grads([ref_out, ref_lse], [dout.cpu().double(), dlse.cpu()], ref_leaves)
    # keys (n, hk) that no NaN row attends
    touched = torch.zeros(case.n, case.hk, dtype=torch.bool)
    for head in range(case.h):
        touched[:, kv_of[head]] |= (counts[head][nan_out[:, head]] > 0).any(0)
    assert not touched.all()
    close(got[0][0].cpu()[fine], want[0][0][fine], case.dtype, "dq")
    for name, g, w in zip("kv", got[1:], want[1:]):
        close(g[0].cpu()[~touched], w[0][~touched], case.dtype, f"d{name}")


# (tensor, batch row, row, head, element, value); rows 2, 3 mod 4 are keys that no query
# attends (one head per offset of rate 4)
FLAGGED = [("q", 0, 0, 0, 0, math.nan), ("q", 1, 37, 1, 11, -math.inf),
           ("k", 1, 6, 1, 3, math.inf), ("k", 0, 39, 0, 11, math.nan),
           ("v", 1, 0, 0, 0, -math.inf), ("v", 0, 22, 1, 5, math.nan)]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
def test_the_nonfinite_check_is_set_by_every_nonfinite_input_the_kernels_read() -> None:
    """The check that the single-device op hands the kernels' variants for the non-finite
    rule (left on the device, never read back): a 0, which the plain forward makes NaN
    where a q row, an out it writes or a row of k is not finite. A NaN or an infinity
    anywhere in q or k sets it (any batch row, row, head or element, a key row no query attends
    included), and in v wherever a program loads the row; a value row that no program
    loads leaves it finite and the result bit for bit that of finite inputs. Finite inputs
    leave it finite."""
    from dilated_attention import dilated

    gen = torch.Generator().manual_seed(3)
    # (b, n, h, d), (b, n, hk, d): 40 rows, d 12 (padded to 16 in the kernels)
    q = torch.randn(2, 40, 2, 12, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 40, 2, 12, generator=gen).to(DEVICE) for _ in range(2))

    def run(q, k, v):
        return dilated.forward_flat(q, k, v, [8], [4], False, 0.3, "triton", 0.0, 0, 0, [0, 1],
                                    None, None, None, True)

    out, lse, check = run(q, k, v)
    assert bool(torch.isfinite(check).all())
    for name, b, row, head, element, value in FLAGGED:
        planted = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        planted[name][b, row, head, element] = value
        got_out, got_lse, got_check = run(planted["q"], planted["k"], planted["v"])
        unread = name == "v" and row % 4 >= 2
        assert bool(torch.isfinite(got_check).all()) == unread, (name, b, row, head, element)
        if unread:
            assert torch.equal(got_out, out) and torch.equal(got_lse, lse)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
def test_the_check_reads_all_of_k_when_tiles_launch_at_two_heights() -> None:
    """The programs of the forward's first launch share k's rows for the check: with tiles
    launched at two heights (32 and 16 rows) a NaN in a row of k that no query attends (rows
    2, 3 mod 4: both patterns have rate 4, and the two heads offsets 0 and 1), so that no
    out shows it, still sets it, in any head or batch row; finite inputs leave it finite."""
    from dilated_attention import dilated

    gen = torch.Generator().manual_seed(5)
    # (b, n, h, d), (b, n, hk, d)
    q = torch.randn(2, 100, 2, 12, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 100, 2, 12, generator=gen).to(DEVICE) for _ in range(2))
    patterns = ((32, 64), (4, 4))
    plan = fused._planner(q, k, patterns, False, Heads.of(2, 2), None, None)(
        **fused.tile_sizes(q.device, q.dtype, 12).plan("forward"))
    assert len(plan.launches()) == 2

    def check(k):
        return dilated.forward_flat(q, k, v, list(patterns[0]), list(patterns[1]), False, 0.3,
                                    "triton", 0.0, 0, 0, [0, 1], None, None, None, True)[2]

    assert bool(torch.isfinite(check(k)).all())
    for b, row, head in ((0, 2, 0), (1, 59, 1), (1, 99, 0), (0, 62, 1)):
        planted = k.clone()
        planted[b, row, head, 7] = math.nan
        assert not bool(torch.isfinite(check(planted)).all()), (b, row, head)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
def test_a_key_whose_logits_are_all_minus_inf_still_gives_nan() -> None:
    """A key row with a -inf element whose every query has a positive weight there: its
    logits are all -inf, so the plain kernel drops it and writes finite outs; the check (its
    programs read every row of k) still sends the rule's variant, which gives every query
    that attends it NaN."""
    case = Case(32, (8, 16), (1, 2), False, h=2, hk=1)
    leaves, _, _, mask = inputs(case)
    with torch.no_grad():
        q, k, _ = leaves
        q[..., 0] = q[..., 0].abs() + 0.5
        k[0, 5, 0, 0] = -math.inf
    out, lse = op(case)(*leaves, mask)
    counts = dilated_counts(case.n, case.h, case.segment_lengths, case.dilation_rates, False)
    attends = (counts[:, :, 5] > 0).T  # (n, h)
    assert attends.any() and not attends.all()
    assert torch.equal(torch.isnan(lse.detach()[0].cpu()).T, attends)
    assert torch.equal(torch.isnan(out.detach()[0].cpu()).all(-1), attends)


class _Skipped:
    """A kernel's launcher that launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _DqIntoScratch:
    """The plain dq kernel's launcher, its dq (argument 8) written into a scratch tensor."""

    def __init__(self, launch):
        self.launch = launch

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            args = args[:8] + (torch.empty_like(args[8]),) + args[9:]
            self.launch[grid](*args, **kwargs)
        return run


# two launch heights (32 and 16 rows) in one or two batch rows; padding, documents and
# extras of period 3
RULE_ALONE_CASES = {"narrow-tiles-b1": dataclasses.replace(CASES["narrow-tiles"], masked=False),
                    "narrow-tiles-b2": dataclasses.replace(CASES["narrow-tiles"], masked=False,
                                                           b=2),
                    "documents-and-padding": dataclasses.replace(CASES["documents-and-padding"],
                                                                 b=2),
                    "lcm-not-power-of-two": CASES["lcm-not-power-of-two"]}


@pytest.mark.parametrize("name", RULE_ALONE_CASES)
def test_the_rules_variants_alone_compute_every_tile(name, monkeypatch) -> None:
    """The kernels for the non-finite rule launch a few programs that each take every so
    many tiles (TileSizes.rule_programs: 2 per batch row in the interpreter), not one per
    tile, every launch height at the widest. Launched alone, with the check already NaN, on
    finite inputs (where the rule changes nothing) into outputs filled with NaN: out, lse
    and every gradient equal the reference, so no tile, launch height or batch row is left
    out. Alone: no plain forward nor dK/dV, and the plain dq only for the delta the rule's
    kernel reads (its dq into a scratch tensor)."""
    case = RULE_ALONE_CASES[name]
    leaves, dout, dlse, mask = inputs(case)
    q, k, v = (x.detach() for x in leaves)
    patterns = (case.segment_lengths, case.dilation_rates)
    heads = Heads.of(case.h, case.hk)
    if name.startswith("narrow-tiles"):
        plan = fused._planner(q, k, patterns, case.causal, heads, None, None)(
            **fused.tile_sizes(q.device, q.dtype, case.d).plan("forward"))
        assert {height for _, height in plan.launches()} == {32, 16}
    from dilated_attention import triton_kernels, triton_launch

    rule_last, launcher = fused._rule_last, triton_launch.launcher
    # no recipe of an earlier call (a GPU's compiled kernels) may replay the plain launches
    triton_launch.forget()
    monkeypatch.setattr(fused, "_rule_last", lambda *args: rule_last(*args)[1:])
    monkeypatch.setattr(triton_launch, "launcher", lambda kernel: (
        _Skipped() if kernel is triton_kernels.fused_dkdv
        else _DqIntoScratch(launcher(kernel)) if kernel is triton_kernels.fused_dq
        else launcher(kernel)))
    check = fused.new_check(q.device).fill_(math.nan)
    kw = dict(causal=case.causal, scale=case.scale or case.d ** -0.5, heads=heads,
              documents=case.cu_seqlens, key_mask=mask, nonfinite=check)
    out, lse = fused.forward(q, k, v, patterns, **kw,
                             into=(torch.full_like(q, math.nan),
                                   torch.full(q.shape[:3], math.nan, device=q.device)))
    dlse_rows = dlse.transpose(1, 2)  # (b, h, n) -> (b, n, h)
    dq, dk, dv = fused.backward(dout, q, k, v, out, lse, dlse_rows, patterns, **kw,
                                into=tuple(torch.full_like(x, math.nan) for x in (q, k, v)))
    ref_leaves, ref_out, ref_lse = reference(case, leaves, mask)
    close(out.cpu(), ref_out, case.dtype, "out")
    close(lse.cpu().transpose(1, 2), ref_lse, case.dtype, "lse")
    want = grads([ref_out, ref_lse], [dout.cpu().double(), dlse.cpu()], ref_leaves)
    for what, got, wanted in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        close(got.cpu(), wanted, case.dtype, what)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, in the interpreter
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-query"])
def test_frozen_keys_and_values_launch_no_dkdv_kernel(nonfinite, monkeypatch) -> None:
    """k and v that require no gradient (frozen): the backward computes dq alone, equal to
    the reference's, with no dK/dV launch; with a NaN in q (the non-finite rule's kernel
    runs) that kernel visits no key tile, and dq is NaN at that row alone."""
    from dilated_attention import triton_kernels, triton_launch

    case = CASES["documents-and-padding"]
    leaves, dout, dlse, mask = inputs(case)
    q, k, v = leaves[0], leaves[1].detach(), leaves[2].detach()
    if nonfinite:
        with torch.no_grad():
            q[0, 40, 1, 3] = math.nan
    launched = []
    real = triton_launch.launcher

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(self.kernel)
            return real(self.kernel)[grid]

    triton_launch.forget()  # no recipe replays launches past the count
    monkeypatch.setattr(triton_launch, "launcher", Counted)
    out, lse = op(case)(q, k, v, mask)
    before = len(launched)
    (dq,) = torch.autograd.grad([out, lse], [q], [dout, dlse])
    backward = launched[before:]
    assert triton_kernels.fused_dq in backward and triton_kernels.fused_dkdv not in backward
    assert backward.count(triton_kernels.fused_backward_rule) == 1  # finite: it returns early

    clean = [torch.nan_to_num(x.detach(), nan=0.0).requires_grad_() for x in (q, k, v)]
    ref_leaves, ref_out, ref_lse = reference(case, clean, mask)
    (want,) = grads([ref_out, ref_lse], [dout.cpu().double(), dlse.cpu()], ref_leaves[:1])
    rows = torch.ones(case.n, case.h, dtype=torch.bool)
    if nonfinite:
        rows[40, 1] = False
        assert torch.isnan(dq[0, 40, 1]).all()
    close(dq[0].cpu()[rows], want[0][rows], case.dtype, "dq")


# the interpreter computes the overflowing logits in numpy, which warns about them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_query_whose_logits_all_overflow_adds_nothing_to_the_keys() -> None:
    """Finite fp32 inputs whose products overflow: every logit of query 3 is -inf, so it
    attends nothing (out 0, lse -inf) and gives its keys no gradient: dK/dV stay those of the
    other queries, finite (no -inf - -inf in its chunks, masked or not). The other queries
    read none of the huge key column: logits of 1e30 would overflow exp2 on a GPU, where
    the backward's fused multiply-add differs from the forward's max by half an ulp (~1e23)."""
    # one segment of 64 rows: the interpreter's chunks of 32 queries are whole, unmasked
    case = Case(64, (64, 16), (1, 2), False, h=2, hk=1, d=4, with_lse=False)
    leaves, dout, _, _ = inputs(case)
    with torch.no_grad():
        q, k, _ = leaves
        q[..., 0] = 0.0
        q[0, 3] = 0.0
        q[0, 3, :, 0] = 1e30
        k[..., 0] = -(k[..., 0].abs() + 1.0) * 1e30
    out, _ = op(case)(*leaves, None)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert torch.equal(out.detach()[0, 3], torch.zeros_like(out[0, 3]))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), name
    # query 3 adds nothing: the same gradients with its dout zeroed
    dout_without = dout.clone()
    dout_without[0, 3] = 0.0
    _, dk_without, dv_without = torch.autograd.grad(op(case)(*leaves, None)[0], leaves,
                                                    dout_without)
    assert torch.equal(dv, dv_without)


PIECES = [  # (case, first row, rows of the piece)
    (Case(64, (16, 32, 64), (1, 2, 4), True, b=2), 20, 30),
    (Case(80, (8, 32), (1, 2), True, h=2, hk=1, cu_seqlens=(0, 20, 20, 57, 80), masked=True),
     17, 50),
    (Case(64, (16, 32), (1, 2), False, d=16, dtype=torch.float16), 40, 24),
]


@pytest.mark.parametrize("case,first,rows", PIECES, ids=["causal-gqa", "documents-padding",
                                                         "fp16"])
def test_a_piece_computes_its_own_pairs(case, first, rows) -> None:
    """fused.forward/backward with a piece (a sequence-parallel rank's rows [first, first +
    rows) of the sequence): out, lse and the gradients of the piece's rows against its own
    keys only, segments and documents those of the whole sequence; one device, so that a GPU
    runs it compiled (the sequence-parallel tests need gloo ranks on CPU tensors)."""
    leaves, dout, dlse, mask = inputs(case)
    lo, hi = first, first + rows
    q, k, v = (x.detach()[:, lo:hi].requires_grad_() for x in leaves)
    heads = Heads.of(case.h, case.hk)
    piece_mask = None if mask is None else mask[:, lo:hi]
    options = dict(causal=case.causal, scale=case.scale or case.d ** -0.5, heads=heads,
                   documents=case.cu_seqlens, key_mask=piece_mask, piece=(first, case.n))
    patterns = (case.segment_lengths, case.dilation_rates)
    out, lse = fused.forward(q, k, v, patterns, **options)
    # (b, h, n) -> (b, n, h) upstream lse gradient of the piece's rows
    dlse_rows = dlse[:, :, lo:hi].transpose(1, 2).contiguous()
    dq, dk, dv = fused.backward(dout[:, lo:hi], q, k, v, out, lse, dlse_rows, patterns,
                                **options)
    counts = dilated_counts(case.n, case.h, case.segment_lengths, case.dilation_rates,
                            case.causal, case.cu_seqlens)[:, lo:hi, lo:hi]
    if piece_mask is not None:
        counts = counts[None].masked_fill(piece_mask.cpu()[:, None, None, :], 0)
    ref_in = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_with_counts(*ref_in, counts, case.scale)
    close(out.cpu(), ref_out, case.dtype, "out")
    close(lse.transpose(1, 2).cpu(), ref_lse, case.dtype, "lse")
    want = grads([ref_out, ref_lse], [dout[:, lo:hi].cpu().double(),
                                      dlse[:, :, lo:hi].cpu().double()], ref_in)
    for name, g, w in zip("qkv", (dq, dk, dv), want):
        close(g.cpu(), w, case.dtype, f"d{name}")


# --------------------------------------------------------------------------
# Sequence parallel: the exchange and the ring call the per-launch kernel, which with
# backend="triton" is the fused kernel over one dense pattern; Ulysses runs the fused
# single-device op on each rank's heads. backend="auto" (with the fused kernel made the
# CPU's default for fp32 in the ranks, as FUSED_BY_DEFAULT makes it CUDA's for bf16/fp16)
# runs it where a rank computes the whole op, a Ulysses rank's heads, and not in the
# exchange's launches.

@dataclasses.dataclass(frozen=True)
class Sharded:
    """A call split over ranks: `strategy` ("exchange", "ulysses", or "ring" for
    ring_attention, whose case has one segment of n, rate 1), each rank's rows, the
    call (n = sum(lengths)), whether the ranks ran the fused kernel on dense
    per-launch blocks (on some rank) and on the whole op or their piece's own pairs (on
    every rank), and the layout of the rows ("zigzag": 2P chunks, rank p holds p and
    2P-1-p)."""

    strategy: str
    lengths: Tuple[int, ...]
    case: Case
    backend: str
    fused: Tuple[bool, bool]
    layout: str = "contiguous"

    def rows(self, rank: int) -> torch.Tensor:
        """The global rows `rank` holds, in its local order."""
        from dilated_attention.distributed.sharding import piece_ranges

        if self.layout == "contiguous":  # pieces of any lengths
            lo = sum(self.lengths[:rank])
            return torch.arange(lo, lo + self.lengths[rank])
        return torch.cat([torch.arange(lo, hi) for lo, hi in
                          piece_ranges(self.case.n, len(self.lengths), rank, self.layout)])


SHARDED = [
    Sharded("exchange", (10, 14), Case(24, (8, 16), (1, 2), True, h=2, hk=1), "triton",
            (True, True)),
    Sharded("ulysses", (9, 7), Case(16, (4, 16), (1, 2), False), "triton", (False, True)),
    Sharded("ring", (8, 5), Case(13, (13,), (1,), True, h=2, hk=2), "triton", (True, False)),
    Sharded("ulysses", (6, 10), Case(16, (8, 16), (1, 4), True, h=2, hk=2), "auto",
            (False, True)),
    Sharded("exchange", (10, 6), Case(16, (8, 16), (1, 2), False, h=2, hk=2), "auto",
            (False, True)),
    # packed documents and padding (a run of ignored keys leaves rows that attend nothing)
    Sharded("ulysses", (11, 13), Case(24, (8, 16), (1, 2), True, cu_seqlens=(0, 10, 24),
                                      masked=True), "auto", (False, True)),
    Sharded("exchange", (12, 12), Case(24, (8, 16), (1, 2), False, h=2, hk=1,
                                       cu_seqlens=(0, 15, 24), masked=True), "triton",
            (True, True)),
    # zigzag: rank 0 holds chunks 0 and 3, whose pairs across the gap (the 32-row segment;
    # the second document) run beside its two fused calls, which write strided rows of one
    # output (batch 2); rank 1 chunks 1 and 2, one window
    Sharded("exchange", (16, 16), Case(32, (8, 32), (1, 2), True, h=2, hk=1, b=2), "auto",
            (False, True), "zigzag"),
    Sharded("exchange", (16, 16), Case(32, (4, 32), (1, 2), False, cu_seqlens=(0, 5, 32),
                                       masked=True), "triton", (True, True), "zigzag"),
]


def _counting(fn, ran: dict, key: str):
    """`fn`, adding one to ran[key] per call."""
    def run(*args, **kwargs):
        ran[key] += 1
        return fn(*args, **kwargs)
    return run


def _check_rows(got, want, rows, dtype: torch.dtype, what: str) -> None:
    """A rank's (out, lse, dq, dk, dv) against `rows` (a slice or an index) of the whole
    call's reference: rows on dim 1, but lse (b, h, n) on dim 2."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        close(g, w[:, :, rows] if name == "lse" else w[:, rows], dtype, f"{what} {name}")


def _sharded(group, calls):
    """Every call on this rank's piece: out, lse and the gradients of <out, dout> + <lse,
    dlse>, and how often the fused kernels ran (dense per-launch blocks, the whole op)."""
    from unittest import mock

    from dilated_attention import backends, fused, ring_attention
    from dilated_attention.distributed import comm

    rank, results = comm.group_rank(group), []
    fused_by_default = mock.patch.dict(backends.FUSED_BY_DEFAULT, {"cpu": (torch.float32,)})
    for call in calls:
        case, ran = call.case, {"dense": 0, "op": 0}
        patches = (mock.patch.object(fused, "dense_forward",
                                     _counting(fused.dense_forward, ran, "dense")),
                   mock.patch.object(fused, "forward", _counting(fused.forward, ran, "op")))
        rows = call.rows(rank)
        leaves, dout, dlse, mask = inputs(case)
        q, k, v = (x.detach()[:, rows].requires_grad_() for x in leaves)
        options = dict(is_causal=case.causal, group=group, return_lse=True,
                       backend=call.backend, cu_seqlens=case.cu_seqlens,
                       key_padding_mask=None if mask is None else mask[:, rows])
        with patches[0], patches[1], fused_by_default:
            if call.strategy == "ring":
                out, lse = ring_attention(q, k, v, **options)
            else:
                out, lse = dilated_attention(q, k, v, list(case.segment_lengths),
                                             list(case.dilation_rates),
                                             strategy=call.strategy, layout=call.layout,
                                             **options)
            got = grads([out, lse], [dout[:, rows], dlse[:, :, rows]], [q, k, v])
        results.append(((out, lse) + got, ran))
    return results


def test_a_zigzag_ranks_fused_piece() -> None:
    """FusedPiece.of: a zigzag rank's chunks are one fused call each, or one where they
    touch; the plan's launches between two chunks (a segment over both) run beside them,
    and no launch within a chunk does."""
    from dilated_attention.distributed.sequence_parallel import FusedPiece
    from dilated_attention.layout import Layout
    from dilated_attention.plan import make_plan

    layout, patterns, heads = Layout.zigzag([16, 16]), ((8, 32), (1, 2)), Heads.of(2, 1)
    pieces = []
    for rank in range(2):
        plan = make_plan(layout, patterns, True, heads, rank)
        pieces.append((plan, FusedPiece.of(patterns, heads, None, layout, rank, plan)))
    (plan, zero), (_, one) = pieces
    assert zero.windows == ((0, 0, 8), (24, 8, 16)) and one.windows == ((8, 0, 16),)
    assert zero.crossing and not one.crossing
    lo_of = {block.index: block.lo for block in plan.blocks}
    for launch in zero.crossing:  # the rows of chunk 3 against the keys of chunk 0 (causal)
        assert lo_of[launch.q_blocks[0]] >= 8 > lo_of[launch.k_blocks[0]]
        assert launch.keys.length == 8 and not launch.causal


# k and v frozen on every rank: (op, segments, rates); the ring's and the windows' cases have
# one segment of n (a window of 6 rows: a halo of 6 rows on two ranks, or one process)
FROZEN_KV = [("exchange", (8, 16), (1, 2)), ("exchange", (8, 32), (1, 2)), ("ring", (32,), (1,)),
             ("window", (32,), (1,)), ("window on one process", (32,), (1,))]
FROZEN_WINDOW = (6, 0)


def _frozen_kv_rank(group):
    """Per FROZEN_KV call with k and v frozen on every rank: dq of this rank's rows, and the
    names of the kernels its backward launched."""
    from unittest import mock

    from dilated_attention import ring_attention, triton_launch
    from dilated_attention.distributed import comm

    rank, results = comm.group_rank(group), []
    launched, real = [], triton_launch.launcher

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(self.kernel.fn.__name__)
            return real(self.kernel)[grid]

    for op, segments, rates in FROZEN_KV:
        leaves, dout, _, _ = inputs(Case(32, segments, rates, True, h=4, hk=2))
        alone = op == "window on one process"
        rows = slice(0, 32) if alone else slice(16 * rank, 16 * rank + 16)
        q = leaves[0].detach()[:, rows].requires_grad_()
        k, v = (x.detach()[:, rows] for x in leaves[1:])
        triton_launch.forget()  # no recipe replays launches past the count
        with mock.patch.object(triton_launch, "launcher", Counted):
            if op.startswith("window"):
                out = ring_attention(q, k, v, is_causal=True, window_size=FROZEN_WINDOW,
                                     group=None if alone else group, backend="triton")
            elif op == "ring":
                out = ring_attention(q, k, v, is_causal=True, group=group, backend="triton")
            else:
                out = dilated_attention(q, k, v, list(segments), list(rates), is_causal=True,
                                        group=group, backend="triton", strategy=op)
            before = len(launched)
            (dq,) = torch.autograd.grad(out, [q], dout[:, rows])
        results.append((dq, launched[before:]))
    return results


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
def test_frozen_keys_and_values_launch_no_dkdv_kernel_under_a_group() -> None:
    """k and v frozen on every rank: a FusedPiece's backward, the exchange's launches on
    received keys (a segment across the ranks), the ring's launches and a sliding window's
    (over two ranks, and on one process) compute dq alone, no dK/dV launch, dq equal to the
    reference's rows."""
    by_rank = SPAWNS.results(2, _frozen_kv_rank)
    for i, (op, segments, rates) in enumerate(FROZEN_KV):
        case = Case(32, segments, rates, True, h=4, hk=2)
        leaves, dout, _, _ = inputs(case)
        if op.startswith("window"):
            ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
            ref_out, _ = reference_window_attention(*ref_leaves, FROZEN_WINDOW, True)
        else:
            ref_leaves, ref_out, _ = reference(case, leaves, None)
        (want,) = grads([ref_out], [dout.double()], ref_leaves[:1])
        for rank in range(2):
            dq, backward = by_rank[rank][i]
            assert "fused_dq" in backward and "fused_dkdv" not in backward, (op, rank, backward)
            rows = slice(0, 32) if op == "window on one process" else slice(16 * rank,
                                                                            16 * rank + 16)
            close(dq, want[:, rows], case.dtype, f"{op} {segments} {rank}")


# Three ranks, the exchange with its own pairs fused: a dense segment over every rank (the
# rotate rounds), a causal segment over two of them beside an empty piece, GQA in fp16
THREE_RANKS = [
    Sharded("exchange", (8, 9, 7), Case(24, (24,), (1,), False, h=2, hk=1), "triton",
            (True, True)),
    Sharded("exchange", (10, 0, 14), Case(24, (4, 24), (1, 3), True, h=3, hk=3), "auto",
            (False, True)),
    Sharded("exchange", (12, 12, 8), Case(32, (8, 32), (1, 2), True, d=16, h=4, hk=2,
                                          dtype=torch.float16), "triton", (True, True)),
    # zigzag over three ranks: ranks 0 and 1 each hold two chunks apart, rank 2 two that touch
    Sharded("exchange", (16, 16, 16), Case(48, (8, 48), (1, 4), True, h=4, hk=2), "triton",
            (True, True), "zigzag"),
]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
@pytest.mark.parametrize("ranks,calls", [(2, SHARDED), (3, THREE_RANKS)], ids=["2", "3"])
def test_sequence_parallel_with_the_fused_kernel(ranks, calls) -> None:
    """Spawned ranks: the exchange, Ulysses and the ring with backend="triton", and Ulysses
    and the exchange with "auto", give each rank its rows of the fp64 reference of the
    whole sequence (out, lse and the gradients with an lse gradient; packed documents and
    padding too), and run the fused kernel where `Sharded.fused` says: the exchange runs
    each rank's own pairs in fused calls (one per chunk of a zigzag rank, the pairs across
    its two chunks beside them), its launches on received keys beside it."""
    by_rank = SPAWNS.results(ranks, _sharded, calls)
    for i, call in enumerate(calls):
        leaves, dout, dlse, mask = inputs(call.case)
        ref_leaves, ref_out, ref_lse = reference(call.case, leaves, mask)
        want = (ref_out, ref_lse) + grads([ref_out, ref_lse], [dout.double(), dlse.double()],
                                          ref_leaves)
        ran = [by_rank[rank][i][1] for rank in range(ranks)]
        assert (any(r["dense"] for r in ran), all(r["op"] for r in ran)) == call.fused, \
            (call, ran)
        for rank in range(ranks):
            _check_rows(by_rank[rank][i][0], want, call.rows(rank), call.case.dtype,
                        f"{call.strategy} {call.layout} {call.backend} rank {rank}")


MESH_LENGTHS = (6, 5, 7, 6)  # pieces s * U + u of a 2 x 2 mesh


def _on_a_mesh(group, case):
    """A 2 x 2 mesh (Ulysses over heads x the exchange over the sequence), backend="triton":
    this rank's piece, its out, lse and gradients, and how often the fused kernel ran a
    piece or a whole op."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("heads", "sequence"))
    u, s = mesh.get_coordinate()
    piece = s * 2 + u
    lo, hi = sum(MESH_LENGTHS[:piece]), sum(MESH_LENGTHS[:piece + 1])
    leaves, dout, dlse, _ = inputs(case)
    q, k, v = (x.detach()[:, lo:hi].requires_grad_() for x in leaves)
    ran = {"op": 0}
    with mock.patch.object(fused, "forward", _counting(fused.forward, ran, "op")):
        out, lse = dilated_attention(q, k, v, list(case.segment_lengths),
                                     list(case.dilation_rates), is_causal=case.causal,
                                     group=mesh, return_lse=True, backend="triton")
        got = grads([out, lse], [dout[:, lo:hi], dlse[:, :, lo:hi]], [q, k, v])
    return piece, (out, lse) + got, ran["op"], _dropout_on_a_mesh(mesh, piece)


def _dropout_on_a_mesh(mesh, piece: int):
    """With dropout, pieces of 8 rows and segments inside each sequence rank's 16: the
    fused pieces count from their first row and head (Note [fused dropout]), so out and
    the gradients are one device's under the same torch.manual_seed (max differences)."""
    case = Case(32, (8, 16), (1, 2), True, h=4, hk=2)
    leaves, dout, _, _ = inputs(case)
    rows = slice(8 * piece, 8 * piece + 8)

    def run(x, group, dout):
        torch.manual_seed(7)
        out = dilated_attention(*x, [8, 16], [1, 2], is_causal=True, dropout_p=0.3,
                                group=group, backend="triton")
        return (out, *torch.autograd.grad(out, x, dout))

    want = run([x.detach().requires_grad_() for x in leaves], None, dout)
    got = run([x.detach()[:, rows].requires_grad_() for x in leaves], mesh, dout[:, rows])
    return [float((g - w[:, rows]).abs().max()) for g, w in zip(got, want)]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
def test_a_mesh_runs_each_ranks_own_pairs_fused() -> None:
    """Ulysses x the exchange: each rank's heads over its sequence group, its own pairs in
    one fused call beside the received keys; every rank's rows equal the fp64 reference.
    With dropout, where no segment crosses a sequence rank, one device's call."""
    from dist_harness import run_distributed

    case = Case(sum(MESH_LENGTHS), (8, 24), (1, 2), True)
    leaves, dout, dlse, _ = inputs(case)
    ref_leaves, ref_out, ref_lse = reference(case, leaves, None)
    want = (ref_out, ref_lse) + grads([ref_out, ref_lse], [dout.double(), dlse.double()],
                                      ref_leaves)
    for piece, got, fused_calls, dropout in run_distributed(_on_a_mesh, 4, case, timeout=300):
        assert fused_calls == 1, (piece, fused_calls)
        assert max(dropout) < 1e-5, (piece, dropout)
        lo, hi = sum(MESH_LENGTHS[:piece]), sum(MESH_LENGTHS[:piece + 1])
        _check_rows(got, want, slice(lo, hi), torch.float32, f"piece {piece}")


# --------------------------------------------------------------------------
# Errors


def _call(backend: str = "triton", dtype=torch.float32, **kwargs):
    q = torch.randn(1, 8, 2, 4, dtype=dtype)
    return dilated_attention(q, q, q, [4], [1], backend=backend, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors only")
def test_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors only")
def test_kernels_created_without_the_interpreter_are_refused(monkeypatch) -> None:
    """The variable set only after the kernels were created: a clear error, not a crash
    deep inside Triton."""
    from dilated_attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "fused_forward", object())
    with pytest.raises(ValueError, match="created for a GPU"):
        _call()


def _no_checked_calls(monkeypatch) -> None:
    """The op keeps each call signature's checked configuration, taking which packages are
    installed as fixed for the process (validation.signature): a test that changes that
    starts with none kept."""
    from dilated_attention import functional, validation

    monkeypatch.setattr(functional, "_DILATED_CALLS", validation.CheckedCalls())


def test_needs_the_triton_package(monkeypatch) -> None:
    from dilated_attention import backends

    monkeypatch.setitem(backends._INSTALLED, "triton", False)
    _no_checked_calls(monkeypatch)
    with pytest.raises(ValueError, match="the triton package installed"):
        _call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors only")
def test_an_interpreter_too_old_for_numpy_is_refused(monkeypatch) -> None:
    """Triton's interpreter before 3.7 cannot run the kernels' loops beside numpy 2.4 (it
    takes int() of a 1-element array), nor 3.0 and 3.1's at all: a ValueError naming the
    versions, not an InterpreterError from inside the kernel. Compiled kernels are not
    affected."""
    from dilated_attention import backends

    assert backends._interpreter_problem((3, 6), (2, 3)) is None
    assert "triton 3.2 or newer" in backends._interpreter_problem((3, 1), (2, 3))
    assert backends._interpreter_problem((3, 7), (2, 4)) is None
    assert backends._interpreter_problem((), (2, 4)) is None
    problem = backends._interpreter_problem((3, 6), (2, 4))
    monkeypatch.setattr(backends, "_INTERPRETER_PROBLEM", problem)
    _no_checked_calls(monkeypatch)
    with pytest.raises(ValueError, match=r"triton 3\.7 or newer.*got triton 3\.6 and numpy 2\.4"):
        _call()
    with pytest.raises(ValueError, match=r"triton 3\.7 or newer"):
        select_backend(torch.device("cpu"), torch.float32, backend="triton")


@pytest.mark.parametrize("dtype,device,match", [
    (torch.float64, "cpu", "float64"),
    (torch.bfloat16, "cpu", "bfloat16 matrix products are wrong"),
])
def test_dtypes_it_cannot_run(dtype, device, match) -> None:
    with pytest.raises(ValueError, match=match):
        select_backend(torch.device(device), dtype, backend="triton")


def test_gpus_older_than_sm80_are_refused(monkeypatch) -> None:
    """The CUDA tiles are checked for sm_80 and newer (benchmarks/cross_compile.py): a T4
    (sm_75) gets a ValueError saying so, not Triton's OutOfResources at the first launch."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 8\.0 or newer \(got 7\.5\)"):
        select_backend(torch.device("cuda"), torch.float16, backend="triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert select_backend(torch.device("cuda"), torch.float16, backend="triton") == "triton"


# Every tile shape the CUDA table ships (rows per tile 16 to 128, chunks of 16 to 64) under
# the interpreter: the plan and the kernels' masks at those sizes, which the interpreter's
# own 32 x 32 tiles do not reach (num_warps and num_stages mean nothing there).
CUDA_TILES_CASE = Case(160, (32, 64, 128), (1, 2, 4), True, d=16, cu_seqlens=(0, 70, 160),
                       masked=True)
KERNEL_ROLES = ("forward", "dq", "dkdv")


def _cuda_tile_shapes():
    """TileSizes that together give each kernel every (rows, chunk) the CUDA table does."""
    shapes = {role: sorted({getattr(sizes, role)[:2] for sizes in fused.CUDA_TILE_SIZES.values()})
              for role in KERNEL_ROLES}
    count = max(len(s) for s in shapes.values())
    tiles = [[fused.KernelTiles(*shapes[role][i % len(shapes[role])], 1) for role in KERNEL_ROLES]
             for i in range(count)]
    # narrow tiles would run this short case's tiles at 16 rows, whatever the table's
    return [fused.TileSizes(*t, narrowest=max(x.rows for x in t)) for t in tiles]


def _tiles_id(sizes: fused.TileSizes) -> str:
    return "-".join(f"{t.rows}x{t.chunk}" for t in (sizes.forward, sizes.dq, sizes.dkdv))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every call runs the CUDA tiles")
@pytest.mark.parametrize("sizes", _cuda_tile_shapes(), ids=_tiles_id)
def test_the_cuda_tiles_compute_the_op(sizes, monkeypatch) -> None:
    monkeypatch.setattr(fused, "tile_sizes", lambda device, dtype, head_dim, dropout=False: sizes)
    check(CUDA_TILES_CASE, op(CUDA_TILES_CASE))


def test_auto_runs_the_fused_kernel_for_a_whole_op_in_half_precision_on_cuda(monkeypatch):
    """backends.FUSED_BY_DEFAULT: on CUDA (an H100 here, capability patched) backend="auto"
    runs a single-device op in bf16/fp16 with the fused kernel, padding mask or not; the
    sequence-parallel launches, fp32 (not measured on a GPU) and head dims past the tiles
    keep the SDPA kernels."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert select_backend(cuda, torch.bfloat16, whole_op=True, head_dim=64) == "triton"
    assert select_backend(cuda, torch.float16, whole_op=True, head_dim=128,
                          masked=True) == "triton"
    assert select_backend(cuda, torch.bfloat16, head_dim=64) == "cuda_cudnn"
    assert select_backend(cuda, torch.float32, whole_op=True, head_dim=64) == "cuda_efficient"
    assert select_backend(cuda, torch.bfloat16, whole_op=True, head_dim=512) == "cuda_cudnn"
    assert select_backend(torch.device("cpu"), torch.float32, whole_op=True) == "cpu_flash"


def test_head_dims_past_the_tiles_are_refused() -> None:
    q = torch.randn(1, 8, 2, 264)
    with pytest.raises(ValueError, match=r"head dim of at most 256 \(got 264\)"):
        dilated_attention(q, q, q, [4], [1], backend="triton")


# --------------------------------------------------------------------------
# triton_spans.unmasked_chunks (key tiles, causal): the first whole chunk read without
# a mask starts at the first query at or after the tile's LAST key row, ceil((last -
# start) / stride). A hand-made plan where that bound is not a multiple of the stride:
# key rows {0, 4} read by the queries 2, 6, 10, ... (stride 4, 40 of them: a whole chunk
# of 32). Query 2 attends key 0 but not key 4. (kills tk-fulllo-floor)


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _handmade_plans(m: int):
    from dilated_attention.fused_plan import TilePlan

    queries = [2 + 4 * i for i in range(m)]
    empty = torch.zeros(1, 2, dtype=torch.int32)
    q_tiles = [(0, lo, min(32, m - lo), 0, 0, 1) for lo in range(0, m, 32)]
    query_plan = TilePlan(_i32(q_tiles), _i32(queries), _i32([(0, 0, 4, 2, 1, 0, 0)]), empty,
                          32, 0, heights=((32, len(q_tiles)),))
    key_plan = TilePlan(_i32([(0, 0, 2, 0, 0, 1)]), _i32([0, 4]),
                        _i32([(0, 2, 4, m, 1, 0, 0)]), empty, 32, 0, heights=((32, 1),))
    return queries, query_plan, key_plan


def test_key_tile_unmasked_chunks_start_after_its_last_row():
    m = 40
    queries, query_plan, key_plan = _handmade_plans(m)
    n = queries[-1] + 1

    def planner(block_m, keys, split_keys, narrowest, order_window):
        return (key_plan if keys else query_plan).to(DEVICE)

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, 1, 16, generator=gen, dtype=torch.float64)
                     for _ in range(4))
    scale = 0.25
    x32 = [x.float().to(DEVICE) for x in (q, k, v, dout)]
    out, lse = fused._forward(*x32[:3], planner, True, scale, None, None)
    dq, dk, dv = fused._backward(x32[3], *x32[:3], out, lse, None, planner, True, scale,
                                 None, None)
    counts = torch.zeros(1, n, n, dtype=torch.int64)
    for t in queries:
        for u in (0, 4):
            counts[0, t, u] = int(u <= t)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = attention_with_counts(*leaves, counts, scale)
    want = grads([ref_out], [dout], leaves)
    rows = torch.tensor(queries)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double()[:, rows], ref_out.detach()[:, rows], **tol)
    torch.testing.assert_close(dq.cpu().double()[:, rows], want[0][:, rows], **tol)
    for name, got, w in (("dk", dk, want[1]), ("dv", dv, want[2])):
        torch.testing.assert_close(got.cpu().double()[:, [0, 4]], w[:, [0, 4]], **tol, msg=name)


# The exchange with backend="triton" in fp16: a rank's own pairs run in FusedPiece's fused
# calls, whose lse must be fp32 (sequence_parallel_dilated_attention's contract), not the
# inputs' fp16 rounding of it.

F4_N, F4_PATTERNS = 32, ([8, 32], [1, 2])


def _f4_inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, F4_N, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2)]


def _f4_rank(group):
    from dilated_attention.distributed import comm

    rank = comm.group_rank(group)
    rows = slice(16 * rank, 16 * rank + 16)
    q, k, v = (x[:, rows].half() for x in _f4_inputs())
    return dilated_attention(q, k, v, *F4_PATTERNS, is_causal=True, group=group,
                             return_lse=True, backend="triton", strategy="exchange")


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors")
def test_fused_pieces_keep_an_fp32_lse_in_half_precision():
    q, k, v = _f4_inputs()
    _, want = dilated_attention(q, k, v, *F4_PATTERNS, is_causal=True, return_lse=True)
    # the single-device fused call's own error in fp16
    _, one = dilated_attention(q.half(), k.half(), v.half(), *F4_PATTERNS, is_causal=True,
                               return_lse=True, backend="triton")
    bound = 1.1 * (one.double() - want).abs().max().item()
    for rank, (_, lse) in enumerate(SPAWNS.results(2, _f4_rank)):
        assert lse.dtype == torch.float32, (rank, lse.dtype)
        rows = slice(16 * rank, 16 * rank + 16)
        error = (lse.double() - want[:, :, rows]).abs().max().item()
        assert error <= bound, (rank, error, bound)


# What select_backend picks and refuses on a GPU, its capability patched (no GPU needed):
# a masked "auto" call on CUDA runs the blockwise kernel (the CPU flash op cannot take CUDA
# tensors); a kernel that needs sm_80 runs on an sm_80 GPU (an A100).

def test_select_backend_on_an_sm80_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert select_backend(cuda, dtype, masked=True) == "blockwise", dtype
    assert select_backend(cuda, torch.float16, backend="cuda_flash") == "cuda_flash"
    assert select_backend(cuda, torch.bfloat16, backend="triton") == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 8\.0 or newer \(got 7\.5\)"):
        select_backend(cuda, torch.float16, backend="cuda_flash")


# One spawn of 2 ranks for the rank functions above that run on 2 (the frozen keys' last: it
# forgets the kept launches), and one of 3 (the mesh's 4 ranks spawn alone)
SPAWNS = SharedSpawn({2: [(_sharded, SHARDED), (_f4_rank,), (_frozen_kv_rank,)],
                      3: [(_sharded, THREE_RANKS)]})
