"""Bilinear recurrent language model: Mixer -> Block -> BilinearModel -> BilinearForCausalLM; hybrids put attention
blocks (``config.layer_types``) among the bilinear ones, all on transformers' ``DynamicCache``.

``save_pretrained`` copies this module and its relative imports as remote code: it imports only torch,
transformers and same-folder modules.
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CompileConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_bilinear import BilinearCache, BilinearCacheMixin, BilinearStaticCache
from .configuration_bilinear import BilinearConfig
from .cpu_allocator import keep_freed_memory_when_training
from .dispatch import linear, memory_recurrence, rms_norm, state_norm, swiglu
from .initialization import init_time_step_bias_
from .input_checks import check_attention_mask, check_input_ids, check_labels
from .transformers_compat import CACHE_NAME, returned_cache, takes_cache
from .transitions import TRANSITIONS

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass
class BilinearModelOutput(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus, with ``output_mixer_states=True``, ``mixer_states``: one
    ``[batch, seq_len, heads, state_size]`` tensor per bilinear layer, the recurrent state after each position (each
    head's state is defined up to a positive factor: compare directions), and with memory heads ``memory_reads``: one
    ``[batch, seq_len, memory_heads, memory_value_size]`` tensor per bilinear layer, the memory's read-out at each
    position (what enters the output projection beside the tracking state)."""

    mixer_states: tuple[torch.Tensor, ...] | None = None
    memory_reads: tuple[torch.Tensor, ...] | None = None


