"""The one model factory: the bilinear LM or a peer (Llama, Gated DeltaNet, Mamba2, Mamba, an LSTM LM) from
(model_type, config dict, vocab size).

    model = build_model("bilinear", {"hidden_size": 128, "num_hidden_layers": 4, ...}, vocab_size=65)
    model = build_model("llama", same_dict, vocab_size=65)      # a Llama with ~ the same parameter count
    model = build_model("gated_deltanet", {**same_dict, "allow_neg_eigval": True}, 65)   # Gated DeltaNet[-1,1]
    model = build_model("llama", {"hidden_size": 32, "num_hidden_layers": 1, ...}, 65, match_bilinear=False)

By default (``match_bilinear=True``: train.py, the benchmarks) the config dict is a *bilinear* config and
the baselines keep its depth and embedding tying and solve for the width (and the MLP width) whose *exact*
parameter count (a meta-device instantiation, no memory) is closest to the bilinear model's; Gated DeltaNet also
keeps its layer layout (a bilinear ``layer_types`` with ``full_attention`` entries becomes Qwen3.5's hybrid of
``linear_attention`` and ``full_attention`` layers). With ``match_bilinear=False`` (the probes, the tiny test
checkpoints) the dict is the model's own config: ``LlamaConfig`` / ``Qwen3_5TextConfig`` / ``Mamba2Config`` /
``MambaConfig`` keys, or ``hidden_size`` / ``num_layers`` for the LSTM. Gated DeltaNet's own keys, either way
(``GATED_DELTANET_OPTIONS``): ``allow_neg_eigval`` gives its [-1, 1] form, ``dt_bias_init`` its initialization.

The peers are transformers' own models: Gated DeltaNet is ``Qwen3_5ForCausalLM`` (the text model of Qwen3.5, whose
``linear_attention`` layers are Gated DeltaNet) behind :class:`GatedDeltaNetForCausalLM`, a thin adapter
(``bilinear_lm/modeling/modeling_gated_deltanet.py``, saved with the model as remote code); Mamba2 is
``Mamba2ForCausalLM`` as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaConfig, LlamaForCausalLM,
                          Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM, PreTrainedConfig,
                          PreTrainedModel)
from transformers.modeling_outputs import CausalLMOutput

from . import GATED_DELTANET_OPTIONS, MODEL_TYPES
from .modeling.configuration_bilinear import swiglu_width
from .modeling.configuration_gated_deltanet import GatedDeltaNetConfig
from .modeling.modeling_gated_deltanet import GatedDeltaNetForCausalLM


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups ``[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
    "weight_decay": 0.0}]`` (nanoGPT's ``configure_optimizers``) for any model of ``build_model``: the bilinear LM's
    rules (:func:`bilinear_optimizer_groups`), else weight decay on ``nn.Linear`` / ``nn.Embedding`` weights only
    (not on norms, biases, convolutions, recurrent weights or SSM parameters). Tied weights appear once; frozen ones
    are left out."""
    from .modeling.modeling_bilinear import BilinearPreTrainedModel

    if isinstance(model, BilinearPreTrainedModel):
        return bilinear_optimizer_groups(model, weight_decay)
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            is_matrix = isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight"
            (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def bilinear_optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The bilinear LM's AdamW groups. Decayed: the projection and embedding matrices (``nn.Linear`` /
    ``nn.Embedding`` weights), the transitions' weights but their ``factor_bias`` (the input factors' offset, 1 at
    init) and the short convolution's weight. Not decayed: norm weights (including the state norm's scale),
    ``factor_bias``, ``h_start`` (the output is invariant to its scale), the memory heads' decay parameters
    (``A_log``, ``dt_bias``) and linear biases. A parameter that no rule names is an error, so a new one gets a
    decision."""
    from .modeling.modeling_bilinear import (BilinearMemory, BilinearMixer, BilinearRMSNorm, BilinearShortConv,
                                             BilinearStateNorm)
    from .modeling.transitions import Transition

    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if (isinstance(module, (nn.Linear, nn.Embedding, BilinearShortConv)) and name == "weight") or \
                    (isinstance(module, Transition) and name != "factor_bias"):
                decay.append(param)
            elif (isinstance(module, (BilinearRMSNorm, BilinearStateNorm)) and name == "weight") or \
                    (isinstance(module, Transition) and name == "factor_bias") or \
                    (isinstance(module, BilinearMixer) and name == "h_start") or \
                    (isinstance(module, BilinearMemory) and name in ("A_log", "dt_bias")) or \
                    (isinstance(module, nn.Linear) and name == "bias"):
                no_decay.append(param)
            else:
                raise ValueError(f"optimizer_groups: no weight-decay rule for parameter "
                                 f"{module_name + '.' if module_name else ''}{name}; add one")
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


def mamba2_keys(hidden: int, heads: int, layers: int, tie: bool, **overrides) -> dict:
    """``Mamba2Config`` keys (but ``vocab_size``) of the Mamba2 peer: ``2 * heads`` heads of ``hidden / heads``
    (expand 2), state 64, one group, convolution 4; ``overrides`` (``chunk_size``, ``use_cache``) on top. The factory,
    the probes and the recall harness all size it here."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_heads=2 * heads, head_dim=hidden // heads, expand=2,
                state_size=64, n_groups=1, conv_kernel=4, tie_word_embeddings=tie, pad_token_id=None,
                bos_token_id=None, eos_token_id=None, **overrides)


