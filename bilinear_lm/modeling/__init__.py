"""Modeling code. ``save_pretrained`` copies the config and model modules and their relative imports (not this
``__init__``) as remote code, so these modules import only torch, transformers and each other."""

from .cache_bilinear import BilinearCache, BilinearStaticCache
from .configuration_bilinear import BilinearConfig
from .modeling_bilinear import BilinearForCausalLM, BilinearModel, BilinearPreTrainedModel

__all__ = ["BilinearCache", "BilinearConfig", "BilinearForCausalLM", "BilinearModel", "BilinearPreTrainedModel",
           "BilinearStaticCache"]
