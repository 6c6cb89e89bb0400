"""The transformers backend (integrations/transformers.py), all in float64.

Checked against transformers' own sdpa backend (dense pattern), against a
Llama forward written here that calls `dilated_attention` directly (real
dilated patterns), against each packed document run alone, and under
sequence parallelism against one process (spawned gloo ranks, P = 2, 3).
The contract with transformers is pinned on its public interfaces only: the
keywords the attention function accepts, transformers' TransformersKwargs,
and what reaches the function from a Llama model in every mode used here.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest
import torch
# CI installs the [hf] extra: without transformers this module fails to import, loudly
import transformers
from transformers import (AttentionInterface, AutoModelForCausalLM, DynamicCache,
                          GenerationConfig, LlamaConfig)
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.utils import TransformersKwargs

from dilated_attention import all_reduce_gradients, dilated_attention
from dilated_attention.releases import installed_release
from dilated_attention.distributed import comm
from dilated_attention.distributed.sharding import piece_ranges
from dilated_attention.integrations import transformers as hf
from dilated_attention.integrations.transformers import (causal_lm_loss, causal_lm_parts,
                                                          register, refusals, shard_inputs)
from dilated_attention.integrations.transformers.generation import cache_keyword
from dilated_attention.integrations.transformers.masks import (CAUSAL, PackedDocuments, Window,
                                                                build_mask)
from dist_harness import SharedSpawn, error_of, subgroup

TOL = dict(rtol=0, atol=1e-10)
VOCAB = 61
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     pad_token_id=0, eos_token_id=None)  # generate() runs every step
SEGMENTS, RATES = [4, 8, 16], [1, 2, 4]  # real dilated patterns: N ~ 30 crosses every segment
DENSE = register("dilated_dense_test", segment_lengths=[4096], dilation_rates=[1])
DILATED = register("dilated_test", segment_lengths=SEGMENTS, dilation_rates=RATES)


def build(impl: str, seed: int = 0, **overrides):
    """A tiny random Llama (GQA: 4 heads, 2 kv heads), float64, in eval mode."""
    config = copy.deepcopy(CONFIG)  # from_config keeps (and edits) the config it is given
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                            dtype=torch.float64).eval()


def tokens(b: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def padding(kind: str, b: int, n: int) -> torch.Tensor:
    """(b, n) 0/1 mask: row i has 3 i padded tokens on the left or right."""
    mask = torch.ones(b, n, dtype=torch.long)
    for i in range(b):
        if kind == "left":
            mask[i, : 3 * i] = 0
        elif kind == "right" and i:
            mask[i, -3 * i:] = 0
    return mask


def grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(a: dict, b: dict, float32_norms: bool = False) -> None:
    """Equal to 1e-10; with float32_norms, to 1e-6 of each gradient's largest entry.

    Llama's RMSNorm computes in float32 (it casts a float64 input down), so its backward
    rounds gradients to float32. Under P sequence-parallel ranks a rank's backward starts
    from P times its share of the loss's gradient (Note [gradients across ranks]); for P = 3
    that product rounds differently there than one process's, so sequence-parallel gradients
    agree to float32 precision (the 1e-10 held while P was a power of two or 1).
    """
    assert a.keys() == b.keys() and a
    for name in a:
        tol = dict(rtol=0, atol=1e-6 * float(b[name].abs().max()) + 1e-10) if float32_norms \
            else TOL
        torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m: f"{name}: {m}")


def assert_equals_sdpa(make, ids: torch.Tensor, mask: torch.Tensor, output: str = "logits",
                      **kwargs) -> torch.Tensor:
    """make(impl) -> model: with the dense pattern, its `output` (logits) at mask's real
    positions and the gradients of a loss over them equal sdpa's; returns ours."""
    results = []
    for impl in ("sdpa", DENSE):
        model = make(impl)
        logits = getattr(model(ids, **kwargs), output)
        if not results:
            weight = torch.randn(logits.shape, dtype=torch.float64) * mask[..., None]
        (logits * weight).sum().backward()  # a loss over the real (unpadded) positions only
        results.append((logits.detach(), grads(model)))
    (ref, ref_grads), (ours, our_grads) = results
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], **TOL)
    assert_grads_equal(our_grads, ref_grads)
    return ours


# --------------------------------------------------------------------------
# Dense pattern == transformers' sdpa


@pytest.mark.parametrize("use_cache", [True, False])  # True: k, v come strided out of the cache
@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_dense_pattern_equals_sdpa(pad, use_cache):
    b, n = 3, 21
    ids, mask = tokens(b, n), padding(pad, b, n)
    # generate()'s positions for left padding; plain 0 .. n-1 otherwise
    pos = (mask.cumsum(-1) - 1).clamp(min=0) if pad == "left" else None
    kwargs = dict(position_ids=pos, use_cache=use_cache)
    if pad != "none":
        kwargs["attention_mask"] = mask
    assert_equals_sdpa(build, ids, mask, **kwargs)


@pytest.mark.parametrize("pad", ["none", "right"])
def test_bidirectional_dense_pattern_equals_sdpa(pad):
    """config.is_causal = False: transformers builds a bidirectional mask and passes is_causal=False."""
    ids, mask = tokens(2, 17), padding(pad, 2, 17)
    kwargs = {"attention_mask": mask} if pad != "none" else {}
    with torch.no_grad():
        ref, ours = (build(impl, is_causal=False)(ids, **kwargs).logits for impl in ("sdpa", DENSE))
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], **TOL)
    with torch.no_grad():  # and it is not the causal result
        causal = build(DENSE)(ids, **kwargs).logits
    assert not torch.allclose(causal[:, :-1], ours[:, :-1])


@pytest.mark.parametrize("family", ["Qwen2Config", "MistralConfig"])
def test_other_model_families_equal_sdpa(family):
    """Decoders with their own attention classes (Mistral's window switched off) take the same path."""
    config = getattr(transformers, family)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    ids, mask = tokens(2, 19), padding("left", 2, 19)
    results = []
    for impl in ("sdpa", DENSE):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                 dtype=torch.float64).eval()
        with torch.no_grad():
            results.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(results[1][mask.bool()], results[0][mask.bool()], **TOL)


@pytest.mark.parametrize("pad", ["none", "right"])
def test_bidirectional_layers_that_pass_no_flag_follow_the_mask(pad):
    """StableLM's layers keep is_causal = True and pass no flag: with config.is_causal = False
    the mask function is what says bidirectional (eager attention reads only the mask; sdpa
    skips an unpadded mask and then runs causal, so eager is the reference here)."""
    config = transformers.StableLmConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, pad_token_id=0)
    config.is_causal = False
    ids, mask = tokens(2, 9), padding(pad, 2, 9)
    kwargs = {"attention_mask": mask} if pad != "none" else {}
    results = []
    for impl in ("eager", DENSE):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                 dtype=torch.float64).eval()
        assert all(layer.self_attn.is_causal for layer in model.model.layers)
        with torch.no_grad():
            results.append(model(ids, **kwargs).logits)
    real = mask.bool()
    torch.testing.assert_close(results[1][real], results[0][real], rtol=0, atol=1e-7)
    assert build_mask(1, 3, 3, mask_function=transformers.masking_utils.
                      bidirectional_mask_function).inner is None


def test_dense_pattern_generates_like_sdpa():
    ids = tokens(2, 9)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True)
    ref, ours = build("sdpa").generate(ids, **kwargs), build(DENSE).generate(ids, **kwargs)
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), **TOL)


# --------------------------------------------------------------------------
# Other model families == transformers' sdpa (dense pattern)

# every family's tiny config takes the values its __init__ names (attribute_map spellings too)
FAMILY_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    pad_token_id=0, eos_token_id=None, sliding_window=6, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    decoder_sparse_step=1, n_inner=64, ffn_dim=64, word_embed_proj_dim=32, rotary_dim=4,
    n_positions=128)
FAMILIES = {
    "mixtral": {}, "qwen2_moe": {}, "qwen3": {}, "qwen3_moe": {}, "gemma": {},
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "phi": dict(partial_rotary_factor=0.5), "phi3": {}, "starcoder2": {}, "olmo": {},
    "olmo2": {}, "cohere": {}, "granite": {}, "gpt_neox": dict(rotary_pct=0.5), "gptj": {},
    "gpt2": {}, "opt": {}, "smollm3": dict(no_rope_layer_interval=2), "glm": {},
    "exaone4": dict(sliding_window_pattern=2),
}


def family_model(model_type: str, impl: str, **overrides):
    import inspect

    cls = transformers.CONFIG_MAPPING[model_type]
    names = set(inspect.signature(cls.__init__).parameters)
    spelled = getattr(cls, "attribute_map", {}) or {}
    values = {**FAMILY_COMMON, **FAMILIES.get(model_type, {}), **overrides}
    config = cls(**{spelled.get(k, k): v for k, v in values.items()
                    if spelled.get(k, k) in names})
    torch.manual_seed(0)
    # experts "eager": transformers' grouped_mm experts take no float64
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                            dtype=torch.float64,
                                            experts_implementation="eager").eval()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_model_families_equal_sdpa(model_type):
    """The families docs/transformers.md names as checked: logits unpadded and left-padded
    equal transformers' sdpa (its attention and mask functions registered under another name:
    Gemma 2 refuses "sdpa" itself), every layer calling the registered function (Bloom and
    MPT, whose layers do not, raise instead)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("reference_attention", sdpa_attention_forward)
    AttentionMaskInterface.register("reference_attention", sdpa_mask)
    calls = []
    dense = AttentionInterface()[DENSE]

    def counted(*args, **kwargs):
        calls.append(1)
        return dense(*args, **kwargs)

    AttentionInterface.register("dilated_counted_test", counted)
    AttentionMaskInterface.register("dilated_counted_test", AttentionMaskInterface()[DENSE])
    if model_type == "gptj" and installed_release("transformers") < (5, 24):
        pytest.skip("GPT-J's layers call the attention interface from transformers 5.24 on")
    ids, mask = tokens(2, 16), padding("left", 2, 16)
    with torch.no_grad():
        ref, ours = (family_model(model_type, impl)
                     for impl in ("reference_attention", "dilated_counted_test"))
        for kwargs in ({}, {"attention_mask": mask}):
            real = kwargs.get("attention_mask", torch.ones_like(mask)).bool()
            want, got = ref(ids, **kwargs).logits, ours(ids, **kwargs).logits
            torch.testing.assert_close(got[real], want[real], rtol=0,
                                       atol=1e-9 * float(want.abs().max()))
    assert len(calls) == 2 * 2  # every layer (2) of both forwards


@pytest.mark.parametrize("pad", ["none", "left"])
@pytest.mark.parametrize("family", ["bloom", "mpt", "gpt_neox_japanese"])
def test_models_that_never_call_the_attention_function_raise(family, pad):
    """Bloom, MPT and GPT-NeoX-Japanese accept the registered name but compute attention in
    their own layers, reading the mask function's result as their mask: an error saying so,
    where a plain causal mask of None once ran Bloom's attention bidirectional, silently, and
    a padded batch's keep-mask gave a shape error inside the model."""
    config = (transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
              if family == "bloom" else
              transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2,
                                     expansion_ratio=2) if family == "mpt" else
              transformers.GPTNeoXJapaneseConfig(vocab_size=VOCAB, hidden_size=32,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_multiple_size=2))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=DENSE).eval()
    kwargs = {} if pad == "none" else {"attention_mask": padding(pad, 2, 12)}
    with torch.no_grad(), pytest.raises(NotImplementedError,
                                        match="never calls transformers' AttentionInterface"):
        model(tokens(2, 12), **kwargs)
    with pytest.raises(AttributeError, match="reached the model's own code"):
        CAUSAL.to(torch.float64)
    with pytest.raises(NotImplementedError, match="uses the attention mask in its own code"):
        CAUSAL[:, 0]  # noqa: B018 - indexing is the point


