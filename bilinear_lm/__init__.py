"""bilinear-lm: bilinear recurrent language models native to the HuggingFace stack.

Importing the package registers model_type ``"bilinear"`` with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, and marks the classes so that ``save_pretrained`` copies the modeling code
(loadable later with ``trust_remote_code=True`` where this package is not installed).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling import BilinearCache, BilinearConfig, BilinearForCausalLM, BilinearModel, BilinearPreTrainedModel

AutoConfig.register(BilinearConfig.model_type, BilinearConfig, exist_ok=True)
AutoModel.register(BilinearConfig, BilinearModel, exist_ok=True)
AutoModelForCausalLM.register(BilinearConfig, BilinearForCausalLM, exist_ok=True)
BilinearConfig.register_for_auto_class()
BilinearModel.register_for_auto_class("AutoModel")
BilinearForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__version__ = "0.1.0"
__all__ = ["BilinearCache", "BilinearConfig", "BilinearForCausalLM", "BilinearModel", "BilinearPreTrainedModel"]
