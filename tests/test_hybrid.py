"""Hybrid layouts: attention layers among the bilinear ones (``layer_types``), on transformers' ``DynamicCache``."""

import copy
import math

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from bilinear_lm import BilinearCache, BilinearConfig, BilinearForCausalLM
from bilinear_lm.evaluation import perplexity as ppl
from bilinear_lm.modeling.configuration_bilinear import interleaved_layer_types
from bilinear_lm.modeling.cache_bilinear import BilinearLayerCache
from bilinear_lm.modeling.transformers_compat import returned_cache

WINDOW = 3


def hybrid_config(base, **changes):
    """The tiny config as 4 layers: bilinear, full attention, sliding attention, bilinear (convolutions on)."""
    return BilinearConfig(**{**base.to_dict(), "num_hidden_layers": 4, "conv_width": 3, "num_key_value_heads": 2,
                             "layer_types": ["bilinear", "full_attention", "sliding_attention", "bilinear"],
                             "sliding_window": WINDOW, **changes})


def build(config, seed=0):
    torch.manual_seed(seed)
    model = BilinearForCausalLM(config).double().eval()
    for layer in model.model.layers:  # zero at init: the identity would hide a wrong window
        if getattr(layer, "conv", None) is not None:
            torch.nn.init.normal_(layer.conv.weight, std=0.5)
    return model


