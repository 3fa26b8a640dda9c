"""Bilinear recurrent language model: Mixer -> Block -> BilinearModel -> BilinearForCausalLM.

``save_pretrained`` copies this module and its relative imports as remote code: it imports only torch,
transformers and same-folder modules.
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_bilinear import BilinearConfig
from .cpu_kernels import Linear, build_kernels, built_kernel
from .ops import fused_decode_weights, recurrence
from .recurrence import (
    CPTransition,
    block_diagonal_transition,
    diagonal_transition,
    full_transition,
    is_boundary,
    reference_step,
    rotation_transition,
)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid}


def write_channel_weights(W1, W2):
    """CP weights ``[N, H+1, R+H+1]`` of the write-channel transition ``[[A(x), b(x)], [0, gamma(x)]]`` on ``[h; c]``.

    With factors ``[u | b | gamma]``: ``W1' diag(.) W2'^T [h; c] = [W1 (u * W2^T h) + b c; gamma c]``. The update stays
    linear and homogeneous in ``[h; c]`` (so chunked normalization of both together stays exact) and runs on every
    CP path, yet ``b(x) c`` writes like an additive input, forgotten at a rate set by ``gamma`` relative to ``A``.
    """
    N, H, R = W1.shape
    eye, zeros = torch.eye(H, dtype=W1.dtype, device=W1.device).expand(N, H, H), W1.new_zeros(N, H, H + 1)
    top1 = torch.cat([W1, eye, W1.new_zeros(N, H, 1)], dim=-1)
    bottom1 = torch.cat([W1.new_zeros(N, 1, R + H), W1.new_ones(N, 1, 1)], dim=-1)
    top2 = torch.cat([W2, zeros], dim=-1)
    bottom2 = torch.cat([W2.new_zeros(N, 1, R), W2.new_ones(N, 1, H + 1)], dim=-1)
    return torch.cat([top1, bottom1], dim=1), torch.cat([top2, bottom2], dim=1)


def coupled_write_channel_weights(W1, W2, w):
    """CP weights ``[N, H+1, R+1]`` of the coupled write channel: the write reuses the transition's input factors.

    With factors ``[u | gamma]``: ``W1' diag(.) W2'^T [h; c] = [W1 (u * (W2^T h + w c)); gamma c]``, so the write is
    ``b(x) = W1 (u(x) * w)`` (``w [N, R]`` learned). Linear and homogeneous in ``[h; c]`` like
    :func:`write_channel_weights`, at rank ``R + 1`` instead of ``R + H + 1``: about the pure model's cost.
    """
    N, H, R = W1.shape
    W1c = torch.cat([torch.cat([W1, W1.new_zeros(N, H, 1)], dim=-1),
                     torch.cat([W1.new_zeros(N, 1, R), W1.new_ones(N, 1, 1)], dim=-1)], dim=1)
    W2c = torch.cat([torch.cat([W2, W2.new_zeros(N, H, 1)], dim=-1),
                     torch.cat([w[:, None, :].to(W2.dtype), W2.new_ones(N, 1, 1)], dim=-1)], dim=1)
    return W1c, W2c


def rope_rotation(size: int, base: float) -> torch.Tensor:
    """``[size, size]`` block-diagonal 2x2 rotations by the angles ``base^(-2k / size)``, k = 0, 1, ... (RoPE's
    frequencies; an odd last coordinate is left unrotated)."""
    angles = base ** (-2 * torch.arange(size // 2, dtype=torch.float64) / size)
    O = torch.eye(size, dtype=torch.float64)
    i = torch.arange(0, size - 1, 2)
    O[i, i], O[i, i + 1], O[i + 1, i], O[i + 1, i + 1] = angles.cos(), -angles.sin(), angles.sin(), angles.cos()
    return O.float()


class BilinearCache:
    """Recurrent cache: each layer's state ``[batch, heads, state_size]``, O(1) memory in sequence length.

    ``generate()`` receives it as ``past_key_values``; beam search reorders it in place.
    """

    is_compileable = False

    def __init__(self, num_layers: int):
        self.states: list[torch.Tensor | None] = [None] * num_layers
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers  # [batch, conv_width - 1, hidden]
        self.follows_eos: torch.Tensor | None = None  # [batch] bool: the last token was EOS (reset_state_at_eos)
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions consumed so far (padding included)."""
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows in place (beam search)."""
        def select(states):
            return [None if s is None else s.index_select(0, beam_idx.to(s.device)) for s in states]

        self.states, self.conv_states = select(self.states), select(self.conv_states)
        self.follows_eos = select([self.follows_eos])[0]

    def __len__(self) -> int:
        return len(self.states)


@dataclass
class BilinearModelOutput(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``mixer_states``: with ``output_mixer_states=True``, one
    ``[batch, seq_len, heads, state_size]`` tensor per layer (``state_size + 1`` with the write channel: ``[h; c]``),
    the recurrent state after each position (each head's state is defined up to a positive factor: compare
    directions)."""

    mixer_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class BilinearCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``mixer_states`` (see :class:`BilinearModelOutput`)."""

    mixer_states: tuple[torch.Tensor, ...] | None = None


class BilinearRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in at least fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class BilinearStateNorm(nn.Module):
    """Per-head state normalization: unit norm first (exactly scale invariant, no eps), then a learned scale."""

    def __init__(self, num_heads: int, state_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, state_size))

    def forward(self, h):
        norm = h.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
        return h / norm * (math.sqrt(h.shape[-1]) * self.weight.to(h.dtype))


class BilinearShortConv(nn.Module):
    """Causal depthwise convolution with a residual, ``x + conv(x)`` (``weight`` zero at init: the identity).

    ``forward(x [B,T,D], window [B,w-1,D] or None, mask, reset) -> (y, new_window)``: ``window`` holds the last
    ``w - 1`` inputs (zeros at the start of a stream). Padded positions enter as zeros, so left padding is exact; at a
    ``reset`` (``[B, T]`` bool: a document starts there) the taps reaching back before it read zeros.
    """

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, 1, width))

    def forward(self, x, window=None, mask=None, reset=None):
        B, T, D = x.shape
        width = self.weight.shape[-1]
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if window is None:
            window = x.new_zeros(B, width - 1, D)
        full = torch.cat([window.to(x.dtype), x], dim=1)
        if reset is None:
            y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype), groups=D).transpose(1, 2)
            return x + y, full[:, T:]
        # Document index of every position (the window's are 0): a tap counts only within its position's document.
        doc = torch.cat([reset.new_zeros(B, width - 1, dtype=torch.long), reset.long().cumsum(1)], dim=1)
        weight = self.weight[:, 0].to(x.dtype)
        y = sum(full[:, k:k + T] * ((doc[:, k:k + T] == doc[:, width - 1:])[..., None] * weight[:, k])
                for k in range(width))  # one tap at a time: 5x faster than an unfold + einsum (forward + backward)
        return x + y, full[:, T:] * (doc[:, T:] == doc[:, -1:])[..., None].to(x.dtype)


class BilinearMixer(nn.Module):
    """Multi-head bilinear recurrence ``h_t = A(x_t) h_{t-1}`` with a normalized, gated readout.

    ``forward(x, state, mask, offset) -> (y, states, final_state)``: the layer receives and returns its state
    (``states``: the state after every position, ``[B, T, heads, state_size]``).
    """

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        N, H, R = config.num_heads, config.state_size, config.rank
        self.num_heads, self.state_size = N, H
        self.mixer_type = config.mixer_type
        self.factor_size = R if config.mixer_type in ("cp", "full", "block_diagonal") else H
        # One fused input projection: [input factors | output gate | additive input | write channel (b, log gamma)].
        self.split_sizes = [N * self.factor_size, N * H if config.use_gate else 0, N * H if config.additive_input else 0,
                            (N if config.coupled_write else N * (H + 1)) if config.write_channel else 0]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes))
        self.factor_bias = nn.Parameter(torch.zeros(N * self.factor_size))
        if config.write_channel:
            self.c0 = nn.Parameter(torch.empty(N, 1))  # the write channel's initial coordinate
        if config.coupled_write:
            self.write_vector = nn.Parameter(torch.empty(N, R))  # w of coupled_write_channel_weights
        if config.mixer_type == "cp":
            self.W1 = nn.Parameter(torch.empty(N, H, R))
            self.W2 = nn.Parameter(torch.empty(N, H, R))
        elif config.mixer_type == "full":
            self.W = nn.Parameter(torch.empty(N, H, H, R))
        elif config.mixer_type == "block_diagonal":
            b = config.block_size
            self.W = nn.Parameter(torch.empty(N, H // b, b, b, R))
        self.h0 = nn.Parameter(torch.empty(N, H))
        self.state_norm = BilinearStateNorm(N, H)
        self.out_proj = Linear(N * H, config.hidden_size)

    @torch.no_grad()
    def reset_parameters(self):
        """Initialization that keeps long products of transitions well conditioned.

        Every transition starts near the identity: the input factors are ``1 + small noise`` (bias 1, small
        input weights) and the transition weights compose to the identity (CP: ``W1 = W2 = Q`` with orthonormal
        columns, so ``M = W2^T W1 = I`` and ``A(x) ~ Q Q^T``; full/block: ``W_k = I / R + noise``). Products
        of near-identity maps neither explode nor vanish, which is what made training work in our measurements
        (plain random init was much worse). Positive diagonals start at slow decays in (0.9, 0.999), as Mamba.
        """
        cfg, N, H = self.config, self.num_heads, self.state_size
        std = cfg.input_factor_init_std
        factor_rows = self.split_sizes[0]
        row_std = torch.full((self.in_proj.weight.shape[0], 1), cfg.initializer_range)
        row_std[:factor_rows] = std / cfg.input_factor_multiplier  # the same u(x) at init for any multiplier
        init.copy_(self.in_proj.weight, torch.randn(self.in_proj.weight.shape) * row_std)
        init.ones_(self.factor_bias)
        if self.mixer_type == "cp":
            q, _ = torch.linalg.qr(torch.randn(N, max(H, cfg.rank), min(H, cfg.rank)))
            q = q if H >= cfg.rank else q.transpose(1, 2)
            init.copy_(self.W1, q @ rope_rotation(cfg.rank, cfg.rotation_init_base) if cfg.rotation_init_base else q)
            init.copy_(self.W2, q)
            init.copy_(self.factor_bias, torch.linspace(cfg.factor_bias_min, 1.0, cfg.rank).repeat(N))
        elif self.mixer_type in ("full", "block_diagonal"):
            b = H if self.mixer_type == "full" else cfg.block_size
            eye = torch.eye(b).unsqueeze(-1) / cfg.rank
            init.copy_(self.W, eye.expand(self.W.shape) + torch.randn(self.W.shape) / (b * math.sqrt(cfg.rank)))
        elif self.mixer_type == "rotation":
            init.copy_(self.factor_bias, torch.tensor([1.0, 0.0]).repeat(factor_rows // 2))
        elif self.mixer_type == "positive_diagonal":
            decay = torch.linspace(0.9, 0.999, H).repeat(N)
            init.copy_(self.factor_bias, torch.logit(decay))
        h0 = torch.randn(N, H)
        init.copy_(self.h0, h0 / h0.norm(dim=-1, keepdim=True))
        init.ones_(self.state_norm.weight)
        if cfg.write_channel:  # writes start at the input-projection scale, gamma(x) = exp(small) ~ 1
            init.ones_(self.c0)
        if cfg.coupled_write:  # writes W1 (u * w) start at about the state's unit norm
            init.copy_(self.write_vector, torch.randn(N, cfg.rank) / math.sqrt(cfg.rank))
        init.normal_(self.out_proj.weight, mean=0.0, std=cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers))

    def _transition(self, dtype):
        if self.mixer_type == "cp":
            W1, W2 = self.W1.to(dtype), self.W2.to(dtype)
            if self.config.coupled_write:
                return CPTransition(*coupled_write_channel_weights(W1, W2, self.write_vector))
            return CPTransition(*write_channel_weights(W1, W2)) if self.config.write_channel else CPTransition(W1, W2)
        if self.mixer_type == "full":
            return partial(full_transition, W=self.W.to(dtype))
        if self.mixer_type == "block_diagonal":
            return partial(block_diagonal_transition, W=self.W.to(dtype))
        if self.mixer_type == "rotation":
            return rotation_transition
        return diagonal_transition

    def _inputs(self, x, state):
        """``(transition, factors [B,T,N,F], gate, additive [B,T,N,H] or None, h0, h_start)``, the recurrence's
        inputs in at least fp32 (``h0``: ``state``, else ``h_start``, the learned initial state).

        Call under disabled autocast: long products of transitions need the range.
        """
        B, T, _ = x.shape
        N, H = self.num_heads, self.state_size
        factors, gate, additive, write = self.in_proj(x).split(self.split_sizes, dim=-1)
        if self.config.input_factor_multiplier != 1:
            factors = factors * self.config.input_factor_multiplier
        factors = factors + self.factor_bias.to(factors.dtype)
        if self.mixer_type == "positive_diagonal":
            factors = torch.sigmoid(factors)
        dtype = torch.promote_types(x.dtype, torch.float32)
        factors = factors.to(dtype).view(B, T, N, self.factor_size)
        additive = additive.to(dtype).view(B, T, N, H) if self.config.additive_input else None
        h_start = self.h0
        if self.config.write_channel:  # factors [u | b | gamma] ([u | gamma] when coupled), state [h | c]
            write = write.to(dtype).view(B, T, N, -1)
            factors = torch.cat([factors, write[..., :-1], write[..., -1:].exp()], dim=-1)
            h_start = torch.cat([self.h0, self.c0], dim=-1)
        h_start = h_start.to(dtype)
        h0 = h_start if state is None else state.to(dtype)
        return self._transition(dtype), factors, gate, additive, h0, h_start

    def _readout(self, states, gate, dtype):
        """``Wo(StateNorm(h) * act(gate))``; with the write channel ``h`` is the state without its last coordinate
        (the normalized output is invariant to the scale of ``[h; c]`` together)."""
        y = self.state_norm(states[..., :self.state_size]).flatten(2).to(dtype)
        if self.config.use_gate:
            y = y * _ACTIVATIONS[self.config.gate_activation](gate)
        return self.out_proj(y)

    def forward(self, x, state=None, mask=None, offset: int = 0, reset=None):
        """``reset``: optional ``[B, T]`` bool, positions where a document starts (the state restarts from ``h0``)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            transition, factors, gate, additive, h0, h_start = self._inputs(x, state)
            cfg = self.config
            states, final = recurrence(transition, factors, h0, mask, cfg.norm_chunk_size, offset,
                                       cfg.recurrence_impl, additive, reset, h_start)
        return self._readout(states, gate, x.dtype), states, final

    def step(self, x, state=None, mask=None, offset: int = 0, reset=None):
        """One decoding position: ``x [B, 1, D] -> (y [B, 1, D], new_state [B, N, H])``, equal to ``forward``."""
        chunk = self.config.norm_chunk_size
        with torch.autocast(device_type=x.device.type, enabled=False):
            transition, factors, gate, additive, h0, h_start = self._inputs(x, state)
            h = reference_step(transition, factors[:, 0], h0.expand(x.shape[0], *h0.shape[-2:]),
                               None if mask is None else mask[:, 0], is_boundary(chunk, offset, 0), guard=chunk > 0,
                               additive_t=None if additive is None else additive[:, 0],
                               reset_t=None if reset is None else reset[:, 0], h_start=h_start)
        return self._readout(h[:, None], gate, x.dtype), h


