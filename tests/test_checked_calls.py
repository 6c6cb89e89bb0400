"""The ops check a call signature's arguments once (validation.CheckedCalls): a call whose
signature was checked before must give exactly what a full check gives, errors included,
and the checks that read data or per-call state must still run every call."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest
import torch
from torch.autograd import forward_ad

from dilated_attention import dilated_attention, functional, ring_attention, validation
from dilated_attention.distributed import comm


def qkv(dtype=torch.float32, requires_grad=False, h=4, hk=2):
    """q (2, 8, h, 16), k/v (2, 8, hk, 16), the same numbers every time."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 8, heads, 16, generator=gen, dtype=torch.float64).to(dtype)
            .requires_grad_(requires_grad) for heads in (h, hk, hk)]


def outcome(monkeypatch, op: Callable, tensors: List[torch.Tensor], kwargs: Dict[str, Any],
            *, grad_mode: bool = True):
    """What a call gives: its error (type and message), or the configuration it agreed on,
    its output and its gradients."""
    agreed = []
    agree = comm.agree

    def recording(group, config, **kwargs):
        agreed.append(agree(group, config, **kwargs))
        return agreed[-1]

    monkeypatch.setattr(comm, "agree", recording)
    try:
        with torch.set_grad_enabled(grad_mode):
            out = op(*tensors, **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        grads = ()
        if out.requires_grad:
            grads = torch.autograd.grad(out.sum(), [x for x in tensors if x.requires_grad])
        return ("ok", agreed, out.detach(), grads)
    except (TypeError, ValueError) as error:
        return ("error", type(error), str(error))
    finally:
        monkeypatch.setattr(comm, "agree", agree)


def assert_same(checked, fresh) -> None:
    assert checked[0] == fresh[0], (checked, fresh)
    if checked[0] == "error":
        assert checked[1:] == fresh[1:]
        return
    assert checked[1] == fresh[1]
    torch.testing.assert_close(checked[2], fresh[2], rtol=0, atol=0, equal_nan=True)
    assert len(checked[3]) == len(fresh[3])
    for a, b in zip(checked[3], fresh[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def nan_k():
    q, k, v = qkv()
    k[1, 3, 0, 5] = float("nan")
    return [q, k, v]


MASK = torch.zeros(2, 8, dtype=torch.bool)
SOME_MASKED = MASK.clone()
SOME_MASKED[0, 2:5] = True

# (tensors, keyword arguments, grad mode): each differs from one before it in one thing,
# often a value that a hash would take as equal (True and 1, 0.0 and False, a list and a
# tuple, 4 and 4.0)
DILATED_CALLS = [
    (qkv(), {}, True),
    (qkv(), {"is_causal": True}, True),
    (qkv(), {"is_causal": 1}, True),
    (qkv(), {"dropout_p": 0}, True),
    (qkv(), {"dropout_p": False}, True),
    (qkv(), {"scale": 1}, True),
    (qkv(), {"scale": 1.0}, True),
    (qkv(), {"scale": True}, True),
    (qkv(), {"segment_lengths": [4]}, True),
    (qkv(), {"segment_lengths": [4.0]}, True),
    (qkv(), {"segment_lengths": [True]}, True),
    (qkv(), {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}, True),
    (qkv(), {"segment_lengths": [4, 8], "dilation_rates": [1]}, True),
    (qkv(), {"dilation_rates": [5]}, True),
    (qkv(), {"return_lse": True}, True),
    (qkv(), {"return_lse": 1}, True),
    (qkv(), {"backend": "blockwise"}, True),
    (qkv(), {"backend": "triton"}, True),
    (qkv(torch.float64), {"backend": "triton"}, True),
    (qkv(), {"backend": "cuda_cudnn"}, True),
    (qkv(), {"backend": "nope"}, True),
    (qkv(), {"cu_seqlens": [0, 8]}, True),
    (qkv(), {"cu_seqlens": [0, 3, 8]}, True),
    (qkv(), {"cu_seqlens": (0, 3, 8)}, True),
    (qkv(), {"cu_seqlens": torch.tensor([0, 3, 8])}, True),
    (qkv(), {"cu_seqlens": [0, 3, 9]}, True),
    (qkv(), {"key_padding_mask": MASK}, True),
    (qkv(), {"key_padding_mask": SOME_MASKED}, True),
    (qkv(), {"key_padding_mask": MASK}, True),
    (qkv(), {"key_padding_mask": SOME_MASKED.float()}, True),
    (qkv(), {"key_padding_mask": SOME_MASKED[:, :4]}, True),
    (qkv(), {"strategy": "ulysses"}, True),
    (qkv(), {"strategy": "ring"}, True),
    (qkv(), {"layout": "zigzag"}, True),
    (qkv(), {"window_size": [-1, -1]}, True),
    (qkv(), {"window_size": (-1, 0)}, True),
    (qkv(torch.float64), {}, True),
    (qkv(torch.float16), {}, True),
    (qkv(h=3, hk=2), {}, True),
    (qkv(requires_grad=True), {}, True),
    (qkv(requires_grad=True), {}, False),
    (qkv(requires_grad=True), {"backend": "triton"}, True),
    (nan_k(), {}, True),
    (nan_k(), {"backend": "triton"}, True),
    (qkv()[:2] + [qkv()[2].tolist()], {}, True),
]


@pytest.mark.parametrize("op, calls", [
    (lambda q, k, v, segment_lengths=(4,), dilation_rates=(1,), **kw:
     dilated_attention(q, k, v, segment_lengths, dilation_rates, **kw), DILATED_CALLS),
    (ring_attention, [
        (qkv(), {}, True),
        (qkv(), {"is_causal": True}, True),
        (qkv(), {"is_causal": 1}, True),
        (qkv(), {"window_size": (2, 0), "is_causal": True}, True),
        (qkv(), {"window_size": (2, 1), "is_causal": True}, True),
        (qkv(), {"cu_seqlens": [0, 3, 8]}, True),
        (qkv(), {"key_padding_mask": SOME_MASKED}, True),
        (qkv(), {"key_padding_mask": SOME_MASKED[:, :4]}, True),
        (qkv(requires_grad=True), {}, True),
        (nan_k(), {}, True),
        (qkv(), {"backend": "nope"}, True),
    ]),
], ids=["dilated_attention", "ring_attention"])
def test_a_checked_signature_changes_no_outcome(monkeypatch, op, calls) -> None:
    checked = validation.CheckedCalls()
    for tensors, kwargs, grad_mode in calls:
        monkeypatch.setattr(functional, "_DILATED_CALLS", checked)
        monkeypatch.setattr(functional, "_RING_CALLS", checked)
        got = outcome(monkeypatch, op, tensors, kwargs, grad_mode=grad_mode)
        fresh = validation.CheckedCalls()
        monkeypatch.setattr(functional, "_DILATED_CALLS", fresh)
        monkeypatch.setattr(functional, "_RING_CALLS", fresh)
        assert_same(got, outcome(monkeypatch, op, tensors, kwargs, grad_mode=grad_mode))
    # the calls that passed are kept (one signature was not: a tensor cu_seqlens)
    assert len(checked._checked) > len(calls) // 3


def test_the_static_checks_run_once_per_signature(monkeypatch) -> None:
    monkeypatch.setattr(functional, "_DILATED_CALLS", validation.CheckedCalls())
    calls = []
    check_patterns = validation.check_patterns
    monkeypatch.setattr(validation, "check_patterns",
                        lambda *args: calls.append(args) or check_patterns(*args))
    q, k, v = qkv()
    for _ in range(3):
        dilated_attention(q, k, v, [4], [1])
    assert len(calls) == 1
    dilated_attention(q, k, v, [4], [1], is_causal=True)
    dilated_attention(q[:, :4], k[:, :4], v[:, :4], [4], [1])
    dilated_attention(q, k, v, (4,), (1,))  # a tuple is another key (no harm)
    assert len(calls) == 4
    dilated_attention(q, k, v, [4], [1])
    assert len(calls) == 4
    # a bad call is checked, and raises, every time
    for _ in range(2):
        with pytest.raises(ValueError, match="dilation_rates"):
            dilated_attention(q, k, v, [4], [5])
    assert len(calls) == 6


def test_transforms_are_refused_after_a_checked_call() -> None:
    q, k, v = qkv()
    dilated_attention(q, k, v, [4], [1])
    with pytest.raises(ValueError, match="vmap"):
        torch.func.vmap(lambda q: dilated_attention(q, k, v, [4], [1]))(q[None])
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(ValueError, match="forward-mode AD"):
            dilated_attention(dual, k, v, [4], [1])


def test_the_memo_is_bounded() -> None:
    calls = validation.CheckedCalls(size=2)
    checks = []

    def check(value):
        return lambda: checks.append(value) or {"value": value}

    assert calls.get("a", check(1))["value"] == 1
    assert calls.get("a", check(2))["value"] == 1
    assert calls.get(None, check(3))["value"] == 3
    assert calls.get(None, check(4))["value"] == 4
    calls.get("b", check(5))
    calls.get("c", check(6))
    assert len(calls._checked) <= 2
    assert checks == [1, 3, 4, 5, 6]
    with pytest.raises(TypeError):  # read-only: a caller cannot change a kept configuration
        calls.get("c", check(7))["value"] = 0


def test_signatures() -> None:
    q, k, v = qkv()
    key = validation.signature((q, k, v, None), ([4], 1.0, True, None, "x"))
    assert key == validation.signature((q, k, v, None), ([4], 1.0, True, None, "x"))
    for values in (((4,), 1.0, True, None, "x"), ([4], 1, True, None, "x"),
                   ([4], 1.0, 1, None, "x"), ([4], 1.0, True, False, "x")):
        assert validation.signature((q, k, v, None), values) != key
    assert validation.signature((q, k, v, None), ([4.0],)) is None
    assert validation.signature((q, k, v, None), (torch.tensor([4]),)) is None
    assert validation.signature((torch.nn.Parameter(q), k, v, None), ()) is None
    assert validation.signature((q.double(), k, v, None), ()) != validation.signature(
        (q, k, v, None), ())
    grad_mode = validation.signature((q, k, v, None), ())
    with torch.no_grad():
        assert validation.signature((q, k, v, None), ()) != grad_mode


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors only")
def test_the_interpreter_setting_is_part_of_a_signature(monkeypatch) -> None:
    """backend="triton" on CPU tensors needs TRITON_INTERPRET=1: a signature checked with it
    is not taken for a call without it."""
    q, k, v = qkv()
    dilated_attention(q, k, v, [4], [1], backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        dilated_attention(q, k, v, [4], [1], backend="triton")


@pytest.mark.parametrize("where", ["none", "q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_finite_check_reads_back_three_sums_and_dispatches_nothing_else(where, bad):
    """Every call's check for NaN and infinity (functional._all_finite): a reduction per
    tensor, read back once and compared in Python, not by ops of its own on the device; it
    finds a non-finite entry in any of q, k, v."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    tensors = qkv()
    if where != "none":
        tensors["qkv".index(where)][1, 3, 0, 5] = bad
    with Ops() as dispatched:
        finite = functional._all_finite(*tensors)
    assert finite == (where == "none")
    assert set(dispatched.ops) <= {"empty", "select", "sum"}, dispatched.ops