@dataclass
class BilinearCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``mixer_states`` and ``memory_reads`` (see :class:`BilinearModelOutput`)."""

    mixer_states: tuple[torch.Tensor, ...] | None = None
    memory_reads: tuple[torch.Tensor, ...] | None = None


class BilinearRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in at least fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class BilinearStateNorm(nn.Module):
    """Per-head state normalization: unit norm first (exactly scale invariant, no eps), then a learned scale."""

    def __init__(self, num_heads: int, state_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, state_size))

    def forward(self, h):
        return state_norm(h, self.weight)


class BilinearShortConv(nn.Module):
    """Causal depthwise convolution with a residual, ``x + conv(x)`` (``weight`` zero at init: the identity).

    ``forward(x [B,T,D], window [B,w-1,D] or None, mask, reset, keep) -> (y, new_window)``: ``window`` holds the last
    ``w - 1`` inputs (zeros at the start of a stream). Padded positions enter as zeros, so left padding is exact; at a
    ``reset`` (``[B, T]`` bool: a document starts there) the taps reaching back before it read zeros. With ``keep``
    (a cache that can roll back), ``new_window`` is the window after each of the last ``keep`` positions,
    ``[B, keep, w-1, D]``.
    """

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, 1, width))

    def forward(self, x, window=None, mask=None, reset=None, keep: int = 0):
        B, T, D = x.shape
        width = self.weight.shape[-1]
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if window is None:
            window = x.new_zeros(B, width - 1, D)
        full = torch.cat([window.to(x.dtype), x], dim=1)
        if reset is None:
            if T == 1:  # a decoding step: one dot product per channel (conv1d's setup costs ~20x more here)
                y = (full * self.weight[:, 0].t().to(x.dtype)).sum(1, keepdim=True)
            else:
                y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype), groups=D).transpose(1, 2)
            return x + y, windows_after(full, None, T, keep)
        # Document index of every position (the window's are 0): a tap counts only within its position's document.
        doc = torch.cat([reset.new_zeros(B, width - 1, dtype=torch.long), reset.long().cumsum(1)], dim=1)
        weight = self.weight[:, 0].to(x.dtype)
        y = sum(full[:, k:k + T] * ((doc[:, k:k + T] == doc[:, width - 1:])[..., None] * weight[:, k])
                for k in range(width))  # one tap at a time: 5x faster than an unfold + einsum (forward + backward)
        return x + y, windows_after(full, doc, T, keep)


def windows_after(full, doc, T: int, keep: int = 0):
    """A convolution's window after the last of ``T`` positions (``[B, w-1, D]``), or with ``keep`` after each of
    the last ``keep`` (``[B, keep, w-1, D]``), from ``full`` (``[B, w-1+T, D]``: the window before, then the inputs)
    and ``doc`` (the document index of each, or None): the inputs of an earlier document read as zeros."""
    width = full.shape[1] - T + 1
    windows = []
    for start in range(T + 1 - keep, T + 1) if keep else (T,):
        window = full[:, start:start + width - 1]
        if doc is not None:
            window = window * (doc[:, start:start + width - 1] == doc[:, start + width - 2, None])[..., None].to(
                full.dtype)
        windows.append(window)
    return torch.stack(windows, 1) if keep else windows[0]


KEY_OFFSET = 0.1  # added to the memory's queries and keys before their unit norm (BilinearMemory: why)
BETA_SHIFT = 3.0  # beta = 2 sigmoid(b - BETA_SHIFT): 0.095 at init, a weak write


class BilinearMemory(nn.Module):
    """The memory heads of a bilinear mixer (``config.memory_heads``): a projective gated delta rule
    (``delta_rule_reference.reference_delta_rule``) on queries, keys and values from a short causal convolution (SiLU; queries
    and keys plus :data:`KEY_OFFSET`, then to unit norm), ``alpha = exp(-exp(A_log) softplus(a + dt_bias))`` in
    ``(0, 1]``, ``beta = 2 sigmoid(b - BETA_SHIFT)`` in ``(0, 2)``, the read-out ``S q / c`` RMS-normalized per head
    (not gated).

    At init the memory is a bag: every key shares the offset's direction (positive ``q . k``) and the writes are weak
    (``beta`` 0.095), so a query reads a decayed sum of the values before it, a signal that points the same way for
    every query. Without any one of the three (``q . k`` and an output gate have random signs per token pair, a full
    write keeps mostly the newest value), MQAR at vocabulary 8,192 stayed near chance for hundreds of steps more
    (docs/architecture.md, docs/results-history.md "Issue 38: the memory heads recall").

    ``forward(x, memory, mask, offset, reset, keep) -> (y [B, T, heads * value_size], memory)``; ``memory`` is
    ``(S [B, heads, value_size, key_size], c [B, heads], window [B, conv_width - 1, channels])``, or None: an empty
    matrix, ``c = 1`` and a zero window. With ``keep`` (a cache that can roll back) the memory returned is the memory
    after each of the last ``keep`` positions, each part with a positions dimension after the batch's.
    """

    def __init__(self, config: BilinearConfig):
        super().__init__()
        self.config = config
        N, Dk, Dv = config.memory_heads, config.memory_key_size, config.memory_value_size
        self.num_heads, self.key_size, self.value_size = N, Dk, Dv
        # One fused projection: [queries, keys, values (through the convolution) | beta | alpha].
        self.split_sizes = [N * (2 * Dk + Dv), N, N]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        self.conv = BilinearShortConv(N * (2 * Dk + Dv), config.memory_conv_width)
        self.A_log = nn.Parameter(torch.empty(N))
        self.dt_bias = nn.Parameter(torch.empty(N))
        self.out_norm = BilinearRMSNorm(Dv, config.rms_norm_eps)

    @torch.no_grad()
    def reset_parameters(self):
        """Gated DeltaNet's (Mamba's) decay initialization: ``exp(A_log)`` uniform in (1, 16), the softplus of
        ``dt_bias`` log-uniform in (0.001, 0.1) (:func:`init_time_step_bias_`)."""
        init.copy_(self.A_log, torch.empty(self.num_heads).uniform_(1, 16).log())
        init_time_step_bias_(self.dt_bias)

    def forward(self, x, memory=None, mask=None, offset: int | torch.Tensor = 0, reset=None, keep: int = 0):
        B, T, _ = x.shape
        N, Dk, Dv = self.num_heads, self.key_size, self.value_size
        qkv, b, a = linear(self.in_proj, x).split(self.split_sizes, dim=-1)
        S, c, window = (None, None, None) if memory is None else memory
        qkv, window = self.conv(qkv, window, mask, reset, keep)
        with torch.autocast(device_type=x.device.type, enabled=False):  # the recurrence in at least fp32
            dtype = torch.promote_types(x.dtype, torch.float32)
            q, k, v = F.silu(qkv.to(dtype)).split([N * Dk, N * Dk, N * Dv], dim=-1)
            q = F.normalize(q.view(B, T, N, Dk) + KEY_OFFSET, dim=-1, eps=1e-6)
            k = F.normalize(k.view(B, T, N, Dk) + KEY_OFFSET, dim=-1, eps=1e-6)
            g = -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))
            beta = 2 * torch.sigmoid(b.to(dtype) - BETA_SHIFT)
            if S is None:
                S, c = x.new_zeros(B, N, Dv, Dk, dtype=dtype), x.new_ones(B, N, dtype=dtype)
            o, (S, c) = memory_recurrence(q, k, v.view(B, T, N, Dv), g, beta, (S.to(dtype), c.to(dtype)), mask,
                                          self.config.norm_chunk_size, offset, self.config.recurrence_impl, reset, keep)
        return self.out_norm(o).to(x.dtype).flatten(2), (S, c, window)


class BilinearMixer(nn.Module):
    """Multi-head bilinear recurrence ``h_t = A(x_t) h_{t-1}`` with a normalized, gated readout, and with
    ``memory_heads`` its :class:`BilinearMemory` beside it (both read-outs enter one output projection).

    The mixer owns the projections and the readout; ``transition`` (a class of ``transitions.TRANSITIONS``, by
    ``mixer_type``) owns ``A`` and runs the recurrence. ``forward(x, state, mask, offset, reset, memory, keep) -> (y,
    states, final, memory, read)``: the layer receives and returns its state (``states``: the state after every
    position, ``[B, T, heads, state_size]``; a missing ``state`` starts from the learned ``h_start``) and its memory
    (with ``keep``, after each of the last ``keep`` positions: :class:`BilinearMemory`), and ``read`` is the memory
    heads' read-out at every position, ``[B, T, memory_heads, memory_value_size]`` (both None without memory
    heads).
    """

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        N, H = config.num_heads, config.state_size
        self.num_heads, self.state_size = N, H
        self.transition = TRANSITIONS[config.mixer_type](config)
        self.factor_size = self.transition.factor_size
        # One fused input projection: [transition inputs | output gate | additive input].
        self.split_sizes = [N * self.factor_size, N * H if config.use_gate else 0, N * H if config.additive_input else 0]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        self.h_start = nn.Parameter(torch.empty(N, H))
        self.state_norm = BilinearStateNorm(N, H)
        self.out_proj = nn.Linear(N * H + config.memory_heads * config.memory_value_size, config.hidden_size,
                                  bias=False)
        self.memory = BilinearMemory(config) if config.memory_heads else None

    @torch.no_grad()
    def reset_parameters(self):
        """The transition's own initialization, projections at ``initializer_range`` (the transition's rows at its
        own std: the input factors start at ``1 + small noise``), a random unit start state, and the output projection
        scaled down with depth (GPT-2)."""
        cfg, N = self.config, self.num_heads
        self.transition.reset_parameters()
        row_std = torch.full((self.in_proj.weight.shape[0], 1), cfg.initializer_range)
        row_std[:self.split_sizes[0], 0] = self.transition.input_init_std().repeat(N)
        init.copy_(self.in_proj.weight, torch.randn(self.in_proj.weight.shape) * row_std)
        h = torch.randn(N, self.state_size)
        init.copy_(self.h_start, h / h.norm(dim=-1, keepdim=True))
        init.ones_(self.state_norm.weight)
        init.normal_(self.out_proj.weight, mean=0.0, std=cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers))

    def forward(self, x, state=None, mask=None, offset: int = 0, reset=None, memory=None, keep: int = 0):
        """``reset``: optional ``[B, T]`` bool, positions where a document starts (the state restarts from
        ``h_start``, the memory empties). The recurrence runs in at least fp32, outside autocast: long products of
        transitions need the range."""
        B, T, _ = x.shape
        N, H = self.num_heads, self.state_size
        with torch.autocast(device_type=x.device.type, enabled=False):
            raw, gate, additive = linear(self.in_proj, x).split(self.split_sizes, dim=-1)
            dtype = torch.promote_types(x.dtype, torch.float32)
            raw = raw.to(dtype).view(B, T, N, self.factor_size)
            additive = additive.to(dtype).view(B, T, N, H) if self.config.additive_input else None
            h0 = self.h_start if state is None else state
            states, final = self.transition(raw, h0, self.h_start, mask, offset, additive, reset)
        y = self.state_norm(states).flatten(2).to(x.dtype)
        if self.config.use_gate:
            y = y * F.silu(gate)
        read = None
        if self.memory is not None:
            read, memory = self.memory(x, memory, mask, offset, reset, keep)
            y = torch.cat([y, read], dim=-1)
            read = read.unflatten(-1, (self.memory.num_heads, self.memory.value_size))
        return linear(self.out_proj, y), states, final, memory, read


class BilinearMLP(nn.Module):
    """SwiGLU MLP (gate and up projections fused)."""

    def __init__(self, config: BilinearConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return linear(self.down_proj, swiglu(linear(self.gate_up_proj, x), self.act))


class BilinearRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's rotary embedding (its default inverse frequencies from ``rope_parameters["rope_theta"]`` and the head
    size, its forward) for the attention layers. Subclassed only to skip ``max_position_embeddings``, which Llama's
    constructor reads for the RoPE types that rescale to a maximum length: the model has none, and takes only
    ``rope_type="default"``."""

    def __init__(self, config: BilinearConfig):
        nn.Module.__init__(self)
        self.config = config
        self.rope_type = "default"
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)


