"""The one place where the transformers versions the project supports (5.23 to 5.25, pyproject.toml) need different
code: 5.24 renamed the cache argument ``past_key_values`` to ``cache`` in every model's ``forward``, in ``generate``'s
model kwargs, in the mask builders and in the output classes' field (``past_key_values`` deprecated there, removal
announced for 5.40). The model's code says ``cache``; this module maps it to the installed version's name.

Imported by the modeling code, so it travels with it as remote code (torch and transformers only).
"""

import functools
import inspect

from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

# The installed version's name of the cache, in model kwargs, mask builders' arguments and outputs' fields.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def takes_cache(forward):
    """Wrap a ``forward(..., cache=None, ...)`` so that it also takes ``past_key_values``: the name 5.23's
    ``generate`` passes (renamed silently there), deprecated from 5.24 (transformers' own decorator warns, as its
    models do)."""
    if CACHE_NAME == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def forward_taking_past_key_values(*args, past_key_values=None, **kwargs):
        if past_key_values is not None:
            if kwargs.get("cache") is not None:
                raise ValueError("pass the cache once: as cache or as past_key_values, not both")
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    # The signature names it too: generate() checks its model kwargs against it (an assistant model's cache).
    signature = inspect.signature(forward)
    parameters = list(signature.parameters.values())
    parameters.insert(len(parameters) - 1, inspect.Parameter("past_key_values", inspect.Parameter.KEYWORD_ONLY,
                                                             default=None))
    forward_taking_past_key_values.__signature__ = signature.replace(parameters=parameters)
    return forward_taking_past_key_values


def cache_argument(model) -> str:
    """The keyword under which ``model.forward`` (any transformers model) takes its cache here: ``cache`` from 5.24;
    on 5.23 ``past_key_values``, or ``cache_params`` for the Mamba models."""
    if CACHE_NAME == "cache":
        return "cache"
    return "cache_params" if "cache_params" in inspect.signature(model.forward).parameters else CACHE_NAME


def returned_cache(outputs):
    """The cache a model's ``forward`` (any transformers model) or ``generate`` returned, under either version's name
    (5.23's Mamba models return ``cache_params``)."""
    cache = getattr(outputs, CACHE_NAME, None)
    if cache is None and CACHE_NAME != "cache":
        cache = getattr(outputs, "cache_params", None)
    return cache
