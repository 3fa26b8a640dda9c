"""Bilinear recurrent language model: Mixer -> Block -> BilinearModel -> BilinearForCausalLM.

``save_pretrained`` copies this module and its relative imports as remote code: it imports only torch,
transformers and same-folder modules.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_bilinear import BilinearConfig
from .cpu_kernels import SMALL_BATCH_ROWS, Linear, kernel_available_for, load_kernel
from .recurrence import (
    block_diagonal_transition,
    cp_recurrence,
    cp_transition,
    diagonal_transition,
    full_transition,
    reference_recurrence,
    rotation_transition,
)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class BilinearCache:
    """Recurrent cache: each layer's state ``[batch, heads, state_size]``, O(1) memory in sequence length.

    ``generate()`` receives it as ``past_key_values``; beam search reorders it in place.
    """

    is_compileable = False

    def __init__(self, num_layers: int):
        self.states: list[torch.Tensor | None] = [None] * num_layers
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions consumed so far (padding included)."""
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows in place (beam search)."""
        self.states = [None if s is None else s.index_select(0, beam_idx.to(s.device)) for s in self.states]

    def __len__(self) -> int:
        return len(self.states)


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


class BilinearMixer(nn.Module):
    """Multi-head bilinear recurrence ``h_t = A(x_t) h_{t-1}`` with a normalized, gated readout.

    ``forward(x, state, mask, offset) -> (y, final_state)``: the layer receives and returns its state.
    """

    def __init__(self, config: BilinearConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        N, H, R = config.num_heads, config.state_size, config.rank
        self.num_heads, self.state_size = N, H
        self.mixer_type = config.mixer_type
        self.factor_size = R if config.mixer_type in ("cp", "full", "block_diagonal") else H
        # One fused input projection: [input factors | output gate | additive input].
        self.split_sizes = [N * self.factor_size, N * H if config.use_gate else 0, N * H if config.additive_input else 0]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes))
        self.factor_bias = nn.Parameter(torch.zeros(N * self.factor_size))
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
        row_std[:factor_rows] = std
        init.copy_(self.in_proj.weight, torch.randn(self.in_proj.weight.shape) * row_std)
        init.ones_(self.factor_bias)
        if self.mixer_type == "cp":
            q, _ = torch.linalg.qr(torch.randn(N, max(H, cfg.rank), min(H, cfg.rank)))
            q = q if H >= cfg.rank else q.transpose(1, 2)
            init.copy_(self.W1, q)
            init.copy_(self.W2, q)
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
        init.normal_(self.out_proj.weight, mean=0.0, std=cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers))

    def _transition(self, dtype):
        if self.mixer_type == "cp":
            return partial(cp_transition, W1=self.W1.to(dtype), W2=self.W2.to(dtype))
        if self.mixer_type == "full":
            return partial(full_transition, W=self.W.to(dtype))
        if self.mixer_type == "block_diagonal":
            return partial(block_diagonal_transition, W=self.W.to(dtype))
        if self.mixer_type == "rotation":
            return rotation_transition
        return diagonal_transition

    def forward(self, x, state=None, mask=None, offset: int = 0):
        B, T, _ = x.shape
        N, H = self.num_heads, self.state_size
        factors, gate, additive = self.in_proj(x).split(self.split_sizes, dim=-1)
        factors = factors + self.factor_bias.to(factors.dtype)
        if self.mixer_type == "positive_diagonal":
            factors = torch.sigmoid(factors)
        # The recurrence always runs in at least fp32 (outside autocast): long products need the range.
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            factors = factors.to(dtype).view(B, T, N, self.factor_size)
            h0 = (self.h0 if state is None else state).to(dtype)
            chunk = self.config.norm_chunk_size
            impl = self.config.recurrence_impl
            if self.mixer_type == "cp" and not self.config.additive_input and impl != "reference":
                states, final = cp_recurrence(
                    factors, self.W1.to(dtype), self.W2.to(dtype), h0, mask, chunk, offset, impl)
            else:
                add = additive.to(dtype).view(B, T, N, H) if self.config.additive_input else None
                states, final = reference_recurrence(self._transition(dtype), factors, h0, mask, chunk, offset, add)
            y = self.state_norm(states).flatten(2)
        y = y.to(x.dtype)
        if self.config.use_gate:
            y = y * F.silu(gate)
        return self.out_proj(y), final


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
        self.mixer = BilinearMixer(config, layer_idx)
        if config.use_mlp:
            self.mlp_norm = BilinearRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = BilinearMLP(config)
        else:
            self.mlp = None

    def forward(self, hidden_states, state=None, mask=None, offset: int = 0):
        weights = self._fused_decode_weights(hidden_states)
        if weights is not None:
            return self._fused_decode_step(hidden_states, weights, state, mask, offset)
        mixed, final_state = self.mixer(self.mixer_norm(hidden_states), state, mask, offset)
        hidden_states = hidden_states + mixed
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return hidden_states, final_state

    def _fused_decode_weights(self, x) -> list | None:
        """The weights for the compiled one-call decoding step if it covers this call, else None (the modules run).

        Covered: one position, at most ``SMALL_BATCH_ROWS`` rows, no gradients, no autocast, CPU fp32/fp64 with
        every weight contiguous and in ``x``'s dtype, the CP mixer without additive input, silu MLP or none,
        recurrence ``auto`` or ``cpp``, and the projections still this package's ``Linear`` (adapters such as LoRA
        that replace them take the modules; forward hooks on the submodules are not run by the fused step).
        """
        cfg, mixer, mlp = self.mixer.config, self.mixer, self.mlp
        if not (x.shape[1] == 1 and x.shape[0] <= SMALL_BATCH_ROWS and not torch.is_grad_enabled()
                and cfg.mixer_type == "cp" and not cfg.additive_input and cfg.hidden_act == "silu"
                and cfg.recurrence_impl in ("auto", "cpp") and not torch.is_autocast_enabled(x.device.type)
                and type(mixer.in_proj) is Linear and type(mixer.out_proj) is Linear
                and (mlp is None or type(mlp.gate_up_proj) is Linear and type(mlp.down_proj) is Linear)
                and kernel_available_for(x)):
            return None
        empty = torch.empty(0, dtype=x.dtype)
        weights = [self.mixer_norm.weight, mixer.in_proj.weight, mixer.factor_bias, mixer.W1, mixer.W2,
                   mixer.state_norm.weight, mixer.out_proj.weight,
                   *([self.mlp_norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight] if mlp else [empty] * 3)]
        return weights if all(w.dtype == x.dtype and w.is_contiguous() for w in weights) else None

    def _fused_decode_step(self, x, weights, state, mask, offset):
        B, _, D = x.shape
        chunk = self.mixer.config.norm_chunk_size
        h = (self.mixer.h0 if state is None else state).to(x.dtype).expand(B, *self.mixer.h0.shape).contiguous()
        keep = torch.empty(0, dtype=torch.bool) if mask is None else mask[:, 0].bool().expand(B).contiguous()
        norm_w, *rest = weights  # both RMSNorms take config.rms_norm_eps
        x_new, h_new = load_kernel().decode_block(
            x.reshape(B, D).contiguous(), h, keep, chunk > 0 and (offset + 1) % chunk == 0, chunk > 0,
            norm_w, self.mixer_norm.eps, *rest)
        return x_new.view(B, 1, D), h_new


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

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own recurrent cache


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
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BilinearModel.forward: pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
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

        hidden_states = inputs_embeds
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            state = past_key_values.states[i] if past_key_values is not None else None
            hidden_states, final_state = layer(hidden_states, state, mask, offset)
            if past_key_values is not None:
                past_key_values.states[i] = final_state
            if output_hidden_states and i < len(self.layers) - 1:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
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
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
        )


__all__ = ["BilinearCache", "BilinearModel", "BilinearForCausalLM", "BilinearPreTrainedModel"]
