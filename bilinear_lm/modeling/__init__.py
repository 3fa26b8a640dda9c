"""Modeling code. ``save_pretrained`` copies the config and model modules and their relative imports (not this
``__init__``) as remote code, so these modules import only torch, transformers and each other.

Importing this package costs only the configuration (``train.py --help`` reads ``BilinearConfig`` without loading
the model stack of transformers). The model classes load on first use: a name taken from this package, or the first
``BilinearConfig`` built, loaded or unpickled (every ``AutoModel*`` path starts from one). Then they register with
``AutoModel`` and ``AutoModelForCausalLM`` and are marked so that ``save_pretrained`` copies the modeling code.
"""
import importlib
import threading

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_bilinear import BilinearConfig

_CLASS_MODULES = {"BilinearCache": "cache_bilinear", "BilinearStaticCache": "cache_bilinear",
                  "BilinearForCausalLM": "modeling_bilinear", "BilinearModel": "modeling_bilinear",
                  "BilinearPreTrainedModel": "modeling_bilinear"}
__all__ = ["BilinearConfig", *_CLASS_MODULES]


_registered = False
_registering = threading.Lock()


def register_model_classes() -> None:
    """Load the model classes and register them with the Auto classes (once, thread-safe; later calls do nothing)."""
    global _registered
    if _registered:
        return
    with _registering:
        if _registered:
            return
        from .modeling_bilinear import BilinearForCausalLM, BilinearModel

        AutoModel.register(BilinearConfig, BilinearModel, exist_ok=True)
        AutoModelForCausalLM.register(BilinearConfig, BilinearForCausalLM, exist_ok=True)
        BilinearModel.register_for_auto_class("AutoModel")
        BilinearForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        _registered = True


def _new_config(cls, *args, **kwargs):
    register_model_classes()
    return object.__new__(cls)


AutoConfig.register(BilinearConfig.model_type, BilinearConfig, exist_ok=True)
BilinearConfig.register_for_auto_class()
# Construction, `from_pretrained`, pickle and deepcopy all call `__new__` (a __new__ once set stays: CPython keeps the
# slot, and object.__new__ refuses arguments behind it).
BilinearConfig.__new__ = staticmethod(_new_config)


def __getattr__(name):
    if name not in _CLASS_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_model_classes()
    return getattr(importlib.import_module(f".{_CLASS_MODULES[name]}", __name__), name)