class BilinearMLP(nn.Module):
    """SwiGLU MLP (gate and up projections fused)."""

    def __init__(self, config: BilinearConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class BilinearBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: ``x + Mixer(norm(x))``, then ``x + MLP(norm(x))`` if the config has an MLP."""

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.conv = BilinearShortConv(config.hidden_size, config.conv_width) if config.conv_width else None
        self.conv_residual = config.conv_residual
        self.mixer = BilinearMixer(config, layer_idx)
        if config.use_mlp:
            self.mlp_norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = BilinearMLP(config)
        else:
            self.mlp = None

    def forward(self, hidden_states, state=None, mask=None, offset: int = 0, conv_state=None, reset=None):
        """``(hidden [B,T,D], state, mask, offset, conv_state, reset) -> (hidden, states [B,T,N,H],
        final_state [B,N,H], conv_state)`` (``conv_state``: the convolution's last inputs, None without one;
        ``reset``: ``[B, T]`` bool, document starts, or None)."""
        if hidden_states.shape[1] == 1:
            hidden_states, final_state, conv_state = self.step(hidden_states, state, mask, offset, conv_state, reset)
            return hidden_states, final_state[:, None], final_state, conv_state
        hidden_states, mixer_input, conv_state = self._mixer_input(hidden_states, conv_state, mask, reset)
        mixed, states, final_state = self.mixer(mixer_input, state, mask, offset, reset)
        return self._mlp_residual(hidden_states + mixed), states, final_state, conv_state

    def step(self, hidden_states, state=None, mask=None, offset: int = 0, conv_state=None, reset=None):
        """One decoding position ``[B, 1, D] -> (hidden, new_state, conv_state)``: one compiled call where
        :func:`~.ops.fused_decode_weights` covers it, else the modules (``BilinearMixer.step``)."""
        weights = fused_decode_weights(self, hidden_states)
        if weights is None:
            hidden_states, mixer_input, conv_state = self._mixer_input(hidden_states, conv_state, mask, reset)
            mixed, new_state = self.mixer.step(mixer_input, state, mask, offset, reset)
            return self._mlp_residual(hidden_states + mixed), new_state, conv_state
        B, _, D = hidden_states.shape
        chunk = self.mixer.config.norm_chunk_size
        h_start = self.mixer.h0.to(hidden_states.dtype)
        h0 = h_start.expand(B, *h_start.shape) if state is None else state.to(hidden_states.dtype)
        if reset is not None:  # a document starts here: the step starts from h_start (a padded row keeps its state)
            restart = reset[:, 0].bool() if mask is None else reset[:, 0].bool() & mask[:, 0].bool()
            h0 = torch.where(restart[:, None, None], h_start, h0)
        x_new, h_new = built_kernel().decode_block(
            x=hidden_states.reshape(B, D).contiguous(), h=h0.contiguous(),
            keep=hidden_states.new_empty(0, dtype=torch.bool) if mask is None else mask[:, 0].bool().contiguous(),
            boundary=is_boundary(chunk, offset, 0), guard=chunk > 0, eps=self.mixer_norm.eps,  # both norms' eps
            factor_scale=self.mixer.config.input_factor_multiplier, **weights._asdict())
        return x_new.view(B, 1, D), h_new, None

    def _mixer_input(self, hidden_states, conv_state, mask, reset):
        """``(residual stream, mixer input, conv_state)``: the convolution, if any, acts on the residual stream
        (``conv_residual``) or on the mixer's normalized input."""
        if self.conv is None:
            return hidden_states, self.mixer_norm(hidden_states), None
        if self.conv_residual:
            hidden_states, conv_state = self.conv(hidden_states, conv_state, mask, reset)
            return hidden_states, self.mixer_norm(hidden_states), conv_state
        mixer_input, conv_state = self.conv(self.mixer_norm(hidden_states), conv_state, mask, reset)
        return hidden_states, mixer_input, conv_state

    def _mlp_residual(self, hidden_states):
        if self.mlp is None:
            return hidden_states
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))

    def projections(self) -> list[nn.Module]:
        """The block's linear projections (the fused decoding step covers only this package's ``Linear``)."""
        mixer = [self.mixer.in_proj, self.mixer.out_proj]
        return mixer if self.mlp is None else [*mixer, self.mlp.gate_up_proj, self.mlp.down_proj]


