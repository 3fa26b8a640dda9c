"""The bilinear model's caches: each bilinear layer's states (:class:`BilinearLayerCache`, and
:class:`BilinearStaticLayerCache` for a compiled decoding step) as transformers' linear-attention cache layers, and
the model's caches (:class:`BilinearCache` on ``DynamicCache``, :class:`BilinearStaticCache` on ``StaticCache``)
built from ``config.layer_types``, with what belongs to the whole model (:class:`BilinearCacheMixin`).

transformers registers a cache layer class under a layer type through ``CacheLayerMixin._layer_type``, for attention
layers only: a linear-attention layer (``LinearAttentionCacheLayerMixin``) has no such hook in 5.23 or 5.24, so this
module adds ``"bilinear"`` to its two mappings itself (``register_layer_type``; tests/test_hybrid.py checks that
``DynamicCache(config)`` and ``StaticCache(config)`` still build these layers from them).

Imported by the modeling code, so it travels with it as remote code (torch and transformers only).
"""

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, DynamicCache,
                                      LinearAttentionLayer, StaticCache, StaticLayer, StaticSlidingWindowLayer)

from .configuration_bilinear import BilinearConfig

# A bilinear layer's cached states (transformers' state_idx): recurrent 0 the tracking heads' state, 1 and 2 the
# memory heads' matrix S and coordinate c; conv 0 the mixer input's window, 1 the memory's queries, keys and values'.
NUMBER_OF_STATES = 3