class BilinearAttention(nn.Module):
    """Causal softmax attention of the hybrid layers, Llama's: q/k/v/o projections, rotary embedding, grouped
    key/value heads, run by transformers' attention interface (``config._attn_implementation``: sdpa by default).
    The mask says what each query sees (causal, padding, the sliding window, documents); the cache layer keeps the
    keys and values (``DynamicSlidingWindowLayer``: only the last ``sliding_window - 1``). Returns
    ``(output, weights)`` as transformers' attention modules do: the weights (``[B, heads, T, keys]``) only from an
    implementation that computes them (``eager``; None from sdpa), which ``output_attentions`` records."""

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.o_proj.scale_init_with_depth = True  # read by _init_weights

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """``(hidden [B,T,D], (cos, sin) or None (no rotary embedding), attention_mask (the interface's mask, or
        None), cache, **kwargs (to the attention interface)) -> (output [B,T,D], weights or None)``."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = linear(self.q_proj, hidden_states).view(shape).transpose(1, 2)
        key = linear(self.k_proj, hidden_states).view(shape).transpose(1, 2)
        value = linear(self.v_proj, hidden_states).view(shape).transpose(1, 2)
        if position_embeddings is not None:  # None: use_rope=False
            query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 sliding_window=self.sliding_window, **kwargs)
        return linear(self.o_proj, out.reshape(*hidden_states.shape[:-1], -1)), weights


class PreNormBlock(GradientCheckpointingLayer):
    """What every block shares: the mixing sublayer's norm (``mixer_norm``) and short convolution (``conv``, with
    ``conv_width``), applied by ``mixing_input``; then its ``mixing`` module; and, if the config has an MLP, the
    pre-norm residual SwiGLU MLP (``mlp_residual``). Registered in this order, which sets the order of
    initialization: a given seed gives the same weights as before hybrids existed."""

    def __init__(self, config: BilinearConfig, layer_idx: int, **mixing: nn.Module):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.conv = BilinearShortConv(config.hidden_size, config.conv_width) if config.conv_width else None
        for name, module in mixing.items():
            setattr(self, name, module)
        if config.use_mlp:
            self.mlp_norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = BilinearMLP(config)
        else:
            self.mlp = None

    def mixing_input(self, hidden_states, cache=None, mask=None, reset=None):
        """``norm(x)``, then the convolution if the block has one, its window from and back to ``cache`` (a
        :class:`BilinearCache`, or None: zeros before the first position); ``mask``: ``[B, T]`` padding,
        ``reset``: ``[B, T]`` document starts, or None."""
        x = self.mixer_norm(hidden_states)
        if self.conv is None:
            return x
        keep = cache.positions_to_record if cache is not None else 0
        x, window = self.conv(x, cache.conv_window(self.layer_idx) if cache is not None else None, mask, reset, keep)
        if cache is not None:
            if keep:
                cache.record(("window", self.layer_idx, 0), window)
                window = window[:, -1]
            cache.set_conv_window(self.layer_idx, window)  # its last conv_width - 1 positions
        return x

    def mlp_residual(self, hidden_states):
        """``x + MLP(norm(x))``, or ``x`` without an MLP."""
        return hidden_states if self.mlp is None else hidden_states + self.mlp(self.mlp_norm(hidden_states))


class BilinearBlock(PreNormBlock):
    """Pre-norm residual block: ``x + Mixer(conv(norm(x)))`` (the short convolution only with ``conv_width``),
    then ``x + MLP(norm(x))`` if the config has an MLP. Decoding (one position) runs the same code."""

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__(config, layer_idx, mixer=BilinearMixer(config, layer_idx))

    def forward(self, hidden_states, cache=None, mask=None, offset: int = 0, reset=None):
        """``(hidden [B,T,D], cache, mask, offset, reset) -> (hidden, states [B,T,N,S], read)`` (``read``: the
        memory heads' read-out, see :class:`BilinearMixer`): the state and the
        convolution's window come from and go back to ``cache`` (a :class:`BilinearCache`, or None: start from
        ``h_start`` and zeros); ``reset``: ``[B, T]`` bool, document starts, or None."""
        idx = self.layer_idx
        state = cache.get_recurrent_state(idx) if cache is not None else None
        memory = None
        if cache is not None and self.mixer.memory is not None and cache.get_recurrent_state(idx, 1) is not None:
            memory = (cache.get_recurrent_state(idx, 1), cache.get_recurrent_state(idx, 2), cache.conv_window(idx, 1))
        keep = cache.positions_to_record if cache is not None else 0  # states a cache that can roll back keeps
        mixer_input = self.mixing_input(hidden_states, cache, mask, reset)
        mixed, states, final_state, memory, read = self.mixer(mixer_input, state, mask, offset, reset, memory, keep)
        if cache is not None:
            cache.update_recurrent_state(final_state, idx, num_positions=hidden_states.shape[1])
            if keep:
                cache.record(("state", idx, 0), states[:, -keep:].clone())  # not a view: the rest can go
            if memory is not None:
                if keep:  # the memory after each kept position
                    for slot, value in zip((("state", idx, 1), ("state", idx, 2), ("window", idx, 1)), memory):
                        cache.record(slot, value)
                    memory = tuple(value[:, -1] for value in memory)
                cache.update_recurrent_state(memory[0], idx, 1)
                cache.update_recurrent_state(memory[1], idx, 2)
                cache.set_conv_window(idx, memory[2], 1)
        return self.mlp_residual(hidden_states + mixed), states, read


class BilinearAttentionBlock(PreNormBlock):
    """A hybrid's attention layer: ``x + Attention(conv(norm(x)))`` (the short convolution only with
    ``conv_width``), then the same MLP as the bilinear blocks. The convolution gives the keys and values the previous
    tokens, which a bilinear layer below does not pass on: without it a 2-layer hybrid stayed at ``1 / pairs`` on
    associative recall, with it it recalled (docs/results-history.md, hybrids)."""

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__(config, layer_idx, attention=BilinearAttention(config, layer_idx))

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, mask=None, reset=None,
                **kwargs):
        """``(hidden [B,T,D], (cos, sin), attention_mask (the interface's), cache, mask [B,T] (padding, for the
        convolution), reset [B,T] (document starts), **kwargs (to the attention interface)) -> hidden``."""
        attention_input = self.mixing_input(hidden_states, cache, mask, reset)
        attended, _ = self.attention(attention_input, position_embeddings, attention_mask, cache, **kwargs)
        return self.mlp_residual(hidden_states + attended)


def document_starts(input_ids, eos_token_id, mask=None, follows_eos=None):
    """``(reset [B, T], follows_eos [B, T])``: the positions right after an EOS token (the first position too where
    ``follows_eos``, carried by the cache across calls, says the previous call ended with one), and at each position
    whether the row's last unpadded token so far is EOS (``follows_eos`` before any)."""
    B, T = input_ids.shape
    eos_ids = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id],
                           device=input_ids.device)
    is_eos = torch.isin(input_ids, eos_ids)
    before = torch.zeros(B, dtype=torch.bool, device=input_ids.device) if follows_eos is None else follows_eos
    reset = torch.cat([before[:, None], is_eos[:, :-1]], dim=1)
    if mask is None:
        return reset, is_eos
    positions = torch.arange(T, device=input_ids.device)
    last = torch.where(mask.bool(), positions, -1).cummax(dim=1).values
    last_is_eos = is_eos.gather(1, last.clamp_min(0))
    return reset, torch.where(last >= 0, last_is_eos, before[:, None])