@pytest.mark.parametrize("pad", ["none", "left"])
def test_sparse_attention_indexers_raise(pad):
    """DeepSeek V3.2's sparse attention (GLM-MoE-DSA, AXK2, dots3, HY V4 share it) indexes the
    mask in its own indexer and passes the selected keys as `indices`: refused from the config,
    naming it, where it crashed with "'Causal' object is not subscriptable" (an IndexError
    when padded)."""
    model = family_model("deepseek_v32", DENSE, num_key_value_heads=4, n_routed_experts=4,
                         n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    kwargs = {} if pad == "none" else {"attention_mask": padding(pad, 2, 12)}
    with torch.no_grad(), pytest.raises(NotImplementedError, match="config.index_topk"):
        model(tokens(2, 12), **kwargs)


def test_chunked_attention_is_refused_by_name():
    """Llama 4's chunked attention layers (config.attention_chunk_size): refused naming it,
    where the chunks read as packed documents and the error spoke of a packed-sequence mask and
    position_ids the caller never gave; its other layers and a model without chunks run."""
    common = dict(interleave_moe_layer_step=1, no_rope_layers=[1, 0], num_key_value_heads=2)
    ids = tokens(2, 16)
    with torch.no_grad():
        chunked = family_model("llama4_text", DENSE, attention_chunk_size=6, **common)
        with pytest.raises(NotImplementedError, match="attention_chunk_size = 6"):
            chunked(ids)
        if installed_release("transformers") < (5, 24):
            pytest.skip("before 5.24 transformers' own cache of a Llama 4 without chunks "
                        "fails (a sliding-window layer of size None)")
        # no chunks: every layer is plain causal attention, equal to sdpa
        got, want = (family_model("llama4_text", impl, attention_chunk_size=None, **common)(ids)
                     .logits for impl in (DENSE, "sdpa"))
    torch.testing.assert_close(got, want, **TOL)
    config = transformers.Llama4TextConfig(attention_chunk_size=4)

    def chunks(b, h, q, kv):
        return (kv <= q) & (q // 4 == kv // 4)

    read = build_mask(batch_size=1, q_length=12, kv_length=12, mask_function=chunks,
                      local_size=4, config=config)
    assert "chunked attention" in read.reason


# --------------------------------------------------------------------------
# Multi-head latent attention: v's head dim differs from q's (Note [head dims])


def latent_model(impl: str, seed: int = 0):
    """A tiny float64 DeepSeek V3: q and k heads of 8 + 4 (rotary) columns, v heads of 8."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(seed)
    # experts "eager": transformers' grouped_mm experts take no float64
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float64,
                                            experts_implementation="eager").eval()


@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_latent_attention_equals_sdpa(pad):
    """DeepSeek V3's v heads are narrower than its q and k heads: logits, gradients and
    generate() equal sdpa's with the dense pattern."""
    b, n = 2, 19
    ids, mask = tokens(b, n), padding(pad, b, n)
    kwargs = {"attention_mask": mask} if pad != "none" else {}
    assert_equals_sdpa(latent_model, ids, mask, **kwargs)
    if pad != "right":  # generate continues each row at its end: left padding only
        gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0,
                   return_dict_in_generate=True, output_scores=True, **kwargs)
        ref, ours = (latent_model(impl).generate(ids, **gen) for impl in ("sdpa", DENSE))
        assert torch.equal(ours.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), **TOL)


@pytest.mark.parametrize("dv", [4, 16])  # narrower than q's 8: zero columns on v; wider: on q, k
def test_head_dims_of_v_other_than_q_are_exact(dv):
    """Each output column depends on its own column of v only: the attention function with
    v's head dim != q's equals the op on q's head dim with other columns beside (random, not
    zeros), real dilated patterns, decoding included; gradients too."""
    ours = AttentionInterface()[DILATED]
    module = build(DILATED).model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    b, h, hk, n, d = 2, 4, 2, 30, 8
    q = torch.randn(b, h, n, d, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(b, hk, n, d, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(b, hk, n, dv, dtype=torch.float64, generator=g, requires_grad=True)
    extra = torch.randn(b, hk, n, abs(d - dv), dtype=torch.float64, generator=g)
    out, _ = ours(module, q, k, v, None, scaling=0.3)
    assert out.shape == (b, n, h, dv)

    def op(vv, scale=0.3):  # in our layout: (b, h, n, d) -> (b, n, h, d)
        t = [x.transpose(1, 2) for x in (q, k, vv)]
        return dilated_attention(*t, SEGMENTS, RATES, is_causal=True, scale=scale)

    def reference(scale=0.3):
        if dv < d:
            return op(torch.cat([v, extra], dim=-1), scale)[..., :dv]
        # v's columns in two groups of q's head dim
        return torch.cat([op(v[..., :d], scale), op(v[..., d:], scale)], dim=-1)

    ref = reference()
    torch.testing.assert_close(out, ref, **TOL)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)
    with torch.no_grad():  # one new token against the cache: the full forward's last row
        step, _ = ours(module, q[:, :, -1:], k, v, None, scaling=0.3)
    torch.testing.assert_close(step[:, 0], ref[:, -1].detach(), **TOL)
    # no scaling given: q's own head dim's scale, not that of q padded to v's head dim
    with torch.no_grad():
        unscaled, _ = ours(torch.nn.Module().eval(), q, k, v, None)
        torch.testing.assert_close(unscaled, reference(d ** -0.5), **TOL)


def _serving_step(ours, module, q, k, v, cached_k, cached_v):
    """One new token (q, k, v's last rows) through the attention function as a step of
    sharded generation reads it: from the serving cache (one process, a stand-in cache
    holding cached_k, cached_v (b, n, hk, d) as its rows)."""
    import types

    from dilated_attention.decoding import CachedRows
    from dilated_attention.integrations.transformers.backend import serving
    n = cached_k.shape[1]
    cache = types.SimpleNamespace(group=None, prefill_group=None, decoding=True,
                                  position=lambda layer: n - 1,
                                  rows=lambda layer: [CachedRows(cached_k, cached_v, 0, n)])
    with serving(cache), torch.no_grad():
        return ours(module, q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], None, scaling=0.3)[0]


def test_sharded_step_with_other_head_dims():
    """A step of sharded generation pads the cached rows as the new token's (v's head dim
    other than q's) and equals the full forward's last row; cached keys of another head dim
    than the layer's (a cache of other tensors, heads alike) are refused."""
    ours = AttentionInterface()[DILATED]
    module = torch.nn.Module().eval()
    module.layer_idx = 0
    g = torch.Generator().manual_seed(5)
    b, h, hk, n, d = 1, 4, 2, 30, 8
    for dv in (4, 16):
        q = torch.randn(b, h, n, d, dtype=torch.float64, generator=g)
        k = torch.randn(b, hk, n, d, dtype=torch.float64, generator=g)
        v = torch.randn(b, hk, n, dv, dtype=torch.float64, generator=g)
        full, _ = ours(module, q, k, v, None, scaling=0.3)
        step = _serving_step(ours, module, q, k, v, k.transpose(1, 2), v.transpose(1, 2))
        torch.testing.assert_close(step[:, 0], full[:, -1], **TOL)
    with pytest.raises(NotImplementedError, match="caches other tensors than its attention"):
        _serving_step(ours, module, q, k, v, k.transpose(1, 2)[..., :6], v.transpose(1, 2))


# --------------------------------------------------------------------------
# Sliding-window models == transformers' sdpa (Note [sliding-window layers])


def window_model(family: str, impl: str = DENSE, seed: int = 0, **overrides):
    """A tiny float64 model with sliding-window layers: Mistral (every layer, window 6),
    Qwen2 (2 global layers, then 2 with window 5) or Gemma 3 (local window 5 and global
    layers alternating)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=6)
    elif family == "qwen2":
        common["num_hidden_layers"] = 4
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=5,
                                          max_window_layers=2)
    else:
        common["num_hidden_layers"] = 4
        config = transformers.Gemma3TextConfig(
            **common, head_dim=8, sliding_window=5, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"] * 2)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                            dtype=torch.float64).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("case", ["plain", "left", "packed"])
def test_sliding_window_models_equal_sdpa(family, case):
    """Logits and gradients, float64: the window layers through ring_attention's window, the
    others (Gemma 3's global layers) through the registered dense pattern."""
    b, n = 2, 23
    ids = tokens(b, n)
    mask = padding("left", b, n) if case == "left" else torch.ones(b, n, dtype=torch.long)
    kwargs = {"attention_mask": mask} if case == "left" else {}
    if case == "packed":  # documents of 9 and 14 tokens: transformers' packed-sequence mask
        kwargs = dict(position_ids=torch.cat([torch.arange(9), torch.arange(14)])[None],
                      use_cache=False)
    ours = assert_equals_sdpa(lambda impl: window_model(family, impl), ids, mask, **kwargs)
    real = mask.bool()
    # the window matters: without it the logits differ
    wide = window_model(family, DENSE, sliding_window=4096)(ids, **kwargs).logits.detach()
    assert not torch.allclose(wide[real], ours[real])


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_models_generate_like_sdpa(family):
    """generate() with transformers' sliding-window cache, which drops keys older than the
    window: 14 new tokens after a prompt of 9, windows of 6 and 5 keys."""
    ids = tokens(2, 9)
    kwargs = dict(max_new_tokens=14, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    ref, ours = (window_model(family, impl).generate(ids, **kwargs) for impl in ("sdpa", DENSE))
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), **TOL)


@pytest.mark.parametrize("family", ["Cohere2Config", "MinistralConfig"])
def test_models_that_build_an_unused_full_attention_mask_generate_like_sdpa(family):
    """Every layer a sliding window: these models still build the full-attention mask at each
    step, from the sliding-window cache's sizes (keys dropped); no layer uses it, so it is
    refused only where used, and generate() gives sdpa's tokens and scores."""
    config = getattr(transformers, family)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, pad_token_id=0,
        eos_token_id=None, layer_types=["sliding_attention"] * 2,
        **({"head_dim": 8} if family == "MinistralConfig" else {}))
    ids = tokens(2, 9)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    results = []
    for impl in ("sdpa", DENSE):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                 dtype=torch.float64).eval()
        results.append(model.generate(ids, **kwargs))
    ref, ours = results
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), **TOL)


# --------------------------------------------------------------------------
# Real dilated patterns == a Llama whose attention calls dilated_attention directly


def reference_logits(model, ids, *, position_ids=None, key_padding_mask=None, cu_seqlens=None,
                     dropout_p=0.0):
    """LlamaForCausalLM.forward written out, its attention a direct dilated_attention call."""
    inner = model.model
    b, n = ids.shape
    x = inner.embed_tokens(ids)
    if position_ids is None:
        position_ids = torch.arange(n)[None]
    cos, sin = inner.rotary_emb(x, position_ids)
    for layer in inner.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        # (b, n, e) -> (b, n, heads, d): our layout, so rotary unsqueezes at dim 2
        q = attn.q_proj(h).view(b, n, -1, attn.head_dim)
        k = attn.k_proj(h).view(b, n, -1, attn.head_dim)
        v = attn.v_proj(h).view(b, n, -1, attn.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        out = dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=True, scale=attn.scaling,
                                dropout_p=dropout_p, key_padding_mask=key_padding_mask,
                                cu_seqlens=cu_seqlens)
        x = x + attn.o_proj(out.reshape(b, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x))


@pytest.mark.parametrize("case", ["plain", "left", "right", "packed", "dropout"])
def test_dilated_pattern_equals_direct_calls(case):
    b, n = 2, 30
    ids = tokens(b, n, seed=3)
    model = build(DILATED)
    kwargs, ref_kwargs = {}, {}
    if case in ("left", "right"):
        mask = padding(case, b, n)
        kwargs["attention_mask"] = mask
        ref_kwargs["key_padding_mask"] = ~mask.bool()
    if case == "packed":
        pos = torch.cat([torch.arange(m) for m in (11, 7, 12)])[None]
        kwargs["position_ids"] = ref_kwargs["position_ids"] = pos
        ref_kwargs["cu_seqlens"] = [0, 11, 18, 30]
    if case == "dropout":
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.3
        model.train()
        ref_kwargs["dropout_p"] = 0.3
    results = []
    for run in (lambda: reference_logits(model, ids, **ref_kwargs),
                lambda: model(ids, **kwargs).logits):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the same dropout seeds, drawn in the same order
        logits = run()
        logits.square().mean().backward()
        results.append((logits.detach(), grads(model)))
    (ref, ref_grads), (ours, our_grads) = results
    torch.testing.assert_close(ours, ref, **TOL)
    assert_grads_equal(our_grads, ref_grads)


def test_right_padded_rows_equal_rows_alone():
    """Key padding keeps positions and segments in place: right-padded rows are the rows alone."""
    b, n = 3, 30
    ids, mask = tokens(b, n, seed=4), padding("right", b, n)
    model = build(DILATED)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for i in range(b):
            length = int(mask[i].sum())
            alone = model(ids[i:i + 1, :length]).logits[0]
            torch.testing.assert_close(padded[i, :length], alone, **TOL)


def test_dropout_only_in_training():
    model = build(DILATED)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = tokens(1, 20)
    with torch.no_grad():
        evals = [model(ids).logits for _ in range(2)]
        model.train()
        trains = [model(ids).logits for _ in range(2)]
    torch.testing.assert_close(evals[0], evals[1], rtol=0, atol=0)
    assert not torch.allclose(trains[0], trains[1])


def test_dilated_decoding_equals_full_forward():
    """Decoding (one token against the cache) is exact: each step's logits are the full forward's."""
    model = build(DILATED)
    seq = tokens(2, 13)
    cache = DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():
        logits = model(seq, **{cache_keyword(model): cache}).logits[:, -1]
        for _ in range(8):
            steps.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
            logits = model(seq[:, -1:], **{cache_keyword(model): cache}).logits[:, -1]
        full = model(seq, use_cache=False).logits
    for i, step in enumerate(steps):
        torch.testing.assert_close(step, full[:, 12 + i], **TOL)
    # generate() takes the same path (its scores are float32)
    out = model.generate(seq[:, :13], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, seq)


def test_left_padded_rows_generate_what_they_generate_alone():
    """generate() pads on the left and numbers each row's real tokens from 0: the backend
    starts the row's segments there too, so each row is the row alone, prompt and steps."""
    b, n = 3, 23
    ids, mask = tokens(b, n, seed=4), padding("left", b, n)
    ids[mask == 0] = 0
    model = build(DILATED)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # generate()'s for left padding
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
        for i in range(b):
            pad = 3 * i
            assert torch.equal(out[i, pad:], model.generate(ids[i:i + 1, pad:], **kwargs)[0])
            alone = model(ids[i:i + 1, pad:]).logits[0]
            torch.testing.assert_close(logits[i, pad:], alone, **TOL)
        # positions that count the padding (no position_ids given) keep it in the segments,
        # masked: the row alone only where no segment reaches the padding
        counted = model(ids, attention_mask=mask).logits
        assert not torch.allclose(counted[2, 6:], logits[2, 6:])
        reference = reference_logits(model, ids, key_padding_mask=~mask.bool())
        torch.testing.assert_close(counted[mask.bool()], reference[mask.bool()], **TOL)


