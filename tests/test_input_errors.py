"""One test per input error of issue 2: the exception type, and a message that
names the argument and the offending value."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

from dilated_attention import dilated_attention, ring_attention
from dist_harness import SharedSpawn


def names(*parts: str) -> str:
    """A `match` regex requiring every part, literally, anywhere in the message.

    A part that starts or ends with a word character must be a whole word
    there, so "q" is not found in "query" nor "6" in "16".
    """

    def word(part: str) -> str:
        start = r"\b" if re.match(r"\w", part[0]) else ""
        end = r"\b" if re.match(r"\w", part[-1]) else ""
        return start + re.escape(part) + end

    return "(?s)" + "".join(f"(?=.*{word(p)})" for p in parts)


def qkv(b=2, n=8, h=4, hk=2, d=16, dtype=torch.float32):
    """q (b, n, h, d), k/v (b, n, hk, d)."""
    return (
        torch.randn(b, n, h, d, dtype=dtype),
        torch.randn(b, n, hk, d, dtype=dtype),
        torch.randn(b, n, hk, d, dtype=dtype),
    )


def call(q=None, k=None, v=None, segment_lengths=(4,), dilation_rates=(1,), **kwargs):
    dq, dk, dv = qkv()
    q, k, v = (dq if q is None else q), (dk if k is None else k), (dv if v is None else v)
    return dilated_attention(q, k, v, segment_lengths, dilation_rates, **kwargs)


def test_valid_call_runs() -> None:
    assert call().shape == (2, 8, 4, 16)


# ---------------------------------------------------------------- pattern lists


def test_mismatched_list_lengths() -> None:
    expected = names("segment_lengths", "dilation_rates", "[4, 8]", "[1]")
    with pytest.raises(ValueError, match=expected):
        call(segment_lengths=[4, 8], dilation_rates=[1])


def test_empty_segment_lengths() -> None:
    with pytest.raises(ValueError, match=names("segment_lengths", "[]")):
        call(segment_lengths=[], dilation_rates=[])


def test_empty_dilation_rates() -> None:
    with pytest.raises(ValueError, match=names("dilation_rates", "[]")):
        call(segment_lengths=[4], dilation_rates=[])


def test_pattern_list_not_a_list() -> None:
    with pytest.raises(TypeError, match=names("segment_lengths", "4")):
        call(segment_lengths=4, dilation_rates=[1])


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_segment_length(bad: int) -> None:
    with pytest.raises(ValueError, match=names("segment_lengths[1]", str(bad))):
        call(segment_lengths=[4, bad], dilation_rates=[1, 1])


@pytest.mark.parametrize("bad", [0, -1])
def test_non_positive_dilation_rate(bad: int) -> None:
    with pytest.raises(ValueError, match=names("dilation_rates[0]", str(bad))):
        call(segment_lengths=[4], dilation_rates=[bad])


@pytest.mark.parametrize("bad", [4.0, "4", True, None])
def test_non_integer_segment_length(bad) -> None:
    with pytest.raises(TypeError, match=names("segment_lengths[0]", repr(bad))):
        call(segment_lengths=[bad], dilation_rates=[1])


def test_integer_types_and_sequences_beyond_int_and_list_are_accepted() -> None:
    """Plain ints and lists take a fast path; any other Integral and Sequence still counts."""

    class Length(int):
        pass

    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    want = dilated_attention(q, q, q, [4, 8], [1, 2])
    got = dilated_attention(q, q, q, range(4, 12, 4), (Length(1), Length(2)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [1.5, "2", False])
def test_non_integer_dilation_rate(bad) -> None:
    with pytest.raises(TypeError, match=names("dilation_rates[0]", repr(bad))):
        call(segment_lengths=[4], dilation_rates=[bad])


@pytest.mark.parametrize("which", ["segment_lengths", "dilation_rates"])
@pytest.mark.parametrize("bad", [2**63, 2**64 + 3])
def test_pattern_value_beyond_int64(which: str, bad: int) -> None:
    kwargs = {"segment_lengths": [4, 2**63 - 1], "dilation_rates": [1, 1]}
    kwargs[which][1] = bad
    with pytest.raises(ValueError, match=names(f"{which}[1]", str(bad), "2**63 - 1")):
        call(**kwargs)


def test_rate_larger_than_segment() -> None:
    expected = names("dilation_rates[1]", "5", "segment_lengths[1]", "4")
    with pytest.raises(ValueError, match=expected):
        call(segment_lengths=[8, 4], dilation_rates=[1, 5])


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(which: str) -> None:
    with pytest.raises(TypeError, match=names(which, "list")):
        call(**{which: [[1.0]]})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("which", ["q", "k", "v", "key_padding_mask"])
def test_not_a_dense_tensor(which: str) -> None:
    """Sparse and nested tensors are refused by name, also after a dense call of the same
    shapes (the checked-call memo keys tensors by layout too)."""
    q, k, v = qkv()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    dense = {"q": q, "k": k, "v": v, "key_padding_mask": mask}
    call(**dense)
    nested = [torch.nested.as_nested_tensor(list(dense[which]), layout=layout)
              for layout in (torch.strided, torch.jagged)]
    for bad, what in ((dense[which].to_sparse(), "layout torch.sparse_coo"),
                      (nested[0], "a nested tensor"), (nested[1], "a nested tensor")):
        with pytest.raises(TypeError, match=names(which, "dense (strided)", what)):
            call(**{**dense, which: bad})


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_4d(which: str) -> None:
    bad = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match=names(which, "4-D", "(2, 8, 16)")):
        call(**{which: bad})


def test_mismatched_batch() -> None:
    q, _, _ = qkv()
    _, k, v = qkv(b=3)
    with pytest.raises(ValueError, match=names("batch", "(2, 8, 4, 16)", "(3, 8, 2, 16)")):
        call(q, k, v)


def test_mismatched_seq_len() -> None:
    q, k, _ = qkv()
    _, _, v = qkv(n=9)
    with pytest.raises(ValueError, match=names("seq_len", "v", "(2, 9, 2, 16)")):
        call(q, k, v)


def test_mismatched_head_dim() -> None:
    _, k, v = qkv()
    q, _, _ = qkv(d=8)
    with pytest.raises(ValueError, match=names("head_dim", "q", "(2, 8, 4, 8)")):
        call(q, k, v)


def test_heads_not_divisible_by_kv_heads() -> None:
    q, k, v = qkv(h=6, hk=4)
    with pytest.raises(ValueError, match=names("q", "6", "k", "4", "heads")):
        call(q, k, v)


def test_k_and_v_heads_differ() -> None:
    q, k, _ = qkv(h=4, hk=2)
    _, _, v = qkv(h=4, hk=4)
    with pytest.raises(ValueError, match=names("k", "v", "(2, 8, 2, 16)", "(2, 8, 4, 16)")):
        call(q, k, v)


LAYOUT_HINT = names("(batch, seq_len, heads, head_dim)", "(batch, heads, seq_len, head_dim)",
                    "transpose(1, 2)")


@pytest.mark.parametrize("case", ["gqa", "key_padding_mask"])
def test_sdpa_layout_gets_a_hint(case: str) -> None:
    """(b, h, n, d) tensors that fail a check, and would pass it transposed: the error says
    what the layout is (issue 27.11). Equal head counts run: that is a valid call."""
    q, k, v = (x.transpose(1, 2) for x in qkv(n=8, h=4, hk=2))
    kwargs = {}
    if case == "key_padding_mask":
        k, v = q, q
        kwargs["key_padding_mask"] = torch.zeros(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=LAYOUT_HINT):
        call(q, k, v, **kwargs)


@pytest.mark.parametrize("case", ["seq_len", "transposed_too"])
def test_no_layout_hint_for_other_mistakes(case: str) -> None:
    if case == "seq_len":
        q, k, _ = qkv()
        _, _, v = qkv(n=9)
    else:  # 6 heads over 4 kv heads: wrong in either layout
        q, k, v = (x.transpose(1, 2) for x in qkv(n=8, h=6, hk=4))
    with pytest.raises(ValueError) as error:
        call(q, k, v)
    assert "transpose" not in str(error.value)


@pytest.mark.parametrize("dim", [0, 1, 2, 3], ids=["batch", "seq_len", "heads", "head_dim"])
def test_empty_dimension(dim: int) -> None:
    shape = [2, 8, 4, 16]
    shape[dim] = 0
    q = torch.randn(shape)
    kv_shape = shape[:2] + [2 if dim != 2 else 1] + shape[3:]
    k, v = torch.randn(kv_shape), torch.randn(kv_shape)
    with pytest.raises(ValueError, match=names("q", str(tuple(shape)))):
        call(q, k, v)


def test_mixed_dtypes() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError, match=names("k", "torch.float32", "torch.float64")):
        call(q, k.double(), v)


def test_mixed_devices() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=names("device", "v", "cpu", "meta")):
        call(q, k, v.to("meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_dtype(dtype: torch.dtype) -> None:
    q, k, v = (torch.ones(2, 8, 2, 4, dtype=dtype) for _ in range(3))
    with pytest.raises(TypeError, match=names("q", str(dtype))):
        call(q, k, v)


# ---------------------------------------------------------------- scalars


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan])
def test_dropout_outside_unit_interval(bad: float) -> None:
    with pytest.raises(ValueError, match=names("dropout_p", str(bad))):
        call(dropout_p=bad)


@pytest.mark.parametrize("bad", ["0.1", None, True])
def test_dropout_not_a_number(bad) -> None:
    with pytest.raises(TypeError, match=names("dropout_p", repr(bad))):
        call(dropout_p=bad)


@pytest.mark.parametrize("bad", [0.0, -0.5, math.inf, -math.inf, math.nan])
def test_scale_not_positive_finite(bad: float) -> None:
    with pytest.raises(ValueError, match=names("scale", str(bad))):
        call(scale=bad)


@pytest.mark.parametrize("bad", ["0.5", True, torch.tensor(0.5)])
def test_scale_not_a_number(bad) -> None:
    with pytest.raises(TypeError, match=names("scale")):
        call(scale=bad)


@pytest.mark.parametrize("flag", ["is_causal", "return_lse"])
def test_flags_must_be_bool(flag: str) -> None:
    with pytest.raises(TypeError, match=names(flag, "'yes'")):
        call(**{flag: "yes"})


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match=names("backend", "'cuda_magic'")):
        call(backend="cuda_magic")


@pytest.mark.parametrize("backend", ["cpu_flash", "cuda_flash", "cuda_efficient", "flash_attn"])
def test_backend_without_dropout_support(backend: str) -> None:
    """Only the blockwise kernel drops; the others must refuse, not silently run p = 0."""
    with pytest.raises(ValueError, match=names("backend", repr(backend), "dropout_p", "0.1")):
        call(backend=backend, dropout_p=0.1)


# what each kernel named by `backend` needs, on CPU float32 tensors
CUDA_ONLY = {
    "cuda_flash": ("CUDA", "got cpu", "float16 or bfloat16", "got torch.float32"),
    "cuda_cudnn": ("CUDA", "got cpu", "float16 or bfloat16", "got torch.float32"),
    "cuda_efficient": ("CUDA", "got cpu"),
    "flash_attn": ("CUDA", "got cpu", "float16 or bfloat16", "got torch.float32"),
}


@pytest.mark.parametrize("backend", sorted(CUDA_ONLY))
def test_backend_needs_what_it_needs(backend: str) -> None:
    """A CUDA kernel on CPU tensors says what it needs, not a raw aten/import error."""
    expected = names("backend", repr(backend), *CUDA_ONLY[backend])
    with pytest.raises(ValueError, match=expected):
        call(backend=backend)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=expected):
        ring_attention(q, k, v, backend=backend)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="flash-attn is installed")
def test_flash_attn_backend_names_the_missing_package() -> None:
    with pytest.raises(ValueError, match=names("'flash_attn'", "flash-attn", "installed")):
        call(backend="flash_attn")


def test_cuda_efficient_names_the_dtype() -> None:
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(ValueError, match=names("'cuda_efficient'", "float32", "torch.float64")):
        call(q, k, v, backend="cuda_efficient")


def test_named_kernels_run_on_meta_tensors() -> None:
    """Meta tensors (shape-only runs) stand in for any device: the CPU kernels take them."""
    q, k, v = (x.to("meta") for x in qkv())
    assert call(q, k, v, backend="cpu_flash").device.type == "meta"
    assert call(q, k, v, backend="blockwise").device.type == "meta"
    # with a padding mask too, through every single-device path (the op's launches, the
    # dense op, a window)
    from dilated_attention import ring_attention

    mask = torch.zeros(q.shape[:2], dtype=torch.bool, device="meta")
    for out in (call(q, k, v, key_padding_mask=mask),
                ring_attention(q, k, v, key_padding_mask=mask),
                ring_attention(q, k, v, key_padding_mask=mask, window_size=(2, 0),
                               is_causal=True)):
        assert out.device.type == "meta" and out.shape == q.shape


def test_inputs_are_checked_once_per_call() -> None:
    """One validation pass per call: the op, the ring, the modules, forward and backward."""
    from unittest import mock

    from dilated_attention import DilatedAttention, MultiheadDilatedAttention, ring_attention
    from dilated_attention import validation

    q, k, v = (x.requires_grad_() for x in qkv())
    mha = MultiheadDilatedAttention(16, 2, [4], [1])
    x = torch.randn(2, 8, 16)
    calls = {
        "dilated_attention": lambda: dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True),
        "ring_attention": lambda: ring_attention(q, k, v, is_causal=True),
        "DilatedAttention": lambda: DilatedAttention([4, 8], [1, 2])(q, k, v),
        "MultiheadDilatedAttention": lambda: mha(x, x, x)[0],
    }
    for name, fn in calls.items():
        with mock.patch.object(validation, "check_qkv", wraps=validation.check_qkv) as spy:
            fn().sum().backward()
        assert spy.call_count == 1, (name, spy.call_count)


def _forward_mode(attend, x):
    from torch.autograd import forward_ad

    with forward_ad.dual_level():
        attend(forward_ad.make_dual(x, torch.ones_like(x)))


# each ran into a raw error inside torch (grad, vmap) or lost its tangents silently (jvp)
TRANSFORMS = {
    "grad": (lambda f, x: torch.func.grad(lambda x: f(x).sum())(x), "torch.func.grad"),
    "jacrev": (lambda f, x: torch.func.jacrev(f)(x), "torch.func.grad"),
    "vmap": (lambda f, x: torch.func.vmap(f)(x[None].expand(2, -1, -1, -1, -1)),
             "torch.func.vmap"),
    "jvp": (lambda f, x: torch.func.jvp(f, (x,), (x,)), "torch.func.jvp"),
    "forward_ad": (_forward_mode, "forward-mode AD"),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("op", ["dilated_attention", "ring_attention", "DilatedAttention"])
def test_torch_func_transforms_are_refused(transform: str, op: str) -> None:
    from dilated_attention import DilatedAttention

    attend = {
        "dilated_attention": lambda x: dilated_attention(x, x, x, [4], [1]),
        "ring_attention": lambda x: ring_attention(x, x, x),
        "DilatedAttention": lambda x: DilatedAttention([4], [1])(x, x, x),
    }[op]
    apply, name = TRANSFORMS[transform]
    with pytest.raises(ValueError, match=names(name, "not support", "torch.autograd.grad")):
        apply(attend, torch.randn(1, 8, 2, 4, dtype=torch.float64))


def test_all_reduce_gradients_arguments() -> None:
    from dilated_attention import all_reduce_gradients

    with pytest.raises(TypeError, match=names("group", "str", "'bogus'")):
        all_reduce_gradients(torch.nn.Linear(2, 2), "bogus")
    with pytest.raises(TypeError, match=names("module", "torch.nn.Module", "str")):
        all_reduce_gradients("model", None)


# ---------------------------------------------------------------- across ranks


def _outcome(fn) -> str:
    """'ok', or the error's type and message."""
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _errors_across_ranks(group) -> dict:
    """Each case's outcome on this rank (rank 1 is the odd one where ranks differ)."""
    from dilated_attention.distributed import comm

    rank = comm.group_rank(group)
    q, k, v = qkv(b=1, n=6)
    results = {
        # a kernel this rank cannot run: an error on every rank, not a hang
        "cuda_backend": _outcome(lambda: call(q, k, v, group=group,
                                              backend="cuda_flash" if rank == 1 else "auto")),
        # ranks disagree on an argument from which the kernel is derived
        "dropout_p": _outcome(lambda: call(q, k, v, group=group,
                                           dropout_p=0.1 if rank == 1 else 0.0)),
        "is_causal": _outcome(lambda: call(q, k, v, group=group, is_causal=rank == 1)),
    }
    # double backward: refused on every rank, before the backward's first collective
    for name, attend in (
        ("double_backward_dilated",
         lambda q, k, v: dilated_attention(q, k, v, [4, 8], [1, 2], group=group,
                                           is_causal=True)),
        ("double_backward_ring",
         lambda q, k, v: ring_attention(q, k, v, group=group, is_causal=True)),
    ):
        leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]

        def twice():
            out = attend(*leaves)
            torch.autograd.grad(out.square().sum(), leaves, create_graph=True)

        results[name] = _outcome(twice)
    results.update(_gradient_reductions(group, rank))
    return results


