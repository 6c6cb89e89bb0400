"""DilatedAttention and MultiheadDilatedAttention: shapes, state, plumbing, equivalences, errors."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from dilated_attention import (DilatedAttention, MultiheadDilatedAttention, apply_rotary,
                               dilated_attention, rotary_tables)
from dilated_attention.distributed import comm

from dist_harness import SharedSpawn

PATTERNS = ([4, 8], [1, 2])


def _mhda(**kwargs) -> MultiheadDilatedAttention:
    kwargs = {"embed_dim": 16, "num_heads": 4, "segment_lengths": PATTERNS[0],
              "dilation_rates": PATTERNS[1], **kwargs}
    return MultiheadDilatedAttention(**kwargs)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("n", [1, 7, 20])
def test_shapes(num_kv_heads, n):
    torch.manual_seed(0)
    m = _mhda(num_kv_heads=num_kv_heads)
    x = torch.randn(3, n, 16)
    out, weights = m(x, x, x, is_causal=True)
    assert out.shape == (3, n, 16) and weights is None
    assert m.k_proj.weight.shape == (4 * (num_kv_heads or 4), 16)


def test_scale_reaches_the_attention():
    """scale=s equals the default scale 1/sqrt(d) with q's projection multiplied by s sqrt(d)."""
    torch.manual_seed(0)
    scaled, plain = _mhda(scale=0.3, dtype=torch.float64), _mhda(dtype=torch.float64)
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        for p in (plain.q_proj.weight, plain.q_proj.bias):
            p.mul_(0.3 * 4 ** 0.5)  # head_dim 4
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    torch.testing.assert_close(scaled(x, x, x, is_causal=True)[0],
                               plain(x, x, x, is_causal=True)[0], rtol=1e-12, atol=1e-12)
    assert "scale=0.3" in repr(scaled)