# --------------------------------------------------------------------------
# Packed sequences == each document alone


@pytest.mark.parametrize("how", ["position_ids", "position_ids_no_cache", "cu_seq_lens",
                                 "batch_of_two"])
def test_packed_documents_equal_documents_alone(how):
    lengths = [11, 5, 14]
    n = sum(lengths)
    b = 2 if how == "batch_of_two" else 1
    ids = tokens(b, n, seed=5)
    pos = torch.cat([torch.arange(m) for m in lengths])[None]
    kwargs = {"position_ids": pos}
    if how == "position_ids_no_cache":
        kwargs["use_cache"] = False  # transformers then packs the causal mask itself
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 11, 16, n], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    model = build(DILATED)
    with torch.no_grad():
        packed = model(ids, **kwargs).logits
        alone = torch.cat([model(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, **TOL)


# --------------------------------------------------------------------------
# Sequence parallel == one process


def _sp_case_inputs(case: str, n: int):
    """(input_ids, labels, position_ids, attention_mask) of the whole batch."""
    ids = tokens(2, n, seed=11)
    labels = ids.clone()
    labels[:, ::4] = -100
    pos = mask = None
    if case == "left_padding":
        mask = padding("left", 2, n)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        labels[mask == 0] = -100
    if case == "packed":
        # documents start at 10 and 15: rank borders at P = 3 (10) and P = 2 (15)
        pos = torch.cat([torch.arange(m) for m in (10, 5, n - 15)])[None]
    if case == "last_token_only":
        # one target, on the last rank: the others have none and must not hang
        labels = torch.full_like(ids, -100)
        labels[:, -1] = ids[:, 0]
    return ids, labels, pos, mask


SP_CASES = ("plain", "left_padding", "packed", "last_token_only")
# sharded, these compute the loss from the hidden states and lm_head (causal_lm_parts)
CHUNKED_CASES = ("packed", "last_token_only")


def _sp_rank(group):
    world, rank = comm.group_size(group), comm.group_rank(group)
    sp = register("dilated_sp_test", segment_lengths=SEGMENTS, dilation_rates=RATES, group=group)
    # head-parallel too where the 4 query heads split over the ranks
    ulysses = register("dilated_sp_ulysses_test", segment_lengths=SEGMENTS,
                       dilation_rates=RATES, group=group, strategy="ulysses")
    n = 29
    (start, stop), = piece_ranges(n, world, rank)
    results = []
    for case, impl in [(case, sp) for case in SP_CASES] + \
            [(case, ulysses) for case in SP_CASES if world == 2]:
        def loss_of(model, inputs, targets, g, case=case):
            if g is not None and case in CHUNKED_CASES:
                # the body's hidden states and lm_head: the loss over chunks of 3 rows
                body, head = causal_lm_parts(model)
                hidden = body(**inputs).last_hidden_state
                return head(hidden), causal_lm_loss(hidden, targets, g, lm_head=head,
                                                    chunk_bytes=3 * VOCAB * 8)
            logits = model(**inputs).logits
            return logits, causal_lm_loss(logits, targets, g)

        results.append((case,) + _one_and_sharded(case, n, group, (start, stop), build(DILATED),
                                                  build(impl), loss_of))
    # forgetting the global position_ids: transformers restarts them at 0 on every rank
    model = build(sp)
    try:
        model(shard_inputs(tokens(1, n), group)[0]["input_ids"])
        error = None
    except ValueError as exc:
        error = str(exc)
    # fewer tokens than ranks: an empty piece, which transformers' models cannot run (Llama's
    # attention reshapes (b, 0, -1, d)); it once hung the other ranks after an IndexError
    try:
        shard_inputs(tokens(1, world - 1), group)
        empty = None
    except ValueError as exc:
        empty = str(exc)
    error = (error, empty)
    # examples/finetune_hf.py, packed: its loss curve on these ranks and on one process
    example = _example()
    args = example.parse_args(["--seq-len", "96", "--batch-size", "2", "--steps", "3",
                               "--packed", "2", "--dtype", "float64", "--eval-batches", "1"])
    curves = (example.train(args, group)["losses"], example.train(args, None)["losses"])
    return results, error, curves, _sharded_generation(group), _window_models(group)


def _window_models(group):
    """Sliding-window models (Mistral; Gemma 3, local and global layers) sequence-parallel
    against one process: the window layers run the halo exchange; sharded generation."""
    world, rank = comm.group_size(group), comm.group_rank(group)
    sp = register("dilated_sp_dense_test", segment_lengths=[4096], dilation_rates=[1],
                  group=group)
    n = 29
    (start, stop), = piece_ranges(n, world, rank)

    def loss_of(model, inputs, targets, g):
        logits = model(**inputs).logits
        return logits, causal_lm_loss(logits, targets, g)

    steps = [(f"{family} {case}",) + _one_and_sharded(
                 case, n, group, (start, stop), window_model(family, DENSE),
                 window_model(family, sp), loss_of)
             for family in ("mistral", "gemma3") for case in ("plain", "left_padding", "packed")]
    # generation: each step's window (6 or 5 keys) reaches into rows other ranks hold; one
    # process generates with transformers' sliding-window cache
    for family in ("mistral", "gemma3"):
        one, sharded = window_model(family, DENSE), window_model(family, sp)
        for b, length, new, kwargs in (GENERATION_CASES[0], GENERATION_CASES[3]):
            ids, kwargs = _generation_inputs(b, length, kwargs)
            outs = [hf.generate(model, ids, group=g, max_new_tokens=new, pad_token_id=0,
                                **kwargs) for model, g in ((one, None), (sharded, group))]
            assert torch.equal(outs[1], outs[0]), (family, length, kwargs)
    # layers of another kind are refused up front, on every rank
    sharded.config.layer_types = ["sliding_attention", "chunked_attention"] * 2
    with pytest.raises(NotImplementedError, match=r"layer types \['chunked_attention'\]"):
        hf.generate(sharded, ids, group=group, max_new_tokens=2, pad_token_id=0)
    return steps


def _one_and_sharded(case: str, n: int, group, rows, one, sharded, loss_of):
    """A training step of the same model on one process and on this rank's rows: (logits,
    the one-process logits of those rows, loss, its one-process loss, gradients (averaged
    over the ranks), the one-process gradients). loss_of(model, inputs, targets, group) ->
    (logits, loss)."""
    ids, labels, pos, mask = _sp_case_inputs(case, n)
    out = {}
    for label, model, g in (("one", one, None), ("sp", sharded, group)):
        inputs, targets = shard_inputs(ids, g, labels=labels, position_ids=pos,
                                       attention_mask=mask)
        logits, loss = loss_of(model, inputs, targets, g)
        loss.backward()
        all_reduce_gradients(model, g)
        out[label] = (logits.detach(), loss.detach(), grads(model))
    (logits1, loss1, grads1), (logits2, loss2, grads2) = out["one"], out["sp"]
    return logits2, logits1[:, rows[0]:rows[1]], loss2, loss1, grads2, grads1


GENERATION_CASES = [
    # (batch, prompt length, new tokens, generate arguments)
    (2, 21, 9, dict(do_sample=False)),
    (1, 30, 6, dict(do_sample=True, top_k=5)),  # the same seed on every rank
    (2, 1, 7, dict(do_sample=False)),  # fewer tokens than ranks: the prompt runs whole
    # left padding (rows of 23, 20 and 6 real tokens) ending on another rank's piece
    (3, 23, 8, dict(do_sample=False, attention_mask=torch.tensor([0, 3, 17])[:, None]
                    <= torch.arange(23)[None])),
]


def _generation_inputs(b: int, n: int, kwargs):
    """A generation case's prompt (padding ids 0) and generate arguments (a 0/1 mask)."""
    ids = tokens(b, n, seed=n)
    if "attention_mask" in kwargs:
        ids[~kwargs["attention_mask"]] = 0
        kwargs = {**kwargs, "attention_mask": kwargs["attention_mask"].long()}
    return ids, kwargs


def _sharded_generation(group):
    """hf.generate on these ranks returns what model.generate returns on one process."""
    world, rank = comm.group_size(group), comm.group_rank(group)
    name = register("dilated_generate_test", segment_lengths=SEGMENTS, dilation_rates=RATES,
                    group=group)
    one, sharded = build(DILATED), build(name)
    done = []
    for b, n, new, kwargs in GENERATION_CASES:
        ids, kwargs = _generation_inputs(b, n, kwargs)
        outs = []
        for model, g in ((one, None), (sharded, group)):
            torch.manual_seed(3)
            outs.append(hf.generate(model, ids, group=g, max_new_tokens=new, pad_token_id=0,
                                    **kwargs))
        assert torch.equal(outs[1], outs[0]), (n, kwargs)
        done.append(outs[1])
    # multi-head latent attention caches its compressed latents (from transformers 5.15; its
    # keys and values before), not the keys and values a step would read: refused at the
    # first step, on every rank
    ids, _ = _generation_inputs(2, 21, {})
    if installed_release("transformers") >= (5, 15):
        with pytest.raises(NotImplementedError, match="caches other tensors than its attention"):
            hf.generate(latent_model(name), ids, group=group, max_new_tokens=3, pad_token_id=0)
    else:
        outs = [hf.generate(latent_model(impl), ids, group=g, max_new_tokens=3, pad_token_id=0)
                for impl, g in ((DILATED, None), (name, group))]
        assert torch.equal(outs[1], outs[0])
    # traffic: each step beyond the first token sends one all-gather per layer, no agreement
    ids = tokens(2, 21, seed=21)
    counts = []
    for new in (1, 5):
        with comm.count_communication() as stats:
            hf.generate(sharded, ids, group=group, max_new_tokens=new, pad_token_id=0)
        counts.append(stats)
    layers, heads = CONFIG.num_hidden_layers, CONFIG.num_attention_heads
    head_dim = CONFIG.hidden_size // heads
    steps = 4 * layers
    assert counts[1].agreements == counts[0].agreements
    assert counts[1].messages - counts[0].messages == steps
    assert counts[1].messages_of("all_gather") - counts[0].messages_of("all_gather") == steps
    assert counts[1].bytes_sent - counts[0].bytes_sent == \
        steps * (world - 1) * 2 * heads * (head_dim + 1) * 8
    # a mistake on one rank is an error on every rank
    for args, kwargs, error, match in [
        ((sharded, ids if rank else ids % 7), {}, ValueError, "ranks disagree on 'input_ids'"),
        ((one, ids), {}, ValueError, "registered with group=None"),
        ((sharded, ids), dict(num_beams=2), NotImplementedError, "beam search"),
        ((sharded, ids), dict(cache_implementation="static"), ValueError, "cache_implementation"),
        ((sharded, ids[:, :0]), {}, ValueError, "at least one token"),
    ]:
        with pytest.raises(error, match=match):
            hf.generate(*args, group=group, max_new_tokens=3, pad_token_id=0, **kwargs)
    # decoding under the group outside hf.generate is refused (the cache is not sharded)
    inputs, _ = shard_inputs(ids, group)
    cache = DynamicCache(config=sharded.config)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="outside dilated_attention"):
        sharded(**{**inputs, "use_cache": True}, **{cache_keyword(sharded): cache})
        sharded(ids[:, -1:], position_ids=torch.tensor([[21]]), **{cache_keyword(sharded): cache})
    return done


def _example():
    """examples/finetune_hf.py as a module (it imports train_long_context from its folder)."""
    folder = pathlib.Path(__file__).resolve().parents[1] / "examples"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module("finetune_hf")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_equals_one_process(world):
    outputs = SPAWNS.results(world, _sp_rank)
    for results, error, (sharded, single), generated, windows in outputs:
        assert all(torch.equal(a, b) for a, b in zip(generated, outputs[0][3]))
        torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), **TOL)
        for case, logits, ref_logits, loss, ref_loss, grads_sp, grads_one in results + windows:
            torch.testing.assert_close(logits, ref_logits, **TOL, msg=lambda m: f"{case}: {m}")
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{case}: {m}")
            assert_grads_equal(grads_sp, grads_one, float32_norms=True)
        positions, empty = error
        assert positions is not None and "GLOBAL position_ids" in positions
        assert empty is not None and f"{world - 1} tokens for {world}" in empty, empty
        assert "empty piece" in empty


def test_causal_lm_loss_equals_transformers_loss():
    ids, labels, _, _ = _sp_case_inputs("plain", 23)
    model = build(DILATED)
    inputs, targets = shard_inputs(ids, None, labels=labels)
    with torch.no_grad():
        logits = model(**inputs).logits
        ours = causal_lm_loss(logits, targets, None)
        theirs = model(ids, labels=labels).loss  # computed in float32
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(ours, shifted, **TOL)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)


