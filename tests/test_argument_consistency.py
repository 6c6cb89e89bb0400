"""One argument, one rule: every entry point that takes the same kind of value accepts and
refuses it alike, with the same error (one validator per idea, validation.py).

Each test runs one value through several entry points and compares the outcomes (small
inputs: seconds in all)."""

from __future__ import annotations

import functools
import math

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


# ---------------------------------------------------------------- groups


def _group_entry_points():
    """name -> (argument name, call(group)) for every public function that takes a group."""
    from dilated_attention import (DilatedAttention, LongNetConfig, LongNetLM,
                                   MultiheadDilatedAttention, all_reduce_gradients,
                                   shard_sequence, unshard_sequence)

    q, k, v = qkv()
    tiny = LongNetConfig.from_name("tiny", num_layers=1)
    entries = {
        "dilated_attention": ("group", lambda g: WINDOW_OPS["dilated_attention"](q, k, v,
                                                                                   group=g)),
        "ring_attention": ("group", lambda g: ring_attention(q, k, v, group=g)),
        "shard_sequence": ("group", lambda g: shard_sequence(q, g)),
        "unshard_sequence": ("group", lambda g: unshard_sequence(q, g)),
        "all_reduce_gradients": ("group", lambda g: all_reduce_gradients(torch.nn.Linear(2, 2),
                                                                         g)),
        "DilatedAttention": ("process_group", lambda g: DilatedAttention([4], [1],
                                                                         process_group=g)),
        "MultiheadDilatedAttention": ("process_group", lambda g: MultiheadDilatedAttention(
            8, 2, [4], [1], process_group=g)),
        "LongNetLM": ("process_group", lambda g: LongNetLM(tiny, process_group=g)),
    }
    try:
        from dilated_attention.integrations.transformers import (causal_lm_loss, register,
                                                                shard_inputs)
    except ImportError:  # transformers not installed: the library's own entry points only
        return entries
    ids = torch.zeros(1, 4, dtype=torch.long)
    entries.update({
        "transformers.register": ("group", lambda g: register(
            "consistency", segment_lengths=[4], dilation_rates=[1], group=g, replace=True)),
        "transformers.shard_inputs": ("group", lambda g: shard_inputs(ids, g)),
        "transformers.causal_lm_loss": ("group", lambda g: causal_lm_loss(
            torch.zeros(1, 4, 8), ids, g)),
    })
    return entries


GROUP_ENTRIES = _group_entry_points()


@pytest.mark.parametrize("entry", sorted(GROUP_ENTRIES))
@pytest.mark.parametrize("group", [0, "world", [0], object()],
                         ids=["int", "str", "list", "object"])
def test_a_group_of_the_wrong_kind_is_the_same_type_error_everywhere(entry: str, group) -> None:
    name, call = GROUP_ENTRIES[entry]
    assert outcome(lambda: call(group)) == (
        f"TypeError: {name} must be None, a torch.distributed.ProcessGroup or a 1-D/2-D "
        f"DeviceMesh, got {type(group).__name__} {group!r}")


# ---------------------------------------------------------------- ints


@pytest.mark.parametrize("op", ["shard_sequence", "unshard_sequence"])
def test_dim_takes_what_torch_takes_for_a_dim(op: str) -> None:
    import dilated_attention

    call = getattr(dilated_attention, op)
    x = torch.arange(12.0).reshape(1, 6, 2)
    for dim in (np.int64(1), np.int32(-2)):
        assert torch.equal(call(x, None, dim=dim), call(x, None, dim=1))
    for dim in (True, 1.0, "1", torch.tensor(1)):
        assert outcome(lambda: call(x, None, dim=dim)) == (
            f"TypeError: dim must be an int, got {dim!r} ({type(dim).__name__})")


# ---------------------------------------------------------------- padding masks (1 = real token)


