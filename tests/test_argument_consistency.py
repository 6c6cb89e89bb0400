"""One argument, one rule: every entry point that takes the same kind of value accepts and
refuses it alike, with the same error (one validator per idea, validation.py).

Each test runs one value through several entry points and compares the outcomes (small
inputs: seconds in all)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dilated_attention import dilated_attention, ring_attention
from dist_harness import error_of


def outcome(call) -> str:
    """"no error", or the error's type and message."""
    return error_of(call)[0]


def qkv(n: int = 8):
    torch.manual_seed(0)
    return tuple(torch.randn(1, n, 2, 4) for _ in range(3))


# ---------------------------------------------------------------- windows

WINDOW_OPS = {
    "dilated_attention": lambda q, k, v, **kw: dilated_attention(q, k, v, [4], [1], **kw),
    "ring_attention": ring_attention,
}


@pytest.mark.parametrize("op", sorted(WINDOW_OPS))
@pytest.mark.parametrize("window", [(-1, -1), [-1, -1], (np.int64(-1), np.int64(-1)),
                                    (np.int32(-1), -1)], ids=["tuple", "list", "np.int64",
                                                              "np.int32"])
def test_every_form_of_the_unbounded_window_is_accepted(op: str, window) -> None:
    q, k, v = qkv()
    want = WINDOW_OPS[op](q, k, v)
    assert torch.equal(WINDOW_OPS[op](q, k, v, window_size=window), want)


@pytest.mark.parametrize("window", [(-2, 0), (1.0, 2), (True, -1), (1, 2, 3), None, "ab",
                                    np.array([-1, -1]), torch.tensor([-1, -1])])
def test_a_malformed_window_is_the_same_error_from_both_ops(window) -> None:
    q, k, v = qkv()
    seen = {op: outcome(lambda: call(q, k, v, window_size=window))
            for op, call in WINDOW_OPS.items()}
    assert len(set(seen.values())) == 1, seen
    assert seen["ring_attention"].startswith("ValueError: window_size must be a pair")