# a bilinear layer type -> Qwen3.5's (its linear_attention layers are Gated DeltaNet)
GATED_DELTANET_LAYER_TYPES = {"bilinear": "linear_attention", "full_attention": "full_attention"}


def gated_deltanet_keys(hidden: int, heads: int, layer_types: list[str], tie: bool, **overrides) -> dict:
    """``GatedDeltaNetConfig`` keys (but ``vocab_size``) of the Gated DeltaNet peer: layers of ``heads`` key heads of
    ``hidden / (2 heads)`` and value heads of ``hidden / heads`` (values twice the keys, as the paper's), convolution
    4, the bilinear MLP's width; the bilinear ``layer_types`` mapped by ``GATED_DELTANET_LAYER_TYPES`` (attention:
    ``heads`` heads of ``hidden / heads``); ``overrides`` (``allow_neg_eigval``, ``intermediate_size``, ...) on top.
    The factory, the probes and the recall harness all size it here."""
    unknown = sorted(set(layer_types) - set(GATED_DELTANET_LAYER_TYPES))
    if unknown:
        raise ValueError(f"gated_deltanet: layer type(s) {unknown} have no Qwen3.5 counterpart; use "
                         f"{sorted(GATED_DELTANET_LAYER_TYPES)}")
    return {**dict(hidden_size=hidden, intermediate_size=swiglu_width(hidden), num_hidden_layers=len(layer_types),
                   layer_types=[GATED_DELTANET_LAYER_TYPES[t] for t in layer_types], num_attention_heads=heads,
                   num_key_value_heads=heads, head_dim=hidden // heads, linear_num_key_heads=heads,
                   linear_num_value_heads=heads, linear_key_head_dim=hidden // (2 * heads),
                   linear_value_head_dim=hidden // heads, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                   tie_word_embeddings=tie), **overrides}


def matched_baseline_config(model_type: str, bilinear_config_dict: dict, vocab_size: int):
    """The config of a ``llama``, ``gated_deltanet``, ``mamba2`` or ``mamba`` model with the bilinear model's depth
    (Gated DeltaNet: its layer layout) and ~its parameter count; ``GATED_DELTANET_OPTIONS`` in the dict are Gated
    DeltaNet's."""
    if model_type not in ("llama", "gated_deltanet", "mamba2", "mamba"):
        raise ValueError(f"matched_baseline_config: model_type must be 'llama', 'gated_deltanet', 'mamba2' or "
                         f"'mamba', got {model_type!r}")
    from bilinear_lm import BilinearForCausalLM

    bilinear_config_dict = dict(bilinear_config_dict)
    options = {key: bilinear_config_dict.pop(key) for key in GATED_DELTANET_OPTIONS if key in bilinear_config_dict}
    bcfg = bilinear_config(bilinear_config_dict, vocab_size)
    target = _meta_count(BilinearForCausalLM, bcfg)
    layers, tie = bcfg.num_hidden_layers, bcfg.tie_word_embeddings
    heads = bcfg.num_heads
    if model_type == "llama":
        step = heads * 2 if heads > 1 else 2  # head_dim even for rotary embeddings
        make = lambda h: _llama_config(h, heads, layers, vocab_size, tie)  # noqa: E731
        cls = LlamaForCausalLM
    elif model_type == "gated_deltanet":
        step = 2 * heads  # key heads of hidden / (2 heads); attention heads even for rotary embeddings
        make = lambda h: GatedDeltaNetConfig(vocab_size=vocab_size, **gated_deltanet_keys(  # noqa: E731
            h, heads, bcfg.layer_types, tie, **options))
        cls = GatedDeltaNetForCausalLM
    elif model_type == "mamba2":
        step = heads
        make = lambda h: Mamba2Config(vocab_size=vocab_size, **mamba2_keys(h, heads, layers, tie))  # noqa: E731
        cls = Mamba2ForCausalLM
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
    """``bilinear`` -> BilinearForCausalLM(model_config); ``llama`` / ``gated_deltanet`` / ``mamba2`` / ``mamba`` /
    ``lstm`` -> that model, sized to match the bilinear model of ``model_config`` (``match_bilinear=True``) or built
    from ``model_config`` itself."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; choose one of {MODEL_TYPES}")
    if model_type != "gated_deltanet":
        for key, default in GATED_DELTANET_OPTIONS.items():
            if model_config.get(key, default) != default:
                raise ValueError(f"{key} is a gated_deltanet option; {model_type} has no such setting")
        model_config = {k: v for k, v in model_config.items() if k not in GATED_DELTANET_OPTIONS}
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
                             "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
                             "mamba2": (Mamba2Config, Mamba2ForCausalLM),
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


# after `import bilinear_lm.baselines`, Auto classes load a saved LSTM LM (e.g. train.py --model_type lstm output) and
# a saved Gated DeltaNet with its adapter; a saved Gated DeltaNet also carries the adapter as remote code
AutoConfig.register(LSTMConfig.model_type, LSTMConfig, exist_ok=True)
AutoModelForCausalLM.register(LSTMConfig, LSTMLanguageModel, exist_ok=True)
AutoConfig.register(GatedDeltaNetConfig.model_type, GatedDeltaNetConfig, exist_ok=True)
AutoModelForCausalLM.register(GatedDeltaNetConfig, GatedDeltaNetForCausalLM, exist_ok=True)
GatedDeltaNetConfig.register_for_auto_class()
GatedDeltaNetForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def matched_lstm(bilinear_config_dict: dict, vocab_size: int) -> LSTMLanguageModel:
    """An LSTM LM with the bilinear model's depth and about its parameter count (width solved in closed form)."""
    from bilinear_lm import BilinearForCausalLM

    bcfg = bilinear_config(bilinear_config_dict, vocab_size)
    target, layers = _meta_count(BilinearForCausalLM, bcfg), bcfg.num_hidden_layers
    # params(d) = 8 d^2 L + 8 d L (LSTM) + 2 V d + V (embedding, head)
    a, b, c = 8 * layers, 8 * layers + 2 * vocab_size, vocab_size - target
    width = max(1, round((-b + (b * b - 4 * a * c) ** 0.5) / (2 * a)))
    return LSTMLanguageModel(LSTMConfig(vocab_size=vocab_size, hidden_size=width, num_layers=layers))