def _tiny_llama():
    """A one-layer Llama over 64 ids on the dilated backend, or None without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from dilated_attention.integrations.transformers import register
    except ImportError:
        return None
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, attn_implementation=register(
            "consistency", segment_lengths=[4], dilation_rates=[1], replace=True))).eval()


def _attention_mask_entry_points():
    """name -> call(mask) on the ids (1, 4) of 0 .. 3, for every public function that takes a
    padding mask for token ids."""
    from dilated_attention import LongNetConfig, LongNetLM

    torch.manual_seed(0)
    ids = torch.arange(4)[None]
    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]))
    entries = {"LongNetLM.generate": lambda m: lm.generate(ids, 1, attention_mask=m)}
    model = _tiny_llama()
    if model is None:  # transformers not installed: the library's own entry point only
        return entries
    from dilated_attention.integrations import transformers as hf

    entries.update({
        "transformers.generate": lambda m: hf.generate(model, ids, group=None, max_new_tokens=1,
                                                       attention_mask=m, pad_token_id=0),
        "transformers.shard_inputs": lambda m: hf.shard_inputs(ids, None, attention_mask=m),
    })
    return entries


MASK_ENTRIES = _attention_mask_entry_points()
LEFT_PADDED = [[0, 1, 1, 1]]


@pytest.mark.parametrize("entry", sorted(MASK_ENTRIES))
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64, torch.float32])
def test_a_padding_mask_of_any_real_dtype_is_the_same_mask(entry: str, dtype) -> None:
    call = MASK_ENTRIES[entry]
    got = call(torch.tensor(LEFT_PADDED, dtype=dtype))
    want = call(torch.tensor(LEFT_PADDED))
    if isinstance(got, tuple):  # shard_inputs: (inputs, targets)
        got, want = got[0]["attention_mask"].long(), want[0]["attention_mask"]
    assert torch.equal(got, want)


BAD_MASKS = {
    "list": ([[1, 1, 1, 1]], "TypeError: attention_mask must be a bool, integer or float "
                             "tensor of 0s (padding) and 1s (real tokens), got list"),
    "complex": (torch.ones(1, 4, dtype=torch.complex64),
                "TypeError: attention_mask must be a bool, integer or float tensor of 0s "
                "(padding) and 1s (real tokens), got torch.complex64"),
    "shape": (torch.ones(1, 5), "ValueError: attention_mask must have {ids}' shape (1, 4), "
                                "got (1, 5)"),
    "meta": (torch.ones(1, 4, device="meta"), "ValueError: attention_mask must hold values: "
                                              "got a tensor on the meta device (shapes only)"),
    "values": (torch.full((1, 4), 2), "ValueError: attention_mask must hold 0 (padding) and 1 "
                                      "(real token) only"),
    "half": (torch.full((1, 4), 0.5), "ValueError: attention_mask must hold 0 (padding) and 1 "
                                      "(real token) only"),
}


@pytest.mark.parametrize("entry", sorted(MASK_ENTRIES))
@pytest.mark.parametrize("bad", sorted(BAD_MASKS))
def test_a_bad_padding_mask_is_the_same_error_everywhere(entry: str, bad: str) -> None:
    mask, want = BAD_MASKS[bad]
    ids = "tokens" if entry == "LongNetLM.generate" else "input_ids"
    assert outcome(lambda: MASK_ENTRIES[entry](mask)) == want.format(ids=ids)


# ---------------------------------------------------------------- reals


def _real_entry_points():
    """name -> (argument, what it must be, a valid value, call(value)) for every public real
    argument: one validator (validation.check_real), one wording."""
    from dilated_attention import (DilatedAttention, LongNetConfig, LongNetLM,
                                   MultiheadDilatedAttention, rotary_tables)

    q, k, v = qkv()
    positive, probability = "a positive finite float", "a float in [0, 1)"
    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]))
    ids = torch.arange(4)[None]
    config = functools.partial(LongNetConfig.from_name, "tiny")
    return {
        "dilated_attention.scale": ("scale", positive, 0.5, lambda x: WINDOW_OPS[
            "dilated_attention"](q, k, v, scale=x)),
        "ring_attention.scale": ("scale", positive, 0.5, lambda x: ring_attention(q, k, v,
                                                                                  scale=x)),
        "DilatedAttention.scale": ("scale", positive, 0.5, lambda x: DilatedAttention(
            [4], [1], scale=x)),
        "MultiheadDilatedAttention.gamma_init": ("gamma_init", positive, 0.5, lambda x:
                                                 MultiheadDilatedAttention(8, 2, [4], [1],
                                                                           gamma_init=x)),
        "rotary_tables.theta": ("theta", positive, 0.5, lambda x: rotary_tables(
            torch.arange(4), 4, theta=x)),
        "LongNetConfig.rope_theta": ("rope_theta", positive, 0.5, lambda x: config(
            rope_theta=x)),
        "dilated_attention.dropout_p": ("dropout_p", probability, 0.5, lambda x: WINDOW_OPS[
            "dilated_attention"](q, k, v, dropout_p=x)),
        "DilatedAttention.dropout": ("dropout", probability, 0.5, lambda x: DilatedAttention(
            [4], [1], dropout=x)),
        "LongNetConfig.attention_dropout": ("attention_dropout", probability, 0.5,
                                            lambda x: config(attention_dropout=x)),
        "LongNetLM.generate.temperature": ("temperature", "a finite float >= 0", 0.5,
                                           lambda x: lm.generate(ids, 1, temperature=x)),
        "LongNetLM.generate.top_p": ("top_p", "a float in (0, 1] or None", 0.5,
                                     lambda x: lm.generate(ids, 1, temperature=1.0, top_p=x)),
    }


REAL_ENTRIES = _real_entry_points()


@pytest.mark.parametrize("entry", sorted(REAL_ENTRIES))
def test_a_real_takes_python_and_numpy_numbers_and_refuses_the_rest_alike(entry: str) -> None:
    name, what, good, call = REAL_ENTRIES[entry]
    for value in (good, np.float64(good), np.float32(good)):
        assert outcome(lambda: call(value)) == "no error", value
    for bad in (True, str(good), torch.tensor(good)):
        assert outcome(lambda: call(bad)) == (
            f"TypeError: {name} must be {what}, got {bad!r} ({type(bad).__name__})")
    for bad in (math.nan, -math.inf, -1.0):
        assert outcome(lambda: call(bad)) == f"ValueError: {name} must be {what}, got {bad}"


# ---------------------------------------------------------------- across ranks


def _one_rank_differs(group) -> dict:
    """Each case's outcome on this rank: rank 1 alone passes the odd value."""
    from dilated_attention import LongNetConfig, LongNetLM, unshard_sequence
    from dilated_attention.distributed import comm

    odd = comm.group_rank(group) == 1
    q, k, v = qkv(4)
    op = WINDOW_OPS["dilated_attention"]
    numpy_window = (np.int64(-1), np.int64(-1)) if odd else (-1, -1)
    torch.manual_seed(0)
    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]), process_group=group)
    results = {
        # the same window in another form on each rank: the same call
        "window_forms": torch.equal(op(q, k, v, group=group, window_size=numpy_window),
                                    op(q, k, v, group=group)),
        "window": outcome(lambda: op(q, k, v, group=group, window_size=(
            np.int64(2) if odd else -1, np.int64(0) if odd else -1))),
        "scale": outcome(lambda: ring_attention(q, k, v, group=group,
                                                scale=True if odd else 0.5)),
        "dim": outcome(lambda: unshard_sequence(q, group, dim=True if odd else 1)),
        "temperature": outcome(lambda: lm.generate(torch.arange(4)[None], 1, temperature=(
            np.float64(math.nan) if odd else 1.0))),
    }
    try:
        from dilated_attention.integrations.transformers import shard_inputs
    except ImportError:
        return results
    results["attention_mask"] = outcome(lambda: shard_inputs(
        torch.arange(4)[None], group, attention_mask=torch.full((1, 4), 2 if odd else 1)))
    return results