def document_starts(input_ids, eos_token_id, mask=None, follows_eos=None):
    """``(reset [B, T], follows_eos [B])``: the positions right after an EOS token (the first position too where
    ``follows_eos``, carried by the cache across calls, says the previous call ended with one), and whether each
    row's last unpadded token is EOS (rows with no unpadded token keep ``follows_eos``)."""
    B, T = input_ids.shape
    eos_ids = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id],
                           device=input_ids.device)
    is_eos = torch.isin(input_ids, eos_ids)
    before = torch.zeros(B, dtype=torch.bool, device=input_ids.device) if follows_eos is None else follows_eos
    reset = torch.cat([before[:, None], is_eos[:, :-1]], dim=1)
    if mask is None:
        return reset, is_eos[:, -1]
    positions = torch.arange(T, device=input_ids.device)
    last = torch.where(mask.bool(), positions, -1).amax(dim=1)
    last_is_eos = is_eos.gather(1, last.clamp_min(0)[:, None])[:, 0]
    return reset, torch.where(last >= 0, last_is_eos, before)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a ValueError naming the problem and the fix for empty ``input_ids`` or ids outside ``[0, vocab_size)``
    (instead of torch's ``IndexError: index out of range in self``)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq_len] with seq_len >= 1, got shape {tuple(input_ids.shape)}; "
                         "pass at least one token per row")
    low, high = input_ids.min().item(), input_ids.max().item()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); the tokenizer does "
                         f"not match the model: use the tokenizer saved with the checkpoint, or build the model with "
                         f"vocab_size >= {high + 1} (e.g. len(tokenizer))")