def test_state_dict_round_trip():
    torch.manual_seed(0)
    m = _mhda(num_kv_heads=2)
    with torch.no_grad():
        for p in m.parameters():  # non-default values everywhere, norms included
            p.add_(torch.randn_like(p) * 0.1)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = _mhda(num_kv_heads=2)
    fresh.load_state_dict(torch.load(buf))
    x = torch.randn(2, 13, 16)
    torch.testing.assert_close(fresh(x, x, x)[0], m(x, x, x)[0], rtol=0, atol=0)
    assert set(m.state_dict()) == {
        f"{p}.{w}"
        for p in ("q_proj", "k_proj", "v_proj", "out_proj", "norm")
        for w in ("weight", "bias")
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_plumbing(dtype):
    m = _mhda(dtype=dtype)
    assert all(p.dtype == dtype for p in m.parameters())
    x = torch.randn(2, 9, 16, dtype=dtype)
    out, _ = m(x, x, x, is_causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_meta_device_constructs():
    m = _mhda(device="meta", num_kv_heads=2)
    assert all(p.device.type == "meta" for p in m.parameters())
    assert m.k_proj.weight.shape == (8, 16)


def test_batch_first_false_takes_sequence_first_inputs():
    """batch_first=False: (n, b, e) in and out, the batch-first module's results transposed,
    gradients included; key_padding_mask stays (b, n); shape errors name the layout."""
    modules = []
    for batch_first in (True, False):
        torch.manual_seed(0)
        modules.append(MultiheadDilatedAttention(16, 4, [4, 8], [1, 2], num_kv_heads=2,
                                                 batch_first=batch_first, dtype=torch.float64))
    x = torch.randn(3, 19, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, 19, dtype=torch.bool)
    mask[1, 15:] = True
    want, _ = modules[0](x, x, x, key_padding_mask=mask, is_causal=True)
    seq_first = x.detach().transpose(0, 1).clone().requires_grad_()
    got, _ = modules[1](seq_first, seq_first, seq_first, key_padding_mask=mask, is_causal=True)
    assert got.shape == (19, 3, 16)
    torch.testing.assert_close(got, want.transpose(0, 1), rtol=1e-12, atol=1e-12)
    g = torch.randn(19, 3, 16, dtype=torch.float64)
    got.backward(g)
    want.backward(g.transpose(0, 1))
    torch.testing.assert_close(seq_first.grad, x.grad.transpose(0, 1), rtol=1e-12, atol=1e-12)
    assert "batch_first=False" in repr(modules[1])
    with pytest.raises(ValueError, match=r"query must be \(seq_len, batch, embed_dim=16\)"):
        modules[1](x[..., :8], x[..., :8], x[..., :8])
    with pytest.raises(TypeError, match="batch_first must be a bool"):
        MultiheadDilatedAttention(16, 4, [4], [1], batch_first=0)


def _llama_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' Llama rotation written out: x (b, n, h, d) at positions (b, n) or (n,),
    inverse frequencies 1 / theta^(2i/d), x cos + rotate_half(x) sin."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[..., None, :]  # (..., n, 1, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_rotary_turns_queries_and_keys_as_llama(per_row, batch_first):
    """rotary=(cos, sin) turns the projected q and k as transformers' Llama does, before the
    op: out and every gradient equal the module written out by hand (float64, GQA, positions
    shared by the batch or one row each)."""
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(24, 6, [4, 8], [1, 2], num_kv_heads=2, dtype=torch.float64,
                                  batch_first=batch_first)
    b, n = 3, 19
    positions = (torch.arange(n) + torch.tensor([[0], [5], [11]])) if per_row else \
        torch.arange(n) + 1000
    tables = rotary_tables(positions, 4, theta=500.0, dtype=torch.float64)
    assert tables[0].shape == ((b, n, 1, 2) if per_row else (n, 1, 2))
    x = torch.randn(b, n, 24, dtype=torch.float64, requires_grad=True)
    inputs = x if batch_first else x.transpose(0, 1)
    got, _ = m(inputs, inputs, inputs, is_causal=True, rotary=tables)
    got = got if batch_first else got.transpose(0, 1)

    # (b, n, e) -> (b, n, heads, 4)
    q = _llama_rope(m.q_proj(x).unflatten(-1, (6, 4)), positions, 500.0)
    k = _llama_rope(m.k_proj(x).unflatten(-1, (2, 4)), positions, 500.0)
    v = m.v_proj(x).unflatten(-1, (2, 4))
    want = m.project_out(dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = [x, m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]
    g = torch.randn_like(want)
    for a, w in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)


def test_apply_rotary_is_llamas_rotation():
    """The public turn, for q or k in the ops' layout, equals transformers' Llama rotation
    written out (positions per row; odd heads count); bad shapes are a ValueError."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, generator=g)
    positions = torch.arange(7) + torch.tensor([[4], [90]])
    tables = rotary_tables(positions, 8, theta=1e4, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(x, *tables), _llama_rope(x, positions, 1e4),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"^x must be a floating tensor \(batch, seq_len, heads"):
        apply_rotary(x[0], *tables)
    with pytest.raises(ValueError, match=r"^rotary's cos must be of shape \(7, 1, 4\)"):
        apply_rotary(x, *rotary_tables(positions, 6))


def test_rotary_attention_sees_relative_positions():
    """Shifting every position by the same amount changes nothing (up to the rounding of the
    angles): queries and keys are turned alike. The turn has second derivatives."""
    torch.manual_seed(0)
    m = _mhda(num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(2, 20, 16, dtype=torch.float64, requires_grad=True)
    outs = [m(x, x, x, is_causal=True, rotary=rotary_tables(torch.arange(20) + shift, 4,
                                                            dtype=torch.float64))[0]
            for shift in (0, 12345)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(outs[0], m(x, x, x, is_causal=True)[0])
    tables = rotary_tables(torch.arange(6), 4, dtype=torch.float64)
    y = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(lambda y: apply_rotary(y, *tables) ** 2, (y,))


@pytest.mark.parametrize("per_row", [False, True])
def test_apply_rotary_differentiates_tables_that_need_it(per_row):
    """Tables computed from a learned quantity (here a scale of the angles' cos and sin)
    get their gradient (it was None, silently), first and second derivatives; tables that
    take none keep no activation (x is not saved)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.stack([torch.arange(5), torch.arange(5) + 3]) if per_row else \
        torch.arange(5)
    cos, sin = (t.requires_grad_() for t in rotary_tables(positions, 4, dtype=torch.float64))
    torch.autograd.gradcheck(apply_rotary, (x, cos, sin))
    torch.autograd.gradgradcheck(apply_rotary, (x, cos, sin))
    scale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    got = torch.autograd.grad(apply_rotary(x, cos * scale, sin * scale).square().sum(), scale)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos * scale, sin * scale
    written = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(got[0], torch.autograd.grad(written.square().sum(), scale)[0])
    y = apply_rotary(x, cos.detach(), sin.detach())
    assert y.grad_fn.saved_tensors[2] is None


def test_rotary_tables_are_exact_past_two_to_the_24():
    """The angles are float64: positions past 2^24, which float32 rounds, are exact."""
    import math

    d, theta = 8, 500.0
    positions = torch.tensor([2**24 + 1, 2**24 + 3, 2**30 + 7])
    cos, sin = rotary_tables(positions, d, theta=theta, dtype=torch.float64)
    for row, p in enumerate(positions.tolist()):
        for i in range(d // 2):
            angle = p * theta ** (-2 * i / d)
            assert cos[row, 0, i].item() == pytest.approx(math.cos(angle), abs=1e-6), (p, i)
            assert sin[row, 0, i].item() == pytest.approx(math.sin(angle), abs=1e-6), (p, i)


def test_rotary_errors():
    m = _mhda()
    x = torch.randn(2, 8, 16)
    cos, sin = rotary_tables(torch.arange(8), 4)
    with pytest.raises(TypeError, match=r"^rotary must be a pair of tensors \(cos, sin\)"):
        m(x, x, x, rotary=cos)
    with pytest.raises(ValueError, match=r"^rotary's cos must be .*\(8, 1, 2\).*got "
                                         r"torch.float32 of shape \(9, 1, 2\)"):
        m(x, x, x, rotary=rotary_tables(torch.arange(9), 4))
    with pytest.raises(ValueError, match=r"^rotary's sin must be on cpu, got meta"):
        m(x, x, x, rotary=(cos, sin.to("meta")))
    with pytest.raises(TypeError, match=r"^rotary's sin must be a floating tensor, got "
                                        r"torch.int64 of shape \(8, 1, 2\)"):
        m(x, x, x, rotary=(cos, sin.long()))
    with pytest.raises(TypeError, match=r"^positions must be an integer tensor"):
        rotary_tables(torch.arange(8.0), 4)
    with pytest.raises(TypeError, match=r"^positions must be an integer tensor .* got "
                                        r"torch.bool of shape \(2,\)"):
        rotary_tables(torch.tensor([True, False]), 4)
    with pytest.raises(TypeError, match=r"^positions must be an integer tensor .* of shape "
                                        r"\(2, 3, 5\)"):
        rotary_tables(torch.zeros(2, 3, 5, dtype=torch.long), 4)
    with pytest.raises(TypeError, match=r"^rotary must be a pair of tensors \(cos, sin\)"):
        m(x, x, x, rotary=(cos, sin, cos))
    with pytest.raises(TypeError, match=r"got tuple of \(NoneType, Tensor\)$"):
        apply_rotary(torch.zeros(1, 8, 2, 4), None, sin)
    with pytest.raises(ValueError, match=r"^head_dim must be even.*got 5"):
        rotary_tables(torch.arange(8), 5)
    with pytest.raises(ValueError, match=r"^theta must be a positive finite float, got -1"):
        rotary_tables(torch.arange(8), 4, theta=-1)


def test_bad_rotary_tables_raise_from_every_public_entry():
    """The module's forward (either layout), its project_qkv and apply_rotary each check the
    tables, with the same errors naming rotary; project_qkv checks a key of other rows than
    the query's against the tables too."""
    m, m_seq = _mhda(num_kv_heads=2), _mhda(num_kv_heads=2, batch_first=False)
    x = torch.randn(2, 8, 16)
    cos, sin = rotary_tables(torch.arange(8), 4)
    q = m.q_proj(x).unflatten(-1, (4, 4)).detach()
    entries = {
        "forward": lambda tables: m(x, x, x, rotary=tables),
        "forward, sequence first": lambda tables: m_seq(*(x.transpose(0, 1),) * 3,
                                                        rotary=tables),
        "project_qkv": lambda tables: m.project_qkv(x, x, x, tables),
        "apply_rotary": lambda tables: apply_rotary(q, *tables),
    }
    bad = [((cos, sin.to("meta")), ValueError, r"^rotary's sin must be on cpu, got meta"),
           (rotary_tables(torch.arange(9), 4), ValueError,
            r"^rotary's cos must be of shape \(8, 1, 2\) or \(2, 8, 1, 2\)"),
           ((cos, sin.long()), TypeError, r"^rotary's sin must be a floating tensor"),
           ((cos.expand(3, -1, -1, -1), sin), ValueError,  # another batch size
            r"^rotary's cos must be of shape .* got torch.float32 of shape \(3, 8, 1, 2\)")]
    for name, entry in entries.items():
        for tables, error, message in bad:
            with pytest.raises(error, match=message):
                entry(tables)
    with pytest.raises(ValueError, match=r"^rotary's cos must be of shape \(5, 1, 2\)"):
        m.project_qkv(x, x[:, :5], x[:, :5], (cos, sin))


def test_rotary_refuses_an_odd_head_dim():
    """An odd head_dim has no pairs of halves: the module's forward and apply_rotary refuse
    it by name (tables for d - 1 have d's shape; the turn failed with a RuntimeError of
    broadcast shapes), and rotary_tables takes only a floating dtype (an integer one gave
    tables of 0s and 1s, a string 'Invalid device string')."""
    m = MultiheadDilatedAttention(12, 4, [4], [1])  # head_dim 3
    x = torch.randn(2, 8, 12)
    tables = rotary_tables(torch.arange(8), 2)  # (8, 1, 1), as d = 3 would have
    with pytest.raises(ValueError, match=r"^head_dim must be even for rotary positions.*got 3"):
        m(x, x, x, rotary=tables)
    with pytest.raises(ValueError, match=r"^head_dim must be even for rotary positions.*got 5"):
        apply_rotary(torch.randn(2, 8, 4, 5), *rotary_tables(torch.arange(8), 4))
    for dtype in (torch.int64, torch.bool, "float32"):
        with pytest.raises(TypeError, match=r"^dtype must be a floating torch.dtype for the "
                                            rf"tables, got {dtype!r}"):
            rotary_tables(torch.arange(8), 4, dtype=dtype)


def test_each_call_checks_the_rotary_tables_once(monkeypatch):
    """forward, project_qkv and apply_rotary check the tables once a call (the module's
    forward checked them three times: at its entry, then in q's turn and in k's); a
    LongNetLM with rotary positions, once a layer (each layer's attention is called)."""
    from dilated_attention import LongNetConfig, LongNetLM, modules, rotary
    calls = []
    real = rotary.check_tables

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rotary, "check_tables", counted)
    monkeypatch.setattr(modules, "check_tables", counted)
    m = _mhda(num_kv_heads=2)
    x = torch.randn(2, 8, 16)
    tables = rotary_tables(torch.arange(8), 4)
    lm = LongNetLM(LongNetConfig(vocab_size=11, embed_dim=16, num_heads=4, ffn_dim=8,
                                 num_layers=3, segment_lengths=PATTERNS[0],
                                 dilation_rates=PATTERNS[1], positions="rotary"))
    for call, checks in ((lambda: m(x, x, x, rotary=tables), 1),
                         (lambda: m.project_qkv(x, x, x, tables), 1),
                         (lambda: apply_rotary(x.unflatten(-1, (4, 4)), *tables), 1),
                         (lambda: lm(torch.zeros(2, 8, dtype=torch.long)), 3)):
        calls.clear()
        call()
        assert len(calls) == checks


def test_no_layer_norm_and_no_bias():
    m = _mhda(layer_norm=False, bias=False)
    assert m.norm is None
    assert all(getattr(p, "bias") is None for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))


def test_magneto_initialisation():
    torch.manual_seed(0)
    e = 256
    m = MultiheadDilatedAttention(e, 4, [8], [1], gamma_init=3.0)
    xavier_std = (2.0 / (e + e)) ** 0.5
    for name, gain in (("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", 3.0), ("out_proj", 3.0)):
        proj = getattr(m, name)
        assert abs(proj.weight.std().item() / (gain * xavier_std) - 1) < 0.02, name
        assert torch.count_nonzero(proj.bias) == 0


def _copy_into_torch_mha(m: MultiheadDilatedAttention, dtype) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(m.embed_dim, m.num_heads, batch_first=True, dtype=dtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
        ref.out_proj.weight.copy_(m.out_proj.weight)
        ref.out_proj.bias.copy_(m.out_proj.bias)
    return ref


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [5, 16])
def test_equals_nn_multihead_attention_for_one_dense_pattern(causal, n):
    torch.manual_seed(0)
    dtype = torch.float64
    # one pattern with w >= n and r = 1 is dense attention
    m = MultiheadDilatedAttention(16, 4, [16], [1], layer_norm=False, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref = _copy_into_torch_mha(m, dtype)
    q, k, v = (torch.randn(2, n, 16, dtype=dtype) for _ in range(3))
    mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=dtype) if causal else None
    expected, _ = ref(q, k, v, attn_mask=mask, is_causal=causal, need_weights=False)
    got, _ = m(q, k, v, is_causal=causal)
    torch.testing.assert_close(got, expected)
    # self-attention (query is key is value) too, with gradients wrt the input
    x1 = torch.randn(2, n, 16, dtype=dtype, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.randn(2, n, 16, dtype=dtype)
    expected, _ = ref(x1, x1, x1, attn_mask=mask, is_causal=causal, need_weights=False)
    got, _ = m(x2, x2, x2, is_causal=causal)
    torch.testing.assert_close(got, expected)
    expected.backward(g)
    got.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(num_kv_heads):
    torch.manual_seed(0)
    dtype = torch.float64
    gqa = _mhda(num_kv_heads=num_kv_heads, dtype=dtype)
    mha = _mhda(dtype=dtype)
    group = 4 // num_kv_heads
    with torch.no_grad():
        for p in gqa.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for name in ("q_proj", "out_proj", "norm"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            # (hk * d, e) -> (hk, d, e) -> (h, d, e): query head j reads kv head j // group
            for w in ("weight", "bias"):
                rows = getattr(src, w).unflatten(0, (num_kv_heads, 4))
                getattr(dst, w).copy_(rows.repeat_interleave(group, 0).flatten(0, 1))
    x = torch.randn(2, 19, 16, dtype=dtype)
    for causal in (False, True):
        expected, _ = mha(x, x, x, is_causal=causal)
        torch.testing.assert_close(gqa(x, x, x, is_causal=causal)[0], expected)


def test_dilated_attention_module_equals_functional_op():
    torch.manual_seed(0)
    q = torch.randn(2, 23, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 23, 3, 8, dtype=torch.float64).unbind(0)
    mod = DilatedAttention([4, 8, 32], [1, 2, 4], scale=0.3)
    for causal in (False, True):
        expected = dilated_attention(q, k, v, [4, 8, 32], [1, 2, 4], is_causal=causal, scale=0.3)
        torch.testing.assert_close(mod(q, k, v, is_causal=causal), expected, rtol=0, atol=0)
    assert "segment_lengths=[4, 8, 32]" in repr(mod) and "scale=0.3" in repr(mod)


def test_dropout_only_in_training_mode():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 12, 2, 4).unbind(0)
    mod = DilatedAttention([4], [1], dropout=0.5)
    plain = dilated_attention(q, k, v, [4], [1])
    mod.eval()
    torch.testing.assert_close(mod(q, k, v), plain, rtol=0, atol=0)
    mod.train()
    assert not torch.allclose(mod(q, k, v), plain)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    m = _mhda(num_kv_heads=2)
    x = torch.randn(2, 11, 16, requires_grad=True)
    out, _ = m(x, x, x, is_causal=True)
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
    assert torch.count_nonzero(x.grad) > 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"embed_dim": 15}, ValueError, r"embed_dim \(15\).*num_heads \(4\)"),
        ({"num_kv_heads": 3}, ValueError, r"num_heads \(4\).*num_kv_heads \(3\)"),
        ({"num_heads": 0}, ValueError, r"num_heads.*0"),
        ({"embed_dim": 16.0}, TypeError, r"embed_dim.*16.0"),
        ({"num_heads": None}, TypeError, r"^num_heads must be a positive int, got None"),
        ({"dilation_rates": [1, 9]}, ValueError, r"dilation_rates\[1\] = 9"),
        ({"segment_lengths": [4]}, ValueError, r"same length"),
        ({"dropout": 1.0}, ValueError, r"^dropout must be a float in \[0, 1\), got 1.0"),
        ({"gamma_init": -1.0}, ValueError, r"gamma_init.*-1.0"),
        ({"layer_norm_eps": 0.0}, ValueError, r"^layer_norm_eps must be.*0.0"),
        ({"layer_norm_eps": None}, TypeError, r"^layer_norm_eps must be.*None"),
        ({"layer_norm": 1}, TypeError, r"layer_norm.*1"),
        # an integer dtype failed in nn.Linear without naming dtype, a complex one at the
        # first call naming q
        ({"dtype": torch.int64}, TypeError, r"^dtype must be None, torch.float64.*torch.int64"),
        ({"dtype": torch.complex64}, TypeError, r"^dtype must be None.*torch.complex64"),
        ({"dtype": "float32"}, TypeError, r"^dtype must be None.*'float32'"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        _mhda(**kwargs)


def test_dilated_attention_constructor_errors():
    with pytest.raises(TypeError, match=r"^dropout must be a float.*None"):
        DilatedAttention([4], [1], dropout=None)
    with pytest.raises(ValueError, match=r"scale.*-2"):
        DilatedAttention([4], [1], scale=-2.0)
    with pytest.raises(ValueError, match=r"segment_lengths must not be empty"):
        DilatedAttention([], [])
    # a wrong kind of group at construction (it was kept until the first call named "group")
    for make in (DilatedAttention, lambda *a, **kw: MultiheadDilatedAttention(16, 4, *a, **kw)):
        with pytest.raises(TypeError, match=r"^process_group must be None, a torch.distributed"
                                            r".ProcessGroup or a 1-D/2-D DeviceMesh, got str "
                                            r"'world'"):
            make([4], [1], process_group="world")


def test_forward_errors():
    m = _mhda()
    x = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="need_weights"):
        m(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq_len, embed_dim=16\)"):
        m(torch.randn(2, 8, 12), x, x)
    with pytest.raises(ValueError, match=r"same shape.*\(2, 8, 16\).*\(2, 5, 16\)"):
        m(x, torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    with pytest.raises(TypeError, match="is_causal"):
        m(x, x, x, is_causal=None)
    # need_weights and average_attn_weights are bools, as is_causal (None and 'no' passed)
    for value in (None, "no", 0):
        with pytest.raises(TypeError, match=rf"^need_weights must be a bool, got {value!r}"):
            m(x, x, x, need_weights=value)
    with pytest.raises(TypeError, match=r"^average_attn_weights must be a bool, got None"):
        m(x, x, x, average_attn_weights=None)
    # parameters cast to a dtype the constructor refuses fail before the projections
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "Complex modules are a new feature"
        complex_module, z = _mhda().to(torch.complex64), x.to(torch.complex64)
    with pytest.raises(TypeError, match=r"^the module's parameters are torch.complex64"):
        complex_module(z, z, z)
    # an empty batch names query and its shape (it named q and its projected shape)
    for module, empty in ((m, x[:0]), (_mhda(batch_first=False), x[:0].transpose(0, 1))):
        layout = r"\(batch, seq_len" if module.batch_first else r"\(seq_len, batch"
        with pytest.raises(ValueError, match=rf"^query must have a non-empty batch {layout}, "
                                             rf"embed_dim\), got shape \({empty.shape[0]}, "):
            module(empty, empty, empty)


def test_forward_follows_multihead_attention_argument_order():
    """nn.MultiheadAttention's argument order: (query, key, value, key_padding_mask, need_weights,
    attn_mask, average_attn_weights, is_causal); a positional mask is a key padding mask."""
    m = _mhda()
    x = torch.randn(2, 8, 16)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 6:] = True
    positional, _ = m(x, x, x, mask)
    keyword, _ = m(x, x, x, key_padding_mask=mask)
    torch.testing.assert_close(positional, keyword, rtol=0, atol=0)
    assert not torch.equal(positional, m(x, x, x)[0])
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, None, False, torch.zeros(8, 8))
    with pytest.raises(TypeError, match="dtype"):
        m(x.double(), x.double(), x.double())


