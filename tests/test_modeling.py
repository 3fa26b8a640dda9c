"""Model-level behaviour: scale invariance, padding, long sequences, config validation, HF features."""

import copy
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from bilinear_lm import BilinearCache, BilinearConfig, BilinearForCausalLM, BilinearModel
from bilinear_lm.modeling.configuration_bilinear import MIXER_TYPES
from bilinear_lm.modeling.modeling_bilinear import BilinearCausalLMOutput, BilinearModelOutput
from bilinear_lm.modeling.transformers_compat import returned_cache


def build(config, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return BilinearForCausalLM(config).to(dtype).eval()


def with_changes(config, **changes):
    return BilinearConfig(**{**config.to_dict(), **changes})


def test_auto_classes_are_registered(tiny_bilinear_config):
    assert isinstance(AutoConfig.for_model("bilinear", vocab_size=5), BilinearConfig)
    assert isinstance(AutoModel.from_config(tiny_bilinear_config), BilinearModel)
    model = AutoModelForCausalLM.from_config(tiny_bilinear_config)
    assert isinstance(model, BilinearForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default


def test_import_defers_the_model_classes_to_the_first_config_even_an_unpickled_one(tiny_bilinear_config):
    """`import bilinear_lm` loads the configuration only (`train.py --help` stays quick); the first BilinearConfig,
    here one unpickled (pickle bypasses `__init__`), loads the model classes and registers them with the Auto
    classes, so `AutoModelForCausalLM.from_config` finds them."""
    script = f"""
import pickle, sys
import bilinear_lm
from transformers import AutoModelForCausalLM
assert "bilinear_lm.modeling.modeling_bilinear" not in sys.modules and "transformers.modeling_utils" not in sys.modules
config = pickle.loads({pickle.dumps(tiny_bilinear_config)!r})
assert "bilinear_lm.modeling.modeling_bilinear" in sys.modules
model = AutoModelForCausalLM.from_config(config)
assert type(model) is bilinear_lm.BilinearForCausalLM and model.config.hidden_size == {tiny_bilinear_config.hidden_size}
assert bilinear_lm.BilinearForCausalLM._auto_class == "AutoModelForCausalLM"
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_chunked_normalization_does_not_change_logits(tiny_bilinear_config):
    """Exact scale invariance: normalizing every step, every 7 steps and never give the same logits."""
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 40))
    logits = {}
    for chunk in (0, 1, 7):
        model = build(with_changes(tiny_bilinear_config, norm_chunk_size=chunk), torch.float64)
        with torch.no_grad():
            logits[chunk] = model(ids).logits
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits[7], logits[0], rtol=1e-12, atol=1e-12)


def test_state_rescaling_is_invisible(tiny_bilinear_config):
    """Scale invariance itself: any positive rescaling of a cached state leaves every later logit unchanged."""
    model = build(tiny_bilinear_config, torch.float64)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 20))
    with torch.no_grad():
        out = model(ids[:, :10], use_cache=True)
        reference = model(ids[:, 10:], cache=copy.deepcopy(returned_cache(out))).logits
        cache = returned_cache(out)
        for layer in cache.layers:
            layer.recurrent_states[0] = layer.recurrent_states[0] * torch.tensor([1e-20, 3e15], dtype=torch.float64)[
                :, None, None]
        rescaled = model(ids[:, 10:], cache=cache).logits
    torch.testing.assert_close(rescaled, reference, rtol=1e-12, atol=1e-12)


def test_additive_input_breaks_scale_invariance(tiny_bilinear_config):
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (1, 30))
    logits = []
    for chunk in (0, 5):
        model = build(with_changes(tiny_bilinear_config, additive_input=True, norm_chunk_size=chunk), torch.float64)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-6


@pytest.mark.parametrize("autocast", [False, True])
def test_100k_token_forward_stays_finite(tiny_bilinear_config, autocast):
    config = with_changes(tiny_bilinear_config, norm_chunk_size=64, input_factor_init_std=0.5, num_hidden_layers=1,
                          layer_types=["bilinear"])
    model = build(config)
    for layer in model.model.layers:  # a transition that grows the state ~e^5 per step without normalization
        layer.mixer.transition.factor_bias.data.fill_(50.0)
    ids = torch.randint(0, config.vocab_size, (1, 100_000))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, use_cache=True)
    assert torch.isfinite(out.logits.float()).all()
    states = [layer.recurrent_states[0] for layer in returned_cache(out).layers]
    assert all(torch.isfinite(s).all() and s.norm(dim=-1).max() < 1e30 for s in states)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_left_padding_gives_the_unpadded_logits(tiny_bilinear_config, dtype, tol):
    model = build(tiny_bilinear_config, dtype)
    long_row = torch.randint(1, tiny_bilinear_config.vocab_size, (1, 20))
    short_row = torch.randint(1, tiny_bilinear_config.vocab_size, (1, 13))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 7, dtype=torch.long), short_row], 1)])
    mask = torch.ones_like(batch)
    mask[1, :7] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = model(short_row).logits
        alone_long = model(long_row).logits
    torch.testing.assert_close(padded[1, 7:], alone[0], rtol=tol, atol=tol)
    torch.testing.assert_close(padded[0], alone_long[0], rtol=tol, atol=tol)


# Every layout with the CP transition, and the other transitions in the pure layout: each parameter must learn.
TRAINING_LAYOUTS = {"pure": {}, "conv": {"conv_width": 3},
                    "memory": {"conv_width": 3, "memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3},
                    "hybrid": {"layer_types": ["bilinear", "full_attention"], "conv_width": 3},
                    **{mixer: {"mixer_type": mixer, "state_size": 6} for mixer in MIXER_TYPES if mixer != "cp"}}


def _impl_runs_here(impl: str) -> bool:
    from bilinear_lm.modeling import dispatch

    if impl == "cpp":
        return dispatch.cpu_kernels_available()
    return impl != "triton" or dispatch._triton_available("cpu")


@pytest.mark.parametrize("layout, impl", [(layout, impl) for layout in TRAINING_LAYOUTS
                                          for impl in (("reference",) if layout in MIXER_TYPES
                                                       else ("reference", "torch", "cpp", "triton"))])
def test_one_training_step_gives_every_parameter_a_nonzero_gradient(tiny_bilinear_config, layout, impl):
    """A lost gradient (torch 2.14 gave the C++ scan's outputs none: the transitions never trained, silently) fails
    here on any stack: one step's loss reaches every parameter, by every recurrence impl (a transition other than
    CP runs the reference loop whatever the impl: one case each)."""
    if not _impl_runs_here(impl):
        pytest.skip(f"recurrence_impl={impl!r} does not run on this machine")
    model = build(with_changes(tiny_bilinear_config, recurrence_impl=impl, **TRAINING_LAYOUTS[layout])).train()
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 19))
    model(ids, labels=ids).loss.backward()
    without = [name for name, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not without, f"no gradient for {without}"


def test_gradient_checkpointing_gives_same_gradients(tiny_bilinear_config):
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 17))
    grads = []
    for checkpointing in (False, True):
        model = build(tiny_bilinear_config, torch.float64).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_output_hidden_states(tiny_bilinear_config):
    model = build(tiny_bilinear_config)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        base = model.model(ids)
    assert len(out.hidden_states) == tiny_bilinear_config.num_hidden_layers + 1
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))
    torch.testing.assert_close(out.hidden_states[-1], base.last_hidden_state)
    torch.testing.assert_close(out.logits, base.last_hidden_state @ model.lm_head.weight.T)


def test_save_load_safetensors_and_bf16(tiny_bilinear_config, tmp_path):
    model = build(tiny_bilinear_config)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin"))
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 12))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = bf16(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), model(ids).logits, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("field,value", [
    ("rank", 0), ("num_heads", -2), ("state_size", 2.5), ("norm_chunk_size", -1), ("hidden_act", "tanh"),
    ("mixer_type", "lstm"), ("recurrence_impl", "cuda"), ("rms_norm_eps", 0.0), ("conv_width", 1), ("conv_width", -3),
    ("input_factor_multiplier", 0.0), ("input_factor_multiplier", -1.0),
])
def test_config_rejects_nonsense_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BilinearConfig(**{field: value})


def test_model_rejects_incompatible_block_sizes():
    """Each transition type checks its own fields when the model is built (the config validates names only)."""
    with pytest.raises(ValueError, match="block_size"):
        BilinearForCausalLM(BilinearConfig(mixer_type="block_diagonal", state_size=10, block_size=3))
    with pytest.raises(ValueError, match="even"):
        BilinearForCausalLM(BilinearConfig(mixer_type="rotation", state_size=7))


def test_input_factor_multiplier_is_the_same_model_at_init_with_its_factor_gradient_scaled():
    """``input_factor_multiplier`` m: ``u = bias + m (W_u x)`` with ``W_u`` drawn at ``std / m``, so at initialization
    the model is the one without it, and (chain rule) the gradient of the factor rows of ``in_proj`` is m times
    theirs while every other gradient is unchanged: under Adam, m is the factors' relative learning rate."""
    config = BilinearConfig(vocab_size=11, hidden_size=16, num_heads=2, state_size=5, rank=6, num_hidden_layers=2,
                            input_factor_init_std=0.3)
    ids = torch.randint(0, 11, (2, 9))
    runs = {}
    for m in (1.0, 0.25):
        model = build(with_changes(config, input_factor_multiplier=m)).double()
        out = model(ids, labels=ids)
        out.loss.backward()
        runs[m] = out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}
    (logits, grads), (scaled_logits, scaled_grads) = runs[1.0], runs[0.25]
    torch.testing.assert_close(scaled_logits, logits, rtol=1e-5, atol=1e-6)
    factor_rows = config.num_heads * config.rank
    for name, grad in grads.items():
        expected = grad.clone()
        if name.endswith("mixer.in_proj.weight"):
            expected[:factor_rows] *= 0.25
        torch.testing.assert_close(scaled_grads[name], expected, rtol=1e-4, atol=1e-8, msg=name)


def test_paper_minimal_model_is_a_config():
    config = BilinearConfig(vocab_size=7, hidden_size=8, num_hidden_layers=1, use_mlp=False, mixer_type="full",
                            num_heads=1, state_size=8, rank=8)
    model = BilinearForCausalLM(config)
    assert [name for name, _ in model.model.layers[0].named_children()] == ["mixer_norm", "mixer"]


def test_mixer_states_are_the_recurrence_states(tiny_bilinear_config):
    """``output_mixer_states``: layer l's states equal the reference loop run on that layer's own input factors."""
    from functools import partial

    from bilinear_lm.modeling.bilinear_reference import cp_transition, reference_recurrence

    model = build(tiny_bilinear_config, torch.float64)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_mixer_states=True)
        assert len(out.mixer_states) == tiny_bilinear_config.num_hidden_layers
        for layer, x, states in zip(model.model.layers, out.hidden_states, out.mixer_states):
            mixer = layer.mixer
            factors = mixer.in_proj(layer.mixer_norm(x))[..., :mixer.split_sizes[0]].view(2, 9, mixer.num_heads, -1)
            W1, W2 = mixer.transition.W1, mixer.transition.W2
            expected, _ = reference_recurrence(partial(cp_transition, W1=W1, W2=W2),
                                               factors + mixer.transition.factor_bias, mixer.h_start,
                                               chunk=tiny_bilinear_config.norm_chunk_size)
            torch.testing.assert_close(states, expected, rtol=1e-10, atol=1e-12)
    assert model(ids).mixer_states is None