def _parameters(*specs) -> torch.nn.Module:
    """A module holding a parameter of each (name, shape), in that order, gradients filled."""
    module = torch.nn.Module()
    for name, shape in specs:
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
        module.get_parameter(name).grad = torch.ones(shape)
    return module


class _Wrapper(torch.nn.Module):
    """Names its child "module", as DDP does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _gradient_reductions(group, rank: int) -> dict:
    """all_reduce_gradients where rank 1's parameters differ (same element count each time)."""
    from dilated_attention import all_reduce_gradients

    mine = [("first", (2, 3)), ("second", (3, 2)), ("third", (4,))]
    other = {
        "shapes": [("first", (3, 2)), ("second", (2, 3)), ("third", (4,))],
        "order": [("second", (3, 2)), ("first", (2, 3)), ("third", (4,))],
        "count": [("first", (2, 3)), ("second", (3, 2)), ("third", (2,)), ("fourth", (2,))],
    }
    results = {f"gradients_{case}": _outcome(lambda: all_reduce_gradients(
        _parameters(*(specs if rank == 1 else mine)), group)) for case, specs in other.items()}
    # a wrapped model matches an unwrapped one: rank r's gradients r + 1 average to 1.5
    model = _parameters(*mine)
    for p in model.parameters():
        p.grad.fill_(rank + 1)
    results["gradients_wrapped"] = _outcome(
        lambda: all_reduce_gradients(_Wrapper(model) if rank == 1 else model, group))
    results["gradients_wrapped_values"] = sorted({p.grad.unique().item()
                                                  for p in model.parameters()})
    # "first" has a gradient on rank 0 only (1 and 0 average to 0.5), "second" on no rank:
    # it keeps None, as one process leaves it (an optimizer skips it)
    model = _parameters(*mine)
    model.second.grad = None
    if rank == 1:
        model.first.grad = None
    all_reduce_gradients(model, group)
    results["gradients_partial"] = [None if p.grad is None else p.grad.unique().tolist()
                                    for p in model.parameters()]
    return results


