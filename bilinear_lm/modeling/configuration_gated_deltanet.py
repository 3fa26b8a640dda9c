"""Configuration of the Gated DeltaNet peer (``bilinear_lm.baselines``): transformers' Qwen3.5 text config and two keys
of its own. Saved with the model as remote code (``modeling_gated_deltanet.py``)."""
from transformers import Qwen3_5TextConfig


class GatedDeltaNetConfig(Qwen3_5TextConfig):
    """``Qwen3_5TextConfig`` (its ``linear_attention`` layers are Gated DeltaNet) plus ``allow_neg_eigval``: the delta
    rule's ``beta = 2 sigmoid(b)`` in (0, 2), so the transition ``I - beta k k^T`` has eigenvalues in (-1, 1]
    (Gated DeltaNet[-1,1], Grazzi et al., ICLR 2025), instead of ``sigmoid(b)``; and ``dt_bias_init``: ``"paper"``
    (the Gated DeltaNet paper's draw, :class:`GatedDeltaNetForCausalLM`) or ``"qwen3_5"`` (transformers' Qwen3.5
    initialization, ``dt_bias = 1``)."""

    model_type = "gated_deltanet"

    allow_neg_eigval: bool = False
    dt_bias_init: str = "paper"


DT_BIAS_INITS = ("paper", "qwen3_5")