def _bad_input_on_one_rank(group):
    """Rank 1 passes a wrong embed dim (or a non-bool is_causal): every rank raises quickly."""
    import time

    rank = comm.group_rank(group)
    torch.manual_seed(0)
    m = _mhda(process_group=group)
    good = torch.randn(2, 8, 16)
    elapsed = []
    for bad_input, bad_causal, error in (
        (torch.randn(2, 8, 12), False, ValueError),
        (good, None, TypeError),
        (good.double(), False, TypeError),  # issue 15: a dtype the projections would reject
        (good.long(), False, TypeError),
    ):
        x, causal = (bad_input, bad_causal) if rank == 1 else (good, False)
        start = time.monotonic()
        # the bad rank raises its own error, the others a ValueError naming rank 1
        with pytest.raises(error if rank == 1 else ValueError,
                           match="embed_dim=16|is_causal|dtype" if rank == 1 else "rank 1"):
            m(x, x, x, is_causal=causal)
        elapsed.append(time.monotonic() - start)
    return elapsed


@pytest.mark.distributed
def test_bad_input_on_one_rank_raises_on_every_rank():
    # the group timeout is a minute: an error within 10 s is the agreement, not a timeout
    results = SPAWNS.results(2, _bad_input_on_one_rank)
    assert all(t < 10.0 for elapsed in results for t in elapsed), results