class BilinearPreTrainedModel(PreTrainedModel):
    config: BilinearConfig
    config_class = BilinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BilinearBlock"]
    _is_stateful = True
    _supports_flash_attn = False
    _supports_sdpa = False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BilinearMixer):
            module.reset_parameters()
        elif isinstance(module, BilinearShortConv):
            init.zeros_(module.weight)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own recurrent cache

    def optimizer_groups(self, weight_decay: float, transition_lr: float | None = None) -> list[dict]:
        """AdamW parameter groups (nanoGPT's ``configure_optimizers``): ``[{"params": decay, "weight_decay":
        weight_decay}, {"params": no_decay, "weight_decay": 0.0}]``; with ``transition_lr``, the transition weights
        (``W1``, ``W2``, ``W``, ``write_vector``) and ``factor_bias`` move to two more groups (same decay rules) with
        that ``"lr"``.

        Decayed: the projection and embedding matrices (``nn.Linear`` / ``nn.Embedding`` weights), the transition
        weights (``W1``, ``W2``, ``W``, ``write_vector``) and the short convolution's weight. Not decayed: norm weights
        (including the state norm's scale), ``factor_bias`` (the input factors' offset, 1 at init), ``h0`` and ``c0``
        (initial states; the output is invariant to their scale). A parameter that no rule names is an error, so a new one
        gets a decision. Tied weights appear once; frozen parameters are left out.
        """
        groups = {(decay, own_lr): [] for decay in (True, False) for own_lr in (False, True)}
        seen = set()
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                own_lr = transition_lr is not None and isinstance(module, BilinearMixer) and \
                    name in ("W1", "W2", "W", "write_vector", "factor_bias")
                if (isinstance(module, (nn.Linear, nn.Embedding, BilinearShortConv)) and name == "weight") or \
                        (isinstance(module, BilinearMixer) and name in ("W1", "W2", "W", "write_vector")):
                    groups[True, own_lr].append(param)
                elif (isinstance(module, (BilinearRMSNorm, BilinearStateNorm)) and name == "weight") or \
                        (isinstance(module, BilinearMixer) and name in ("factor_bias", "h0", "c0")) or \
                        (isinstance(module, nn.Linear) and name == "bias"):
                    groups[False, own_lr].append(param)
                else:
                    raise ValueError(f"optimizer_groups: no weight-decay rule for parameter "
                                     f"{module_name + '.' if module_name else ''}{name}; add one")
        result = [{"params": groups[True, False], "weight_decay": weight_decay},
                  {"params": groups[False, False], "weight_decay": 0.0}]
        if transition_lr is not None:
            result += [{"params": groups[True, True], "weight_decay": weight_decay, "lr": transition_lr},
                       {"params": groups[False, True], "weight_decay": 0.0, "lr": transition_lr}]
        return result