@pytest.mark.parametrize("preset,changes", [("tiny", {}), ("tiny-hybrid", {"conv_width": 4})], ids=["pure", "hybrid"])
def test_torch_compile_traces_a_training_step_of_a_preset_in_one_graph(preset, changes):
    """The scans are custom ops with fake implementations: the whole forward and backward trace as one graph
    (``fullgraph=True`` fails on any graph break), and the compiled step's loss and gradients equal eager mode; for the
    tiny preset and the hybrid preset (3 bilinear layers : 1 attention layer) with convolutions."""
    import yaml

    from conftest import REPO_ROOT

    model_keys = yaml.safe_load((REPO_ROOT / f"bilinear_lm/configs/{preset}.yaml").read_text())["model"]
    if preset == "tiny-hybrid":
        assert model_keys["layer_types"].count("bilinear") == 3
    torch.manual_seed(0)
    model = BilinearForCausalLM(BilinearConfig(vocab_size=512, **{**model_keys, **changes})).train()
    ids = torch.randint(0, 512, (2, 80))  # past one normalization boundary (norm_chunk_size 64)
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


CONV_AND_RESETS = {"conv_width": 3, "reset_state_at_eos": True, "eos_token_id": 3, "num_hidden_layers": 1,
                   "layer_types": ["bilinear"], "memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3}
HYBRID = {**CONV_AND_RESETS, "num_hidden_layers": 3, "sliding_window": 3, "num_key_value_heads": 2,
          "layer_types": ["bilinear", "full_attention", "sliding_attention"]}


@pytest.mark.parametrize("changes", [CONV_AND_RESETS, HYBRID], ids=["pure", "hybrid"])
def test_export_and_compile_with_an_attention_mask_give_eager_logits(tiny_bilinear_config, changes):
    """An ``attention_mask`` (every tokenizer output carries one) leaves the forward traceable end to end (the
    convolution, resets at EOS, memory heads and, in the hybrid, the attention masks with documents): ``torch.export``
    succeeds and ``torch.compile(fullgraph=True)`` makes one graph (Dynamo's, where a data-dependent branch breaks it;
    export traces the ATen graph). Nothing branches on the mask's values: the program exported
    and the model compiled with one left-padded mask give eager's logits for it, for another padding and for an
    all-ones mask (which eager drops). Exported without the cache (``BilinearCache`` is no pytree), compiled with it."""
    model = build(with_changes(tiny_bilinear_config, **changes))
    ids = torch.randint(4, tiny_bilinear_config.vocab_size, (2, 10))
    ids[:, 6] = 3  # an EOS: a document starts at position 7
    masks = [torch.ones_like(ids) for _ in range(3)]
    masks[0][1, :4] = 0
    masks[1][0, :2] = 0
    with torch.no_grad():
        expected = [model(ids, attention_mask=mask).logits for mask in masks]
        exported = torch.export.export(model, (ids,), kwargs={"attention_mask": masks[0], "use_cache": False}).module()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        for mask, eager in zip(masks, expected):
            valid = mask.bool()  # a padded position's logits mean nothing
            torch.testing.assert_close(exported(ids, attention_mask=mask, use_cache=False).logits[valid], eager[valid])
            torch.testing.assert_close(compiled(ids, attention_mask=mask).logits[valid], eager[valid])


@pytest.mark.parametrize("how", ["argument", "config"])
def test_return_dict_false_returns_the_outputs_to_tuple(tiny_bilinear_config, how):
    """``return_dict=False``, as an argument or ``config.return_dict``, makes ``BilinearForCausalLM`` and
    ``BilinearModel`` return their ``ModelOutput``'s fields as a tuple, in order and without the None ones (the
    ``to_tuple()`` of transformers' models): ``loss, logits, *rest = model(ids, labels=ids, return_dict=False)``."""
    model = build(tiny_bilinear_config)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 6))
    lm_kwargs = dict(labels=ids, output_hidden_states=True, output_mixer_states=True, use_cache=False)
    with torch.no_grad():
        lm = model(ids, **lm_kwargs)
        base = model.model(ids, output_hidden_states=True)
        if how == "config":
            model.config.return_dict = False
            lm_tuple, base_tuple = model(ids, **lm_kwargs), model.model(ids, output_hidden_states=True)
            assert isinstance(model(ids, return_dict=True), BilinearCausalLMOutput)  # the argument wins
        else:
            lm_tuple = model(ids, **lm_kwargs, return_dict=False)
            base_tuple = model.model(ids, output_hidden_states=True, return_dict=False)
        loss, logits, cache = model(ids, labels=ids, use_cache=True, return_dict=False)
    assert isinstance(lm, BilinearCausalLMOutput) and isinstance(base, BilinearModelOutput)
    assert type(lm_tuple) is tuple and type(base_tuple) is tuple
    assert len(lm_tuple) == 4 and len(base_tuple) == 3  # no cache (use_cache=False), no attentions
    for got, expected in [(lm_tuple, (lm.loss, lm.logits, lm.hidden_states, lm.mixer_states)),
                          (base_tuple, (base.last_hidden_state, returned_cache(base), base.hidden_states))]:
        for a, b in zip(got, expected):
            if isinstance(b, BilinearCache):
                assert isinstance(a, BilinearCache) and a.get_seq_length() == b.get_seq_length()
            else:
                assert torch.equal(torch.stack(a) if isinstance(a, tuple) else a,
                                   torch.stack(b) if isinstance(b, tuple) else b)
    assert torch.equal(loss, lm.loss) and torch.equal(logits, lm.logits) and isinstance(cache, BilinearCache)


