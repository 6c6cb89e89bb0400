"""LongNet models: config, shapes, state, generation with a cache, and
sequence-parallel training steps on spawned gloo ranks equal to one process."""

from __future__ import annotations

import importlib.util
import io
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from dilated_attention import LongNet, LongNetConfig, LongNetLM, dilated_attention
from dilated_attention import all_reduce_gradients
from dilated_attention.decoding import cached_dilated_attention
from dilated_attention.models import IGNORE_INDEX, token_mean_loss
from dilated_attention.decoding import CachePlan
from dilated_attention.models.generation import Sampling, decode_token, prefill, sample
from dilated_attention.models.layers import Positions
from dilated_attention.distributed.sharding import shard_sequence

from dist_harness import SharedSpawn, run_distributed

SMALL = dict(vocab_size=23, embed_dim=24, num_heads=6, ffn_dim=32, num_layers=2,
             num_encoder_layers=2, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))


def small_config(**overrides) -> LongNetConfig:
    return LongNetConfig(**{**SMALL, **overrides})


def _perturb(model: torch.nn.Module) -> None:
    """Non-default values in every parameter (norms and biases start at 1 and 0)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def _data(b: int, n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    targets = torch.randint(0, vocab, (b, n), generator=g)
    targets[:, ::5] = IGNORE_INDEX  # ignored positions, unevenly spread over pieces
    return tokens, targets


# ---------------------------------------------------------------------------
# Config


def test_presets():
    base = LongNetConfig.from_name("base")
    assert (base.num_layers, base.embed_dim, base.num_heads, base.ffn_dim) == (12, 768, 12, 3072)
    assert base.segment_lengths == (2048, 4096, 8192, 16384, 32768)
    assert base.dilation_rates == (1, 2, 4, 6, 12)
    tiny = LongNetConfig.from_name("tiny", num_layers=3)
    assert tiny.num_layers == 3 and tiny.embed_dim == 64
    model = LongNetLM(base, device="meta")
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"embed_dim": 25}, ValueError, r"embed_dim \(25\).*num_heads \(6\)"),
        ({"num_kv_heads": 4}, ValueError, r"num_heads \(6\).*num_kv_heads \(4\)"),
        ({"dilation_rates": (1, 2, 32)}, ValueError, r"dilation_rates\[2\] = 32"),
        ({"positions": "xpos"}, ValueError, r"positions.*'xpos'"),
        ({"positions": "rotary", "embed_dim": 30}, ValueError, r"even head dim.*got 5"),
        ({"rope_theta": 0.0}, ValueError, r"^rope_theta must be a positive finite float"),
        ({"activation": "tanh"}, ValueError, r"activation.*'tanh'"),
        ({"dropout": 1.5}, ValueError, r"^dropout must be a float in \[0, 1\), got 1.5"),
        ({"attention_dropout": -0.1}, ValueError, r"^attention_dropout must be.*-0.1"),
        ({"attention_dropout": "0.1"}, TypeError, r"^attention_dropout must be.*'0.1'"),
        ({"num_layers": 0}, ValueError, r"num_layers.*0"),
        ({"backend": "fast"}, ValueError, r"^backend must be one of .*'fast'"),
        # None is no default for a size (it failed later, deep in the model or the loss)
        *(({name: None}, TypeError, rf"^{name} must be a positive int, got None")
          for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "ffn_dim",
                       "num_encoder_layers", "max_seq_len", "loss_chunk_bytes")),
        ({"tie_embeddings": "yes"}, TypeError, r"tie_embeddings.*'yes'"),
        ({"layer_norm_eps": -1.0}, ValueError, r"^layer_norm_eps must be.*-1.0"),
        ({"layer_norm_eps": float("nan")}, ValueError, r"^layer_norm_eps must be.*nan"),
        ({"layer_norm_eps": "1e-5"}, TypeError, r"^layer_norm_eps must be.*'1e-5'"),
    ],
)
def test_config_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        small_config(**overrides)
    with pytest.raises(ValueError, match="unknown LongNet preset 'huge'"):
        LongNetConfig.from_name("huge")
    # not a name (a JSON file's {"preset": ["tiny"]}): once "unhashable type: 'list'"
    with pytest.raises(ValueError, match=r"unknown LongNet preset \['tiny'\]"):
        LongNetConfig.from_name(["tiny"])


# ---------------------------------------------------------------------------
# Forward, loss, state, plumbing


def test_cross_attention_reads_kv_head_j_over_group():
    """The encoder-decoder's cross-attention under GQA: query head j reads key/value head
    j // (h / hk), as SDPA's enable_gqa (one process cannot tell j % hk from it otherwise)."""
    from dilated_attention.models.layers import CrossAttention

    torch.manual_seed(0)
    config = small_config(num_heads=6, num_kv_heads=2)
    attend = CrossAttention(config, {"dtype": torch.float64})
    x, memory = (torch.randn(2, n, 24, dtype=torch.float64) for n in (5, 9))
    # (b, n, e) -> (b, heads, n, d)
    q, k, v = (proj(t).unflatten(-1, (-1, 4)).transpose(1, 2) for proj, t in
               ((attend.q_proj, x), (attend.k_proj, memory), (attend.v_proj, memory)))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    want = attend.out_proj(out.transpose(1, 2).flatten(-2))
    torch.testing.assert_close(attend(x, memory), want, rtol=1e-12, atol=1e-12)


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).expand(2000, -1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, Sampling(1.0, 2, None, (), 0), gen).tolist()) == {1, 2}
    assert set(sample(logits, Sampling(1.0, 1, None, (), 0), gen).tolist()) == {1}


