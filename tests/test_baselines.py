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