def left_padded(vocab_size, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(4, vocab_size, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def test_the_cache_is_transformers_dynamic_cache_with_one_layer_type_per_layer(tiny_bilinear_config):
    """transformers' caches build each layer's cache from its layer type: ours from the "bilinear" entries that
    cache_bilinear.register_layer_type adds to transformers' mappings (transformers has no registration for
    linear-attention layers): a change of those mappings underneath fails here."""
    from transformers.cache_utils import StaticLayer

    from bilinear_lm.modeling.cache_bilinear import (BilinearStaticCache, BilinearStaticLayerCache,
                                                     BilinearStaticSlidingWindowLayer)

    static = BilinearStaticCache(hybrid_config(tiny_bilinear_config), max_cache_len=16)
    assert [type(layer) for layer in static.layers] == [BilinearStaticLayerCache, StaticLayer,
                                                        BilinearStaticSlidingWindowLayer, BilinearStaticLayerCache]
    model = build(hybrid_config(tiny_bilinear_config))
    ids = torch.randint(4, 60, (2, 8))
    with torch.no_grad():
        cache = returned_cache(model(ids, use_cache=True))
    assert isinstance(cache, BilinearCache)
    assert [type(layer) for layer in cache.layers] == [BilinearLayerCache, DynamicLayer, DynamicSlidingWindowLayer,
                                                       BilinearLayerCache]
    assert [cache.get_seq_length(i) for i in range(4)] == [8] * 4
    assert cache.layers[1].keys.shape[-2] == 8 and cache.layers[2].keys.shape[-2] == WINDOW - 1


@pytest.mark.parametrize("use_rope", [True, False])
def test_full_forward_equals_the_token_by_token_cached_loop_and_each_row_alone_with_left_padding(tiny_bilinear_config,
                                                                                                use_rope):
    model = build(hybrid_config(tiny_bilinear_config, use_rope=use_rope))
    ids, mask = left_padded(60, [14, 9, 5])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache, steps = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = returned_cache(out)
            steps.append(out.logits)
        alone = [model(row[m.bool()][None]).logits[0] for row, m in zip(ids, mask)]  # each row without padding
    stepped = torch.cat(steps, 1)
    valid = mask.bool()
    torch.testing.assert_close(stepped[valid], full[valid], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full[valid], torch.cat(alone), rtol=1e-10, atol=1e-10)


def reference_attention(attention, config, x, visible):
    """Plain masked softmax attention in fp64, written out: projections, rotary embedding at positions 0..T-1
    (``theta^(-2i/d)``; none with ``use_rope=False``), each query head on its key/value group, softmax over the
    ``visible`` [B, T, T] keys. Returns ``(output [B, T, D], weights [B, heads, T, T])``."""
    B, T, D = x.shape
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = D // H
    q = (x @ attention.q_proj.weight.T).view(B, T, H, d)
    k = (x @ attention.k_proj.weight.T).view(B, T, G, d)
    v = (x @ attention.v_proj.weight.T).view(B, T, G, d)
    theta = config.rope_parameters["rope_theta"]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rotate(t):
        first, second = t[..., :d // 2], t[..., d // 2:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    if config.use_rope:
        q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(H // G, dim=2)
    v = v.repeat_interleave(H // G, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, D) @ attention.o_proj.weight.T, weights


def visible_keys(mask, window=None):
    """``[B, T, T]``: the keys each query may see, written out: causal, not padding, within ``window`` if given."""
    T = mask.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & mask.bool()[:, None, :]
    return visible & (i - j < window) if window is not None else visible


@pytest.mark.parametrize("kind,layer_idx", [("full_attention", 1), ("sliding_attention", 2)])
@pytest.mark.parametrize("implementation,use_rope", [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_attention_layer_equals_plain_masked_softmax(tiny_bilinear_config, kind, layer_idx, implementation, use_rope):
    """The full layer against a causal + padding mask, the sliding layer against an explicit band of WINDOW
    positions (itself included), both built by hand; with and without the rotary embedding."""
    model = build(hybrid_config(tiny_bilinear_config, use_rope=use_rope))
    model.config._attn_implementation = implementation
    _, mask = left_padded(60, [12, 7])
    B, T = mask.shape
    x = torch.randn(B, T, tiny_bilinear_config.hidden_size, dtype=torch.float64)
    positions = torch.arange(T).expand(B, T)
    attention = model.model.layers[layer_idx].attention
    with torch.no_grad():
        masks = model.model.attention_masks(x, mask, None, positions, None)
        rotary = model.model.rotary_emb(x, positions) if use_rope else None
        out, weights = attention(x, rotary, masks[kind])
    visible = visible_keys(mask, WINDOW if kind == "sliding_attention" else None)
    valid = mask.bool()  # a padded query sees no key: its output is whatever the implementation makes of that
    expected, expected_weights = reference_attention(attention, model.config, x, visible)
    torch.testing.assert_close(out[valid], expected[valid], rtol=1e-5, atol=1e-6)  # Llama's rotary is fp32
    if implementation == "eager":  # the weights too (sdpa computes none)
        torch.testing.assert_close(weights.transpose(1, 2)[valid], expected_weights.transpose(1, 2)[valid],
                                   rtol=1e-5, atol=1e-6)
    else:
        assert weights is None


def eager_fp32_hybrid(base):
    """The hybrid with eager attention, in fp32: eager attention takes its softmax in fp32 (Llama's), where fp64's
    -1.8e308 mask becomes -inf and a padded query, which sees no key, NaN, which then reaches the valid positions
    through the keys' values and the convolution."""
    model = build(hybrid_config(base)).float()
    model.set_attn_implementation("eager")
    return model


def test_output_attentions_returns_each_attention_layers_softmax_weights(tiny_bilinear_config):
    """``output_attentions=True`` (eager attention) returns one ``[B, heads, T, T]`` tensor per attention layer, in
    layer order: softmax(QK^T / sqrt(d)) written out in fp64 over the keys each query sees (causal, padding, the
    sliding window), from the layer's input (its norm and convolution of the hidden state below); the same as a tuple
    with ``return_dict=False``. With sdpa, which computes no weights, there are none, as in transformers."""
    model = eager_fp32_hybrid(tiny_bilinear_config)
    config = model.config
    ids, mask = left_padded(60, [9, 6])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        as_tuple = model(ids, attention_mask=mask, output_attentions=True, use_cache=False, return_dict=False)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, config.num_attention_heads, 9, 9)
    valid = mask.bool()
    for attentions, (layer_idx, window) in zip(out.attentions, [(1, None), (2, WINDOW)]):
        layer = copy.deepcopy(model.model.layers[layer_idx]).double()
        with torch.no_grad():
            x = layer.mixing_input(out.hidden_states[layer_idx].double(), None, mask)
            _, expected = reference_attention(layer.attention, config, x, visible_keys(mask, window))
        torch.testing.assert_close(attentions.transpose(1, 2)[valid].double(), expected.transpose(1, 2)[valid],
                                   rtol=1e-5, atol=1e-6)
    logits, attentions = as_tuple  # (logits, attentions): no loss, cache or hidden states asked for
    assert torch.equal(logits, out.logits) and len(attentions) == 2
    assert all(torch.equal(a, b) for a, b in zip(attentions, out.attentions))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert model(ids, attention_mask=mask, output_attentions=True).attentions == ()


def test_generate_returns_the_attention_weights_of_every_step(tiny_bilinear_config):
    """``generate(output_attentions=True, return_dict_in_generate=True)``: per step, one tensor per attention layer;
    the prompt's are the forward's, and each cached step's row equals the teacher-forced forward's row of that
    position over the whole sequence (the sliding layer's cache holds its last WINDOW keys: the row's last ones)."""
    model = eager_fp32_hybrid(tiny_bilinear_config)
    ids, mask = left_padded(60, [7, 4])
    steps = 4
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_attentions=True,
                         return_dict_in_generate=True, pad_token_id=0)
    assert len(out.attentions) == steps and all(len(step) == 2 for step in out.attentions)
    full_mask = torch.cat([mask, torch.ones(2, steps - 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        forced = model(out.sequences[:, :-1], attention_mask=full_mask, output_attentions=True).attentions
    prompt_len, valid = ids.shape[1], mask.bool()  # a padded query's weights mean nothing
    for layer_pos in range(2):
        prefill = out.attentions[0][layer_pos].transpose(1, 2)[valid]
        torch.testing.assert_close(prefill, forced[layer_pos][:, :, :prompt_len, :prompt_len].transpose(1, 2)[valid])
        for step in range(1, steps):
            row = forced[layer_pos][:, :, prompt_len + step - 1, :prompt_len + step]
            got = out.attentions[step][layer_pos]
            assert got.shape[2] == 1
            expected = row if layer_pos == 0 else row[..., -WINDOW:]
            torch.testing.assert_close(got[:, :, 0], expected)


def test_a_short_mask_after_cached_tokens_is_refused_with_attention_layers(tiny_bilinear_config):
    model = build(hybrid_config(tiny_bilinear_config))
    ids = torch.randint(4, 60, (2, 6))
    with torch.no_grad():
        cache = returned_cache(model(ids[:, :5], use_cache=True))
        with pytest.raises(ValueError, match=r"pass a mask of shape \[2, 6\] \(the whole sequence's"):
            model(ids[:, 5:], attention_mask=torch.ones(2, 1), cache=cache)


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["bilinear"]}, r"layer_types must list one of .* per layer \(num_hidden_layers=2\)"),
    ({"layer_types": ["bilinear", "attention"]}, "interleaved_layer_types"),
    ({"layer_types": ["bilinear", "sliding_attention"]}, "sliding_window must be a positive integer"),
    ({"layer_types": ["bilinear", "full_attention"], "num_attention_heads": 5}, "must divide hidden_size"),
    ({"layer_types": ["bilinear", "full_attention"], "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "only rope_type 'default'"),
])
def test_bad_hybrid_configs_name_the_field_and_the_fix(tiny_bilinear_config, changes, message):
    with pytest.raises(ValueError, match=message):
        BilinearConfig(**{**tiny_bilinear_config.to_dict(), **changes})


def test_interleaved_layer_types():
    assert interleaved_layer_types(8, 4) == ["bilinear"] * 3 + ["full_attention"] + ["bilinear"] * 3 + [
        "full_attention"]
    assert interleaved_layer_types(3, 2, "sliding_attention") == ["bilinear", "sliding_attention", "bilinear"]
    with pytest.raises(ValueError, match="attention_every must be a positive integer"):
        interleaved_layer_types(4, 0)


def test_output_projections_start_scaled_down_with_depth(tiny_bilinear_config):
    """GPT-2's init: every block's output projection (the mixers' and the attention layers') has std
    initializer_range / sqrt(2 * layers), the other projections initializer_range."""
    config = hybrid_config(tiny_bilinear_config, hidden_size=256, num_hidden_layers=8, num_heads=4,
                           num_attention_heads=4, num_key_value_heads=4, conv_width=0,
                           layer_types=interleaved_layer_types(8, 2))
    torch.manual_seed(0)
    model = BilinearForCausalLM(config)
    scaled = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    for layer in model.model.layers:
        mixing = getattr(layer, "attention", None) or layer.mixer
        out = mixing.o_proj if hasattr(mixing, "o_proj") else mixing.out_proj
        assert out.weight.std().item() == pytest.approx(scaled, rel=0.05)
        if hasattr(mixing, "q_proj"):
            assert mixing.q_proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)


def test_save_and_reload_keep_the_layer_types_and_the_logits(tiny_bilinear_config, tmp_path):
    """from_pretrained of a saved hybrid (with trust_remote_code, without the package: test_generation's
    test_remote_code_loads_without_the_package)."""
    model = build(hybrid_config(tiny_bilinear_config)).float()
    model.save_pretrained(tmp_path / "ckpt")
    ids, mask = left_padded(60, [9, 6])
    reloaded = BilinearForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert reloaded.config.layer_types == model.config.layer_types
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


def test_sampling_and_beam_search_run(tiny_bilinear_config):
    model = build(hybrid_config(tiny_bilinear_config))
    ids, mask = left_padded(60, [6, 4])
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=10)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2,
                           do_sample=False)
    assert sampled.shape == (2, 12) and beams.shape == (4, 12)


def _nll(model, ids):
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))


def test_streaming_perplexity_is_exact_with_sliding_windows_and_refused_with_full_attention(tiny_bilinear_config):
    ids = torch.randint(4, 60, (50,))
    sliding = build(hybrid_config(tiny_bilinear_config,
                                  layer_types=["bilinear", "sliding_attention", "sliding_attention", "bilinear"]))
    nll, count = ppl.streaming_perplexity(sliding, ids, segment_len=7)
    assert count == 49 and nll == pytest.approx(_nll(sliding, ids), rel=1e-9)
    with pytest.raises(ValueError, match="--mode strided"):
        ppl.streaming_perplexity(build(hybrid_config(tiny_bilinear_config)), ids, segment_len=7)


def test_text_generation_pipeline_batches_with_left_padding(tiny_bilinear_config):
    from transformers import pipeline

    from fixtures import cached_tokenizer

    tokenizer = copy.deepcopy(cached_tokenizer())
    tokenizer.padding_side = "left"
    model = build(hybrid_config(tiny_bilinear_config, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)).float()
    prompts = ["The history of the", "A"]
    out = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts, max_new_tokens=6, do_sample=False,
                                                                         batch_size=2)
    for prompt, result in zip(prompts, out):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert result[0]["generated_text"] == prompt + tokenizer.decode(alone[0, ids.shape[1]:])


def test_train_py_trains_samples_and_saves_the_hybrid_preset(tmp_path, monkeypatch):
    import train

    from conftest import REPO_ROOT

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = {"config": REPO_ROOT / "bilinear_lm/configs/tiny-hybrid.yaml", "tokenizer": "char", "max_steps": 2,
            "block_size": 32, "batch_size": 2, "eval_interval": 2, "eval_iters": 1, "save_interval": 0,
            "sample_tokens": 8, "output_dir": tmp_path / "out"}
    final = train.main([x for k, v in args.items() for x in (f"--{k}", str(v))])
    assert final["step"] == 2
    saved = BilinearForCausalLM.from_pretrained(tmp_path / "out")
    assert saved.config.layer_types == ["bilinear", "bilinear", "bilinear", "full_attention"]
    assert saved.config.conv_width == 4 and saved.config.use_rope is False  # the hybrid measured in docs/results.md