def test_causal_lm_loss_from_hidden_states_and_lm_head():
    """causal_lm_parts + causal_lm_loss(hidden, ..., lm_head=): the loss and gradients of the
    logits path, tied and untied heads; what it refuses."""
    ids, labels, _, _ = _sp_case_inputs("plain", 23)
    for tie in (False, True):
        model = build(DILATED, tie_word_embeddings=tie)
        inputs, targets = shard_inputs(ids, None, labels=labels)
        runs = []
        for chunked in (False, True):
            model.zero_grad(set_to_none=True)
            if chunked:
                body, head = causal_lm_parts(model)
                loss = causal_lm_loss(body(**inputs).last_hidden_state, targets, None,
                                      lm_head=head, chunk_bytes=5 * VOCAB * 8)
            else:
                loss = causal_lm_loss(model(**inputs).logits, targets, None)
            loss.backward()
            runs.append((loss.detach(), grads(model)))
        torch.testing.assert_close(runs[1][0], runs[0][0], **TOL)
        assert_grads_equal(runs[1][1], runs[0][1])
    with pytest.raises(ValueError, match=r"hidden states \(batch, seq_len, 32\) for lm_head"):
        causal_lm_loss(torch.zeros(1, 4, VOCAB), torch.zeros(1, 4), None, lm_head=head)
    with pytest.raises(TypeError, match="lm_head must be the model's torch.nn.Linear head"):
        causal_lm_loss(torch.zeros(1, 4, 32), torch.zeros(1, 4), None, lm_head=body)
    capped = build(DILATED, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        causal_lm_parts(capped)
    with pytest.raises(ValueError, match="no nn.Linear output head"):
        causal_lm_parts(body)


def test_shard_inputs_masks_document_ends():
    ids = tokens(1, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    inputs, targets = shard_inputs(ids, None, labels=ids, position_ids=pos)
    assert targets.tolist() == [[ids[0, 1].item(), ids[0, 2].item(), -100, ids[0, 4].item(), -100,
                                 ids[0, 6].item(), ids[0, 7].item(), -100]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert inputs["use_cache"] is False
    # an all-ones mask pads nothing: still documents; with padding, restarts are not documents
    ones = torch.ones(1, 8, dtype=torch.long)
    assert "cu_seq_lens_q" in shard_inputs(ids, None, position_ids=pos, attention_mask=ones)[0]
    ones[0, :2] = 0
    assert "cu_seq_lens_q" not in shard_inputs(ids, None, position_ids=pos, attention_mask=ones)[0]


# --------------------------------------------------------------------------
# The contract with transformers: what reaches us, what we accept, what we refuse


def test_accepted_keywords():
    assert refusals.USED_KWARGS == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "sliding_window"}
    assert refusals.IGNORED_KWARGS == {"use_cache", "max_length_q", "max_length_k",
                                 "num_items_in_batch", "output_hidden_states",
                                 "output_router_logits"}
    assert set(refusals.OFF_KWARGS) == {"output_attentions", "softcap", "s_aux", "seq_idx", "sinks",
                                        "position_bias", "encoder_hidden_states", "deterministic"}
    assert refusals.ACCEPTED_KWARGS == refusals.USED_KWARGS | refusals.IGNORED_KWARGS | set(refusals.OFF_KWARGS)
    assert refusals.MASK_KWARGS == {"allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype",
                              "config", "use_vmap", "device", "local_size"}


def test_transformers_kwargs_are_all_classified():
    """transformers' public list of forward keywords that reach attention layers.

    A new entry fails here: decide whether the backend uses, ignores or refuses it.
    """
    known = set(TransformersKwargs.__annotations__)
    assert known == {"num_items_in_batch", "output_hidden_states", "output_attentions",
                     "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                     "max_length_k", "position_ids", "is_causal", "seq_idx"}
    # is_causal is a named parameter of the attention function
    assert known - {"is_causal"} <= refusals.ACCEPTED_KWARGS


def test_what_reaches_the_attention_function():
    """Every mode the tests use, recorded: keywords and mask types stay within the contract."""
    seen = []
    ours = AttentionInterface()[DILATED]

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((frozenset(k for k in kwargs if k not in ("dropout", "scaling", "is_causal")),
                     type(attention_mask).__name__))
        return ours(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dilated_spy_test", spy)
    AttentionMaskInterface.register("dilated_spy_test", build_mask)
    model = build("dilated_spy_test")
    ids = tokens(2, 20)
    pos = torch.cat([torch.arange(10), torch.arange(10)])[None]
    cu = torch.tensor([0, 10, 20])
    with torch.no_grad():
        model(ids)
        model(ids, use_cache=False)
        model(ids, attention_mask=padding("left", 2, 20))
        model(ids, position_ids=pos, use_cache=False)
        model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10,
              max_length_k=10)
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.train()
    model(ids, labels=ids, num_items_in_batch=torch.tensor(38)).loss.backward()
    assert {kind for _, kind in seen} == {"Causal", "Tensor", "PackedDocuments"}
    assert set().union(*(keys for keys, _ in seen)) <= refusals.ACCEPTED_KWARGS
    assert all({"position_ids", "use_cache"} <= keys for keys, _ in seen)


def test_refuses_what_it_cannot_honour():
    model = build(DILATED)
    ids = tokens(2, 20)
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"unexpected keyword arguments \['new_feature'\]"):
            model(ids, new_feature=1)
        with pytest.raises(ValueError, match="4-D torch.bool tensor of shape"):
            model(ids, attention_mask=torch.ones(2, 1, 20, 20, dtype=torch.bool))
        with pytest.raises(NotImplementedError, match="output_attentions=True .*weights; for "
                                                      "them run the model with attn_impl"):
            model(ids, output_attentions=True)
        with pytest.raises(NotImplementedError, match="seq_idx=a 2-D"):
            model(ids, seq_idx=torch.zeros(2, 20, dtype=torch.int32))
        with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
            model(ids, cu_seq_lens_q=torch.tensor([0, 5, 20]))
        pos = torch.cat([torch.arange(10), torch.arange(10)])[None]
        with pytest.raises(ValueError, match=r"restart at rows \[10\], which cu_seq_lens_q"):
            model(ids, position_ids=pos, cu_seq_lens_q=torch.tensor([0, 5, 20]),
                  cu_seq_lens_k=torch.tensor([0, 5, 20]))
        with pytest.raises(ValueError, match="differ between batch rows"):
            model(ids, position_ids=torch.stack([pos[0], torch.arange(20)]))
        # a KV cache: more than one new token, padding while decoding, a static cache
        cache = DynamicCache(config=model.config)
        model(ids[:, :14], **{cache_keyword(model): cache})
        with pytest.raises(NotImplementedError, match="query length 6 != key length 20"):
            model(ids[:, 14:], **{cache_keyword(model): cache})
        mask = padding("right", 2, 10)  # generate continues after the padding: a hole
        with pytest.raises(NotImplementedError, match="padding after a row's first real token"):
            model.generate(ids[:, :10], attention_mask=mask, max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
        with pytest.raises(NotImplementedError, match="pre-allocated static cache"):
            model.generate(ids[:1, :10], max_new_tokens=2, do_sample=False, pad_token_id=0,
                           cache_implementation="static", disable_compile=True)
    # decoding is inference only
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :10], **{cache_keyword(model): cache})
    with pytest.raises(NotImplementedError, match="gradients"):
        model(ids[:, 10:11], **{cache_keyword(model): cache})


def test_sliding_window_layers_refuse_dropout():
    """ring_attention, which computes a window, has no attention dropout."""
    model = window_model("mistral", attention_dropout=0.1, num_hidden_layers=1).train()
    with pytest.raises(NotImplementedError, match="dropout=0.1 on a sliding-window layer"):
        model(tokens(1, 12))


def test_refuses_other_arguments_of_the_attention_function():
    ours = AttentionInterface()[DILATED]
    module = build(DILATED).model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8,
                                                                      dtype=torch.float64)
    # sinks (Inkling 2) and position_bias (Inkling): refused with a reason, not as unknown;
    # encoder_hidden_states (None from BERT's self-attention) and ModernBERT's deterministic
    # (flash-attn's backward, False unless asked) too
    for name, value, reason in (
            ("softcap", 30.0, "soft-capping"), ("s_aux", torch.zeros(4), "sinks"),
            ("sliding_window", 4, "sliding-window mask"),
            ("sinks", torch.zeros(1, 4, 6, 1), "sinks"),
            ("position_bias", torch.zeros(6, 6), "bias"),
            ("encoder_hidden_states", torch.zeros(1, 6, 32), "cross-attention"),
            ("deterministic", True, "use_deterministic_algorithms")):
        with pytest.raises(NotImplementedError, match=f"{name}(?s:.*){reason}"):
            ours(module, q, kv, kv, None, **{name: value})
    with pytest.raises(ValueError, match="2-D torch.float64"):
        ours(module, q, kv, kv, torch.zeros(1, 6, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="cross-attention"):
        ours(module, q, kv[:, :, :4], kv[:, :, :4], None)
    out, weights = ours(module, q, kv, kv, None, scaling=0.3)
    assert weights is None and out.shape == (1, 6, 4, 8)


def test_cu_seq_lens_q_and_k_only_together():
    """cu_seq_lens_q without cu_seq_lens_k (or the reverse) is an error, not documents
    dropped silently."""
    ours = AttentionInterface()[DILATED]
    module = torch.nn.Module().eval()
    q, kv = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8,
                                                                      dtype=torch.float64)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    for kwargs in ({"cu_seq_lens_k": cu}, {"cu_seq_lens_q": cu}):
        with pytest.raises(ValueError, match="must be given together"):
            ours(module, q, kv, kv, None, scaling=0.3, **kwargs)


def test_sharded_generate_refuses_a_model_without_position_ids():
    """generate(..., group=) refuses a model whose forward takes no position_ids (Bloom)
    before the prefill, with the reason (one process: the check runs there too)."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=DENSE).eval()
    with pytest.raises(NotImplementedError, match="takes no position_ids"):
        hf.generate(model, tokens(1, 8), group=None, max_new_tokens=2, pad_token_id=0)


def test_mask_function_reads_documents_and_refuses_other_masks():
    """Mask functions written here, in transformers' (batch, head, q, kv) index form."""

    def causal(b, h, q, kv):
        return kv <= q

    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4])

    def packed(b, h, q, kv):
        return causal(b, h, q, kv) & (docs[b, q] == docs[b, kv])

    def window(b, h, q, kv):
        return causal(b, h, q, kv) & (q - kv < 3)

    def blocks(b, h, q, kv):
        return causal(b, h, q, kv) | (docs[b, q] == docs[b, kv])

    def call(fn, **kwargs):
        return build_mask(batch_size=1, q_length=12, kv_length=12, mask_function=fn, **kwargs)

    assert call(causal) is CAUSAL
    assert call(packed) == PackedDocuments((5, 8))
    assert "first key of its document" in call(window).reason
    assert "later key" in call(blocks).reason
    assert "mask function of its own" in call(causal, use_vmap=True).reason
    assert "sliding window" in call(causal, local_size=4).reason
    # transformers' causal window of 3 keys (the query and 2 before), alone and in documents
    read = call(window, local_size=3)
    assert isinstance(read, Window) and (read.left, read.right, read.inner) == (2, 0, None)
    read = call(lambda b, h, q, kv: window(b, h, q, kv) & (docs[b, q] == docs[b, kv]),
                local_size=3)
    assert (read.left, read.right, read.inner) == (2, 0, PackedDocuments((5, 8)))
    # its bidirectional window of 3: |q - kv| <= 3
    read = call(lambda b, h, q, kv: (q - kv).abs() <= 3, local_size=3)
    assert (read.left, read.right) == (3, 3)
    assert "not transformers' sliding window" in call(window, local_size=4).reason
    with pytest.raises(TypeError, match=r"\['new_flag'\]"):
        call(causal, new_flag=True)
    keep = torch.ones(1, 12, dtype=torch.bool)
    assert call(causal, attention_mask=keep) is CAUSAL
    keep[0, :2] = False
    assert torch.equal(call(causal, attention_mask=keep), keep)
    # padding together with the packed-sequence mask (the documents would drop the padding)
    assert "padding together with transformers' packed-sequence mask" in \
        call(packed, attention_mask=keep).reason
    # decoding position 5 against a cache that kept keys 2..5 only, outside a window layer
    dropped = build_mask(batch_size=1, q_length=1, kv_length=4, q_offset=5, kv_offset=2,
                         mask_function=causal)
    assert "drops old keys (kv_offset = 2)" in dropped.reason


# --------------------------------------------------------------------------
# Registering, and the package without transformers