def test_bad_input_ids_raise_a_clear_error(tiny_bilinear_config):
    model = build(tiny_bilinear_config)
    V = tiny_bilinear_config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {V} at position 1 is outside the model.s vocabulary of {V} ids"):
        model(torch.tensor([[1, V, 2]]))
    with pytest.raises(ValueError, match=r"token id -1 at position 3 is outside"):
        model(torch.tensor([[1, 2], [0, -1]]))
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token id {V + 5} at position 1 is outside"):
        model.generate(torch.tensor([[1, V + 5]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one position"):
        model(inputs_embeds=torch.zeros(1, 0, tiny_bilinear_config.hidden_size))
    with pytest.raises(ValueError, match=r"got shape \(0, 3\); pass at least one row of at least one token"):
        model(torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"no rows or no positions \(shape \(0, 2, \d+\)\)"):
        model(inputs_embeds=torch.zeros(0, 2, tiny_bilinear_config.hidden_size))


def test_an_attention_mask_that_does_not_fit_the_inputs_is_a_clear_error(tiny_bilinear_config):
    model = build(tiny_bilinear_config).eval()
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 5))
    for mask in (torch.ones(3, 5), torch.ones(2, 4), torch.ones(2, 7), torch.ones(5)):
        with pytest.raises(ValueError, match=rf"attention_mask of shape \({', '.join(map(str, mask.shape))},?\) does "
                                             r"not fit the inputs' \[batch, seq_len\] = \[2, 5\]: pass a mask of "
                                             r"shape \[2, 5\]$"):
            model(ids, attention_mask=mask, use_cache=False)
    def cache():
        return returned_cache(model(ids, attention_mask=torch.ones(2, 5), use_cache=True))

    step = ids[:, :1]
    with pytest.raises(ValueError, match=r"of shape \(2, 4\) does not fit the inputs' \[batch, seq_len\] = \[2, 1\] "
                                         r"after 5 cached tokens: pass a mask of shape \[2, 1\] or \[2, 6\]"):
        model(step, attention_mask=torch.ones(2, 4), cache=cache())
    # the whole sequence's mask, as generate() passes it, and this call's columns alone are the same call
    whole = model(step, attention_mask=torch.ones(2, 6), cache=cache()).logits
    assert torch.equal(whole, model(step, attention_mask=torch.ones(2, 1), cache=cache()).logits)
    padded = torch.ones(2, 5, dtype=torch.long)
    padded[0, :2] = 0  # left padding, through generate()
    assert model.generate(ids, attention_mask=padded, max_new_tokens=3, do_sample=False).shape == (2, 8)


def test_short_conv_equals_an_explicit_causal_loop_and_starts_as_the_identity(tiny_bilinear_config):
    from bilinear_lm.modeling.modeling_bilinear import BilinearShortConv

    conv = BilinearShortConv(6, 4).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y, window = conv(x)
    torch.testing.assert_close(y, x)  # zero weight at init: x + conv(x) = x
    torch.testing.assert_close(window, x[:, -3:])
    torch.nn.init.normal_(conv.weight)
    w = conv.weight[:, 0]  # [D, width]; tap k multiplies x_{t - (width - 1) + k}
    history = torch.randn(2, 3, 6, dtype=torch.float64)
    y, window = conv(x, history)
    padded = torch.cat([history, x], dim=1)
    expected = torch.stack([x[:, t] + sum(w[:, k] * padded[:, t + k] for k in range(4)) for t in range(9)], dim=1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(window, x[:, -3:])


def test_zero_initialized_conv_leaves_the_model_unchanged(tiny_bilinear_config):
    plain = build(tiny_bilinear_config, torch.float64)
    with_conv = BilinearForCausalLM(with_changes(tiny_bilinear_config, conv_width=4)).double().eval()
    missing, unexpected = with_conv.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and sorted(missing) == [f"model.layers.{i}.conv.weight" for i in range(2)]
    assert all(layer.conv.weight.abs().max() == 0 for layer in with_conv.model.layers)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(with_conv(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_reset_needs_an_eos_token():
    with pytest.raises(ValueError, match="reset_state_at_eos needs eos_token_id"):
        BilinearConfig(reset_state_at_eos=True)


def test_lora_on_the_transition_weights_trains_and_generates_like_its_merged_model(tiny_bilinear_config):
    """PEFT LoRA on parameters (``target_parameters``) wraps the transition module: forward, the cached decoding steps
    of ``generate`` and a gradient step all see the adapter, equal to the model with the adapter merged in."""
    peft = pytest.importorskip("peft")
    model = build(tiny_bilinear_config, torch.float64)
    config = peft.LoraConfig(r=2, target_modules=[], target_parameters=["mixer.transition.W1", "mixer.transition.W2"])
    lora = peft.get_peft_model(model, config)
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # zero at init: make the adapter change the model
            torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(1, tiny_bilinear_config.vocab_size, (2, 7))
    loss = lora(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for name, p in lora.named_parameters() if p.requires_grad)
    with torch.no_grad():
        logits = lora(input_ids=ids).logits
        generated = lora.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        merged = lora.merge_and_unload()
        torch.testing.assert_close(logits, merged(ids).logits, rtol=1e-9, atol=1e-9)
        assert (logits - build(tiny_bilinear_config, torch.float64)(ids).logits).abs().max() > 1e-3  # adapter acts
        assert torch.equal(generated, merged.generate(ids, max_new_tokens=6, do_sample=False))


def test_labels_outside_the_vocabulary_are_a_one_line_error_and_minus_100_is_ignored(tiny_bilinear_config):
    """Labels are checked like input ids (torch's cross-entropy says only `IndexError: Target 70 is out of bounds`);
    -100, the loss's ignore index, passes."""
    model = build(tiny_bilinear_config)
    V = tiny_bilinear_config.vocab_size
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=rf"^label {V + 3} at position 4 is outside the model.s vocabulary of {V} ids "
                                         rf"\(0..{V - 1}\): labels are token ids .* or -100 where no loss is wanted"):
        model(input_ids=ids, labels=torch.tensor([[1, 2, 3], [-100, V + 3, 6]]))
    with pytest.raises(ValueError, match=r"^label -5 at position 0 is outside"):
        model(input_ids=ids, labels=torch.tensor([[-5, 2, 3], [4, 5, 6]]))
    loss = model(input_ids=ids, labels=torch.tensor([[1, -100, 3], [-100, 5, 6]])).loss
    assert torch.isfinite(loss)