def packed_document_starts(B: int, T: int, position_ids=None, cu_seq_lens_q=None, seq_idx=None):
    """``[B, T]`` bool: where a document of a padding-free packed row starts after the row's first position (the form
    transformers' ``DataCollatorWithFlattening`` gives: ``position_ids`` restarting at 0, the offsets
    ``cu_seq_lens_q`` of a single row, or ``seq_idx`` changing); None where none is given or, outside a compiled
    graph, none restarts (nothing changes then)."""
    if T < 2:
        return None
    if seq_idx is not None:
        starts = torch.cat([torch.zeros_like(seq_idx[:, :1], dtype=torch.bool), seq_idx[:, 1:] != seq_idx[:, :-1]], 1)
    elif cu_seq_lens_q is not None:
        if B != 1:
            raise ValueError(f"cu_seq_lens_q marks the documents of one packed row, but the batch has {B} rows: pack "
                             "them into one row (DataCollatorWithFlattening does), or pass position_ids or seq_idx")
        starts = torch.zeros(1, T, dtype=torch.bool, device=cu_seq_lens_q.device)
        offsets = cu_seq_lens_q.long()
        starts[0, offsets[(offsets > 0) & (offsets < T)]] = True
    elif position_ids is not None:
        starts = position_ids == 0
        starts[..., 0] = False
    else:
        return None
    if not torch.compiler.is_compiling() and not bool(starts.any()):
        return None
    return starts.expand(B, T)


