"""The probe model zoo: a model name -> a model that maps token ids to class scores.

Every model maps token ids to logits and the first ``num_classes`` logits are the class scores, so the
vocabulary is sized max(num_symbols, num_classes) and untied. Models are built by the library's one factory,
``bilinear_lm.baselines.build_model``, from explicit configs (the probe grid fixes depth and width):

- ``bilinear-<mixer>`` for mixer in cp, full, block_diagonal, rotation, diagonal, positive_diagonal:
  BilinearForCausalLM(num_hidden_layers=1, use_mlp=False, num_heads=1) = the paper's minimal model (embedding ->
  one bilinear recurrence -> linear readout of the normalized state); ``gate=True`` adds the LM's output gate,
  ``memory_heads`` memory heads beside the tracking head.
- ``hybrid-N`` (N >= 4): N of those ``bilinear-cp`` layers with every fourth a full-attention layer (``num_heads``
  heads, RoPE; ``interleaved_layer_types(N, 4)``, the 3:1 of Qwen3-Next and Kimi Linear; sliding-window attention
  with ``attention_window``, without rotary embeddings with ``attention_rope=False``): does attention disturb length
  generalization? ``stack-N``: the same N layers all ``bilinear-cp``, its control at equal depth.
- ``lstm``: torch.nn.LSTM (``lstm-2`` for two layers).
- ``transformer-N``: LlamaForCausalLM with N layers (RoPE, ``num_heads`` heads).
- ``mamba-N``: MambaForCausalLM with N layers.
- ``gated_deltanet-N``: Gated DeltaNet with N layers (``bilinear_lm.baselines.GatedDeltaNetForCausalLM``,
  transformers' Qwen3.5 text model; ``num_heads`` heads, keys of ``hidden / (2 heads)``, values of
  ``hidden / heads``); ``gated_deltanet_neg-N`` its [-1, 1] form (``allow_neg_eigval``).
- ``mamba2-N``: Mamba2ForCausalLM with N layers (``2 num_heads`` heads of ``hidden / num_heads``, state 64).
"""
from __future__ import annotations

import torch
from torch import nn

from ..baselines import build_model, gated_deltanet_keys, mamba2_keys
from ..modeling.configuration_bilinear import MIXER_TYPES, interleaved_layer_types
from ..modeling.transitions import TRANSITIONS
from .config import ProbeConfig
from .tasks import Task

MODEL_NAMES = tuple(f"bilinear-{m}" for m in MIXER_TYPES) + (
    "hybrid-4", "stack-4", "lstm", "lstm-2", "transformer-1", "transformer-2", "transformer-4", "mamba-1", "mamba-2",
    "mamba-4", "gated_deltanet-1", "gated_deltanet-2", "gated_deltanet_neg-1", "gated_deltanet_neg-2", "mamba2-1",
    "mamba2-2")


def model_spec(name: str, config: ProbeConfig, num_symbols: int = 2) -> tuple[str, dict]:
    """Model name -> (model_type, config dict without vocab_size) for ``baselines.build_model``.
    An unknown name raises ValueError listing the known ones."""
    H = config.hidden_size
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}; choose one of {list(MODEL_NAMES)}")
    if name.startswith("bilinear-"):
        mixer = name.split("-", 1)[1]
        if mixer not in MIXER_TYPES:
            raise ValueError(f"unknown bilinear mixer {mixer!r}; choose one of {list(MIXER_TYPES)}")
        memory = dict(memory_heads=config.memory_heads, memory_key_size=config.memory_size,
                      memory_value_size=config.memory_size) if config.memory_heads else {}
        cfg = dict(hidden_size=H, num_hidden_layers=1, num_heads=1, state_size=config.state_size, mixer_type=mixer,
                   use_mlp=False, use_gate=config.gate, tie_word_embeddings=False, **memory,
                   **TRANSITIONS[mixer].probe_overrides(config, num_symbols))  # each type's defaults (rank, ...)
        return "bilinear", cfg
    if name in ("lstm", "lstm-2"):
        return "lstm", dict(hidden_size=H, num_layers=2 if name == "lstm-2" else 1)
    kind, _, layers = name.partition("-")
    if kind == "stack" and layers.isdigit() and int(layers) >= 1:
        _, cfg = model_spec("bilinear-cp", config, num_symbols)
        return "bilinear", {**cfg, "num_hidden_layers": int(layers)}
    if kind == "hybrid" and layers.isdigit() and int(layers) >= 4:
        _, cfg = model_spec(f"stack-{layers}", config, num_symbols)  # the stack, every fourth layer attention
        heads = config.num_heads
        if H % heads:
            raise ValueError(f"hidden_size {H} must be divisible by num_heads {heads} for attention layers")
        if config.attention_window is None:
            kind, window = "full_attention", {}
        else:
            kind, window = "sliding_attention", {"sliding_window": config.attention_window}
        return "bilinear", {**cfg, "layer_types": interleaved_layer_types(int(layers), 4, kind),
                            "num_attention_heads": heads, "num_key_value_heads": heads,
                            "use_rope": config.attention_rope, **window}
    if kind in ("transformer", "mamba", "gated_deltanet", "gated_deltanet_neg", "mamba2") and layers.isdigit() \
            and int(layers) >= 1:
        L, heads = int(layers), config.num_heads
        if kind != "mamba" and H % (2 * heads if kind.startswith("gated") else heads):
            raise ValueError(f"hidden_size {H} must be divisible by {'2 x ' if kind.startswith('gated') else ''}"
                             f"num_heads {heads} for {kind}")
        if kind.startswith("gated_deltanet"):
            return "gated_deltanet", gated_deltanet_keys(H, heads, ["bilinear"] * L, tie=False, intermediate_size=4 * H,
                                                         use_cache=False, allow_neg_eigval=kind.endswith("_neg"))
        if kind == "mamba2":  # chunks of 32: transformers' 256 pads every short probe sequence to 256
            return "mamba2", mamba2_keys(H, heads, L, tie=False, chunk_size=32, use_cache=False)
        if kind == "transformer":
            return "llama", dict(hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L, num_attention_heads=heads,
                                 num_key_value_heads=heads, max_position_embeddings=max(2048, config.max_length + 1),
                                 tie_word_embeddings=False, use_cache=False)
        return "mamba", dict(hidden_size=H, state_size=16, num_hidden_layers=L, expand=2, tie_word_embeddings=False,
                             use_cache=False)
    raise ValueError(f"unknown model {name!r}; choose one of {list(MODEL_NAMES)} (transformer-N / mamba-N / "
                     "gated_deltanet[_neg]-N / mamba2-N / stack-N take any N, hybrid-N any N >= 4)")


def build_probe_model(name: str, task: Task, config: ProbeConfig) -> tuple[nn.Module, dict]:
    """Model ``name`` sized for ``task`` -> (model, its config as results record it, incl. model_type and vocab_size)."""
    vocab = max(task.vocab_size, task.num_classes)
    model_type, cfg = model_spec(name, config, task.vocab_size)
    model = build_model(model_type, cfg, vocab, match_bilinear=False)
    return model, {"model_type": model_type, "vocab_size": vocab, **cfg}


def class_logits(model, tokens: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Class scores ``[B, T, num_classes]`` (fp32) of a probe model."""
    return model(input_ids=tokens, use_cache=False).logits[..., :num_classes].float()