def test_a_refusal_on_one_rank_is_an_error_on_every_rank() -> None:
    from dist_harness import run_distributed

    others, odd = run_distributed(_one_rank_differs, 2, timeout=120)
    assert others.pop("window_forms") and odd.pop("window_forms")
    assert set(odd) == set(others)
    for case, own in odd.items():
        assert own.split(":")[0] in ("TypeError", "ValueError"), (case, own)
        assert others[case] == (f"ValueError: the call failed on another rank of the group "
                                f"(rank 1: {own})"), (case, others[case])


# ---------------------------------------------------------------- document boundaries


def _cu_seqlens_entry_points():
    """name -> call(cu_seqlens) over 8 rows, for every public function that takes them."""
    from dilated_attention import (DilatedAttention, LongNetConfig, LongNetLM,
                                   MultiheadDilatedAttention)

    q, k, v = qkv()
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(8, 2, [4], [1])
    x = torch.randn(1, 8, 8)
    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]))
    return {
        "dilated_attention": lambda cu: WINDOW_OPS["dilated_attention"](q, k, v, cu_seqlens=cu),
        "ring_attention": lambda cu: ring_attention(q, k, v, cu_seqlens=cu),
        "DilatedAttention": lambda cu: DilatedAttention([4], [1])(q, k, v, cu_seqlens=cu),
        "MultiheadDilatedAttention": lambda cu: mha(x, x, x, cu_seqlens=cu)[0],
        "LongNetLM": lambda cu: lm(torch.arange(8)[None], cu_seqlens=cu)[0],
    }