def test_register_checks_its_arguments():
    with pytest.raises(ValueError, match="must not contain 'sdpa'"):
        register("my_sdpa", segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match="must not contain 'flash'"):
        register("flash_dilated", segment_lengths=[8], dilation_rates=[1])
    AttentionInterface.register("someone_elses_test", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        register("someone_elses_test", segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match=r"dilation_rates\[0\] = 9 exceeds"):
        register("dilated_bad_test", segment_lengths=[8], dilation_rates=[9])
    with pytest.raises(ValueError, match=r"strategy must be one of \('auto', 'exchange', "
                                         r"'ulysses'\), got 'heads'"):
        register("dilated_bad_test", segment_lengths=[8], dilation_rates=[1], strategy="heads")
    with pytest.raises(TypeError, match=r"group.*'not a group'"):
        register("dilated_bad_test", segment_lengths=[8], dilation_rates=[1],
                 group="not a group")
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'fast'"):
        register("dilated_bad_test", segment_lengths=[8], dilation_rates=[1], backend="fast")
    # the kernel reaches every layer's call: one this device lacks is the op's error naming it
    cuda_only = register("dilated_cuda_kernel_test", segment_lengths=[8], dilation_rates=[1],
                         backend="cuda_flash")
    with pytest.raises(ValueError, match="'cuda_flash'.*CUDA"):
        build(cuda_only)(tokens(1, 12))
    # the same settings again: nothing changes; other settings would change every model
    # built with the name (they look it up at every call): only with replace=True
    name = register("dilated_again_test", segment_lengths=[8], dilation_rates=[1])
    assert register(name, segment_lengths=[8], dilation_rates=[1]) == name
    model = build(name)
    ids = tokens(1, 12)
    with torch.no_grad():
        before = model(ids).logits
        with pytest.raises(ValueError, match=r"'dilated_again_test' is already registered with "
                                             r"segment_lengths \[8\].*replace=True"):
            register(name, segment_lengths=[4], dilation_rates=[2])
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
        assert register(name, segment_lengths=[4], dilation_rates=[2], replace=True) == name
        assert not torch.allclose(model(ids).logits, before)
    with pytest.raises(TypeError, match="replace must be a bool"):
        register(name, segment_lengths=[4], dilation_rates=[1], replace="yes")
    assert AttentionInterface()[name].segment_lengths == (4,)


def test_package_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import dilated_attention\n"
        "from dilated_attention.integrations import transformers as hf\n"
        "try:\n"
        "    hf.register(segment_lengths=[8], dilation_rates=[1])\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ImportError: dilated_attention.integrations.transformers needs transformers>=5.12" \
        in done.stdout


@pytest.mark.parametrize("release", ["5.11.0", "5.0rc1"])  # a pre-release: not an int() error
def test_a_transformers_release_before_5_12_is_refused(monkeypatch, release):
    """The integration is tested from 5.12 (5.0-5.3's mask functions take cache_position, not
    (q_length, q_offset))."""
    real = importlib.metadata.version  # the release is read from the installed metadata
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: release if name == "transformers" else real(name))
    with pytest.raises(ImportError, match=r"needs transformers>=5\.12, found "):
        register("dilated_too_old_test", segment_lengths=[8], dilation_rates=[1])


def test_agreed_origins_read_each_rows_own_first_position():
    from dilated_attention.integrations.transformers.padding import agreed_origins

    # rank 0's piece is padding in both rows; rank 1 has no mask (all ones) and its positions
    # start at 0 in row 0 (its first real token) and at 5 in row 1
    infos = [{"n": 4, "real_from": (None, None), "first": (0, 0)},
             {"n": 4, "real_from": None, "first": (0, 5)}]
    assert agreed_origins(infos, 2) == (4, 0)


# shard_inputs: labels, position_ids and attention_mask of another length than input_ids are a
# ValueError naming the argument (not a shape error from deep inside, or a silent misfit).

@pytest.mark.parametrize("name, match", [
    ("labels", r"^labels must be \(.*8\) like input_ids"),
    # the positions' own check, as the attention's and LongNetLM's (check_position_ids)
    ("position_ids", r"^position_ids must be .* for \(batch, seq_len\) = \(1, 8\)"),
    # the padding mask's own check, as generate's (validation.check_attention_mask)
    ("attention_mask", r"^attention_mask must have input_ids' shape \(1, 8\)")])
def test_shard_inputs_refuses_a_length_other_than_input_ids(name, match):
    ids = torch.arange(8)[None]
    for n in (6, 10):
        with pytest.raises(ValueError, match=match):
            shard_inputs(ids, None, **{name: torch.ones(1, n, dtype=torch.long)})


# Sharded generation refuses beam search up front, in its agreed configuration: before the
# prompt's prefill sends anything (the cache's own refusal comes only after the prefill).

def _beam_search_refused(group):
    name = hf.register("dilated_beam_test", segment_lengths=SEGMENTS, dilation_rates=RATES,
                       group=group)
    sharded = build(name)
    messages = []
    # num_beams as a keyword, in the generation_config passed, or in the model's (which
    # generate reads when neither says): refused before the prefill, on every rank
    configured = build(name)
    configured.generation_config.num_beams = 2
    for model, kwargs in [(sharded, dict(num_beams=2)),
                          (sharded, dict(generation_config=GenerationConfig(num_beams=2))),
                          (configured, {})]:
        with comm.count_communication() as counted:
            with pytest.raises(NotImplementedError, match="pass num_beams=1"):
                hf.generate(model, tokens(2, 21, seed=21), group=group, max_new_tokens=3,
                            pad_token_id=0, **kwargs)
        messages.append(counted.messages)
    return messages


@pytest.mark.distributed
def test_sharded_generation_refuses_beam_search_before_the_prefill():
    assert SPAWNS.results(2, _beam_search_refused) == [[0, 0, 0]] * 2


# causal_lm_parts refuses every model that transforms its logits after lm_head, scales
# below 1 included (Cohere's logit_scale is 0.0625): lm_head(body) would not be its logits.

@pytest.mark.parametrize("field,value", [("logit_scale", 0.0625), ("logits_scaling", 0.5),
                                         ("final_logit_softcapping", 30.0)])
def test_causal_lm_parts_refuses_any_logit_transform(field, value):
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      **{field: value})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"transforms its logits after lm_head \({field}="):
        causal_lm_parts(model)


# --------------------------------------------------------------------------
# Mutation audit (stop 52): padding, documents, the sharded cache and generate,
# training helpers, the window mask's reading


def test_right_padding_with_cu_seq_lens_equals_direct_calls():
    """Right padding together with cu_seq_lens (positions counted, every row starting at
    0): key padding inside declared documents, as a direct dilated_attention call does."""
    b, n = 2, 30
    ids, mask = tokens(b, n, seed=3), padding("right", b, n)
    cu = torch.tensor([0, 11, n], dtype=torch.int32)
    model = build(DILATED)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=19, max_length_k=19).logits
        ref = reference_logits(model, ids, key_padding_mask=~mask.bool(), cu_seqlens=[0, 11, n])
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], **TOL)


def test_decoding_with_positions_that_count_the_padding_equals_the_full_forward():
    """Left padding and no position_ids (positions count the padding, so each row's
    segments keep it, masked): each decoding step's logits are the full forward's, padding
    still masked in the steps."""
    b, n = 3, 13
    ids, mask = tokens(b, n, seed=4), padding("left", b, n)
    ids[mask == 0] = 0
    model = build(DILATED)
    cached = {cache_keyword(model): DynamicCache(config=model.config)}
    seq, steps = ids, []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **cached).logits[:, -1]
        for _ in range(6):
            steps.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            logits = model(seq[:, -1:], attention_mask=mask, **cached).logits[:, -1]
        full = model(seq, attention_mask=mask, use_cache=False).logits
    for i, step in enumerate(steps):
        torch.testing.assert_close(step, full[:, n - 1 + i], **TOL)


def test_packed_documents_restarting_at_any_position_equal_documents_alone():
    """transformers' rule: a document starts wherever a position is not its
    predecessor's + 1, also where it does not restart at 0 (shard_inputs reads the same)."""
    lengths, firsts = [11, 5, 14], [0, 4, 2]
    n = sum(lengths)
    ids = tokens(1, n, seed=5)
    pos = torch.cat([torch.arange(f, f + m) for f, m in zip(firsts, lengths)])[None]
    model = build(DILATED)
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits
        alone = torch.cat([model(doc, position_ids=p).logits
                           for doc, p in zip(ids.split(lengths, 1), pos.split(lengths, 1))], 1)
    torch.testing.assert_close(packed, alone, **TOL)
    inputs, _ = shard_inputs(ids, None, position_ids=pos)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 11, 16, n]


def test_bool_position_ids_are_refused():
    """position_ids must be integers: a bool tensor is a TypeError, not positions 0/1."""
    model = build(DILATED)
    ids = tokens(1, 12)
    with torch.no_grad(), pytest.raises(TypeError, match="position_ids must be an integer"):
        model(ids, position_ids=torch.ones(1, 12, dtype=torch.bool))


# --------------------------------------------------------------------------
# cache.py, generation.py


def test_sharded_cache_layer_keeps_a_copy_of_its_piece_and_refuses_the_rest():
    """A rank's layer keeps its own piece of a prompt that ran whole (a copy:
    not a view that keeps the whole prompt's keys alive), one new row per step, and refuses
    what would move rows."""
    from dilated_attention.decoding import CachePlan
    from dilated_attention.integrations.transformers.cache import ShardedCache

    plan = CachePlan.of(10, 4, 2, 1)  # rank 1 of 2: prompt rows [5, 10)
    # prefill_group None: the prompt ran whole on every rank (shorter than the ranks)
    cache = ShardedCache(1, plan, 10, group=None, prefill_group=None)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 10, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out = layer.update(k, v)
    assert out[0] is k and out[1] is v
    assert (layer.prompt.start, layer.prompt.count, layer.get_seq_length()) == (5, 5, 10)
    assert cache.rows(0)[0] is layer.prompt and cache.position(0) == 9
    assert torch.equal(layer.prompt.k, k[:, :, 5:].transpose(1, 2))
    assert torch.equal(layer.prompt.v, v[:, :, 5:].transpose(1, 2))
    for x in (layer.prompt.k, layer.prompt.v):
        assert x.untyped_storage().nbytes() == 2 * 2 * 5 * 8 * 8
    with pytest.raises(NotImplementedError, match="one new token at a time, got 2"):
        layer.update(k[:, :, :2], v[:, :, :2])
    for call in (lambda: layer.reorder_cache(torch.tensor([1, 0])), lambda: layer.crop(1),
                 lambda: layer.batch_repeat_interleave(2),
                 lambda: layer.batch_select_indices(torch.tensor([0]))):
        with pytest.raises(NotImplementedError, match="not supported"):
            call()


def test_generate_checks_its_arguments_on_one_process():
    """generate(..., group=None) checks what it checks under a group."""
    model = build(DILATED)
    ids = tokens(2, 8)
    for args, kwargs, match in [
        ((ids,), dict(attention_mask=torch.ones(2, 7, dtype=torch.long)),
         r"attention_mask must have input_ids' shape \(2, 8\)"),
        ((ids,), dict(use_cache=False), "use_cache must be True"),
        ((ids,), dict(position_ids=torch.arange(8)[None]), "does not take position_ids="),
        # generation_config settings, as generate reads them (a ValueError, not an error from
        # the cache after the prefill)
        ((ids,), dict(generation_config=GenerationConfig(use_cache=False)),
         "use_cache must be True"),
        ((ids,), dict(generation_config=GenerationConfig(output_hidden_states=True)),
         "does not take output_hidden_states=True"),
        # ids the embeddings do not hold, a mask of other values than 0 and 1
        ((ids + VOCAB - 1,), {}, rf"input_ids must be ids in \[0, {VOCAB}\)"),
        ((ids,), dict(attention_mask=torch.full((2, 8), 2)), "attention_mask must hold 0"),
        # right padding (and a row of padding alone): refused before the prompt runs
        ((ids,), dict(attention_mask=padding("right", 2, 8)),
         r"attention_mask must pad on the left .*: row 1 has padding after a real token"),
        ((ids,), dict(attention_mask=torch.tensor([[1] * 8, [0] * 8])),
         r"attention_mask: row 1 is all padding"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf.generate(model, *args, group=None, max_new_tokens=2, pad_token_id=0, **kwargs)
    # ids of a dtype nn.Embedding does not take: the models' check (check_tokens)
    with pytest.raises(TypeError, match=r"^input_ids must hold integer token ids \(int64 or "
                                        r"int32\), got torch.bool"):
        hf.generate(model, ids.bool(), group=None, max_new_tokens=2, pad_token_id=0)
    model.generation_config.use_cache = False
    with pytest.raises(ValueError, match="use_cache must be True"):
        hf.generate(model, ids, group=None, max_new_tokens=2, pad_token_id=0)


def test_generate_arguments_compare_tensors_by_value():
    """Tensor arguments of generate are compared over the ranks by their values."""
    from dilated_attention.integrations.transformers.generation import _plain

    a, b = torch.tensor([1, 2]), torch.tensor([1, 3])
    assert _plain({"x": a}) == _plain({"x": a.clone()})
    assert _plain({"x": a}) != _plain({"x": b})
    assert _plain({"x": [a]}) != _plain({"x": [b]})


def _sampling_seeded_differently(group):
    from dilated_attention.distributed import comm

    name = register("dilated_seed_test", segment_lengths=SEGMENTS, dilation_rates=RATES,
                       group=group)
    model = build(name)
    torch.manual_seed(comm.group_rank(group))
    with pytest.raises(ValueError, match="random state"):
        hf.generate(model, tokens(1, 9), group=group, max_new_tokens=3, pad_token_id=0,
                    do_sample=True, top_k=5)
    return True


@pytest.mark.distributed
def test_sharded_sampling_refuses_ranks_seeded_differently():
    """Sampling draws from torch's random state on every rank: ranks seeded differently
    raise on every rank instead of generating different text."""
    assert SPAWNS.results(2, _sampling_seeded_differently) == [True, True]


# --------------------------------------------------------------------------
# training.py


def test_shard_inputs_refuses_another_batch_and_rows_that_restart_differently():
    """Labels of another shape, and packed rows whose documents restart at different
    positions in different batch rows, are refused."""
    ids = tokens(2, 8)
    with pytest.raises(ValueError, match=r"^labels must be \(2, 8\) like input_ids"):
        shard_inputs(ids, None, labels=tokens(3, 8))
    pos = torch.stack([torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]),
                       torch.tensor([0, 1, 0, 1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="restart .* differently in different batch rows"):
        shard_inputs(ids, None, position_ids=pos)


def test_shard_inputs_masks_each_rows_own_restarts():
    """Per-row position_ids (left padding, generate's numbering): a row's target before
    its first real token (where its positions restart) is ignored, whatever row 0 does."""
    ids = tokens(2, 8)
    mask = padding("left", 2, 8)  # row 1: 3 padded tokens
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    _, targets = shard_inputs(ids, None, labels=labels, position_ids=pos, attention_mask=mask)
    assert targets[1, :3].tolist() == [-100, -100, -100]
    assert targets[1, 3:7].tolist() == ids[1, 4:].tolist()
    assert targets[0, :7].tolist() == ids[0, 1:].tolist()


def test_causal_lm_loss_forms_gradients_only_in_training(monkeypatch):
    """lm_head in eval mode: the chunked loss is told not to form gradients ahead."""
    from dilated_attention.integrations.transformers import training

    seen = []
    real = training.chunked_token_mean_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["training"])
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "chunked_token_mean_loss", spy)
    head = torch.nn.Linear(4, 7, dtype=torch.float64)
    hidden = torch.randn(1, 5, 4, dtype=torch.float64)
    targets = torch.randint(0, 7, (1, 5))
    for mode in (True, False):
        head.train(mode)
        training.causal_lm_loss(hidden, targets, None, lm_head=head)
    assert seen == [True, False]


def test_causal_lm_parts_refuses_a_model_that_is_its_own_body():
    """A model with a linear head but no separate base_model has no body to run."""

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 7)

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(ValueError, match="no nn.Linear output head"):
        hf.causal_lm_parts(Bare())