class BilinearPreTrainedModel(PreTrainedModel):
    config: BilinearConfig
    config_class = BilinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BilinearBlock", "BilinearAttentionBlock"]
    _supports_flash_attn = False
    _supports_sdpa = True  # the hybrids' attention layers (transformers' attention interface; eager works too)
    # output_attentions: capture_outputs records each attention layer's weights (eager attention computes them)
    _can_record_outputs = {"attentions": OutputRecorder(BilinearAttention, index=1)}

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (BilinearMixer, BilinearMemory)):
            module.reset_parameters()
        elif isinstance(module, BilinearShortConv):
            init.zeros_(module.weight)
        elif isinstance(module, nn.Linear) and getattr(module, "scale_init_with_depth", False):
            # the attention's output projection, scaled down with depth as the mixers' are. Marked on the Linear:
            # transformers skips the init of a custom-code module with no parameters of its own (BilinearAttention)
            init.normal_(module.weight, mean=0.0,
                         std=self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers))

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() would build a plain DynamicCache: the model's own is built instead


class BilinearModel(BilinearPreTrainedModel):
    """Embeddings, a stack of blocks (bilinear, or attention in a hybrid: ``config.layer_types``) and a final norm (no
    positional embedding: the recurrence is ordered; the attention layers have rotary embeddings unless
    ``config.use_rope`` is False)."""

    def __init__(self, config: BilinearConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            BilinearBlock(config, i) if kind == "bilinear" else BilinearAttentionBlock(config, i)
            for i, kind in enumerate(config.layer_types)])
        self.rotary_emb = BilinearRotaryEmbedding(config) if self.attention_types and config.use_rope else None
        self.norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    @property
    def attention_types(self) -> set[str]:
        """The attention layer types present (empty for a pure bilinear model)."""
        return set(self.config.layer_types) - {"bilinear"}

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def attention_masks(self, inputs_embeds, attention_mask, cache, position_ids, document_start, offset=0):
        """transformers' mask for each attention layer type present (``{"full_attention": ...,
        "sliding_attention": ...}``) from the whole sequence's 2D ``attention_mask`` (with a
        :class:`BilinearStaticCache`: this call's, the cache keeping the earlier positions'); ``position_ids``: the
        consecutive positions of this call's tokens; ``document_start`` (``[B, T]`` absolute positions, or None)
        restricts each query to the keys of its own document; ``offset``: the positions consumed before this call."""
        same_document = None
        if document_start is not None:
            def same_document(batch_idx, head_idx, q_idx, kv_idx):
                return kv_idx >= document_start[batch_idx, q_idx - offset]
        if isinstance(cache, BilinearStaticCache):  # the padding of every position so far is in the cache
            mask = None if attention_mask is None else attention_mask[:, -inputs_embeds.shape[1]:]
            attention_mask, same_document = None, cache.visible_keys(inputs_embeds, mask, offset, same_document)
        kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                  CACHE_NAME: cache, "position_ids": position_ids, "and_mask_function": same_document}
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: make[kind](**kwargs) for kind in self.attention_types}

    @takes_cache
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: BilinearCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_mixer_states: bool = False,
        **kwargs,
    ) -> BilinearModelOutput:
        """``cache``: a :class:`BilinearCache` or :class:`BilinearStaticCache` (``past_key_values`` is taken too:
        transformers 5.23's name). ``position_ids`` (``[B, T]``, the attention layers' rotary positions) default to the
        positions consumed so far plus ``0..T-1``; ``generate()`` passes them counted from each row's first unpadded
        token.

        transformers' ``capture_outputs`` wraps it: ``return_dict=False`` (or ``config.return_dict = False``) returns
        ``to_tuple()``, and ``output_attentions=True`` records the attention layers' weights, one tensor per attention
        layer (with ``attn_implementation="eager"``: sdpa computes none); the other ``kwargs`` go to the attention
        interface."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BilinearModel.forward: pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            if not torch.compiler.is_compiling():  # the check reads the ids on the host: not inside a graph
                check_input_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        elif 0 in inputs_embeds.shape[:2]:
            raise ValueError("BilinearModel.forward: inputs_embeds has no rows or no positions (shape "
                             f"{tuple(inputs_embeds.shape)}); pass at least one row of at least one position")
        if self.training:
            keep_freed_memory_when_training(inputs_embeds)  # once per process (cpu_allocator: why, and the opt-out)
        output_hidden_states = output_hidden_states if output_hidden_states is not None \
            else self.config.output_hidden_states
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = BilinearCache(self.config)
        if cache is not None and not isinstance(cache, BilinearCacheMixin):
            raise TypeError(f"BilinearModel.forward: cache is a {type(cache).__name__}; pass a "
                            "BilinearCache(config) or BilinearStaticCache(config, max_cache_len) (or None: the model "
                            "builds one), which hold the model's own state besides the layers'")
        static = isinstance(cache, BilinearStaticCache)
        B, T = inputs_embeds.shape[:2]
        if cache is not None:
            cache.begin_forward(T)  # a cache that can roll back keeps the states of the last positions
        offset = cache.get_seq_length() if cache is not None else 0
        if isinstance(offset, torch.Tensor):  # a static cache's count, which its layers advance in place as they run
            offset = offset.clone()
        mask = None
        if attention_mask is not None:
            if not torch.compiler.is_compiling():  # a graph's shapes are fixed, and its count is a tensor
                # a static cache holds its attention layers' key padding: this call's columns suffice
                check_attention_mask(attention_mask, (B, T), int(offset), bool(self.attention_types) and not static)
            # generate() passes the mask of the whole sequence so far: keep the columns of this call.
            mask = attention_mask[:, -T:]
            # Eager mode drops an all-ones mask (the unmasked path is faster). Not while compiling or exporting: the
            # test reads the mask's values, a data-dependent branch a graph cannot hold; the masked path is exact.
            if not torch.compiler.is_compiling() and bool(mask.all()):
                mask = None
        # Documents start after an EOS (reset_state_at_eos) and where a padding-free packed row says so: every
        # recurrent state restarts there, and the attention layers look no further back.
        reset = packed_document_starts(B, T, position_ids, kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx"))
        if self.config.reset_state_at_eos and input_ids is not None:
            at_eos, follows_eos = document_starts(
                input_ids, self.config.eos_token_id, mask, None if cache is None else cache.follows_eos)
            reset = at_eos if reset is None else reset | at_eos
            if cache is not None:
                cache.carry("follows_eos", follows_eos)

        if self.attention_types:
            positions = torch.arange(T, device=inputs_embeds.device) + offset
            if position_ids is None:
                position_ids = positions.expand(B, T)
            document_start = None
            carried = None if cache is None else cache.document_start
            if reset is not None or carried is not None:
                if carried is None:
                    carried = torch.zeros(B, dtype=torch.long, device=inputs_embeds.device)
                document_start = carried[:, None].expand(B, T) if reset is None else \
                    torch.maximum(torch.where(reset, positions, -1).cummax(dim=1).values, carried[:, None])
                if cache is not None:
                    cache.carry("document_start", document_start)
            # The masks get the consecutive positions: documents are marked by document_start, never by transformers'
            # own detection of restarting position_ids (which remaps the indices the document test reads).
            masks = self.attention_masks(inputs_embeds, attention_mask, cache, positions.expand(B, T), document_start,
                                         offset)
            position_embeddings = (None if self.rotary_emb is None  # use_rope=False
                                   else self.rotary_emb(inputs_embeds, position_ids))

        hidden_states = inputs_embeds
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_mixer_states = () if output_mixer_states else None
        all_memory_reads = () if output_mixer_states and self.config.memory_heads else None
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types)):
            if kind == "bilinear":
                hidden_states, states, read = layer(hidden_states, cache, mask, offset, reset)
                if output_mixer_states:
                    all_mixer_states += (states,)
                if all_memory_reads is not None:
                    all_memory_reads += (read,)
            else:
                hidden_states = layer(hidden_states, position_embeddings, masks[kind], cache, mask, reset,
                                      **kwargs)
            if output_hidden_states and i < len(self.layers) - 1:
                all_hidden_states += (hidden_states,)
        if cache is not None:
            cache.end_forward()
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BilinearModelOutput(
            last_hidden_state=hidden_states,
            **{CACHE_NAME: cache if use_cache else None},
            hidden_states=all_hidden_states,
            mixer_states=all_mixer_states,
            memory_reads=all_memory_reads,
        )


class BilinearForCausalLM(BilinearPreTrainedModel, GenerationMixin):
    """Bilinear LM with a language-modelling head (tied to the input embeddings by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BilinearConfig):
        super().__init__(config)
        self.model = BilinearModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    # generate(..., cache_implementation="static"): a BilinearStaticCache and one compiled program per decoding step,
    # on CPU as on a GPU (transformers compiles only on accelerators). The default generate() stays eager.

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """``cache_implementation="static"`` builds a :class:`BilinearStaticCache` of ``max_cache_length`` positions
        (or ``generation_config.max_cache_len``, or the largest of an earlier call: the same shapes reuse the compiled
        step); otherwise a :class:`BilinearCache` (transformers would build a plain ``DynamicCache``:
        ``_supports_default_dynamic_cache``), recording for a rollback when it is an assistant's (as transformers
        does for the caches it builds), unless the caller passed a cache or ``use_cache=False``."""
        if generation_config.use_cache is False or model_kwargs.get(CACHE_NAME) is not None:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                         max_cache_length)
        if generation_config.cache_implementation != "static":
            super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                  max_cache_length)  # builds nothing here; warns of an unknown kind
            model_kwargs[CACHE_NAME] = BilinearCache(self.config)
            if getattr(generation_config, "is_assistant", False):
                model_kwargs[CACHE_NAME].activate_past_recording()
            return
        if generation_config.prefill_chunk_size is not None and not generation_config.disable_compile:
            raise ValueError("generate(cache_implementation='static') with prefill_chunk_size: transformers compiles "
                             "the prefill's chunks then, and this model's prefill reads the position on the host (the "
                             "scans plan their chunks with it); pass prefill_chunk_size=None (the prefill runs eagerly, "
                             "the decoding steps compiled) or disable_compile=True")
        max_cache_length = max(max_cache_length, generation_config.max_cache_len or 0,
                               getattr(self, "_previous_max_cache_length", 0))
        self._previous_max_cache_length = max_cache_length
        model_kwargs[CACHE_NAME] = BilinearStaticCache(self.config, max_cache_len=max_cache_length)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, **kwargs):
        """What transformers calls to build the attention layers' 4D masks outside a compiled step: here the 2D mask
        unchanged. The model builds its masks in the step (:meth:`BilinearModel.attention_masks`), the cache holding
        the earlier positions' padding; :meth:`prepare_inputs_for_generation` keeps this call's columns."""
        return attention_mask

    def prepare_inputs_for_generation(self, *args, **kwargs):
        """transformers' preparation, then, with a :class:`BilinearStaticCache`, the 2D attention mask cut to this
        call's columns: a compiled step's inputs keep one shape (the whole mask grows by a column a token, and each
        new shape compiled the step again). transformers 5.23 cut it through :meth:`create_masks_for_generate`; 5.24
        skips that hook when every layer is linear (a pure bilinear model)."""
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        mask = inputs.get("attention_mask")
        if isinstance(inputs.get(CACHE_NAME), BilinearStaticCache) and isinstance(mask, torch.Tensor) \
                and mask.dim() == 2:
            new = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
            inputs["attention_mask"] = mask[:, -new.shape[1]:].contiguous()  # one stride too
        return inputs

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers' criteria (a compileable cache that is not a plain ``DynamicCache``, no ``disable_compile``,
        no quantizer or offloading), on CPU too for a :class:`BilinearStaticCache`: transformers compiles on
        accelerators only. Never for a recording cache: assisted decoding's verifications (transformers 5.24
        compiles them) change their number of positions with each draft, and each number would compile again."""
        cache = model_kwargs.get(CACHE_NAME)
        if getattr(cache, "recording", False):
            return False
        if isinstance(cache, BilinearStaticCache) and self.device.type == "cpu":
            generation_config = copy.copy(generation_config)
            generation_config.compile_config = copy.copy(generation_config.compile_config
                                                         or self._default_compile_config())
            generation_config.compile_config._compile_all_devices = True
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _default_compile_config(self) -> CompileConfig:
        """How ``generate()`` compiles the decoding step unless ``compile_config`` says otherwise: one graph
        (``fullgraph``: a graph break is an error) of fixed shapes; on a GPU captured into a CUDA graph
        (``mode="reduce-overhead"``), on CPU Inductor's C++ (docs/architecture.md, compiled decoding)."""
        if self.device.type == "cpu":
            return CompileConfig(fullgraph=True, dynamic=False, mode="default")
        return CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")

    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: BilinearCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_mixer_states: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> BilinearCausalLMOutput:
        """transformers' ``can_return_tuple`` wraps it: ``return_dict=False`` (or ``config.return_dict = False``)
        returns ``to_tuple()``. ``kwargs`` go to the model (``output_attentions``: see :meth:`BilinearModel.forward`)
        and to the loss."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_mixer_states=output_mixer_states,
            return_dict=True,  # a ModelOutput whatever config.return_dict says: this forward reads its fields
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = linear(self.lm_head, hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            if not torch.compiler.is_compiling():  # the check reads the labels on the host: not inside a graph
                check_labels(labels, self.config.vocab_size)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return BilinearCausalLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: returned_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            mixer_states=outputs.mixer_states,
            memory_reads=outputs.memory_reads,
        )


__all__ = ["BilinearModel", "BilinearForCausalLM", "BilinearPreTrainedModel"]