CU_ENTRIES = _cu_seqlens_entry_points()


@pytest.mark.parametrize("entry", sorted(CU_ENTRIES))
def test_document_boundaries_in_every_form_are_the_same_documents(entry: str) -> None:
    call = CU_ENTRIES[entry]
    want = call([0, 3, 8])
    for cu in ((0, 3, 8), [np.int64(0), np.int32(3), np.int64(8)],
               torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8])):
        assert torch.equal(call(cu), want), cu


BAD_CU_SEQLENS = {
    "bool": ([0, True, 8], "TypeError: cu_seqlens[1] must be an int, got True (bool)"),
    "float": ([0, 3.0, 8], "TypeError: cu_seqlens[1] must be an int, got 3.0 (float)"),
    "tensor entry": ([0, torch.tensor(3), 8],
                     "TypeError: cu_seqlens[1] must be an int, got tensor(3) (Tensor)"),
    "numpy array": (np.array([0, 3, 8]), "TypeError: cu_seqlens must be an int tensor or a "
                                         "sequence of ints, got array([0, 3, 8])"),
    "float tensor": (torch.tensor([0.0, 8.0]), "TypeError: cu_seqlens must hold integers, got "
                                               "a tensor of torch.float32"),
    "unsorted": ([0, 5, 3, 8], "ValueError: cu_seqlens must be non-decreasing, got "
                               "cu_seqlens[1] = 5 > cu_seqlens[2] = 3 in [0, 5, 3, 8]"),
    "not from 0": ([1, 8], "ValueError: cu_seqlens must start at 0 and end at the sequence "
                           "length, got [1, 8]"),
    "not to n": ([0, 3, 7], "ValueError: cu_seqlens must end at the sequence length 8, got 7 "
                            "(cu_seqlens [0, 3, 7])"),
}


@pytest.mark.parametrize("entry", sorted(CU_ENTRIES))
@pytest.mark.parametrize("bad", sorted(BAD_CU_SEQLENS))
def test_bad_document_boundaries_are_the_same_error_everywhere(entry: str, bad: str) -> None:
    cu, want = BAD_CU_SEQLENS[bad]
    assert outcome(lambda: CU_ENTRIES[entry](cu)) == want


# ---------------------------------------------------------------- sizes, patterns, flags, masks


def _size_entry_points():
    """name -> (argument, call(value)) for public positive-int arguments (a valid value 4)."""
    from dilated_attention import (LongNetConfig, LongNetLM, MultiheadDilatedAttention,
                                   rotary_tables)

    q, k, v = qkv()
    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]))
    ids = torch.arange(4)[None]
    return {
        "dilated_attention.segment_lengths[0]": ("segment_lengths[0]", lambda x:
                                                 dilated_attention(q, k, v, [x], [1])),
        "MultiheadDilatedAttention.num_heads": ("num_heads", lambda x: MultiheadDilatedAttention(
            8, x, [4], [1])),
        "MultiheadDilatedAttention.num_kv_heads": ("num_kv_heads", lambda x:
                                                   MultiheadDilatedAttention(8, 4, [4], [1],
                                                                             num_kv_heads=x)),
        "LongNetConfig.num_heads": ("num_heads", lambda x: LongNetConfig.from_name(
            "tiny", num_heads=x)),
        "rotary_tables.head_dim": ("head_dim", lambda x: rotary_tables(torch.arange(4), x)),
        "LongNetLM.generate.max_new_tokens": ("max_new_tokens", lambda x: lm.generate(ids, x)),
        "LongNetLM.generate.top_k": ("top_k", lambda x: lm.generate(ids, 1, temperature=1.0,
                                                                     top_k=x)),
    }