# --------------------------------------------------------------------------
# masks.py: _read_window


def _window_mask(fn, size, batch=1, n=12, **kwargs):
    return build_mask(batch_size=batch, q_length=n, kv_length=n, mask_function=fn,
                      local_size=size, **kwargs)


def test_window_reading_refuses_what_is_not_a_sliding_window():
    """Documents that differ between rows, windows with holes inside (read at a window's
    lower end, or at one query's midpoint), a bidirectional window that reaches further ahead
    than back: refused, not read as a window."""
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 7 + [1] * 5])

    def causal_window(b, h, q, kv):
        return (kv <= q) & (q - kv < 5)

    read = _window_mask(lambda b, h, q, kv: causal_window(b, h, q, kv)
                        & (docs[b, q] == docs[b, kv]), 5, batch=2)
    assert "differ between batch rows" in read.reason
    holed = _window_mask(lambda b, h, q, kv: causal_window(b, h, q, kv) & (q - kv != 2), 5)
    assert "not transformers' sliding window" in holed.reason
    # one query's hole, inside its window (query 11 reads keys 7..11): the midpoint probe
    one_hole = _window_mask(lambda b, h, q, kv: causal_window(b, h, q, kv)
                            & ~((q == 11) & (kv == 9)), 5)
    assert "not transformers' sliding window" in one_hole.reason
    lopsided = _window_mask(lambda b, h, q, kv: (kv - q <= 5) & (q - kv <= 3), 3)
    assert "not transformers' sliding window" in lopsided.reason
    # the plain ones still read
    assert (_window_mask(causal_window, 5).left, _window_mask(causal_window, 5).right) == (4, 0)
    both = _window_mask(lambda b, h, q, kv: (q - kv).abs() <= 3, 3)
    assert isinstance(both, Window) and (both.left, both.right) == (3, 3)


def test_window_layer_refuses_a_cache_that_kept_fewer_keys_than_the_window():
    """Decoding position 9 of a window of 5 keys (left reach 4) needs keys 5..9: a
    cache that kept only 7..9 is refused."""

    def causal_window(b, h, q, kv):
        return (kv <= q) & (q - kv < 5)

    fine = build_mask(batch_size=1, q_length=1, kv_length=5, q_offset=9, kv_offset=5,
                      mask_function=causal_window, local_size=5)
    assert isinstance(fine, Window) and fine.left == 4
    with pytest.raises(NotImplementedError, match="keeps fewer keys than the window of 5"):
        build_mask(batch_size=1, q_length=1, kv_length=3, q_offset=9, kv_offset=7,
                   mask_function=causal_window, local_size=5)


def test_sliding_window_model_generates_left_padded_rows_like_sdpa():
    """generate() with left padding and transformers' sliding-window cache, which drops
    keys older than the window: the 2-D padding mask covers every token seen, the cache's
    keys only the last ones (the mask function cuts the mask to them)."""
    ids, mask = tokens(2, 9), padding("left", 2, 9)
    ids[mask == 0] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    ref, ours = (window_model("mistral", impl).generate(ids, **kwargs) for impl in ("sdpa", DENSE))
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), **TOL)


# --------------------------------------------------------------------------
# Encoder models: BERT, RoBERTa, ModernBERT (bidirectional; ModernBERT's local layers a
# two-sided window); cross-attention refused

ENCODER_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, pad_token_id=0)
ENCODERS = {
    "bert": lambda: transformers.BertConfig(**ENCODER_COMMON),
    "roberta": lambda: transformers.RobertaConfig(**ENCODER_COMMON),
    # layers: global, local (a window of 3 keys on each side: local_attention 6), global
    "modernbert": lambda: transformers.ModernBertConfig(
        **{**ENCODER_COMMON, "num_hidden_layers": 3}, local_attention=6,
        global_attn_every_n_layers=2, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2),
}


def encoder(kind: str, impl: str, seed: int = 0, **overrides):
    """A tiny random encoder (AutoModel: last_hidden_state), float64, in eval mode."""
    config = ENCODERS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return transformers.AutoModel.from_config(config, attn_implementation=impl,
                                              dtype=torch.float64).eval()


@pytest.mark.parametrize("pad", ["none", "left", "right"])
@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_encoders_equal_sdpa(kind, pad):
    """Hidden states and gradients with the dense pattern: the bidirectional mask, padding on
    either side, ModernBERT's local layers (a window of 3 keys on each side, n = 19)."""
    ids, mask = tokens(2, 19), padding(pad, 2, 19)
    kwargs = {"attention_mask": mask} if pad != "none" else {}
    assert_equals_sdpa(lambda impl: encoder(kind, impl), ids, mask, output="last_hidden_state",
                       **kwargs)


def test_modernbert_local_layers_get_a_two_sided_window():
    """What reaches the attention function from ModernBERT: its local layers' mask is read as
    the window of 3 keys on each side (its mask's reach; the layer passes flash-attn's 3 + 1),
    its global layers' as bidirectional, padded or not."""
    seen = []
    ours = AttentionInterface()[DENSE]

    def spy(module, query, key, value, attention_mask, **kwargs):
        window = (attention_mask.left, attention_mask.right, kwargs["sliding_window"]) \
            if isinstance(attention_mask, Window) else kwargs.get("sliding_window")
        seen.append((type(attention_mask).__name__, window))
        assert set(kwargs) - {"dropout", "scaling", "is_causal"} <= refusals.ACCEPTED_KWARGS
        return ours(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dilated_encoder_spy_test", spy)
    AttentionMaskInterface.register("dilated_encoder_spy_test", build_mask)
    model = encoder("modernbert", "dilated_encoder_spy_test")
    with torch.no_grad():
        model(tokens(2, 19))
        model(tokens(2, 19), attention_mask=padding("left", 2, 19))
    assert seen == [("Bidirectional", None), ("Window", (3, 3, 4)), ("Bidirectional", None)] * 2


def test_a_window_read_off_one_row_faces_as_its_layer():
    """One row has no later key, so its mask reads as a causal window either way: the layer's
    causal flag decides (a one-token input; a sequence-parallel rank's piece of one row,
    which must read as the other ranks do). ModernBERT on one token equals sdpa."""
    both = _window_mask(lambda b, h, q, kv: (q - kv).abs() <= 3, 3, n=1)
    assert (both.left, both.right, both.one_row) == (2, 0, True)
    assert (both.facing(False).left, both.facing(False).right) == (3, 3)
    assert both.facing(True) is both
    wide = _window_mask(lambda b, h, q, kv: (q - kv).abs() <= 3, 3)  # read off 12 rows
    assert not wide.one_row and wide.facing(True) is wide
    assert_equals_sdpa(lambda impl: encoder("modernbert", impl), tokens(2, 1),
                       torch.ones(2, 1, dtype=torch.long), output="last_hidden_state")


def bert_reference(model, ids, key_padding_mask=None):
    """BertModel.forward written out, its attention a direct dilated_attention call."""
    x = model.embeddings(input_ids=ids)
    b, n, _ = x.shape
    for layer in model.encoder.layer:
        attn = layer.attention.self
        q, k, v = (proj(x).view(b, n, -1, attn.attention_head_size)
                   for proj in (attn.query, attn.key, attn.value))
        out = dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=False, scale=attn.scaling,
                                key_padding_mask=key_padding_mask)
        h = layer.attention.output(out.reshape(b, n, -1), x)
        x = layer.output(layer.intermediate(h), h)
    return x


@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_bert_dilated_pattern_equals_direct_calls(pad):
    """Real dilated patterns (n = 30 crosses every segment): BERT's hidden states and
    gradients equal its forward around dilated_attention; the padding stays in place, masked
    (BERT passes no position_ids to its layers)."""
    ids, mask = tokens(2, 30, seed=3), padding(pad, 2, 30)
    model = encoder("bert", DILATED)
    results = []
    for run in (lambda: bert_reference(model, ids, key_padding_mask=~mask.bool()),
                lambda: model(ids, attention_mask=mask).last_hidden_state):
        model.zero_grad(set_to_none=True)
        hidden = run()
        (hidden * mask[..., None]).square().mean().backward()
        results.append((hidden.detach(), grads(model)))
    (ref, ref_grads), (ours, our_grads) = results
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], **TOL)
    assert_grads_equal(our_grads, ref_grads)


@pytest.mark.parametrize("kind", ["roberta", "modernbert"])
def test_encoders_with_dilated_patterns_are_finite(kind):
    ids, mask = tokens(2, 30, seed=3), padding("left", 2, 30)
    model = encoder(kind, DILATED)
    hidden = model(ids, attention_mask=mask).last_hidden_state
    hidden.square().mean().backward()
    assert torch.isfinite(hidden).all() and all(g.isfinite().all() for g in grads(model).values())


