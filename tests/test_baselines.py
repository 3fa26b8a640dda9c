"""The one model factory (bilinear_lm.baselines.build_model) against the models built directly, and its errors.
(The parameter matching of the baselines is tested in test_train.py.)"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.baselines import LSTMConfig, LSTMLanguageModel, build_model, matched_baseline_config, matched_lstm
from fixtures import build_tiny_model

BILINEAR = {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "state_size": 8, "rank": 8}
EXPLICIT = {
    "llama": ({"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2},
              lambda cfg, v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **cfg))),
    "mamba": ({"hidden_size": 16, "num_hidden_layers": 1, "state_size": 4},
              lambda cfg, v: MambaForCausalLM(MambaConfig(vocab_size=v, **cfg))),
    "lstm": ({"hidden_size": 16, "num_layers": 2},
             lambda cfg, v: LSTMLanguageModel(LSTMConfig(vocab_size=v, **cfg))),
    "bilinear": (BILINEAR, lambda cfg, v: BilinearForCausalLM(BilinearConfig(vocab_size=v, **cfg))),
}


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("model_type", sorted(EXPLICIT))
def test_explicit_config_builds_the_model_itself(model_type):
    """match_bilinear=False: the dict is the model's own config; same seed -> the very model built directly."""
    cfg, direct = EXPLICIT[model_type]
    torch.manual_seed(0)
    built = build_model(model_type, cfg, 37, match_bilinear=False)
    torch.manual_seed(0)
    assert same_weights(built, direct(cfg, 37))


@pytest.mark.parametrize("model_type", ["llama", "mamba", "lstm"])
def test_default_sizes_baselines_like_the_bilinear_config(model_type):
    with torch.device("meta"):
        built = build_model(model_type, BILINEAR, 37)
        reference = (matched_lstm(BILINEAR, 37) if model_type == "lstm"
                     else {"llama": LlamaForCausalLM, "mamba": MambaForCausalLM}[model_type](
                         matched_baseline_config(model_type, BILINEAR, 37)))
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("model_type", ["llama", "bilinear"])
def test_tiny_checkpoint_models_come_from_the_factory_unchanged(model_type):
    """build_tiny_model's configs and seeding give the same weights as constructing the classes by hand."""
    direct = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)),
        "bilinear": lambda: BilinearForCausalLM(BilinearConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, state_size=8, rank=8,
            intermediate_size=64, norm_chunk_size=16)),
    }[model_type]
    tiny = build_tiny_model(model_type, 50, seed=3)
    torch.manual_seed(3)
    assert not tiny.training and same_weights(tiny, direct())
    assert build_tiny_model(model_type, 50, num_hidden_layers=1).config.num_hidden_layers == 1


def test_factory_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model_type 'gru'; choose one of"):
        build_model("gru", BILINEAR, 37)
    with pytest.raises(ValueError, match=r"lstm config: unknown key\(s\) \['num_heads'\]"):
        build_model("lstm", {"hidden_size": 8, "num_heads": 2}, 37, match_bilinear=False)
    with pytest.raises(ValueError, match="model_type must be one of \\['bilinear', 'llama'\\], got 'mamba'"):
        build_tiny_model("mamba", 50)


# ---------------------------------------------------------------------------------- the peers (issue 47)
GUTENBERG_SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4, "state_size": 64, "rank": 64}
HYBRID = {**GUTENBERG_SHAPE, "layer_types": ["bilinear", "bilinear", "bilinear", "full_attention"]}


@pytest.mark.parametrize("model_type, shape, vocab", [
    ("gated_deltanet", GUTENBERG_SHAPE, 8192), ("gated_deltanet", HYBRID, 8192), ("mamba2", GUTENBERG_SHAPE, 8192),
    ("gated_deltanet", BILINEAR, 37), ("mamba2", BILINEAR, 37)])