@pytest.mark.distributed
def test_errors_reach_every_rank_and_name_the_argument() -> None:
    results = SPAWNS.results(2, _errors_across_ranks)
    own, other = results[1]["cuda_backend"], results[0]["cuda_backend"]
    assert re.search(names("ValueError", "'cuda_flash'", "CUDA", "got cpu"), own), own
    assert re.search(names("ValueError", "rank 1", "'cuda_flash'", "CUDA"), other), other
    for rank in (0, 1):
        for arg in ("dropout_p", "is_causal"):
            message = results[rank][arg]
            assert re.search(names("ValueError", "disagree", f"'{arg}'"), message), message
        for path in ("dilated", "ring"):
            message = results[rank][f"double_backward_{path}"]
            assert re.search(names("ValueError", "create_graph=True", "double backward",
                                   "one device"), message), message
        # the first parameter on which the ranks differ, each rank's, on every rank
        for case, expected in (
            ("shapes", ("#0", "rank 0: 'first' (2, 3)", "rank 1: 'first' (3, 2)")),
            ("order", ("#0", "rank 0: 'first' (2, 3)", "rank 1: 'second' (3, 2)")),
            ("count", ("#2", "rank 0: 'third' (4,)", "rank 1: 'third' (2,)")),
        ):
            message = results[rank][f"gradients_{case}"]
            assert re.search(names("ValueError", "different parameters", *expected),
                             message), message
        assert results[rank]["gradients_wrapped"] == "ok"
        assert results[rank]["gradients_wrapped_values"] == [1.5]
        assert results[rank]["gradients_partial"] == [[0.5], None, [1.0]]