SIZE_ENTRIES = _size_entry_points()


@pytest.mark.parametrize("entry", sorted(SIZE_ENTRIES))
def test_a_size_takes_python_and_numpy_ints_and_refuses_the_rest_alike(entry: str) -> None:
    name, call = SIZE_ENTRIES[entry]
    for value in (4, np.int64(4), np.int32(4)):
        assert outcome(lambda: call(value)) == "no error", value
    # True is an int in Python, not a size; 4.0 is not an int
    for bad in (True, 4.0, np.float64(4.0), "4", torch.tensor(4)):
        assert outcome(lambda: call(bad)) == (
            f"TypeError: {name} must be a positive int, got {bad!r} ({type(bad).__name__})")
    for bad in (0, -4, np.int64(-4)):
        assert outcome(lambda: call(bad)) == (
            f"ValueError: {name} must be a positive int, got {bad}")


def _pattern_entry_points():
    """name -> call(segment_lengths) with dilation_rates [1, 2]."""
    from dilated_attention import DilatedAttention, LongNetConfig, MultiheadDilatedAttention

    q, k, v = qkv()
    entries = {
        "dilated_attention": lambda s: dilated_attention(q, k, v, s, [1, 2]),
        "DilatedAttention": lambda s: DilatedAttention(s, [1, 2]),
        "MultiheadDilatedAttention": lambda s: MultiheadDilatedAttention(8, 2, s, [1, 2]),
        "LongNetConfig": lambda s: LongNetConfig.from_name("tiny", segment_lengths=s,
                                                           dilation_rates=[1, 2]),
    }
    try:
        from dilated_attention.integrations.transformers import register
    except ImportError:
        return entries
    entries["transformers.register"] = lambda s: register(
        "consistency", segment_lengths=s, dilation_rates=[1, 2], replace=True)
    return entries


PATTERN_ENTRIES = _pattern_entry_points()


@pytest.mark.parametrize("entry", sorted(PATTERN_ENTRIES))
def test_pattern_lists_are_taken_and_refused_alike(entry: str) -> None:
    call = PATTERN_ENTRIES[entry]
    for value in ([4, 8], (4, 8), [np.int64(4), np.int32(8)], range(4, 9, 4)):
        assert outcome(lambda: call(value)) == "no error", value
    # as torch takes a size list: not an array, a tensor or a generator
    for bad in (np.array([4, 8]), torch.tensor([4, 8]), "48"):
        assert outcome(lambda: call(bad)) == (
            f"TypeError: segment_lengths must be a list of positive ints, got {bad!r}")
    assert outcome(lambda: call([True, 8])) == (
        "TypeError: segment_lengths[0] must be a positive int, got True (bool)")
    assert outcome(lambda: call([])) == "ValueError: segment_lengths must not be empty, got []"


def _key_mask_entry_points():
    """name -> call(key_padding_mask) over q (1, 8, 2, 4)."""
    from dilated_attention import DilatedAttention, MultiheadDilatedAttention

    q, k, v = qkv()
    mha = MultiheadDilatedAttention(8, 2, [4], [1])
    x = torch.randn(1, 8, 8)
    return {
        "dilated_attention": lambda m: WINDOW_OPS["dilated_attention"](q, k, v,
                                                                       key_padding_mask=m),
        "ring_attention": lambda m: ring_attention(q, k, v, key_padding_mask=m),
        "DilatedAttention": lambda m: DilatedAttention([4], [1])(q, k, v, key_padding_mask=m),
        "MultiheadDilatedAttention": lambda m: mha(x, x, x, key_padding_mask=m),
    }


KEY_MASK_ENTRIES = _key_mask_entry_points()