class BilinearLayerCache(LinearAttentionLayer):
    """A bilinear layer's cache: transformers' ``LinearAttentionLayer`` with the mixer's states as its recurrent
    states (opaque, batch first; ``NUMBER_OF_STATES``) and the short convolutions' windows as its conv states
    (``[batch, channels, width - 1]``, time last as the library keeps conv states), plus ``cumulative_length``, the
    positions consumed.

    Subclassed because ``LinearAttentionLayer`` counts no positions (the chunked normalization's ``offset`` and
    ``get_seq_length`` need the count), marks a state as present only after a conv update (a layer without a
    convolution makes none), and copies each new state into the first one's storage for CUDA graphs, which would break
    backpropagation through a carried state and the dtype of a state that changes with the input's: here a new state
    replaces the old one (so the layer is not compileable; :class:`BilinearStaticLayerCache` is).
    """

    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "number_of_states": NUMBER_OF_STATES})
        self.cumulative_length = 0

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, num_positions: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the state after ``num_positions`` more positions."""
        self.dtype, self.device = recurrent_states.dtype, recurrent_states.device
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = self.has_previous_state[state_idx] = True
        self.cumulative_length += num_positions
        return recurrent_states

    def get_seq_length(self) -> int:
        """Number of positions consumed so far (padding included)."""
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


class BilinearStaticLayerCache(LinearAttentionLayer):
    """A bilinear layer's entry in :class:`BilinearStaticCache`, for a compiled decoding step: transformers'
    ``LinearAttentionLayer`` (fixed buffers allocated at the first update, outside a graph, and written in place,
    marked as static addresses for CUDA graphs), with the positions consumed in a 0-d tensor advanced in place, so
    that a compiled step reads no Python number that changes with the position (it would compile again at every
    token). Inference only: an in-place state carries no gradient from one call to the next."""

    is_compileable = True

    def __init__(self, max_cache_len: int | None = None, **kwargs):  # a state has no length: max_cache_len unused
        super().__init__(**{**kwargs, "number_of_states": NUMBER_OF_STATES})
        self.cumulative_length = torch.tensor(0)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the convolution's new window (the whole window: the model passes its last ``conv_width - 1``
        inputs)."""
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        self.conv_states[state_idx].copy_(conv_states)
        self.has_previous_state[state_idx] = True
        return self.conv_states[state_idx]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, num_positions: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the state after ``num_positions`` more positions."""
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
            self.cumulative_length = self.cumulative_length.to(recurrent_states.device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.cumulative_length)
        self.recurrent_states[state_idx].copy_(recurrent_states)
        self.has_previous_state[state_idx] = True
        self.cumulative_length.add_(num_positions)
        return self.recurrent_states[state_idx]

    def get_seq_length(self) -> int | torch.Tensor:
        """Number of positions consumed so far (padding included): a 0-d tensor once a state is stored."""
        return self.cumulative_length if self.is_recurrent_states_initialized[0] else 0

    def reset(self) -> None:
        super().reset()
        self.cumulative_length.zero_()


def register_layer_type() -> None:
    """``DynamicCache(config)`` builds a :class:`BilinearLayerCache` and ``StaticCache(config, max_cache_len)`` a
    :class:`BilinearStaticLayerCache` for each layer of type ``"bilinear"`` (transformers' mappings from layer types to
    cache layers; see the module docstring)."""
    DYNAMIC_LAYER_TYPE_MAPPING["bilinear"] = BilinearLayerCache
    STATIC_LAYER_TYPE_MAPPING["bilinear"] = BilinearStaticLayerCache


register_layer_type()


class BilinearStaticSlidingWindowLayer(StaticSlidingWindowLayer):
    """A sliding attention layer's entry in :class:`BilinearStaticCache`: the last ``sliding_window - 1`` keys and
    values (what the dynamic layer keeps), right-aligned in fixed buffers, and the count in a 0-d tensor.

    transformers' ``StaticSlidingWindowLayer`` counts in a Python int and branches on it (full or not), which a
    compiled step would specialize on at every position. Here every update is the same code: the keys returned are
    the buffer's ``sliding_window - 1`` followed by the new ones (``get_mask_sizes``: that many, from position
    ``count - (sliding_window - 1)``, negative before the window fills: the model's mask hides those), and the buffer
    keeps the last ``sliding_window - 1`` of them."""

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        StaticLayer.__init__(self, max_cache_len=sliding_window - 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length.add_(key_states.shape[-2])
        keys, values = torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        kept = keys.shape[-2] - self.max_cache_len
        self.keys.copy_(keys[:, :, kept:])
        self.values.copy_(values[:, :, kept:])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | torch.Tensor]:
        return self.max_cache_len + query_length, self.get_seq_length() - self.max_cache_len

    get_seq_length = StaticLayer.get_seq_length  # the tensor count (the parent class's is its Python int)


class BilinearCacheMixin:
    """What :class:`BilinearCache` and :class:`BilinearStaticCache` add to transformers' caches, for what belongs to
    the whole model rather than to a layer, reordered with the layers: ``follows_eos`` (``[batch]`` bool,
    ``reset_state_at_eos``: the last token was EOS) and ``document_start`` (``[batch]`` long: where the current
    document began, which the attention layers' mask needs), both written with :meth:`carry`; the attention layers'
    convolution windows (``attention_conv_windows``: layer index -> ``[batch, conv_width - 1, hidden]``), for which
    transformers' attention cache layers have no place (``conv_window`` / ``set_conv_window`` read and write any
    layer's window); and ``get_seq_length``, which transformers' caches ask of an attention layer, absent from a pure
    bilinear model: here every layer answers."""

    def _init_model_state(self) -> None:
        self.follows_eos: torch.Tensor | None = None
        self.document_start: torch.Tensor | None = None
        self.attention_conv_windows: dict[int, torch.Tensor] = {}

    def _keep(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """What a carried tensor becomes: ``new`` here (the static cache copies it into ``old``'s buffer)."""
        return new

    def carry(self, name: str, value: torch.Tensor) -> None:
        """Store ``follows_eos`` or ``document_start``."""
        setattr(self, name, self._keep(getattr(self, name), value))

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Number of positions consumed so far (padding included)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search): the layers' (transformers' ``reorder_cache``), then the model's state."""
        self._reorder_layers(beam_idx)
        for name in ("follows_eos", "document_start"):
            value = getattr(self, name)
            if value is not None:
                self.carry(name, value.index_select(0, beam_idx.to(value.device)))
        for layer_idx, window in self.attention_conv_windows.items():
            selected = window.index_select(0, beam_idx.to(window.device))
            self.attention_conv_windows[layer_idx] = self._keep(window, selected)

    def crop(self, max_length: int) -> None:
        """Refused: the bilinear layers' recurrent states cannot go back to an earlier position (transformers' crop
        would cut the convolution windows and attention keys only, a cache silently wrong for the next token)."""
        raise NotImplementedError(
            f"{type(self).__name__}.crop: the bilinear layers' recurrent states cannot be rolled back to an earlier "
            "position, so the cache cannot be cropped (assisted decoding is refused for the same reason); run the "
            "tokens up to that position again with a fresh cache")

    def _reorder_layers(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)

    def conv_window(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Layer ``layer_idx``'s convolution window ``state_idx`` (a bilinear layer's 1: its memory heads'),
        ``[batch, width - 1, channels]``, or None before the first."""
        if isinstance(self.layers[layer_idx], LinearAttentionLayer):
            window = self.get_conv_state(layer_idx, state_idx)
            return None if window is None else window.transpose(1, 2)
        return self.attention_conv_windows.get(layer_idx)

    def set_conv_window(self, layer_idx: int, window: torch.Tensor, state_idx: int = 0) -> None:
        """Store layer ``layer_idx``'s convolution window ``state_idx`` (``[batch, width - 1, channels]``)."""
        if isinstance(self.layers[layer_idx], LinearAttentionLayer):
            self.update_conv_state(window.transpose(1, 2), layer_idx, state_idx)  # the library's layout: time last
        else:
            self.attention_conv_windows[layer_idx] = self._keep(self.attention_conv_windows.get(layer_idx), window)


def cache_layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a cache layer holds (transformers' or this module's): a linear-attention layer's recurrent and
    convolution states, an attention layer's keys and values; none before its first update."""
    tensors = [*getattr(layer, "recurrent_states", {}).values(), *getattr(layer, "conv_states", {}).values(),
               getattr(layer, "keys", None), getattr(layer, "values", None)]
    return [t for t in tensors if t is not None]


class BilinearCache(BilinearCacheMixin, DynamicCache):
    """transformers' ``DynamicCache`` built from ``config.layer_types``: a :class:`BilinearLayerCache` per bilinear
    layer, ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` per attention layer (O(1) memory in sequence length
    without full attention), plus the model's own state (:class:`BilinearCacheMixin`). ``generate()`` passes it as
    ``cache`` (``past_key_values`` before transformers 5.24); beam search reorders it in place."""

    def __init__(self, config: BilinearConfig):
        super().__init__(config=config)
        self._init_model_state()


class BilinearStaticCache(BilinearCacheMixin, StaticCache):
    """transformers' ``StaticCache`` built from ``config.layer_types``, what ``generate(...,
    cache_implementation="static")`` builds and runs a compiled decoding step on (on CPU too): a
    :class:`BilinearStaticLayerCache` per bilinear layer, ``StaticLayer`` (``max_cache_len`` keys) per full
    attention layer and :class:`BilinearStaticSlidingWindowLayer` per sliding one, plus the model's state
    (:class:`BilinearCacheMixin`) and ``key_padding`` (``[batch, max_cache_len]`` bool, each position's padding
    mask, which the attention layers' masks read: a compiled step takes only its own positions' mask, of a fixed
    shape). Every tensor lives in a buffer allocated by the first (eager) call and updated in place, positions are
    counted in tensors: a compiled step's program runs at every position. Without attention layers nothing has a
    length: ``max_cache_len`` limits nothing."""

    def __init__(self, config: BilinearConfig, max_cache_len: int, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self.layers = [BilinearStaticSlidingWindowLayer(max_cache_len, config.sliding_window)
                       if isinstance(layer, StaticSlidingWindowLayer) else layer for layer in self.layers]
        self.max_cache_len = max_cache_len
        self.key_padding: torch.Tensor | None = None
        self._init_model_state()

    def _keep(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """Copy ``new`` into ``old``'s buffer (allocated from the first value, outside a graph)."""
        if old is None:
            old = new.clone(memory_format=torch.contiguous_format)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(old)
            return old
        return old.copy_(new)

    def _reorder_layers(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows in every layer's buffers and ``key_padding``, in place (transformers' static layers
        would replace their buffers)."""
        tensors = [] if self.key_padding is None else [self.key_padding]
        for layer in self.layers:
            tensors += cache_layer_tensors(layer)
        for tensor in tensors:
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def visible_keys(self, inputs_embeds: torch.Tensor, mask: torch.Tensor | None, offset: int | torch.Tensor,
                     same_document=None):
        """Record the padding of this call's positions ``offset .. offset + T - 1`` (``mask`` ``[B, T]``, or None:
        none padded) in ``key_padding`` and return the attention layers' mask function (transformers'
        ``and_mask_function``): a key is visible where its position is not padding (nor before the stream: a sliding
        layer's window starts at a negative position until it fills) and, with ``same_document``, in the query's
        document."""
        B, T = inputs_embeds.shape[:2]
        if not torch.compiler.is_compiling() and int(offset) + T > self.max_cache_len:
            raise ValueError(f"BilinearStaticCache: {int(offset) + T} positions do not fit max_cache_len="
                             f"{self.max_cache_len} (the attention layers' key buffers); build the cache larger "
                             "(generate() sizes it to max_length, or pass max_cache_len)")
        new = torch.ones(B, T, dtype=torch.bool, device=inputs_embeds.device) if mask is None else mask.bool()
        if self.key_padding is None:
            self.key_padding = self._keep(None, new.new_zeros(B, self.max_cache_len))
        self.key_padding.index_copy_(1, torch.arange(T, device=new.device) + offset, new)
        padding = self.key_padding

        def visible(batch_idx, head_idx, q_idx, kv_idx):
            seen = (kv_idx >= 0) & padding[batch_idx, kv_idx.clamp(min=0)]
            return seen if same_document is None else seen & same_document(batch_idx, head_idx, q_idx, kv_idx)

        return visible


__all__ = ["BilinearCache", "BilinearLayerCache", "BilinearStaticCache", "BilinearStaticLayerCache"]