def _one_rank_skips_backward(group) -> None:
    """Rank 1 runs the forward only and stays alive past the timeout; rank 0 runs backward,
    and its error (which the harness reports) says how long it waited."""
    import time

    from dilated_attention.distributed import comm

    x = torch.randn(1, 64, 2, 8, requires_grad=True)
    # 128 rows over 2 ranks: the 128-row segment spans both, so backward exchanges rows
    out = dilated_attention(x, x, x, [32, 128], [1, 2], group=group)
    if comm.group_rank(group) == 1:
        time.sleep(20.0)
        return
    start = time.monotonic()
    try:
        out.sum().backward()
    except RuntimeError as exc:
        raise RuntimeError(f"waited {time.monotonic() - start:.1f} s: {exc}") from None


@pytest.mark.distributed
def test_a_rank_that_skips_backward_is_a_timeout_on_the_others() -> None:
    """Not detectable (docs/sequence-parallel.md, 'When ranks do different things'): the other rank
    waits in backward for the group's timeout (5 s here), then raises; it never hangs."""
    from dist_harness import RankFailure, run_distributed

    with pytest.raises(RankFailure) as failure:
        run_distributed(_one_rank_skips_backward, 2, timeout=120, pg_timeout=5.0, grace=2.0)
    found = re.search(r"waited (\d+\.\d) s: .*Timed out", str(failure.value))
    assert found, str(failure.value)
    assert 4.0 < float(found.group(1)) < 30.0, found.group(0)


