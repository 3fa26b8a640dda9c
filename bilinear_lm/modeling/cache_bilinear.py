"""The bilinear model's caches: each bilinear layer's states (:class:`BilinearLayerCache`, and
:class:`BilinearStaticLayerCache` for a compiled decoding step) as transformers' linear-attention cache layers, and
the model's caches (:class:`BilinearCache` on ``DynamicCache``, :class:`BilinearStaticCache` on ``StaticCache``)
built from ``config.layer_types``, with what belongs to the whole model (:class:`BilinearCacheMixin`), including
the rollback that assisted decoding needs (:meth:`BilinearCacheMixin.crop`).

transformers registers a cache layer class under a layer type through ``CacheLayerMixin._layer_type``, for attention
layers only: a linear-attention layer (``LinearAttentionCacheLayerMixin``) has no such hook in 5.23 to 5.25, so this
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
    backpropagation through a carried state, the dtype of a state that changes with the input's, and the rollback
    (which keeps earlier states): here a new state replaces the old one (so the layer is not compileable;
    :class:`BilinearStaticLayerCache` is). Its rollback is the model cache's (:meth:`BilinearCacheMixin.crop`).
    """

    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "number_of_states": NUMBER_OF_STATES})
        self.cumulative_length = 0

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the convolution's new window (the whole window: the model passes its last ``conv_width - 1``
        inputs). It replaces the old one, never written in place (a rollback keeps the old one), and
        ``activate_past_recording`` changes nothing here (the model's cache records: :meth:`BilinearCacheMixin.crop`)."""
        self.dtype, self.device = conv_states.dtype, conv_states.device
        self.conv_states[state_idx] = conv_states
        self.is_conv_states_initialized[state_idx] = self.has_previous_state[state_idx] = True
        return conv_states

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
    layer's window); ``get_seq_length``, which transformers' caches ask of an attention layer, absent from a pure
    bilinear model: here every layer answers; and the rollback (:meth:`crop`).

    **Rollback.** A recurrent state cannot be computed backwards, so after ``activate_past_recording()`` (what
    transformers' assisted decoding calls) the cache keeps every state of each of the last ``max_rollback + 1``
    positions: the model hands it, for each forward, the states after each of that forward's last positions
    (:meth:`begin_forward`, :meth:`record`, :meth:`end_forward`); ``crop(-n)`` puts back the states of ``n``
    positions ago, bit for bit, in every layer (tracking and memory heads, convolution windows, ``follows_eos`` and
    ``document_start``; the attention layers' keys by transformers' own crop, or :class:`BilinearStaticCache`'s)."""

    def _init_model_state(self, max_rollback: int) -> None:
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise ValueError(f"{type(self).__name__}(max_rollback={max_rollback!r}): pass how many positions a crop may "
                             "go back, an int >= 0 (default 64)")
        self.follows_eos: torch.Tensor | None = None
        self.document_start: torch.Tensor | None = None
        self.attention_conv_windows: dict[int, torch.Tensor] = {}
        self.max_rollback = max_rollback
        self.recording = False
        self._past: list[tuple[int, dict]] = []  # (positions consumed, {slot: the slot's value then}), oldest first
        self._pending: dict[tuple, torch.Tensor] = {}  # this forward's per-position values, by slot
        self.positions_to_record = 0  # of the current forward: see begin_forward

    def _keep(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """What a carried tensor becomes: ``new`` here (the static cache copies it into ``old``'s buffer)."""
        return new

    def carry(self, name: str, values: torch.Tensor) -> None:
        """Store ``follows_eos`` or ``document_start`` from their values at each of this forward's positions
        (``[batch, T]``): the last one, and the ones a rollback needs."""
        setattr(self, name, self._keep(getattr(self, name), values[:, -1]))
        if self.positions_to_record:
            self.record(("model", name), values[:, -self.positions_to_record:])

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Number of positions consumed so far (padding included)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search): the layers' (transformers' ``reorder_cache``), then the model's state."""
        self._reorder_layers(beam_idx)
        for name in ("follows_eos", "document_start"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, self._keep(value, value.index_select(0, beam_idx.to(value.device))))
        for layer_idx, window in self.attention_conv_windows.items():
            selected = window.index_select(0, beam_idx.to(window.device))
            self.attention_conv_windows[layer_idx] = self._keep(window, selected)
        self._past = [(length, {slot: None if value is None else value.index_select(0, beam_idx.to(value.device))
                                for slot, value in states.items()}) for length, states in self._past]

    # The rollback. A slot names one state: ("state", layer, i) a bilinear layer's recurrent state i, ("window",
    # layer, i) any layer's convolution window i, ("model", name) follows_eos or document_start; in the static cache,
    # ("keys", layer) and ("values", layer) a sliding attention layer's window.

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep the states of the last ``max_rollback + 1`` positions from now on, so that :meth:`crop` can go back
        (transformers calls this before assisted decoding; the attention layers keep their keys until a crop).
        ``recurrent_states_to_keep`` (transformers 5.25 passes how many positions its caller may crop) raises
        ``max_rollback`` to it where it is larger. The layers are not asked to keep states of their own (5.25's
        ``LinearAttentionLayer`` can): this cache's records serve every layer."""
        if recurrent_states_to_keep is not None:
            if isinstance(recurrent_states_to_keep, bool) or not isinstance(recurrent_states_to_keep, int) \
                    or recurrent_states_to_keep < 0:
                raise ValueError(f"activate_past_recording(recurrent_states_to_keep={recurrent_states_to_keep!r}): "
                                 "pass how many positions a crop may go back, an int >= 0")
            self.max_rollback = max(self.max_rollback, recurrent_states_to_keep)
        super().activate_past_recording()
        self.recording = True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many positions back a crop can go now (transformers 5.25 asks before it records): ``max_rollback``
        while recording, else 0; the same for every layer."""
        return self.max_rollback if self.recording else 0

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can put the cache back as it was: once recording."""
        return self.recording

    def begin_forward(self, num_positions: int) -> None:
        """Called by the model before a forward of ``num_positions`` positions: sets ``positions_to_record``, how
        many of the last ones' states the layers should :meth:`record` (0 unless recording)."""
        self._pending = {}
        self.positions_to_record = min(num_positions, self.max_rollback + 1) if self.recording else 0
        if self.positions_to_record and not self._past and self.get_seq_length():  # where recording began
            self._past.append((int(self.get_seq_length()), self._current_states()))

    def record(self, slot: tuple, values: torch.Tensor) -> None:
        """Keep ``values`` (``[batch, P, ...]``): ``slot``'s value after each of this forward's last ``P``
        positions, ``P`` = ``positions_to_record``."""
        self._pending[slot] = values

    def end_forward(self) -> None:
        """Called by the model after a forward: file what the layers recorded by position (a slot that recorded
        nothing kept its value), forget what lies beyond ``max_rollback`` positions back."""
        count = self.positions_to_record
        if not count:
            return
        now, length = self._current_states(), int(self.get_seq_length())
        for j in range(count):
            self._past.append((length - count + 1 + j, {**now, **{slot: values[:, j]
                                                                  for slot, values in self._pending.items()}}))
        del self._past[:-(self.max_rollback + 1)]
        self._pending, self.positions_to_record = {}, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Go back ``-tokens_to_remove`` positions (transformers' convention: a count <= 0), bit for bit, in every
        layer; ``crop(0)`` keeps everything. Possible after ``activate_past_recording()`` and at most
        ``max_rollback`` positions back (one-line errors otherwise)."""
        name = type(self).__name__
        if tokens_to_remove > 0:
            raise ValueError(f"{name}.crop({tokens_to_remove}): pass minus the number of positions to remove (as "
                             "transformers' caches take it), e.g. crop(-2)")
        length, removed = int(self.get_seq_length()), -tokens_to_remove
        if removed:
            states = next((states for position, states in self._past if position == length - removed), None)
            if states is None:
                kept = f"positions {self._past[0][0]}..{self._past[-1][0]}" if self._past else "no positions"
                raise ValueError(
                    f"{name}.crop({tokens_to_remove}): the cache cannot go back to position {length - removed}, it "
                    f"keeps the states of {kept}: call cache.activate_past_recording() before the forwards to undo "
                    f"(it keeps the last max_rollback={self.max_rollback} positions; build BilinearCache(config, "
                    "max_rollback=...) to go further back)")
            for slot, value in states.items():
                self._restore(slot, value)
            self._past = [(position, kept) for position, kept in self._past if position <= length - removed]
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                layer.cumulative_length -= removed
            else:
                self._crop_attention(layer, removed)

    def _crop_attention(self, layer, removed: int) -> None:
        """An attention layer goes back ``removed`` positions: transformers' crop (``crop(0)`` trims a sliding
        window's keys)."""
        layer.crop(-removed)

    def _current_states(self) -> dict:
        """Every slot's value now (``None``: not yet present); a slot is only ever replaced, never written into."""
        states = {("model", name): getattr(self, name) for name in ("follows_eos", "document_start")}
        for layer_idx, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionLayer):
                for i in range(NUMBER_OF_STATES):
                    if layer.is_recurrent_states_initialized[i]:
                        states["state", layer_idx, i] = layer.recurrent_states[i]
                    if layer.is_conv_states_initialized[i]:
                        states["window", layer_idx, i] = self.conv_window(layer_idx, i)
            elif layer_idx in self.attention_conv_windows:
                states["window", layer_idx, 0] = self.attention_conv_windows[layer_idx]
        return states

    def _restore(self, slot: tuple, value: torch.Tensor | None) -> None:
        kind, *where = slot
        if kind == "model":
            setattr(self, where[0], None if value is None else self._keep(getattr(self, where[0]), value))
        elif kind == "window":
            self.set_conv_window(where[0], value, where[1])
        else:
            self.update_recurrent_state(value, *where)

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


MAX_ROLLBACK = 64  # positions a recording BilinearCache can go back by default (assisted decoding's drafts: ~10-20)


class BilinearCache(BilinearCacheMixin, DynamicCache):
    """transformers' ``DynamicCache`` built from ``config.layer_types``: a :class:`BilinearLayerCache` per bilinear
    layer, ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` per attention layer (O(1) memory in sequence length
    without full attention), plus the model's own state (:class:`BilinearCacheMixin`). ``generate()`` passes it as
    ``cache`` (``past_key_values`` before transformers 5.24); beam search reorders it in place; after
    ``activate_past_recording()`` it can go back up to ``max_rollback`` positions (``crop``; assisted decoding)."""

    def __init__(self, config: BilinearConfig, max_rollback: int = MAX_ROLLBACK):
        super().__init__(config=config)
        self._init_model_state(max_rollback)


class BilinearStaticCache(BilinearCacheMixin, StaticCache):
    """transformers' ``StaticCache`` built from ``config.layer_types``, what ``generate(...,
    cache_implementation="static")`` builds and runs a compiled decoding step on (on CPU too): a
    :class:`BilinearStaticLayerCache` per bilinear layer, ``StaticLayer`` (``max_cache_len`` keys) per full
    attention layer and :class:`BilinearStaticSlidingWindowLayer` per sliding one, plus the model's state
    (:class:`BilinearCacheMixin`) and ``key_padding`` (``[batch, max_cache_len]`` bool, each position's padding
    mask, which the attention layers' masks read: a compiled step takes only its own positions' mask, of a fixed
    shape). Every tensor lives in a buffer allocated by the first (eager) call and updated in place, positions are
    counted in tensors: a compiled step's program runs at every position. Without attention layers nothing has a
    length: ``max_cache_len`` limits nothing.

    It rolls back as :class:`BilinearCache` does (``activate_past_recording``, ``crop``; assisted decoding with
    ``generate(..., past_key_values=BilinearStaticCache(...))``, which transformers runs eagerly): the recorded
    states are copies, restored into the buffers in place; a sliding layer records its window after each position
    (views of the keys its update returns); a full layer counts back and zeroes the keys it drops (and their
    padding), so a crop leaves every buffer as if the dropped positions had never run."""

    def __init__(self, config: BilinearConfig, max_cache_len: int, max_rollback: int = MAX_ROLLBACK, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self.layers = [BilinearStaticSlidingWindowLayer(max_cache_len, config.sliding_window)
                       if isinstance(layer, StaticSlidingWindowLayer) else layer for layer in self.layers]
        self.max_cache_len = max_cache_len
        self.key_padding: torch.Tensor | None = None
        self._init_model_state(max_rollback)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' update; while recording, a sliding layer's window after each recorded position too."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer, count = self.layers[layer_idx], self.positions_to_record
        if count and isinstance(layer, BilinearStaticSlidingWindowLayer):
            for name, tensor in (("keys", keys), ("values", values)):  # windows of max_cache_len, one per position
                windows = tensor.unfold(2, layer.max_cache_len, 1).transpose(-1, -2)  # [B, H, T + 1, window, D]
                self.record((name, layer_idx), windows[:, :, -count:].movedim(2, 1))
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        length = int(self.get_seq_length())
        super().crop(tokens_to_remove)
        if self.key_padding is not None:
            self.key_padding[:, int(self.get_seq_length()):length] = False

    crop.__doc__ = BilinearCacheMixin.crop.__doc__

    def _crop_attention(self, layer, removed: int) -> None:
        """Count back; a full layer zeroes the keys and values it drops (a sliding one's window came back with the
        recorded states)."""
        length = int(layer.get_seq_length())
        layer.cumulative_length -= removed
        if removed and layer.is_initialized and not isinstance(layer, BilinearStaticSlidingWindowLayer):
            layer.keys[:, :, length - removed:length] = 0
            layer.values[:, :, length - removed:length] = 0

    def _current_states(self) -> dict:
        """Copies of every slot's buffer (written in place later), sliding layers' windows included."""
        states = super()._current_states()
        for layer_idx, layer in enumerate(self.layers):
            if isinstance(layer, BilinearStaticSlidingWindowLayer) and layer.is_initialized:
                states["keys", layer_idx], states["values", layer_idx] = layer.keys, layer.values
        return {slot: None if value is None else value.clone() for slot, value in states.items()}

    def _restore(self, slot: tuple, value: torch.Tensor | None) -> None:
        if slot[0] in ("keys", "values"):
            getattr(self.layers[slot[1]], slot[0]).copy_(value)
        else:
            super()._restore(slot, value)

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


__all__ = ["MAX_ROLLBACK", "BilinearCache", "BilinearLayerCache", "BilinearStaticCache", "BilinearStaticLayerCache"]
