"""bilinear-lm: bilinear recurrent language models native to the HuggingFace stack.

Importing the package registers model_type ``"bilinear"`` with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, and marks the classes so that ``save_pretrained`` copies the modeling code
(loadable later with ``trust_remote_code=True`` where this package is not installed). The model classes load on
first use (see :mod:`bilinear_lm.modeling`), so the import itself costs torch and transformers' configuration only.
"""
from . import modeling
from .modeling import BilinearConfig

__version__ = "0.1.0"
MODEL_TYPES = ("bilinear", "llama", "gated_deltanet", "mamba2", "mamba", "lstm")  # what baselines.build_model builds
# Gated DeltaNet's own model-config keys (modeling.configuration_gated_deltanet.GatedDeltaNetConfig), beside the
# bilinear ones, and their defaults
GATED_DELTANET_OPTIONS = {"allow_neg_eigval": False, "dt_bias_init": "paper"}
_MODEL_CLASSES = ["BilinearCache", "BilinearForCausalLM", "BilinearModel", "BilinearPreTrainedModel"]
__all__ = ["BilinearConfig", "MODEL_TYPES", *_MODEL_CLASSES]


def __getattr__(name):
    if name not in _MODEL_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(modeling, name)
