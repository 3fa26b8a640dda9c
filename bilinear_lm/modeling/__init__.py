"""Modeling code; this folder is copied verbatim as remote code by ``save_pretrained``."""

from .configuration_bilinear import BilinearConfig
from .modeling_bilinear import BilinearCache, BilinearForCausalLM, BilinearModel, BilinearPreTrainedModel

__all__ = ["BilinearCache", "BilinearConfig", "BilinearForCausalLM", "BilinearModel", "BilinearPreTrainedModel"]