def test_peers_match_the_bilinear_parameter_count_within_5_percent(model_type, shape, vocab):
    from bilinear_lm.baselines import count_parameters

    with torch.device("meta"):
        target = count_parameters(build_model("bilinear", shape, vocab))
        peer = build_model(model_type, shape, vocab)
    assert abs(count_parameters(peer) / target - 1) < 0.05
    if model_type == "gated_deltanet":  # its layout is the bilinear one: Gated DeltaNet where bilinear layers are
        expected = ["full_attention" if t == "full_attention" else "linear_attention"
                    for t in shape.get("layer_types", ["bilinear"] * shape["num_hidden_layers"])]
        assert peer.config.layer_types == expected


@pytest.mark.parametrize("layer_types", [["bilinear", "bilinear"], ["bilinear", "full_attention"]])
def test_the_negative_eigenvalue_adapter_doubles_beta_and_changes_nothing_else(monkeypatch, layer_types):
    """Gated DeltaNet[-1,1] (``allow_neg_eigval``) against the same weights without it: the first layer's call of
    transformers' delta rule gets the same queries, keys, values, gates and state, and twice the beta
    (2 sigmoid(b) in (0, 2)); every layer calls it once; the outputs differ; the rules are restored after each
    forward."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rules = {name: getattr(modeling_qwen3_5, name)
             for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
    calls = []
    for name, rule in rules.items():
        def recording(*args, _rule=rule, **kwargs):
            calls.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            return _rule(*args, **kwargs)

        monkeypatch.setattr(modeling_qwen3_5, name, recording)
    shape = {**BILINEAR, "layer_types": layer_types}
    torch.manual_seed(0)
    plain = build_model("gated_deltanet", shape, 37)
    torch.manual_seed(0)
    negative = build_model("gated_deltanet", {**shape, "allow_neg_eigval": True}, 37)
    assert same_weights(plain, negative) and negative.config.allow_neg_eigval
    ids = torch.randint(0, 37, (2, 11))
    with torch.no_grad():
        plain_logits, negative_logits = plain(ids).logits, negative(ids).logits
    half = len(calls) // 2
    assert half == layer_types.count("bilinear") and len(calls) == 2 * half
    before, after = calls[0], calls[half]  # the first layer's: the same input in both models (later ones differ)
    assert before.keys() == after.keys() and "beta" in before
    assert torch.equal(after["beta"], 2 * before["beta"]) and bool((after["beta"] > 1).any())
    assert all(torch.equal(before[k], after[k]) for k in before if k != "beta")
    assert not torch.allclose(plain_logits, negative_logits)
    assert all(getattr(modeling_qwen3_5, name).__name__ == "recording" for name in rules)  # swapped back


def test_gated_deltanet_starts_with_the_papers_time_steps_so_its_state_remembers():
    """Every Gated DeltaNet layer's ``dt_bias`` is the inverse softplus of a step log-uniform in [1e-3, 0.1] (the
    Gated DeltaNet paper's code), not Qwen3.5's 1; ``A`` stays transformers' U(0.01, 16). So at init (``a = 0``) a
    head keeps ``exp(-A dt)`` of its state per token: above exp(-1.6) for every head, where ``dt_bias = 1`` keeps
    ``exp(-1.31 A)``, about e^-10 for a typical A of 8 and e^-21 at worst."""
    import math

    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    model = build_model("gated_deltanet", dict(hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
                                               linear_num_key_heads=64, linear_num_value_heads=256,
                                               linear_key_head_dim=4, linear_value_head_dim=4, intermediate_size=64,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=16), 37,
                        match_bilinear=False)
    layers = [m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]
    assert len(layers) == 2
    for layer in layers:
        dt = F.softplus(layer.dt_bias.double())
        assert bool((dt >= 1e-3 * (1 - 1e-6)).all() and (dt <= 0.1 * (1 + 1e-6)).all())
        log_dt = dt.log()  # log-uniform: its mean and spread are the uniform's on [log 1e-3, log 0.1]
        assert abs(log_dt.mean().item() - math.log(1e-2)) < 0.25 and abs(log_dt.std().item() - 4.6052 / 12 ** 0.5) < 0.2
        A = layer.A_log.double().exp()
        assert bool((A >= 0.01 - 1e-6).all() and (A <= 16 + 1e-5).all()) and A.max() > 12
        assert bool(((-A * dt).exp() > math.exp(-1.6) - 1e-9).all())
    assert not torch.equal(layers[0].dt_bias, layers[1].dt_bias)


def test_dt_bias_init_qwen3_5_is_transformers_model_as_transformers_builds_it_and_the_paper_differs_in_dt_bias_only():
    """``dt_bias_init="qwen3_5"``: every weight equals that of transformers' own ``Qwen3_5ForCausalLM`` built from the
    same keys and seed (``dt_bias`` 1 included); the default (the paper's) differs from it in ``dt_bias`` alone. A value
    not known, or the key on another model type, is a one-line error."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from bilinear_lm import GATED_DELTANET_OPTIONS
    from bilinear_lm.baselines import GatedDeltaNetConfig

    keys = dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=37)
    torch.manual_seed(0)
    theirs = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**keys)).state_dict()
    for init, differing in (("qwen3_5", set()), ("paper", {"model.layers.0.linear_attn.dt_bias"})):
        torch.manual_seed(0)
        ours = build_model("gated_deltanet", {**keys, "dt_bias_init": init}, 37, match_bilinear=False).state_dict()
        assert ours.keys() == theirs.keys()
        assert {k for k in ours if not torch.equal(ours[k], theirs[k])} == differing, init
    assert bool((theirs["model.layers.0.linear_attn.dt_bias"] == 1).all())
    assert {key: getattr(GatedDeltaNetConfig(), key) for key in GATED_DELTANET_OPTIONS} == GATED_DELTANET_OPTIONS
    with pytest.raises(ValueError, match=r"^dt_bias_init must be one of \('paper', 'qwen3_5'\), got 'ones'$"):
        build_model("gated_deltanet", {**BILINEAR, "dt_bias_init": "ones"}, 37)
    with pytest.raises(ValueError, match="^dt_bias_init is a gated_deltanet option; mamba2 has no such setting$"):
        build_model("mamba2", {**BILINEAR, "dt_bias_init": "qwen3_5"}, 37)