@pytest.mark.parametrize("entry", sorted(KEY_MASK_ENTRIES))
def test_a_key_padding_mask_is_taken_and_refused_alike(entry: str) -> None:
    call = KEY_MASK_ENTRIES[entry]
    assert outcome(lambda: call(torch.zeros(1, 8, dtype=torch.bool))) == "no error"
    for dtype in (torch.int64, torch.float32):
        assert outcome(lambda: call(torch.zeros(1, 8, dtype=dtype))) == (
            f"TypeError: key_padding_mask must be a bool tensor (True = ignore that key), got "
            f"{dtype}")
    assert outcome(lambda: call(np.zeros((1, 8), dtype=bool))) == (
        "TypeError: key_padding_mask must be a bool tensor or None, got ndarray")
    assert outcome(lambda: call(torch.zeros(1, 9, dtype=torch.bool))) == (
        "ValueError: key_padding_mask must have shape (batch, seq_len) = (1, 8), got (1, 9)")
    assert outcome(lambda: call(torch.zeros(1, 8, dtype=torch.bool, device="meta"))) == (
        "ValueError: key_padding_mask must be on q's device cpu, got meta")


@pytest.mark.parametrize("entry", sorted(KEY_MASK_ENTRIES))
def test_is_causal_is_a_bool_everywhere(entry: str) -> None:
    from dilated_attention import DilatedAttention, MultiheadDilatedAttention

    q, k, v = qkv()
    x = torch.randn(1, 8, 8)
    call = {"dilated_attention": lambda c: WINDOW_OPS["dilated_attention"](q, k, v, is_causal=c),
            "ring_attention": lambda c: ring_attention(q, k, v, is_causal=c),
            "DilatedAttention": lambda c: DilatedAttention([4], [1])(q, k, v, is_causal=c),
            "MultiheadDilatedAttention": lambda c: MultiheadDilatedAttention(8, 2, [4], [1])(
                x, x, x, is_causal=c)}[entry]
    assert outcome(lambda: call(True)) == "no error"
    # as F.scaled_dot_product_attention's is_causal: a NumPy bool or an int is no bool
    for bad in (np.bool_(True), 1, torch.tensor(True), None):
        assert outcome(lambda: call(bad)) == f"TypeError: is_causal must be a bool, got {bad!r}"


def test_a_config_keeps_its_numbers_as_python_numbers() -> None:
    import dataclasses
    import json

    from dilated_attention import LongNetConfig

    config = LongNetConfig.from_name(
        "tiny", num_heads=np.int64(4), rope_theta=np.float32(500.0), dropout=np.float32(0.25),
        attention_dropout=np.float64(0.5), layer_norm_eps=np.float32(1e-6))
    for name in ("num_heads", "rope_theta", "dropout", "attention_dropout", "layer_norm_eps"):
        assert type(getattr(config, name)) in (int, float), name
    json.dumps(dataclasses.asdict(config))


@pytest.mark.parametrize("dtype", [torch.int64, "float32", torch.complex64])
def test_a_parameter_dtype_the_ops_do_not_run_is_the_same_error_everywhere(dtype) -> None:
    from dilated_attention import LongNet, LongNetConfig, LongNetLM, MultiheadDilatedAttention

    tiny = LongNetConfig.from_name("tiny", num_layers=1, num_encoder_layers=1)
    want = (f"TypeError: dtype must be None, torch.float64, float32, float16 or bfloat16, got "
            f"{dtype!r}")
    for build in (lambda: MultiheadDilatedAttention(8, 2, [4], [1], dtype=dtype),
                  lambda: LongNetLM(tiny, dtype=dtype), lambda: LongNet(tiny, dtype=dtype)):
        assert outcome(build) == want


# ---------------------------------------------------------------- positions


def _position_entry_points():
    """name -> call(position_ids) for 8 tokens in one batch row."""
    from dilated_attention import LongNetConfig, LongNetLM

    lm = LongNetLM(LongNetConfig.from_name("tiny", num_layers=1, segment_lengths=[4],
                                           dilation_rates=[1]))
    ids = torch.arange(8)[None]
    entries = {"LongNetLM": lambda p: lm(ids, position_ids=p)}
    try:
        from dilated_attention.integrations.transformers import shard_inputs
    except ImportError:
        return entries
    entries["transformers.shard_inputs"] = lambda p: shard_inputs(ids, None, position_ids=p)
    return entries


POSITION_ENTRIES = _position_entry_points()