def test_top_p_draws_from_the_nucleus_in_proportion():
    """top_p keeps the fewest most probable ids whose probabilities reach it, and draws them
    in proportion to their probabilities; top_p 1 draws what no top_p draws."""
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)
    logits = probs.log().expand(4000, -1)
    gen = torch.Generator().manual_seed(0)
    for top_p, nucleus in ((0.45, [1]), (0.75, [1, 3]), (0.9, [1, 2, 3]), (1.0, [0, 1, 2, 3])):
        ids = sample(logits, Sampling(1.0, None, top_p, (), 0), gen)
        assert set(ids.tolist()) == set(nucleus), top_p
        share = (ids == 1).double().mean().item()  # ~1 / sqrt(4000) = 0.016 from its value
        assert abs(share - 0.5 / probs[nucleus].sum().item()) < 0.05, top_p
    same = [sample(logits, Sampling(0.7, 3, top_p, (), 0), torch.Generator().manual_seed(1))
            for top_p in (None, 1.0)]
    assert torch.equal(same[0], same[1])


def _ended(ids: torch.Tensor, n: int, eos, pad: int) -> torch.Tensor:
    """What generating with `eos` returns, from the ids of a run without: each row's ids
    after its first eos replaced by pad, cut after the step where every row has ended."""
    new = ids[:, n:].clone()
    hit = torch.isin(new, torch.tensor(eos))
    seen = hit.cumsum(1)
    new[seen - hit.long() > 0] = pad
    ended = (seen > 0).all(0)
    if ended.any():
        new = new[:, :int(ended.nonzero()[0]) + 1]
    return torch.cat([ids[:, :n], new], dim=1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_eos_ends_each_row_where_it_ends_alone(use_cache):
    """A row that generates an eos id continues with pad ids and generation stops when every
    row has ended; each row's ids up to its end are those of a run without eos_token_id
    (greedy, and sampling from the same generator state)."""
    torch.manual_seed(0)
    model = LongNetLM(small_config(num_kv_heads=2), dtype=torch.float64)
    _perturb(model)
    prompt, _ = _data(3, 6, 23)
    shorter = padded = 0
    for sampling in (dict(), dict(temperature=0.9, top_k=9, top_p=0.9)):
        def run(**more):
            seeded = dict(generator=torch.Generator().manual_seed(4)) if sampling else {}
            return model.generate(prompt, 25, use_cache=use_cache, **sampling, **seeded, **more)

        free = run()
        for eos in ([int(free[0, 8])], [int(free[0, 8]), int(free[1, 7]), int(free[2, 9])]):
            got = run(eos_token_id=eos, pad_token_id=22)
            torch.testing.assert_close(got, _ended(free, 6, eos, 22), rtol=0, atol=0)
            shorter += got.shape[1] < free.shape[1]
            padded += bool((got[:, 6:] == 22).any())
        # the pad id defaults to the (first) eos id
        eos = int(free[0, 8])
        assert torch.equal(run(eos_token_id=eos), _ended(free, 6, [eos], eos))
    assert shorter and padded  # the cases stop early and pad ended rows


def test_generation_argument_errors():
    model = LongNetLM(small_config())
    prompt, _ = _data(1, 5, 23)
    for kwargs, error, match in [
        (dict(top_p=0.0), ValueError, r"top_p must be a float in \(0, 1\] or None, got 0.0"),
        (dict(top_p=1.5), ValueError, r"top_p must be a float in \(0, 1\] or None, got 1.5"),
        (dict(top_p=True), TypeError, "top_p must be a float"),
        (dict(eos_token_id=23), ValueError, r"eos_token_id must be .* in \[0, 23\), got 23"),
        (dict(eos_token_id=[]), ValueError, r"eos_token_id must be .*, got \[\]"),
        (dict(eos_token_id="2"), TypeError, "eos_token_id must be an int id"),
        (dict(eos_token_id=2, pad_token_id=[1]), TypeError, r"pad_token_id must be one int id"),
        (dict(eos_token_id=2, pad_token_id=-1), ValueError, r"pad_token_id must be .*got -1"),
    ]:
        with pytest.raises(error, match=match):
            model.generate(prompt, 2, **kwargs)
    # an empty batch: the argument named, not the attention op's error about q, k, v
    for empty in (prompt[:0], prompt[:, :0]):
        with pytest.raises(ValueError, match=r"tokens must hold at least one row and one id"):
            model.generate(empty, 2)
    # top_k / top_p at temperature 0 change nothing (greedy): said, as transformers says it
    greedy = model.generate(prompt, 2)
    with pytest.warns(UserWarning, match=r"temperature=0 decodes greedily: top_k=3"):
        assert torch.equal(model.generate(prompt, 2, top_k=3, top_p=0.5), greedy)


def test_config_backend_reaches_every_layer():
    """config.backend is the kernel of every layer's attention: one the device lacks is the
    op's error naming it, at the first forward (the fused kernel's results against the
    others are tests/test_fused.py's)."""
    model = LongNetLM(small_config(backend="cuda_flash"))
    assert {block.self_attn.attention.backend for block in model.layers} == {"cuda_flash"}
    with pytest.raises(ValueError, match="'cuda_flash'.*CUDA"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_lm_shapes_and_loss(tie):
    torch.manual_seed(0)
    model = LongNetLM(small_config(tie_embeddings=tie, num_kv_heads=2))
    assert (model.head is None) == tie
    tokens, targets = _data(2, 29, 23)
    logits, loss = model(tokens, targets, return_logits=True)
    assert logits.shape == (2, 29, 23)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected)
    assert model(tokens)[1] is None


@pytest.mark.parametrize("kind", ["lm", "encdec"])
def test_loss_is_zero_when_every_target_is_ignored(kind):
    # 0 / 0 tokens would be NaN: the loss is 0 instead, still differentiable (zero gradients)
    torch.manual_seed(0)
    model = LongNetLM(small_config()) if kind == "lm" else LongNet(small_config())
    tokens, _ = _data(2, 9, 23)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    _, loss = model(tokens, targets) if kind == "lm" else model(tokens, tokens, targets)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_encoder_decoder_shapes():
    torch.manual_seed(0)
    model = LongNet(small_config())
    src, _ = _data(2, 19, 23, seed=1)
    tgt, targets = _data(2, 11, 23, seed=2)
    logits, loss = model(src, tgt, targets, return_logits=True)
    assert logits.shape == (2, 11, 23) and loss.ndim == 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", ["lm", "encdec"])
def test_state_dict_round_trip(kind):
    torch.manual_seed(0)
    config = small_config(positions="learned", max_seq_len=64, tie_embeddings=False)
    build = (lambda: LongNetLM(config)) if kind == "lm" else (lambda: LongNet(config))
    model = build()
    _perturb(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = build()
    fresh.load_state_dict(torch.load(buf))
    tokens, _ = _data(2, 21, 23)
    args = (tokens,) if kind == "lm" else (tokens, tokens[:, :9])
    torch.testing.assert_close(fresh(*args)[0], model(*args)[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lm", "encdec"])
def test_reset_parameters_draws_on_meta_what_it_draws_anywhere(kind):
    """A model built on the meta device, then to_empty and reset_parameters, is the model
    reset_parameters draws with that seed anywhere; every parameter is drawn again (none
    keeps to_empty's memory), from the distribution construction draws it from."""
    # wide enough that a parameter's spread tells reset's distribution from construction's
    config = small_config(positions="learned", max_seq_len=64, tie_embeddings=False,
                          num_kv_heads=3, bias=True, embed_dim=96, ffn_dim=128)
    cls = LongNetLM if kind == "lm" else LongNet
    torch.manual_seed(0)
    built = cls(config)
    constructed = {name: p.detach().clone() for name, p in built.named_parameters()}
    on_meta = cls(config, device="meta")
    on_meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in on_meta.parameters():
            p.fill_(math.nan)
    for model in (built, on_meta):
        torch.manual_seed(1)
        model.reset_parameters()
    torch.testing.assert_close(on_meta.state_dict(), built.state_dict(), rtol=0, atol=0)
    for name, p in built.named_parameters():
        first = constructed[name]
        if first.std() == 0:  # norms' ones, biases' zeros
            torch.testing.assert_close(p, first, rtol=0, atol=0)
        else:
            assert not torch.equal(p, first), name
            # the ratio of two spreads of n draws varies by about 1 / sqrt(n)
            assert abs((p.std() / first.std()).item() - 1) < 5 / p.numel()**0.5, name


def test_dtype_plumbing():
    model = LongNetLM(small_config(), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens, targets = _data(1, 17, 23)
    logits, loss = model(tokens, targets, return_logits=True)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert torch.isfinite(loss)
    _, chunked = model(tokens, targets)  # the head in bfloat16, the loss in float32
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, loss)


def test_magneto_gains():
    model = LongNetLM(small_config(num_layers=6))
    attn = model.layers[0].self_attn
    assert attn.gamma_init == pytest.approx(math.sqrt(math.log(12)))
    assert attn.norm is not None  # sub-LN


def test_learned_positions_bound():
    model = LongNetLM(small_config(positions="learned", max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    # checked before anything runs, not at the step that would need position 16
    with pytest.raises(ValueError, match="prompt of 10 makes sequences of 17 tokens, past "
                                         "max_seq_len=16 of the learned position table"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    assert model.generate(torch.zeros(1, 10, dtype=torch.long), 6).shape == (1, 16)
    # sinusoidal positions have no bound
    model = LongNetLM(small_config(max_seq_len=16))
    assert model.generate(torch.zeros(1, 10, dtype=torch.long), 12).shape == (1, 22)


@pytest.mark.parametrize("embed_dim", [1, 2, 3, 8])
def test_sinusoidal_positions_for_any_width(embed_dim):
    """sin(p f_i) then cos(p f_i), f_i = 10000^(-i / (e // 2)), a zero column for odd e
    (embed_dim 1: no frequency, a zero)."""
    positions = Positions(small_config(embed_dim=embed_dim, num_heads=1), {})
    p = torch.arange(5, dtype=torch.float64)
    half = embed_dim // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))
    want = torch.zeros(5, embed_dim, dtype=torch.float64)
    want[:, :half] = torch.sin(p[:, None] * freq)
    want[:, half:2 * half] = torch.cos(p[:, None] * freq)
    got = positions(torch.arange(5), torch.empty((), dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_input_errors():
    model = LongNetLM(small_config())
    with pytest.raises(ValueError, match=r"tokens must be 2-D.*\(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids.*float32"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"ids in \[0, 23\).*\[0, 23\]"):
        model(torch.tensor([[0, 23]]))
    with pytest.raises(ValueError, match=r"targets must have tokens' shape \(1, 5\)"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature.*-1"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=-1.0)
    with pytest.raises(TypeError, match="max_new_tokens.*2.5"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2.5)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator.*3 \(int\)"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=1.0, generator=3)


def test_sampling_edges():
    """A temperature so small that logit / temperature overflows samples the argmax (greedy);
    ids come back in the prompt's dtype; the plain loss takes int32 targets as the models do."""
    model = LongNetLM(small_config(), dtype=torch.float64)
    tokens, targets = _data(2, 9, 23)
    assert torch.equal(model.generate(tokens, 4, temperature=1e-40), model.generate(tokens, 4))
    assert model.generate(tokens.int(), 3).dtype == torch.int32
    logits, loss = model(tokens, targets, return_logits=True)
    torch.testing.assert_close(token_mean_loss(logits, targets.int(), None), loss)


def test_target_and_token_checks_before_the_forward():
    """Issue 15: ids out of range or negative targets, uint8 ids, labels=, batch mismatch."""
    model = LongNetLM(small_config())
    tokens = torch.zeros(1, 5, dtype=torch.long)
    for bad in (23, -5):
        with pytest.raises(ValueError, match=rf"targets must be ids in \[0, 23\).*{bad}"):
            model(tokens, torch.full((1, 5), bad))
    with pytest.raises(TypeError, match="uint8"):
        model(tokens.to(torch.uint8))
    with pytest.raises(ValueError, match="labels must be ids"):
        model(tokens, labels=torch.full((1, 5), 99))
    targets = torch.ones(1, 5, dtype=torch.long)
    torch.testing.assert_close(model(tokens, labels=targets)[1], model(tokens, targets)[1])
    with pytest.raises(ValueError, match="not both"):
        model(tokens, targets, labels=targets)
    encdec = LongNet(small_config())
    with pytest.raises(ValueError, match="same batch size, got 1 and 2"):
        encdec(tokens, torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("how", ["cu_seqlens", "position_ids"])
def test_packed_documents_equal_training_them_one_by_one(how):
    """A packed sequence: each document's logits are its logits alone (positions restart),
    and the loss is the token mean over every document's targets."""
    torch.manual_seed(0)
    model = LongNetLM(small_config(positions="learned", max_seq_len=20), dtype=torch.float64)
    _perturb(model)
    tokens, targets = _data(2, 37, 23, seed=4)
    kwargs = {"cu_seqlens": PACKED} if how == "cu_seqlens" else {"position_ids": _restarts(37)}
    logits, loss = model(tokens, targets, return_logits=True, **kwargs)
    torch.testing.assert_close(model(tokens, targets, **kwargs)[1], loss, rtol=1e-12, atol=0)
    total, count = 0.0, 0
    for s, e in zip(PACKED[:-1], PACKED[1:]):
        if e == s:
            continue
        alone, _ = model(tokens[:, s:e])
        torch.testing.assert_close(logits[:, s:e], alone, rtol=1e-10, atol=1e-12)
        keep = targets[:, s:e] != IGNORE_INDEX
        total += F.cross_entropy(alone[keep], targets[:, s:e][keep], reduction="sum")
        count += int(keep.sum())
    torch.testing.assert_close(loss, total / count, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        model(tokens, cu_seqlens=PACKED, position_ids=_restarts(37))
    # one row of positions for every batch row, or one row per batch row; not another batch
    with pytest.raises(ValueError, match=r"position_ids must be.*\(2, 37\), got \(3, 37\)"):
        model(tokens, position_ids=_restarts(37)[None].expand(3, -1))


# ---------------------------------------------------------------------------
# Generation with a key/value cache


@pytest.mark.parametrize("hk", [6, 2])
def test_cached_attention_equals_last_row_of_dilated_attention(hk):
    torch.manual_seed(0)
    n, h, d = 45, 6, 4
    patterns = ((4, 8, 16, 64), (1, 2, 4, 5))  # rate 5 does not divide h; 64 > n
    q = torch.randn(2, n, h, d, dtype=torch.float64)
    k, v = torch.randn(2, 2, n, hk, d, dtype=torch.float64).unbind(0)
    full = dilated_attention(q, k, v, *patterns, is_causal=True, scale=0.4)
    for t in range(n):
        prefix = dilated_attention(
            q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], *patterns, is_causal=True, scale=0.4
        )
        step = cached_dilated_attention(
            q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], *patterns, scale=0.4
        )
        torch.testing.assert_close(step[:, 0], prefix[:, t], msg=f"t={t}")
        # causal dilated attention is prefix-consistent: row t does not depend on later rows
        torch.testing.assert_close(step[:, 0], full[:, t], msg=f"t={t}")


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_generate_with_cache_equals_without(positions):
    """Cached generation equals rerunning the sequence, greedy and sampled, and its per-step
    logits a full forward's (rotary: each step turns its query and key, and the cache keeps
    turned keys)."""
    torch.manual_seed(0)
    model = LongNetLM(small_config(num_kv_heads=2, positions=positions, max_seq_len=64,
                                   rope_theta=300.0), dtype=torch.float64)
    _perturb(model)
    prompt, _ = _data(2, 6, 23)
    greedy = model.generate(prompt, 30)
    assert greedy.shape == (2, 36) and torch.equal(greedy[:, :6], prompt)
    torch.testing.assert_close(model.generate(prompt, 30, use_cache=False), greedy, rtol=0, atol=0)
    sampled = [
        model.generate(prompt, 30, temperature=0.8, top_k=5, use_cache=cache,
                       generator=torch.Generator().manual_seed(3))
        for cache in (True, False)
    ]
    torch.testing.assert_close(sampled[0], sampled[1], rtol=0, atol=0)
    assert not torch.equal(sampled[0], greedy)
    # the per-step logits of the cached path equal a full forward over the sequence
    with torch.no_grad():
        hidden, caches = prefill(model.eval(), greedy[:, :6], CachePlan.of(6, 30, 1, 0))
        steps = [hidden]
        steps += [decode_token(model, greedy[:, i], i, caches) for i in range(6, 36)]
        full = model(greedy)[0]
        model.train()
    torch.testing.assert_close(model.logits(model.norm(torch.stack(steps, dim=1))), full[:, 5:])
    assert model.training  # generate restores the mode it found


def _left_padded(b: int, n: int, pads, seed: int = 0):
    """(tokens, attention_mask): rows of random ids, row i with pads[i] padding ids (0) first."""
    tokens, _ = _data(b, n, 23, seed=seed)
    mask = torch.ones(b, n, dtype=torch.long)
    for i, pad in enumerate(pads):
        mask[i, :pad] = 0
        tokens[i, :pad] = 0
    return tokens, mask


@pytest.mark.parametrize("kind", ["lm", "encdec"])
def test_rotary_positions_turn_every_self_attention(kind):
    """positions="rotary": nothing is added to the embeddings and every block's
    self-attention gets the tables of the rows' positions (rope_theta's), in the layers as
    the model runs them; sinusoidal positions or another theta give other logits."""
    from dilated_attention import rotary_tables

    torch.manual_seed(0)
    config = small_config(positions="rotary", rope_theta=300.0, num_kv_heads=2)
    model = (LongNetLM if kind == "lm" else LongNet)(config, dtype=torch.float64)
    _perturb(model)
    tokens, _ = _data(2, 21, 23)
    src, _ = _data(2, 17, 23, seed=3)

    def tables(n):
        return rotary_tables(torch.arange(n), 4, theta=300.0, dtype=torch.float64)

    if kind == "lm":
        got = model(tokens)[0]
        x = model.embed(tokens)
        for block in model.layers:
            x = block(x, rotary=tables(21))
        want = model.logits(model.norm(x))
    else:
        got = model(src, tokens)[0]
        memory = model.embed(src)
        for block in model.encoder:
            memory = block(memory, rotary=tables(17))
        x = model.embed(tokens)
        for block in model.decoder:
            x = block(x, model.encoder_norm(memory), rotary=tables(21))
        want = model.logits(model.decoder_norm(x))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for other in (dict(positions="sinusoidal"), dict(rope_theta=10000.0)):
        changed = (LongNetLM if kind == "lm" else LongNet)(
            small_config(**{**dict(positions="rotary", rope_theta=300.0, num_kv_heads=2),
                            **other}), dtype=torch.float64)
        changed.load_state_dict(model.state_dict())
        assert not torch.allclose(changed(*((tokens,) if kind == "lm" else (src, tokens)))[0],
                                  got)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary"])
def test_left_padded_rows_generate_what_they_generate_alone(positions):
    torch.manual_seed(0)
    model = LongNetLM(small_config(num_kv_heads=2, positions=positions, max_seq_len=40),
                      dtype=torch.float64)
    _perturb(model)
    pads = (0, 7, 18, 3)
    tokens, mask = _left_padded(4, 21, pads)
    for use_cache in (True, False):
        padded = model.generate(tokens, 12, attention_mask=mask, use_cache=use_cache)
        for i, pad in enumerate(pads):
            alone = model.generate(tokens[i:i + 1, pad:], 12, use_cache=use_cache)
            assert torch.equal(padded[i, pad:], alone[0]), (i, use_cache)
        assert torch.equal(padded[:, :21], tokens)
    # a mask of ones is no padding at all; bool masks work like 0/1 ones
    assert torch.equal(model.generate(tokens, 5, attention_mask=torch.ones_like(mask)),
                       model.generate(tokens, 5))
    assert torch.equal(model.generate(tokens, 5, attention_mask=mask.bool()),
                       model.generate(tokens, 5, attention_mask=mask))


def test_padding_mask_errors():
    model = LongNetLM(small_config(positions="learned", max_seq_len=16))
    tokens, mask = _left_padded(2, 10, (0, 4))
    # the longest row counts: 10 real tokens + 7 > 16; 6 + 7 would fit
    with pytest.raises(ValueError, match="prompt of 10 makes sequences of 17 tokens"):
        model.generate(tokens, 7, attention_mask=mask)
    model.generate(tokens[1:], 7, attention_mask=mask[1:])
    right = mask.flip(1)
    with pytest.raises(ValueError, match="pad on the left.*row 1"):
        model.generate(tokens, 2, attention_mask=right)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="row 1 is all padding"):
        model.generate(tokens, 2, attention_mask=empty)
    with pytest.raises(ValueError, match=r"tokens' shape \(2, 10\), got \(2, 9\)"):
        model.generate(tokens, 2, attention_mask=mask[:, 1:])
    # a float 0/1 mask (transformers passes one) is the same mask; a complex one is refused
    assert torch.equal(model.generate(tokens, 2, attention_mask=mask.float()),
                       model.generate(tokens, 2, attention_mask=mask))
    with pytest.raises(TypeError, match="bool, integer or float tensor .*, got torch.complex64"):
        model.generate(tokens, 2, attention_mask=mask.to(torch.complex64))
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        model.generate(tokens, 2, attention_mask=mask * 2)


@pytest.mark.parametrize("n, new, size", [(37, 12, 3), (2, 9, 3), (5, 1, 4), (16, 17, 2), (1, 1, 1)])
def test_cache_plan_places_every_row_once_and_balances(n, new, size):
    plans = [CachePlan.of(n, new, size, rank) for rank in range(size)]
    rows = sorted(p for plan in plans for part in (plan.prompt, plan.block)
                  for p in range(*part))
    assert rows == list(range(n + new))
    counts = [sum(stop - start for start, stop in (p.prompt, p.block)) for p in plans]
    assert max(counts) - min(counts) <= 1  # (n + new) / P each, the first ranks one more
    assert all(plans[0].owner(t) == r for r, p in enumerate(plans) for t in range(*p.block))
    with pytest.raises(ValueError, match=f"position {n + new} is outside"):
        plans[0].owner(n + new)


# ---------------------------------------------------------------------------
# Sharded generation: P spawned gloo ranks generate what one process generates


GEN_CASES = [
    # (config overrides, batch, prompt length, new tokens, left padding of each row): the
    # patterns (4, 8, 16) cross the pieces and the blocks of new rows; a prompt shorter than
    # P leaves pieces empty; padding that ends on another rank's piece
    (dict(), 2, 23, 12, None),
    (dict(num_kv_heads=2, positions="learned", max_seq_len=40, tie_embeddings=False), 1, 29, 11,
     None),
    (dict(segment_lengths=(3, 5, 64), dilation_rates=(1, 2, 3), num_kv_heads=3), 3, 2, 14,
     None),
    (dict(), 1, 1, 6, None),
    (dict(num_kv_heads=2), 3, 21, 10, (0, 9, 20)),
    (dict(num_kv_heads=2, positions="rotary"), 3, 21, 10, (0, 9, 20)),
]


def _generation_models(group, overrides):
    """The same fp64 model twice: on one process, and over `group`."""
    models = []
    for g in (None, group):
        torch.manual_seed(0)
        model = LongNetLM(small_config(**overrides), dtype=torch.float64, process_group=g)
        _perturb(model)
        models.append(model)
    return models


def _sharded_generation(group):
    from dilated_attention.distributed import comm

    rank, size = comm.group_rank(group), comm.group_size(group)
    results = []
    for case, (overrides, b, n, new, pads) in enumerate(GEN_CASES):
        one, sharded = _generation_models(group, overrides)
        prompt, mask = _left_padded(b, n, pads or (0,) * b, seed=n)
        padding = dict(attention_mask=mask) if pads else {}
        if size > 2 and case in (0, 1, 3, 5):
            continue  # three ranks: the cases whose pieces differ in kind (empty, padded)
        modes = (dict(), dict(temperature=0.9, top_k=7),
                 dict(temperature=0.9, top_p=0.8, eos_token_id=(3, 7), pad_token_id=0),
                 dict(use_cache=False))
        for kwargs in modes if case in (0, 1, 4) else modes[:3]:
            outs = []
            for model in (one, sharded):
                if "temperature" in kwargs:
                    kwargs["generator"] = torch.Generator().manual_seed(5)
                outs.append(model.generate(prompt, new, **kwargs, **padding))
            assert torch.equal(outs[1], outs[0]), (overrides, n, kwargs)
            results.append(outs[1])
        # the cache: this rank's rows only; traffic per decode step: one all-gather per layer
        plan = CachePlan.of(n, new - 1, size, rank)
        with torch.no_grad():
            sharded.eval()
            hidden, caches = prefill(sharded, outs[1][:, :n], plan)
            assert all(sum(r.count for r in c.rows()) == plan.prompt[1] - plan.prompt[0]
                       for c in caches)
            with comm.count_communication() as stats:
                decode_token(sharded, outs[1][:, n], n, caches)
        layers, heads = sharded.config.num_layers, sharded.config.num_heads
        head_dim = sharded.config.embed_dim // heads
        assert stats.agreements == 0
        assert stats.messages == stats.messages_of("all_gather") == layers
        # (out, lse) of b x h query heads in fp64 accumulators, to P - 1 ranks
        assert stats.bytes_sent == layers * (size - 1) * b * heads * (head_dim + 1) * 8
    return results


def _generation_errors(group):
    """A mistake on one rank is an error on every rank, not a hang or a silent divergence."""
    from dilated_attention.distributed import comm

    rank = comm.group_rank(group)
    _, model = _generation_models(group, dict(positions="learned", max_seq_len=20))
    prompt, _ = _data(1, 9, 23)
    errors = []
    for kwargs, match in [
        (dict(tokens=prompt if rank else (prompt + 1) % 23), "ranks disagree on 'tokens'"),
        (dict(max_new_tokens=3 + rank), "ranks disagree on 'max_new_tokens'"),
        (dict(eos_token_id=3 + rank), "ranks disagree on 'eos_token_id'"),
        (dict(temperature=1.0, generator=torch.Generator().manual_seed(rank)),
         "ranks disagree on 'sampling state'"),
        (dict(max_new_tokens=12), "sequences of 21 tokens, past max_seq_len=20"),
        (dict(tokens=prompt[:, :0] if rank == 1 else prompt),
         "one id per row" if rank == 1 else "rank 1"),
    ]:
        kwargs = {"tokens": prompt, "max_new_tokens": 3, **kwargs}
        with pytest.raises(ValueError, match=match):
            model.generate(kwargs.pop("tokens"), kwargs.pop("max_new_tokens"), **kwargs)
        errors.append(match)
    # ranks whose parameters differ would generate different ids: an error on every rank
    with torch.no_grad():
        model.embed.weight[0, 0] += rank
    with pytest.raises(ValueError, match="parameters differ between the ranks"):
        model.generate(prompt, 3)
    return errors


def _generation_rank(group):
    return _sharded_generation(group), _generation_errors(group)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_generation_equals_one_process(world_size):
    results = SPAWNS.results(world_size, _generation_rank)
    for ids, _ in results[1:]:  # every rank returns the same ids
        assert all(torch.equal(a, b) for a, b in zip(ids, results[0][0]))
    assert all(len(errors) == 6 for _, errors in results)


def _fsdp_generation(group):
    """generate() on a model whose parameters FSDP2 sharded (here over the sequence ranks):
    generation runs the blocks outside their forward, so fully_shard's hooks never gather
    them; a clear error on every rank (not torch's mixed Tensor/DTensor error from inside a
    layer), and, once every unit is unsharded, the one-process ids."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dilated_attention.distributed import comm

    one, model = _generation_models(group, {})
    mesh = init_device_mesh("cpu", (comm.group_size(group),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prompt, _ = _data(2, 9, 23)
    with pytest.raises(ValueError, match=r"generate needs every parameter whole.*unshard\(\)"):
        model.generate(prompt, 3)
    units = [*model.layers, model]
    for unit in units:
        unit.unshard()
    ids = model.generate(prompt, 3)
    for unit in units:
        unit.reshard()
    return torch.equal(ids, one.generate(prompt, 3))


@pytest.mark.distributed
def test_generate_refuses_fsdp2_sharded_parameters():
    assert SPAWNS.results(2, _fsdp_generation) == [True, True]


# ---------------------------------------------------------------------------
# Sequence parallel: P spawned gloo ranks == one process


def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_long_context.py"
    spec = importlib.util.spec_from_file_location("train_long_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PACKED = (0, 3, 3, 19, 20, 37)  # documents of 3, 0, 16, 1 and 17 tokens


def _restarts(n: int) -> torch.Tensor:
    """(n,) positions restarting at 0 at each document of PACKED."""
    cu = torch.tensor(PACKED)
    rows = torch.arange(n)
    return rows - cu[torch.searchsorted(cu, rows, right=True) - 1]


def _step(model, group, tokens, targets, *extra, return_logits=False, **kwargs):
    """One training step's loss and full parameter gradients, on this rank's pieces."""
    model.zero_grad(set_to_none=True)
    pieces = [shard_sequence(x, group) for x in (*extra, tokens, targets)]
    if "position_ids" in kwargs:
        kwargs = {"position_ids": shard_sequence(kwargs["position_ids"], group, dim=0)}
    _, loss = model(*pieces, return_logits=return_logits, **kwargs)
    loss.backward()
    all_reduce_gradients(model, group)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


# the loss over chunks of 3 rows (float64, vocabulary 23), several in every piece
CHUNKS = dict(loss_chunk_bytes=3 * 23 * 8)


def _sp_cases(group):
    """Each case: the sharded model's loss (over chunks, no logits) and gradients equal one
    process's loss from its logits."""
    cases = [
        ("lm", CHUNKS, 37),  # 37 tokens: uneven pieces
        ("lm", dict(num_kv_heads=2, positions="learned", max_seq_len=40, tie_embeddings=False,
                    **CHUNKS), 40),
        ("lm", dict(checkpoint="layers", segment_lengths=(64,), dilation_rates=(1,)), 31),
        ("encdec", dict(num_kv_heads=3), 26),
        ("lm", dict(), 2),  # 3 ranks: the last piece is empty
        ("packed", dict(positions="learned", max_seq_len=20, **CHUNKS), 37),  # cross pieces
        ("restart", dict(), 37),  # the same documents, given as restarting position_ids
        # rotary positions: global ones in each piece, restarting per document
        ("lm", dict(num_kv_heads=2, positions="rotary", **CHUNKS), 37),
        ("packed", dict(positions="rotary", checkpoint="layers"), 37),
        ("encdec", dict(positions="rotary"), 26),
    ]
    done = []
    for kind, overrides, n in cases:
        config = small_config(**overrides)
        models = []
        for g in (None, group):
            torch.manual_seed(0)  # identical initial parameters in both models
            cls = LongNet if kind == "encdec" else LongNetLM
            models.append(cls(config, dtype=torch.float64, process_group=g))
            _perturb(models[-1])
        tokens, targets = _data(2, n, config.vocab_size, seed=n)
        extra = () if kind != "encdec" else (_data(2, n + 5, config.vocab_size, seed=1)[0],)
        docs = {"packed": dict(cu_seqlens=PACKED), "restart": dict(position_ids=_restarts(n))}
        ref_loss, ref_grads = _step(models[0], None, tokens, targets, *extra, return_logits=True,
                                    **docs.get(kind, {}))
        loss, grads = _step(models[1], group, tokens, targets, *extra, **docs.get(kind, {}))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-12, msg=f"{kind} {name}")
        done.append((kind, n))
    # a bad input on one rank raises on every rank, no hang
    model = LongNetLM(small_config(), process_group=group)
    bad = 99 if comm_rank(group) == 1 else 0
    with pytest.raises((ValueError, RuntimeError)):
        model(torch.full((1, 8), bad))
    done.append("bad input")
    return done


def _example_curves(group):
    example = _example()
    argv = ["--seq-len", "96", "--batch-size", "2", "--steps", "3", "--dtype", "float64",
            "--eval-batches", "1"]
    # sharded and with --checkpoint layers: the one-process curve without checkpointing
    sharded = example.train(example.parse_args(argv + ["--checkpoint", "layers"]), group)
    single = example.train(example.parse_args(argv), None)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]),
                               rtol=1e-10, atol=1e-12)
    assert len(sharded["peak_bytes"]) == 1  # this rank's, reported by fit
    return sharded["losses"]


def comm_rank(group) -> int:
    from dilated_attention.distributed import comm

    return comm.group_rank(group)


def _rank_main(group, with_example: bool):
    result = {"cases": _sp_cases(group)}
    if with_example:
        result["curve"] = _example_curves(group)
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_sequence_parallel_training_step_equals_one_process(world_size):
    results = SPAWNS.results(world_size, _rank_main, world_size == 2)
    assert all(len(r["cases"]) == 11 for r in results)


def _targets_on_one_rank_only(group):
    """Rank 1 passes no targets: the loss all-reduce must not be entered by rank 0 alone."""
    import time

    rank = comm_rank(group)
    results = []
    for kind in ("lm", "encdec"):
        torch.manual_seed(0)
        config = small_config()
        model = (LongNetLM if kind == "lm" else LongNet)(config, process_group=group)
        tokens, targets = _data(1, 8, config.vocab_size, seed=rank)
        args = (tokens,) if kind == "lm" else (tokens, tokens)
        start = time.monotonic()
        with pytest.raises(ValueError, match="targets_passed"):
            model(*args, *([targets] if rank == 0 else []))
        results.append(time.monotonic() - start)
    # a target id out of range on one rank only: every rank raises before the forward
    model = LongNetLM(small_config(), process_group=group)
    tokens, targets = _data(1, 8, 23, seed=rank)
    if rank == 1:
        targets[0, 3] = 23
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"targets must be ids in \[0, 23\)" if rank == 1
                       else "rank 1"):
        model(tokens, targets)
    results.append(time.monotonic() - start)
    # one rank's other arguments wrong: every rank raises (checked inside the agreement)
    for kind in ("lm", "encdec"):
        model = (LongNetLM if kind == "lm" else LongNet)(small_config(), process_group=group)
        tokens, targets = _data(1, 8, 23, seed=rank)
        args = (tokens,) if kind == "lm" else (tokens, tokens)
        one_rank = [({"return_logits": 1}, "return_logits must be a bool"),
                    ({"labels": targets}, "pass targets or labels")]
        if kind == "lm":
            one_rank += [({"cu_seqlens": [0, 9, 3, 16]}, "cu_seqlens must be non-decreasing"),
                         ({"position_ids": torch.arange(8)},
                          r"position_ids must be passed on every rank.*\[0\] passed none")]
        for kwargs, message in one_rank:
            start = time.monotonic()
            # (the other rank: "the call failed on another rank ... rank 1: ...")
            with pytest.raises((ValueError, TypeError),
                               match=message if rank == 1 or "position_ids" in kwargs
                               else "rank 1"):
                model(*args, targets, **(kwargs if rank == 1 else {}))
            results.append(time.monotonic() - start)
    # a model built with other settings on one rank (another backward): every rank raises
    model = LongNetLM(small_config(checkpoint="layers" if rank == 1 else "none"),
                      process_group=group)
    start = time.monotonic()
    with pytest.raises(ValueError, match="ranks disagree on 'config.checkpoint'"):
        model(*_data(1, 8, 23, seed=rank))
    results.append(time.monotonic() - start)
    # every target of every rank ignored: loss 0 on every rank, not NaN
    model = LongNetLM(small_config(), process_group=group)
    tokens, _ = _data(1, 8, 23, seed=rank)
    _, loss = model(tokens, torch.full_like(tokens, IGNORE_INDEX))
    assert loss.item() == 0.0
    return results


@pytest.mark.distributed
def test_targets_on_one_rank_only_raises_on_every_rank():
    # the group timeout is a minute: an error within 10 s is the agreement, not a timeout
    results = run_distributed(_targets_on_one_rank_only, 2, timeout=120, pg_timeout=60.0)
    assert all(t < 10.0 for elapsed in results for t in elapsed), results


# CachePlan.store checks every position against the plan (on every rank): a row past the
# planned new rows is an error, never a row silently not kept (the step that follows would
# attend without its own key).

def test_cache_plan_refuses_a_row_past_the_planned_rows():
    from dilated_attention.decoding import CachePlan
    k = torch.zeros(1, 1, 2, 4)
    for rank in range(2):
        plan = CachePlan.of(6, 2, 2, rank)
        block = plan.empty_block(k, k)
        for t in (6, 7):
            block = plan.store(block, t, k[:, 0], k[:, 0])
        with pytest.raises(ValueError, match=r"position 8 is outside the planned new rows \[6, 8\)"):
            plan.store(block, 8, k[:, 0], k[:, 0])


# decode() over rows of different origins (left padding) with a keep mask that ignores keys
# inside the rows' windows: each run of rows reads its own rows of the mask; the batch equals
# each row decoded alone, and a row decoded alone equals row t of the causal op on its own
# suffix with the same keys ignored.

def test_decode_reads_each_origin_runs_own_mask_rows():
    from dilated_attention import dilated_attention
    from dilated_attention.decoding import CachedRows, decode
    g = torch.Generator().manual_seed(0)
    t, patterns = 9, ((4, 8), (1, 2))
    q = torch.randn(2, 1, 2, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, t + 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(2, t + 1, dtype=torch.bool)
    keep[0, 2] = keep[1, 5] = False
    keep[1, :3] = False  # row 1: left padding, origin 3
    origins = (0, 3)
    got = decode(q, [CachedRows(k, v, 0, t + 1)], t, patterns, origins=origins, keep=keep)
    for i, origin in enumerate(origins):
        alone = decode(q[i:i + 1], [CachedRows(k[i:i + 1], v[i:i + 1], 0, t + 1)], t, patterns,
                       origins=(origin,), keep=keep[i:i + 1])
        torch.testing.assert_close(got[i], alone[0], rtol=0, atol=0)
        # the causal op over the row's own positions [origin, t], its last row
        rows = slice(origin, t + 1)
        qs = torch.cat([k[i:i + 1, rows, :, :].new_zeros(1, t - origin, 2, 4), q[i:i + 1]], 1)
        want = dilated_attention(qs, k[i:i + 1, rows], v[i:i + 1, rows], *map(list, patterns),
                                 is_causal=True, key_padding_mask=~keep[i:i + 1, rows])
        torch.testing.assert_close(alone[0, 0], want[0, -1], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# models: inputs.py, checkpointing.py, encoder_decoder.py

def test_lm_position_ids_must_agree_over_the_batch_and_be_non_negative():
    """Packed positions must be the same in every batch row, and never negative."""
    model = LongNetLM(LongNetConfig(**SMALL))
    tokens_ = torch.zeros(2, 6, dtype=torch.long)
    rows = torch.stack([torch.tensor([0, 1, 2, 0, 1, 2]), torch.arange(6)])
    with pytest.raises(ValueError, match="same in every batch row"):
        model(tokens_, position_ids=rows)
    with pytest.raises(ValueError, match=r"position_ids must be >= 0, got -1"):
        model(tokens_, position_ids=torch.tensor([0, 1, 2, -1, 0, 1]))


def test_digest_tells_dtype_and_shape_apart():
    """The same bytes in another dtype or shape are other inputs."""
    from dilated_attention.models.inputs import digest

    x = torch.arange(6, dtype=torch.int32)
    assert digest(x) == digest(x.clone())
    assert digest(x) != digest(x.view(2, 3))
    assert digest(x) != digest(x.view(torch.float32))


def test_run_in_chunks_with_a_budget_below_one_row():
    """A chunk budget smaller than one row's intermediates runs one row at a time."""
    from dilated_attention.models.checkpointing import run_in_chunks

    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    out = run_in_chunks(torch.sin, x, chunk_bytes=1, row_bytes=100)
    torch.testing.assert_close(out, torch.sin(x), rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x), rtol=0, atol=0)


def test_encoder_decoder_checks_the_source_against_learned_positions():
    """A source longer than the learned position table is the models' ValueError."""
    model = LongNet(LongNetConfig(**SMALL, positions="learned", max_seq_len=16))
    src, tgt = torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="positions up to 19 exceed max_seq_len=16"):
        model(src, tgt)


# One spawn per world size for the rank functions above that run under the default group
# timeout, in this order on the same ranks (FSDP2 last: it shards its own model only)
SPAWNS = SharedSpawn({
    2: [(_generation_rank,), (_rank_main, True), (_fsdp_generation,)],
    3: [(_generation_rank,), (_rank_main, False)],
})