class BilinearModel(BilinearPreTrainedModel):
    """Embeddings, a stack of bilinear blocks and a final norm (no positional embedding: the recurrence is ordered)."""

    def __init__(self, config: BilinearConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([BilinearBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: BilinearCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_mixer_states: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BilinearModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BilinearModel.forward: pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            if not torch.compiler.is_compiling():  # the check reads the ids on the host: not inside a graph
                check_input_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        elif inputs_embeds.shape[1] == 0:
            raise ValueError("BilinearModel.forward: inputs_embeds has no positions (shape "
                             f"{tuple(inputs_embeds.shape)}); pass at least one position")
        if inputs_embeds.device.type == "cpu":
            build_kernels()  # the one place the CPU kernels are built (once; a no-op afterwards)
        output_hidden_states = output_hidden_states if output_hidden_states is not None \
            else self.config.output_hidden_states
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = BilinearCache(self.config.num_hidden_layers)
        T = inputs_embeds.shape[1]
        mask = None
        if attention_mask is not None:
            # generate() passes the mask of the whole sequence so far: keep the columns of this call.
            mask = attention_mask[:, -T:]
            if bool(mask.all()):
                mask = None
        offset = past_key_values.seen_tokens if past_key_values is not None else 0
        reset = None
        if self.config.reset_state_at_eos and input_ids is not None:
            reset, follows_eos = document_starts(
                input_ids, self.config.eos_token_id, mask, None if past_key_values is None else past_key_values.follows_eos)
            if past_key_values is not None:
                past_key_values.follows_eos = follows_eos

        hidden_states = inputs_embeds
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_mixer_states = () if output_mixer_states else None
        for i, layer in enumerate(self.layers):
            state, conv_state = (None, None) if past_key_values is None else \
                (past_key_values.states[i], past_key_values.conv_states[i])
            hidden_states, states, final_state, conv_state = layer(hidden_states, state, mask, offset, conv_state, reset)
            if output_mixer_states:
                all_mixer_states += (states,)
            if past_key_values is not None:
                past_key_values.states[i], past_key_values.conv_states[i] = final_state, conv_state
            if output_hidden_states and i < len(self.layers) - 1:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        return BilinearModelOutput(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            mixer_states=all_mixer_states,
        )


class BilinearForCausalLM(BilinearPreTrainedModel, GenerationMixin):
    """Bilinear LM with a language-modelling head (tied to the input embeddings by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BilinearConfig):
        super().__init__(config)
        self.model = BilinearModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: BilinearCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_mixer_states: bool = False,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> BilinearCausalLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_mixer_states=output_mixer_states,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return BilinearCausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            mixer_states=outputs.mixer_states,
        )


__all__ = ["BilinearCache", "BilinearModel", "BilinearForCausalLM", "BilinearPreTrainedModel"]