def _deepcopy_shares_the_group(group):
    """copy.deepcopy of a sequence-parallel module and model (an EMA copy, AveragedModel):
    the copy shares the process group and computes what the original does; its parameters
    are its own. It once raised "cannot pickle 'ProcessGroup' object"."""
    import copy

    from dilated_attention import LongNetConfig, LongNetLM
    from dilated_attention.distributed.sharding import shard_sequence
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    m = _mhda(process_group=group)
    x = shard_sequence(torch.randn(1, 21, 16), group)
    twin = copy.deepcopy(m)
    assert twin.attention.process_group is group
    assert twin.q_proj.weight is not m.q_proj.weight
    torch.testing.assert_close(twin(x, x, x, is_causal=True)[0], m(x, x, x, is_causal=True)[0],
                               rtol=0, atol=0)
    model = LongNetLM(LongNetConfig.from_name("tiny"), process_group=group)
    tokens = shard_sequence(torch.randint(0, 64, (1, 30)), group)
    average = AveragedModel(model)  # deep-copies the model
    assert average.module.process_group is group
    torch.testing.assert_close(average(tokens), model(tokens), rtol=0, atol=0)
    return True


@pytest.mark.distributed
def test_deepcopy_shares_the_process_group():
    assert SPAWNS.results(2, _deepcopy_shares_the_group) == [True, True]


# One spawn for the rank functions above; a group timeout of a minute (the bad input's test)
SPAWNS = SharedSpawn({2: [(_bad_input_on_one_rank,), (_deepcopy_shares_the_group,)]},
                     pg_timeout=60.0)