@pytest.mark.parametrize("model_type, extra", [("gated_deltanet", {}), ("gated_deltanet", {"allow_neg_eigval": True}),
                                               ("gated_deltanet", {"layer_types": ["bilinear", "full_attention"]}),
                                               ("mamba2", {})])
def test_a_peer_trains_every_parameter_generates_as_an_argmax_loop_and_reloads(model_type, extra, tmp_path):
    """One training step reaches every parameter (an all-linear Qwen3.5 raised in training in transformers);
    greedy generate() with its cache equals re-running the whole sequence (it raised without an attention layer);
    save_pretrained and the Auto classes give the same model back, the [-1,1] adapter included."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = build_model(model_type, {**BILINEAR, **extra}, 37).train()
    ids = torch.randint(0, 37, (2, 13))
    model(ids, labels=ids).loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    model.eval()
    generated = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False)
    loop = ids[:, :5]
    with torch.no_grad():
        for _ in range(6):
            loop = torch.cat([loop, model(loop, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, loop)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is type(model) and same_weights(reloaded, model)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_a_deep_copy_of_gated_deltanet_with_negative_eigenvalues_is_the_same_model_and_a_failed_forward_restores(
        monkeypatch):
    """The [-1,1] adapter lives in module hooks: a deep copy (as checkpoints and model selection make) computes what
    the original did, on its own weights; transformers' delta rule is back after a forward that raised inside it."""
    import copy

    from transformers.models.qwen3_5 import modeling_qwen3_5

    torch.manual_seed(0)
    model = build_model("gated_deltanet", {**BILINEAR, "allow_neg_eigval": True}, 37).eval()
    ids = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        twin = copy.deepcopy(model)
        for module in model.modules():  # change the original: its copy must not follow it
            if hasattr(module, "A_log"):
                module.A_log.add_(1.0)
        torch.testing.assert_close(twin(ids).logits, expected)
        assert not torch.allclose(model(ids).logits, expected)

    def failing(*args, **kwargs):
        raise RuntimeError("the rule failed")

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", failing)
    with pytest.raises(RuntimeError, match="the rule failed"):
        model(ids)
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is failing