def _compiled_names(group):
    from dilated_attention import all_reduce_gradients
    from dilated_attention.distributed import comm

    rank = comm.group_rank(group)
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    all_reduce_gradients(torch.compile(model) if rank == 1 else model, group)
    return sorted({p.grad.unique().item() for p in model.parameters()})


@pytest.mark.distributed
def test_all_reduce_gradients_matches_a_compiled_model_with_a_plain_one():
    # torch.compile names the parameters "_orig_mod.*"
    assert SPAWNS.results(2, _compiled_names) == [[1.5], [1.5]]


def test_no_layout_hint_when_the_mask_fits_neither_layout():
    """(b, h, n, d) tensors with a key padding mask that fits neither (b, n) nor the
    swapped layout's: the error names the mask's shape and gives no transpose hint."""
    q = qkv(h=4, hk=4)[0].transpose(1, 2)  # read as (b=2, n=4, h=8, d)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape") as error:
        dilated_attention(q, q, q, [4], [1], key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    assert "transpose" not in str(error.value)


def test_bool_cu_seqlens_tensor_is_a_type_error():
    """A bool tensor is no list of boundaries (True would read as 1)."""
    q, k, v = qkv(b=1, n=10)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        dilated_attention(q, k, v, [4], [1], cu_seqlens=torch.tensor([0, 10]).bool())


def test_key_padding_mask_on_another_device_names_the_device():
    """A mask on another device than q (meta here, so that it runs without a GPU)."""
    q, k, v = qkv()
    mask = torch.zeros(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="key_padding_mask must be on q's device"):
        dilated_attention(q, k, v, [4], [1], key_padding_mask=mask)


# One spawn for the two rank functions above that return (the skipped backward's fails on
# purpose, alone); a group timeout of a minute, so that an error within seconds is the
# agreement's, not a timeout
SPAWNS = SharedSpawn({2: [(_errors_across_ranks,), (_compiled_names,)]}, pg_timeout=60.0)