@pytest.mark.parametrize("entry", sorted(POSITION_ENTRIES))
def test_position_ids_are_taken_and_refused_alike(entry: str) -> None:
    call = POSITION_ENTRIES[entry]
    for positions in (torch.arange(8), torch.arange(8)[None],
                      torch.arange(8, dtype=torch.int32)[None],
                      torch.arange(8, dtype=torch.int16)[None]):
        assert outcome(lambda: call(positions)) == "no error", positions.dtype
    for bad, got in ((torch.arange(8.0), "a torch.float32 tensor"),
                     (torch.ones(8, dtype=torch.bool), "a torch.bool tensor"),
                     (list(range(8)), "list"), (np.arange(8), "ndarray")):
        assert outcome(lambda: call(bad)) == f"TypeError: position_ids must be an integer " \
                                             f"tensor, got {got}"
    for bad in (torch.arange(9)[None], torch.arange(8).expand(2, 8)):
        assert outcome(lambda: call(bad)) == (
            f"ValueError: position_ids must be (seq_len,), (1, seq_len) or (batch, seq_len) for "
            f"(batch, seq_len) = (1, 8), got {tuple(bad.shape)}")
    assert outcome(lambda: call(torch.arange(8, device="meta"))) == (
        "ValueError: position_ids must hold values: got a tensor on the meta device (shapes "
        "only)")


# ---------------------------------------------------------------- token ids


def _token_entry_points():
    """name -> (argument, call(ids)) for every public function that takes token ids (1, 4)."""
    from dilated_attention import LongNet, LongNetConfig, LongNetLM

    tiny = LongNetConfig.from_name("tiny", num_layers=1, num_encoder_layers=1,
                                   segment_lengths=[4], dilation_rates=[1])
    lm, encoder_decoder = LongNetLM(tiny), LongNet(tiny)
    ids = torch.arange(4)[None]
    entries = {
        "LongNetLM.forward": ("tokens", lambda t: lm(t)),
        "LongNetLM.generate": ("tokens", lambda t: lm.generate(t, 1)),
        "LongNet.forward": ("src_tokens", lambda t: encoder_decoder(t, ids)),
    }
    try:
        from dilated_attention.integrations.transformers import shard_inputs
    except ImportError:
        return entries
    entries["transformers.shard_inputs"] = ("input_ids", lambda t: shard_inputs(t, None))
    model = _tiny_llama()
    if model is not None:
        from dilated_attention.integrations.transformers import generate

        entries["transformers.generate"] = ("input_ids", lambda t: generate(
            model, t, group=None, max_new_tokens=1, pad_token_id=0))
    return entries


TOKEN_ENTRIES = _token_entry_points()


@pytest.mark.parametrize("entry", sorted(TOKEN_ENTRIES))
def test_token_ids_are_taken_and_refused_alike(entry: str) -> None:
    name, call = TOKEN_ENTRIES[entry]
    ids = torch.arange(4)[None]
    for good in (ids, ids.int()):
        assert outcome(lambda: call(good)) == "no error", good.dtype
    # what nn.Embedding indexes with: int64 or int32
    for dtype in (torch.int16, torch.uint8, torch.bool, torch.float32):
        assert outcome(lambda: call(ids.to(dtype))) == (
            f"TypeError: {name} must hold integer token ids (int64 or int32), got {dtype}")
    assert outcome(lambda: call(ids.tolist())) == f"TypeError: {name} must be a torch.Tensor, " \
                                                  f"got list"
    assert outcome(lambda: call(ids[0])) == (
        f"ValueError: {name} must be 2-D (batch, seq_len), got shape (4,)")


@pytest.mark.parametrize("bad", sorted(BAD_CU_SEQLENS))
def test_transformers_boundaries_are_checked_alike_under_their_own_name(bad: str) -> None:
    """cu_seq_lens_q/_k (transformers' names for cu_seqlens): the same check and words."""
    model = _tiny_llama()
    if model is None:
        pytest.skip("transformers is not installed")
    cu, want = BAD_CU_SEQLENS[bad]
    got = outcome(lambda: model(torch.arange(8)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                max_length_q=8, max_length_k=8))
    assert got == want.replace("cu_seqlens", "cu_seq_lens_q")
