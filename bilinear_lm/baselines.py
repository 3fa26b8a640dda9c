"""The one model factory: the bilinear LM, Llama, Mamba or an LSTM LM from (model_type, config dict, vocab size).

    model = build_model("bilinear", {"hidden_size": 128, "num_hidden_layers": 4, ...}, vocab_size=65)
    model = build_model("llama", same_dict, vocab_size=65)      # a Llama with ~ the same parameter count
    model = build_model("llama", {"hidden_size": 32, "num_hidden_layers": 1, ...}, 65, match_bilinear=False)

By default (``match_bilinear=True``: train.py, the benchmarks) the config dict is a *bilinear* config and
the baselines keep its depth and embedding tying and solve for the width (and the MLP width) whose *exact*
parameter count (a meta-device instantiation, no memory) is closest to the bilinear model's. With
``match_bilinear=False`` (the probes, the tiny test checkpoints) the dict is the model's own config:
``LlamaConfig`` / ``MambaConfig`` keys, or ``hidden_size`` / ``num_layers`` for the LSTM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaConfig, LlamaForCausalLM,
                          MambaConfig, MambaForCausalLM, PreTrainedConfig, PreTrainedModel)
from transformers.modeling_outputs import CausalLMOutput

from .modeling.configuration_bilinear import swiglu_width

MODEL_TYPES = ("bilinear", "llama", "mamba", "lstm")


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups ``[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
    "weight_decay": 0.0}]`` for any model of ``build_model``: the model's own ``optimizer_groups`` when it has one
    (the bilinear LM), else weight decay on ``nn.Linear`` / ``nn.Embedding`` weights only (not on norms, biases,
    convolutions, recurrent weights or SSM parameters). Tied weights appear once; frozen ones are left out."""
    if hasattr(model, "optimizer_groups"):
        return model.optimizer_groups(weight_decay)
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            is_matrix = isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight"
            (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _meta_count(model_cls, config) -> int:
    with torch.device("meta"):
        return count_parameters(model_cls(config))


def bilinear_config(model_config: dict, vocab_size: int):
    from bilinear_lm import BilinearConfig

    return BilinearConfig(**{**model_config, "vocab_size": vocab_size})


def _llama_config(hidden: int, heads: int, layers: int, vocab_size: int, tie: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=swiglu_width(hidden),  # the bilinear MLP's
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=4096, tie_word_embeddings=tie, attention_dropout=0.0,
    )


def _mamba_config(hidden: int, layers: int, vocab_size: int, tie: bool) -> MambaConfig:
    return MambaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, state_size=16,
                       expand=2, conv_kernel=4, tie_word_embeddings=tie, pad_token_id=None,
                       bos_token_id=None, eos_token_id=None)


def matched_baseline_config(model_type: str, bilinear_config_dict: dict, vocab_size: int):
    """A LlamaConfig / MambaConfig with the bilinear model's depth and ~its parameter count."""
    if model_type not in ("llama", "mamba"):
        raise ValueError(f"matched_baseline_config: model_type must be 'llama' or 'mamba', got {model_type!r}")
    from bilinear_lm import BilinearForCausalLM

    bcfg = bilinear_config(bilinear_config_dict, vocab_size)
    target = _meta_count(BilinearForCausalLM, bcfg)
    layers, tie = bcfg.num_hidden_layers, bcfg.tie_word_embeddings
    heads = bcfg.num_heads
    if model_type == "llama":
        step = heads * 2 if heads > 1 else 2  # head_dim even for rotary embeddings
        make = lambda h: _llama_config(h, heads, layers, vocab_size, tie)  # noqa: E731
        cls = LlamaForCausalLM
    else:
        step = 8
        make = lambda h: _mamba_config(h, layers, vocab_size, tie)  # noqa: E731
        cls = MambaForCausalLM
    # parameter count is increasing in width: binary search on multiples of `step`, then take the closer
    lo, hi = 1, max(2, 4 * bcfg.hidden_size // step)
    while _meta_count(cls, make(hi * step)) < target:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _meta_count(cls, make(mid * step)) < target:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda k: abs(_meta_count(cls, make(k * step)) - target))
    return make(best * step)


def build_model(model_type: str, model_config: dict, vocab_size: int, *, match_bilinear: bool = True) -> nn.Module:
    """``bilinear`` -> BilinearForCausalLM(model_config); ``llama`` / ``mamba`` / ``lstm`` -> that model, sized to
    match the bilinear model of ``model_config`` (``match_bilinear=True``) or built from ``model_config`` itself."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; choose one of {MODEL_TYPES}")
    if model_type == "bilinear":
        from bilinear_lm import BilinearForCausalLM

        return BilinearForCausalLM(bilinear_config(model_config, vocab_size))
    if model_type == "lstm":
        if match_bilinear:
            return matched_lstm(model_config, vocab_size)
        unknown = sorted(set(model_config) - {"hidden_size", "num_layers"})
        if unknown:
            raise ValueError(f"lstm config: unknown key(s) {unknown}; it takes hidden_size and num_layers")
        return LSTMLanguageModel(LSTMConfig(vocab_size=vocab_size, **model_config))
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "mamba": (MambaConfig, MambaForCausalLM)}[model_type]
    if match_bilinear:
        return model_cls(matched_baseline_config(model_type, model_config, vocab_size))
    return model_cls(config_cls(**{**model_config, "vocab_size": vocab_size}))


class LSTMConfig(PreTrainedConfig):
    """Configuration of :class:`LSTMLanguageModel`: ``vocab_size``, ``hidden_size``, ``num_layers``."""

    model_type = "lstm_lm"

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 1
    tie_word_embeddings: bool = False
    use_cache: bool = False  # no cache: generate() feeds the whole prefix at every step
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None


class LSTMLanguageModel(PreTrainedModel, GenerationMixin):
    """Embedding -> ``torch.nn.LSTM`` -> linear head, an HF causal LM (``save_pretrained``, ``generate``):
    ``forward(input_ids, labels=None) -> .logits`` (and ``.loss``, next-token cross-entropy, with labels)."""

    config_class = LSTMConfig
    _tied_weights_keys = {}

    def __init__(self, config: LSTMConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lstm = nn.LSTM(config.hidden_size, config.hidden_size, num_layers=config.num_layers, batch_first=True)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _init_weights(self, module):
        pass  # torch's own initialization of Embedding, LSTM and Linear

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, labels=None, **_) -> CausalLMOutput:
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)


# after `import bilinear_lm.baselines`, Auto classes load a saved LSTM LM (e.g. train.py --model_type lstm output)
AutoConfig.register(LSTMConfig.model_type, LSTMConfig, exist_ok=True)
AutoModelForCausalLM.register(LSTMConfig, LSTMLanguageModel, exist_ok=True)


def matched_lstm(bilinear_config_dict: dict, vocab_size: int) -> LSTMLanguageModel:
    """An LSTM LM with the bilinear model's depth and about its parameter count (width solved in closed form)."""
    from bilinear_lm import BilinearForCausalLM

    bcfg = bilinear_config(bilinear_config_dict, vocab_size)
    target, layers = _meta_count(BilinearForCausalLM, bcfg), bcfg.num_hidden_layers
    # params(d) = 8 d^2 L + 8 d L (LSTM) + 2 V d + V (embedding, head)
    a, b, c = 8 * layers, 8 * layers + 2 * vocab_size, vocab_size - target
    width = max(1, round((-b + (b * b - 4 * a * c) ** 0.5) / (2 * a)))
    return LSTMLanguageModel(LSTMConfig(vocab_size=vocab_size, hidden_size=width, num_layers=layers))