def packed_encoder_batch(lengths, position_start: int, cu_seq_lens: bool) -> dict:
    """What transformers' padding-free collator passes an encoder for documents of `lengths`
    packed into one row (its labels dropped): position_ids that restart at `position_start`,
    and with `cu_seq_lens` the boundaries flash-attention reads (cu_seq_lens_q/k,
    max_length_q/k)."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=cu_seq_lens,
                                                       position_ids_start=position_start)
    batch = collator([{"input_ids": list(range(1, m + 1))} for m in lengths])
    return {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}


# (encoder, what marks the documents, the registered pattern and what runs each document alone)
PACKED_ENCODER_CASES = [
    ("bert", "position_ids", DENSE, "sdpa"),
    ("bert", "cu_seq_lens", DENSE, "sdpa"),
    ("bert", "cu_seq_lens", DILATED, DILATED),  # documents of 11 and 14 cross segments
    ("roberta", "position_ids", DENSE, "sdpa"),  # positions from padding_idx + 1 = 2
    # its layers get no position_ids: only cu_seq_lens mark documents (local layers too)
    ("modernbert", "cu_seq_lens", DENSE, "sdpa"),
]


@pytest.mark.parametrize("kind,marks,packed_impl,alone_impl", PACKED_ENCODER_CASES)
def test_packed_encoder_documents_equal_documents_alone(kind, marks, packed_impl, alone_impl):
    """Documents packed into one row (DataCollatorWithFlattening's batch) equal each document
    run alone: hidden states, and the gradients of the input embeddings and of every
    parameter (the documents alone share the parameters: their gradients add up)."""
    lengths, start = [11, 5, 14], 2 if kind == "roberta" else 0
    packed = packed_encoder_batch(lengths, start, cu_seq_lens=marks == "cu_seq_lens")
    n = sum(lengths)
    embeds = torch.randn(1, n, 32, dtype=torch.float64, requires_grad=True,
                         generator=torch.Generator().manual_seed(7))
    weight = torch.randn(1, n, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    results = []
    for impl, run in ((alone_impl, lambda model: torch.cat(
            [model(inputs_embeds=e, position_ids=torch.arange(start, start + m)[None])
             .last_hidden_state for e, m in zip(embeds.split(lengths, dim=1), lengths)], dim=1)),
            (packed_impl, lambda model: model(inputs_embeds=embeds, **packed).last_hidden_state)):
        model = encoder(kind, impl)
        embeds.grad = None
        hidden = run(model)
        (hidden * weight).sum().backward()
        results.append((hidden.detach(), embeds.grad.clone(), grads(model)))
    (ref, ref_input, ref_grads), (ours, our_input, our_grads) = results
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(our_input, ref_input, **TOL)
    assert_grads_equal(our_grads, ref_grads)


def test_modernbert_packed_position_ids_alone_are_not_documents():
    """ModernBERT's layers get no position_ids (its rotary tables take them): without
    cu_seq_lens the packed documents attend each other, as under transformers' sdpa."""
    packed = packed_encoder_batch([11, 5, 14], 0, cu_seq_lens=False)
    ids = tokens(1, 30, seed=5)
    with torch.no_grad():
        ref, ours = (encoder("modernbert", impl)(ids, **packed).last_hidden_state
                     for impl in ("sdpa", DENSE))
        alone = torch.cat([encoder("modernbert", "sdpa")(doc).last_hidden_state
                           for doc in ids.split([11, 5, 14], dim=1)], dim=1)
    torch.testing.assert_close(ours, ref, **TOL)
    assert not torch.allclose(ours, alone)


def test_bert_decoder_with_cross_attention_equals_sdpa():
    """BERT as a decoder with cross-attention layers (BertCrossAttention: sdpa) and causal
    self-attention (ours), encoder states as long as the decoder's rows (which the lengths
    alone would take for self-attention): hidden states and gradients."""
    ids, mask = tokens(2, 12), padding("right", 2, 12)
    enc = torch.randn(2, 12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    enc_mask = padding("left", 2, 12)
    assert_equals_sdpa(lambda impl: encoder("bert", impl, is_decoder=True,
                                            add_cross_attention=True),
                       ids, mask, output="last_hidden_state", attention_mask=mask,
                       encoder_hidden_states=enc, encoder_attention_mask=enc_mask)


SEQ2SEQ_COMMON = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
                      decoder_start_token_id=2, eos_token_id=None, forced_eos_token_id=None)
# families with their reference: sdpa where transformers has an sdpa path for them, else eager
SEQ2SEQ = {"bart": "sdpa", "mbart": "sdpa", "marian": "sdpa", "pegasus": "sdpa",
           "blenderbot": "sdpa", "blenderbot-small": "sdpa", "plbart": "sdpa", "m2m_100": "sdpa",
           "whisper": "sdpa", "nllb-moe": "eager", "pegasus_x": "eager",
           "speech_to_text": "eager"}


def seq2seq(model_type: str, impl: str, head: str = "AutoModel", seed: int = 0):
    config = transformers.AutoConfig.for_model(
        model_type, **SEQ2SEQ_COMMON, **({"num_experts": 2} if model_type == "nllb-moe" else {}))
    torch.manual_seed(seed)
    return getattr(transformers, head).from_config(config, attn_implementation=impl,
                                                   dtype=torch.float64).eval()


def seq2seq_inputs(model_type: str, config, pad: str, n: int = 12, m: int = 7) -> dict:
    """The encoder's inputs (token ids, or features for the speech models; padded as `pad`)
    and decoder ids."""
    g = torch.Generator().manual_seed(3)
    inputs = {"decoder_input_ids": torch.randint(1, VOCAB, (2, m), generator=g)}
    if model_type == "whisper":  # its encoder takes exactly 2 * max_source_positions frames
        inputs["input_features"] = torch.randn(2, config.num_mel_bins,
                                               2 * config.max_source_positions,
                                               dtype=torch.float64, generator=g)
    elif model_type == "speech_to_text":
        inputs["input_features"] = torch.randn(2, 2 * n, config.input_feat_per_channel,
                                               dtype=torch.float64, generator=g)
    else:
        inputs["input_ids"] = tokens(2, n, seed=3)
        if pad != "none":
            inputs["attention_mask"] = padding(pad, 2, n)
    return inputs


def _seq2seq_run(make, inputs):
    """Decoder and encoder hidden states, and the gradients of a loss over both."""
    model = make()
    out = model(**inputs)
    hidden = (out.last_hidden_state, out.encoder_last_hidden_state)
    keep = inputs.get("attention_mask")
    weights = [torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator()
                           .manual_seed(i)) for i, h in enumerate(hidden)]
    if keep is not None:  # the encoder's padded rows are not compared
        weights[1] = weights[1] * keep[..., None]
    sum((h * w).sum() for h, w in zip(hidden, weights)).backward()
    return [h.detach() for h in hidden], grads(model)


@pytest.mark.parametrize("model_type", sorted(SEQ2SEQ))
def test_encoder_decoder_families_equal_sdpa(model_type):
    """The encoder's self-attention and the decoder's causal self-attention run dilated
    attention (dense pattern), cross-attention runs sdpa: decoder and encoder hidden states
    and gradients equal the reference's, the encoder left-padded."""
    ref_impl = SEQ2SEQ[model_type]
    inputs = seq2seq_inputs(model_type, seq2seq(model_type, ref_impl).config, "left")
    (ref, ref_grads), (ours, our_grads) = (
        _seq2seq_run(lambda: seq2seq(model_type, impl), inputs) for impl in (ref_impl, DENSE))
    torch.testing.assert_close(ours[0], ref[0], **TOL)
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else slice(None)
    torch.testing.assert_close(ours[1][real], ref[1][real], **TOL)
    assert_grads_equal(our_grads, ref_grads)


@pytest.mark.parametrize("model_type", sorted(SEQ2SEQ))
def test_encoder_decoder_layers_are_told_apart_as_transformers_names_them(model_type):
    """Which calls run as cross-attention equals transformers' own declaration of the model's
    cross-attention layers (the decoder's _can_record_outputs["cross_attentions"], a layer
    name: encoder_attn, cross_attention), every attention layer called."""
    from dilated_attention.integrations.transformers.cross import is_cross_attention

    names, seen = {}, {}
    ours = AttentionInterface()[DENSE]

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen[names[id(module)]] = is_cross_attention(module, attention_mask)
        return ours(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dilated_roles_test", spy)
    AttentionMaskInterface.register("dilated_roles_test", build_mask)
    model = seq2seq(model_type, "dilated_roles_test")
    names.update({id(m): name for name, m in model.named_modules()})
    with torch.no_grad():
        model(**seq2seq_inputs(model_type, model.config, "none", n=7))  # equal lengths
    declared = type(model.get_decoder())._can_record_outputs["cross_attentions"].layer_name
    attention = [name for name, m in model.named_modules()
                 if name.endswith(("self_attn", declared)) and hasattr(m, "config")]
    assert sorted(seen) == sorted(attention)  # PegasusX's encoder attends on its own
    assert seen == {name: name.endswith(declared) for name in seen}, declared


def bart_reference(names, enc_keep):
    """An attention function that knows each Bart layer by its name (names: id -> name):
    self-attention through dilated_attention directly (the encoder's padding masked),
    cross-attention as sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, **kwargs):
        name = names[id(module)]
        if name.endswith("encoder_attn"):
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling)
        encoder = name.startswith("encoder.")
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out = dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=not encoder, scale=scaling,
                                key_padding_mask=~enc_keep if encoder else None)
        return out, None

    return attend


@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_bart_dilated_pattern_equals_direct_calls(pad):
    """Real dilated patterns (an encoder of 30 rows and a decoder of 20 cross segments): Bart
    equals its layers called by name, self-attention through dilated_attention and
    cross-attention as sdpa: hidden states and gradients."""
    inputs = seq2seq_inputs("bart", None, pad, n=30, m=20)
    keep = inputs.get("attention_mask", torch.ones(2, 30, dtype=torch.long)).bool()
    names = {}
    AttentionInterface.register("dilated_bart_reference_test", bart_reference(names, keep))
    AttentionMaskInterface.register("dilated_bart_reference_test",
                                    AttentionMaskInterface()["sdpa"])

    def make(impl):
        model = seq2seq("bart", impl)
        names.update({id(m): name for name, m in model.named_modules()})
        return model

    (ref, ref_grads), (ours, our_grads) = (
        _seq2seq_run(lambda: make(impl), inputs)
        for impl in ("dilated_bart_reference_test", DILATED))
    torch.testing.assert_close(ours[0], ref[0], **TOL)
    torch.testing.assert_close(ours[1][keep], ref[1][keep], **TOL)
    assert_grads_equal(our_grads, ref_grads)


def test_bart_generates_like_sdpa():
    """generate(): the decoder's self-attention decodes each token against its cache (ours),
    cross-attention reads the encoder's cached keys (sdpa); tokens and scores equal sdpa's
    (dense pattern), and with dilated patterns each step's scores equal the full forward's."""
    inputs = seq2seq_inputs("bart", None, "left", n=19)
    del inputs["decoder_input_ids"]
    runs = {}
    for impl in ("sdpa", DENSE, DILATED):
        model = seq2seq("bart", impl, head="AutoModelForSeq2SeqLM")
        with torch.no_grad():
            runs[impl] = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                                        output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(runs[DENSE].sequences, runs["sdpa"].sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(runs[DENSE].scores), torch.stack(runs["sdpa"].scores),
                               **TOL)
    seq = runs[DILATED].sequences
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=seq[:, :-1]).logits
    # generate's scores are float32: the float64 logits rounded
    torch.testing.assert_close(torch.stack(runs[DILATED].scores, dim=1), full[:, -6:].float())


def test_bart_compiles_with_inductor():
    """torch.compile (inductor) of Bart with dilated patterns equals eager: the encoder's and
    the decoder's calls of different lengths recompile the attention function with dynamic
    shapes, and inductor's code for the graph resumed after a break there failed (NameError
    on a shape symbol): compiled without a group the function reads no context variable, so
    no break there. Forward only: the backward adds a minute of compiling on a 2-core CPU."""
    inputs = seq2seq_inputs("bart", None, "left")
    model = seq2seq("bart", DILATED)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager, compiled = model(**inputs), torch.compile(model)(**inputs)
    finally:
        torch._dynamo.reset()
    for name in ("last_hidden_state", "encoder_last_hidden_state"):
        torch.testing.assert_close(compiled[name], eager[name])


def test_cross_attention_refused_where_it_cannot_be_told_apart(monkeypatch):
    """Moonshine's one attention class sets no is_decoder: its encoder's self-attention and
    its cross-attention (both bidirectional masks) cannot be told apart, so the model is
    refused, naming the layer; a cross-attention call under sequence parallelism is refused."""
    from dilated_attention.integrations.transformers.cross import attend_cross

    config = transformers.MoonshineConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=4,
        decoder_num_attention_heads=4)
    model = transformers.AutoModel.from_config(config, attn_implementation=DENSE)
    with pytest.raises(NotImplementedError, match="MoonshineAttention in a model with config."
                                                  "is_encoder_decoder = True: cannot tell"):
        model(input_values=torch.randn(2, 3200), decoder_input_ids=tokens(2, 7))

    layer = transformers.models.bert.modeling_bert.BertCrossAttention(ENCODERS["bert"]())
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    group = object()  # a group of two ranks, as far as the check asks
    monkeypatch.setattr(comm, "is_distributed", lambda g: g is group)
    with pytest.raises(NotImplementedError, match="cross-attention under sequence parallelism "
                                                  ".*on one process, with a name registered "
                                                  "without group="):
        attend_cross(layer, q, q, q, None, 0.0, None, None, {}, group)


def test_a_prepared_decoder_mask_is_refused_as_a_mask():
    """A 4-D decoder_attention_mask reaches the decoder's self-attention unread (transformers
    passes prepared masks on): refused for what it is, a mask that is not a 2-D padding mask,
    in Bart (is_causal = True) and NLLB-MoE (is_causal = False), not reported as a layer
    that sets no is_decoder or as cross-attention."""
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))[None, None].expand(2, 1, 7, 7)
    for model_type in ("bart", "nllb-moe"):
        model = seq2seq(model_type, DILATED)
        with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask .*got "
                                             r"a 4-D torch.bool tensor of shape \(2, 1, 7, 7\)"):
            model(input_ids=tokens(2, 12), decoder_input_ids=tokens(2, 7),
                  decoder_attention_mask=causal)
    # a causal decoder layer given a bidirectional mask: the error says what the layer sets
    from dilated_attention.integrations.transformers.cross import is_cross_attention
    from dilated_attention.integrations.transformers.masks import Bidirectional

    layer = seq2seq("bart", DILATED).get_decoder().layers[0].self_attn
    with pytest.raises(NotImplementedError, match="the layer has is_decoder = True and "
                                                  "is_causal = True, and its mask is a "
                                                  "Bidirectional"):
        is_cross_attention(layer, Bidirectional())


def _encoder_rank(group):
    """BERT (real dilated patterns) and ModernBERT (dense pattern: its window layers' halo
    exchange) on this rank's rows at their global positions against one process: hidden
    states and gradients, plain and padded; ModernBERT also over 3 rows (pieces 2 | 1: a
    rank's window read off one row)."""
    world, rank = comm.group_size(group), comm.group_rank(group)
    patterns = {"bert": (SEGMENTS, RATES), "modernbert": ([4096], [1])}
    out = []
    for kind, (segs, rates) in patterns.items():
        one = register(f"dilated_encoder_one_{kind}_test", segment_lengths=segs,
                       dilation_rates=rates)
        sp = register(f"dilated_encoder_sp_{kind}_test", segment_lengths=segs,
                      dilation_rates=rates, group=group)
        cases = [(29, pad) for pad in ("none", "left", "right")]
        cases += [(3, "none")] if kind == "modernbert" else []
        for n, pad in cases:
            (start, stop), = piece_ranges(n, world, rank)
            ids, mask = tokens(2, n, seed=5), padding(pad, 2, n)
            weight = torch.randn(2, n, 32, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(6)) * mask[..., None]
            result = []
            for impl, g, rows in ((one, None, slice(0, n)), (sp, group, slice(start, stop))):
                model = encoder(kind, impl)
                hidden = model(ids[:, rows], attention_mask=mask[:, rows],
                               position_ids=torch.arange(n)[None, rows]).last_hidden_state
                # world times this rank's share: the averaged gradients are the sum (training.md)
                (comm.group_size(g) * (hidden * weight[:, rows]).sum()).backward()
                all_reduce_gradients(model, g)
                result.append((hidden.detach(), grads(model)))
            (ref, ref_grads), (ours, our_grads) = result
            out.append((f"{kind} {pad} n={n}", ours, ref[:, start:stop], mask[:, start:stop],
                        our_grads, ref_grads))
    return out


@pytest.mark.distributed
def test_sequence_parallel_encoders_equal_one_process():
    for rank_results in SPAWNS.results(2, _encoder_rank):
        for case, ours, ref, mask, our_grads, ref_grads in rank_results:
            real = mask.bool()
            torch.testing.assert_close(ours[real], ref[real], **TOL, msg=lambda m: f"{case}: {m}")
            assert_grads_equal(our_grads, ref_grads)


# documents packed into n = 29 rows, whose pieces are 15 | 14 at P = 2 and 10 | 10 | 9 at P = 3:
# starts at 10 (P = 3's first border), 15 (P = 2's border) and 22 (inside a piece); starts at
# 7 and 20 (P = 3's second border), a document across P = 2's border and P = 3's first
PACKED_SP_LENGTHS = ([10, 5, 7, 7], [7, 13, 9])


def _packed_encoder_run(kind: str, impl: str, group, lengths, rows: slice):
    """(hidden states, the input embeddings' gradient, the parameter gradients averaged over
    `group`) of `rows` of the packed documents, each rank's loss its own share of the one
    process's (no factor P: ModernBERT's rotary rounds dq and dk to float32, where P times a
    gradient rounds otherwise than the gradient when P = 3). impl "sdpa": each document alone.
    """
    n = sum(lengths)
    x = torch.randn(1, n, 32, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(7))[:, rows].requires_grad_()
    weight = torch.randn(1, n, 32, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(8))[:, rows]
    model = encoder(kind, impl)
    if impl == "sdpa":
        hidden = torch.cat([model(inputs_embeds=e, position_ids=torch.arange(m)[None])
                            .last_hidden_state for e, m in zip(x.split(lengths, 1), lengths)],
                           dim=1)
    else:
        # this rank's rows of the global position_ids, the global cu_seq_lens_q/k
        inputs, _ = shard_inputs(tokens(1, n), group, position_ids=torch.cat(
            [torch.arange(m) for m in lengths])[None])
        del inputs["input_ids"]  # inputs_embeds instead, for their gradient
        hidden = model(inputs_embeds=x, **inputs).last_hidden_state
    (hidden * weight).sum().backward()
    all_reduce_gradients(model, group)
    return hidden.detach(), x.grad, grads(model)


def _packed_encoder_rank(group):
    """Packed documents in BERT and ModernBERT (its global layers and its local ones: the halo
    exchange), dense and dilated patterns: P = 3 over the 3 ranks, P = 2 over ranks 0 and 1
    while rank 2 runs one process (and, dense, sdpa on each document alone). Returns (P, case,
    results) for the parent to compare."""
    pair = subgroup([0, 1])
    out = []
    for label, (segs, rates), one in (("dense", ([4096], [1]), DENSE),
                                      ("dilated", (SEGMENTS, RATES), DILATED)):
        groups = [(2, pair)] if pair is not None else []
        sharded = {world: register(f"dilated_packed_sp{world}_{label}_test",
                                   segment_lengths=segs, dilation_rates=rates, group=g)
                   for world, g in groups + [(3, group)]}
        for kind in ("bert", "modernbert"):
            for lengths in PACKED_SP_LENGTHS:
                case = f"{kind} {label} {lengths}"
                if pair is None:  # rank 2, while ranks 0 and 1 run P = 2
                    out.append((1, case, _packed_encoder_run(kind, one, None, lengths,
                                                             slice(None))))
                    if label == "dense":
                        out.append((0, case, _packed_encoder_run(kind, "sdpa", None, lengths,
                                                                 slice(None))))
                for world, g in groups + [(3, group)]:
                    (start, stop), = piece_ranges(sum(lengths), world, comm.group_rank(g))
                    out.append((world, case, _packed_encoder_run(kind, sharded[world], g,
                                                                 lengths, slice(start, stop))))
    return out


@pytest.mark.distributed
def test_sequence_parallel_packed_encoders_equal_one_process():
    """Packed documents under sequence parallelism, P = 2 and 3, equal one process (which, with
    the dense pattern, equals sdpa on each document alone): a document start inside a rank's
    piece, starts at borders between pieces, documents across borders, uneven pieces."""
    results = SPAWNS.results(3, _packed_encoder_rank)
    found = {(world, case): result for rank_results in results
             for world, case, result in rank_results if world < 2}
    alone = [case for world, case in found if world == 0]
    assert len(alone) == 2 * len(PACKED_SP_LENGTHS)
    for case in alone:  # one process against each document alone with sdpa
        (ours, our_x, our_grads), (ref, ref_x, ref_grads) = found[1, case], found[0, case]
        torch.testing.assert_close(ours, ref, **TOL, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(our_x, ref_x, **TOL, msg=lambda m: f"{case} dx: {m}")
        assert_grads_equal(our_grads, ref_grads)
    checked = 0
    for rank, rank_results in enumerate(results):
        for world, case, (ours, our_x, our_grads) in rank_results:
            if world < 2:
                continue
            ref, ref_x, ref_grads = found[1, case]
            (start, stop), = piece_ranges(ref.shape[1], world, rank)
            what = f"{case}, rank {rank} of {world}"
            torch.testing.assert_close(ours, ref[:, start:stop], **TOL,
                                       msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(our_x, ref_x[:, start:stop], **TOL,
                                       msg=lambda m: f"{what} dx: {m}")
            # the average over the ranks of their shares: the gradient / P
            assert_grads_equal({k: world * g for k, g in our_grads.items()}, ref_grads)
            checked += 1
    assert checked == 5 * 4 * len(PACKED_SP_LENGTHS)  # 3 + 2 ranks, 4 (family, pattern) pairs


def _compiled_encoder_rank(group):
    """BERT (one layer, dilated patterns) on this rank's rows, eager and under torch.compile
    (inductor): (hidden states, parameter gradients) of each."""
    rank = comm.group_rank(group)
    sp = register("dilated_sp_compile_test", segment_lengths=SEGMENTS, dilation_rates=RATES,
                  group=group)
    n = 28  # pieces of 14 rows: the ranks compile the same kernels, which inductor's cache shares
    (start, stop), = piece_ranges(n, 2, rank)
    ids = tokens(1, n, seed=5)[:, start:stop]
    weight = torch.randn(1, n, 32, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(6))[:, start:stop]
    model = encoder("bert", sp, num_hidden_layers=1)
    results = []
    torch._dynamo.reset()
    try:
        for run in (model, torch.compile(model)):
            model.zero_grad(set_to_none=True)
            hidden = run(ids, position_ids=torch.arange(start, stop)[None]).last_hidden_state
            (2 * (hidden * weight).sum()).backward()
            all_reduce_gradients(model, group)
            results.append((hidden.detach(), grads(model)))
    finally:
        torch._dynamo.reset()
    return results


@pytest.mark.distributed
def test_sequence_parallel_bert_compiles_with_inductor():
    """torch.compile (inductor) of a model whose backend has a group, on 2 ranks: its attention
    calls run eagerly (graph breaks), the rest compiled; hidden states and gradients equal
    eager's."""
    for (ref, ref_grads), (ours, our_grads) in SPAWNS.results(2, _compiled_encoder_rank):
        torch.testing.assert_close(ours, ref, **TOL)
        assert_grads_equal(our_grads, ref_grads)

BERT_LIKE = {"xlm-roberta": {}, "camembert": {}, "electra": {"embedding_size": 32},
             "ernie": {}, "data2vec-text": {}, "roberta-prelayernorm": {}, "albert": {},
             "xlm-roberta-xl": {}, "nomic_bert": {}, "jina_embeddings_v3": {},
             "distilbert": {"hidden_dim": 64}}


@pytest.mark.parametrize("model_type", sorted(BERT_LIKE))
def test_bert_like_families_equal_sdpa(model_type):
    """Encoders whose attention layers are BERT's or close to it: left-padded hidden states
    and gradients."""
    config = transformers.AutoConfig.for_model(model_type, **ENCODER_COMMON,
                                               **BERT_LIKE[model_type])

    def make(impl):
        torch.manual_seed(0)
        return transformers.AutoModel.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                  dtype=torch.float64).eval()

    ids, mask = tokens(2, 19), padding("left", 2, 19)
    assert_equals_sdpa(make, ids, mask, output="last_hidden_state", attention_mask=mask)


def _bad_targets_rank(group):
    """Rank 0 passes a target of -1 (not -100), the other ranks good ones."""
    head = torch.nn.Linear(8, VOCAB, bias=False, dtype=torch.float64)
    hidden = torch.randn(1, 4, 8, dtype=torch.float64)
    targets = torch.zeros(1, 4, dtype=torch.long)
    if comm.group_rank(group) == 0:
        targets[0, 2] = -1
    return [error_of(lambda: causal_lm_loss(hidden, targets, group, lm_head=head))[0],
            error_of(lambda: causal_lm_loss(head(hidden), targets, group))[0]]


def _one_rank_differs(group):
    """Rank 1 alone passes a different value: each case's outcome on this rank."""
    odd = comm.group_rank(group) == 1
    targets = torch.zeros(1, 4, dtype=torch.long)
    logits = torch.zeros(1, 4, VOCAB, dtype=torch.float64 if odd else torch.float32)
    return {
        # the loss's all-reduce in each rank's accumulator dtype: 16 bytes against 8 aborted
        # the processes in gloo
        "loss_dtype": error_of(lambda: causal_lm_loss(logits, targets, group))[0],
        "loss_vocab": error_of(lambda: causal_lm_loss(
            torch.zeros(1, 4, VOCAB + odd), targets, group))[0],
        "mask_shape": _mask_one_row_short(group, odd),
        # shard_inputs sent nothing: rank 1 raised alone, rank 0 waited in the model's first
        # agreement
        "shard_labels": error_of(lambda: shard_inputs(
            tokens(1, 8), group, labels=torch.zeros(1, 8 - odd, dtype=torch.long)))[0],
    }


def _mask_one_row_short(group, odd: bool) -> str:
    """A padding mask one key short on rank 1: without a cache transformers takes the key
    length from the mask, and the mask function raised on that rank alone (a "static cache"),
    the other waiting in the attention's agreement."""
    model = build(register("dilated_one_rank_test", segment_lengths=SEGMENTS,
                           dilation_rates=RATES, group=group))
    inputs, _ = shard_inputs(tokens(1, 8), group, attention_mask=torch.ones(1, 8))
    if odd:
        inputs["attention_mask"] = inputs["attention_mask"][:, 1:]
    try:
        model(**inputs)
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_value_on_one_rank_only_is_an_error_on_every_rank():
    results = SPAWNS.results(2, _one_rank_differs)
    for result in results:
        for key, name in (("loss_dtype", "'outputs.dtype'"), ("loss_vocab", "'vocab'")):
            assert result[key].startswith(f"ValueError: ranks disagree on {name}"), result
    own, other = (result["shard_labels"] for result in results[::-1])
    assert own.startswith("ValueError: labels must be (1, 8) like input_ids (1, 8), got "), own
    assert other.startswith("ValueError: the call failed on another rank") and \
        "labels must be (1, 8)" in other, other
    own, other = (result["mask_shape"] for result in results[::-1])
    assert own.startswith("NotImplementedError: attention_mask: ") and \
        "padding mask of shape (1, 3) for 4 tokens" in own, own
    assert other.startswith("ValueError: the call failed on another rank") and \
        "padding mask of shape (1, 3)" in other, other


def test_causal_lm_loss_refuses_bad_targets_on_every_rank():
    """A target that is neither an id nor -100: the chunked loss once read -1 as id 0 and
    trained on it silently (the logits path raised an IndexError on that rank alone, the
    others waiting in the loss's all-reduce); now a ValueError on every rank, either path."""
    head = torch.nn.Linear(8, VOCAB, bias=False)
    for bad in (-1, VOCAB):
        targets = torch.tensor([[1, bad, -100]])
        for outputs, kwargs in ((torch.zeros(1, 3, 8), dict(lm_head=head)),
                                (torch.zeros(1, 3, VOCAB), {})):
            with pytest.raises(ValueError, match=rf"targets must be ids in \[0, {VOCAB}\) or "
                                                 rf"-100 \(ignored\), got {bad}"):
                causal_lm_loss(outputs, targets, None, **kwargs)
    for rank, errors in enumerate(SPAWNS.results(2, _bad_targets_rank)):
        for error in errors:
            assert error.startswith("ValueError"), error
            assert ("got -1" if rank == 0 else "failed on another rank") in error, error


# One spawn per world size for every rank function above (each rank imports transformers:
# seconds a spawn), in this order on the same ranks; the sampling case reseeds each rank's
# generator differently: it runs last.
SPAWNS = SharedSpawn({
    2: [(_sp_rank,), (_encoder_rank,), (_compiled_encoder_rank,), (_beam_search_refused,),
        (_one_rank_differs,), (_bad_targets_rank,), (_sampling_seeded_differently,)],
    3: [(_sp_rank,), (_packed_encoder_rank,)],
})
