"""Transition types of the bilinear mixer: one small class each, ``h_t = A(x_t) h_{t-1}`` per head.

A transition owns its parameters, their initialization, the number of input factors it reads per head, how raw
projections become factors (offset, scale, activation) and the map ``h -> A(u) h``; :meth:`Transition.forward` runs
the whole recurrence through the one dispatch point (``dispatch.recurrence``). The mixer owns the projections and
the readout only. A new type is a subclass here, registered in ``TRANSITIONS`` (the config validates
``mixer_type`` against it).

Shapes: batch ``B``, time ``T``, heads ``N``, state ``H``, rank ``R``; factors ``[B, T, N, F]``. With
``state_columns = P > 1`` each head's state is a matrix of ``P`` columns, each transformed by ``A(x)`` (and written
to by the CP write channel, ``b(x) k_j(x)`` in column ``j``): a state ``[..., N, P * S]`` holds the columns one after
the other, and the recurrence runs them as ``B * P`` rows normalized per head (``recurrence``'s module docstring).
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .dispatch import recurrence
from .recurrence import CPTransition, CPWriteTransition, block_diagonal_transition, diagonal_transition, \
    full_transition, rotation_transition


class Transition(nn.Module):
    """Base class. Subclasses set ``factor_size`` (factors per head the map reads) and define :meth:`map`.

    ``input_size``: the projection rows per head it reads (``factor_size`` unless :meth:`factors` derives more);
    ``state_size``: the state of one column (the config's, plus one coordinate with the write channel);
    ``columns``: the columns of each head's state (``state_columns``).
    Factors are ``factor_bias + input_factor_multiplier * raw`` (then :meth:`activation`), so under Adam the
    multiplier is their learning rate relative to the other weights' (the projection starts at
    ``input_factor_init_std / multiplier``: the same model at initialization).
    """

    factor_size: int

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads, self.state_size, self.columns = config.num_heads, config.state_size, config.state_columns
        self.input_size = self.factor_size
        self.factor_bias = nn.Parameter(torch.empty(config.num_heads, self.factor_size))

    def input_init_std(self) -> torch.Tensor:
        """``[input_size]``: the initialization std of each projection row this transition reads."""
        cfg = self.config
        return torch.full((self.input_size,), cfg.input_factor_init_std / cfg.input_factor_multiplier)

    @torch.no_grad()
    def reset_parameters(self):
        """Transitions start near the identity (factors ``1 + small noise``), so that long products of them neither
        explode nor vanish: what made training work in our measurements (plain random init was much worse)."""
        init.ones_(self.factor_bias)

    def activation(self, factors):
        return factors

    def factors(self, raw):
        """``[B, T, N, input_size]`` projections -> ``[B, T, N, factor_size]`` factors (in the dtype of ``raw``)."""
        if self.config.input_factor_multiplier != 1:
            raw = raw * self.config.input_factor_multiplier
        return self.activation(raw + self.factor_bias.to(raw.dtype))

    def column_factors(self, raw):
        """``[B, T, N, input_size]`` projections -> ``[B, T, N, P, factor_size]``: each column's factors (the same
        for every column unless a write addresses them)."""
        u = self.factors(raw)
        return u[..., None, :].expand(*u.shape[:-1], self.columns, u.shape[-1])

    def map(self, dtype):
        """The map ``(h [B, N, S], u_t [B, N, F]) -> A(u_t) h`` with the weights cast to ``dtype`` once
        (a :class:`~.recurrence.CPTransition` where the fast rank-space scans apply)."""
        raise NotImplementedError

    def forward(self, raw, h0, h_start, mask=None, offset: int = 0, additive=None, reset=None):
        """Run the recurrence: ``raw`` ``[B, T, N, input_size]`` projections, ``h0`` the incoming state
        (``[N, P * S]`` or ``[B, N, P * S]``), ``h_start`` ``[N, P * S]`` the learned start (a document restarts from it
        where ``reset``). Returns ``(states [B, T, N, P * S], final [B, N, P * S])`` in ``raw``'s dtype (at least
        fp32)."""
        B, T, N = raw.shape[:3]
        P, S = self.columns, self.state_size
        u = self.column_factors(raw)
        u = u.permute(0, 3, 1, 2, 4).reshape(B * P, T, N, u.shape[-1])  # columns as rows: [B * P, T, N, F]
        h0 = h0.to(u.dtype).unflatten(-1, (P, S)).transpose(-3, -2).expand(B, P, N, S).reshape(B * P, N, S)
        if P > 1:
            mask = None if mask is None else mask.repeat_interleave(P, dim=0)
            reset = None if reset is None else reset.repeat_interleave(P, dim=0)
        cfg = self.config
        states, final = recurrence(self.map(u.dtype), u, h0, mask, cfg.norm_chunk_size, offset, cfg.recurrence_impl,
                                   additive, reset, h_start.to(u.dtype).unflatten(-1, (P, S)).transpose(0, 1), P)
        states = states.unflatten(0, (B, P)).permute(0, 2, 3, 1, 4).reshape(B, T, N, P * S)
        return states, final.unflatten(0, (B, P)).transpose(1, 2).reshape(B, N, P * S)


class CP(Transition):
    """``A(x) = W1 diag(u(x)) W2^T`` (CP-factored, rank ``R``), with ``W1, W2: [N, H, R]``.

    ``W1 = W2 = Q`` with orthonormal columns at init, so ``M = W2^T W1 = I``. With ``write_channel`` each head has
    one more state coordinate ``c``: ``[h; c] -> [[A(x), b(x)], [0, gamma(x)]] [h; c]`` (``gamma = exp(.)``), an
    additive-like write with a forget rate that keeps the update linear and homogeneous
    (:class:`~.recurrence.CPWriteTransition`: the scans run the write as one more rank-space coordinate). With
    ``P = state_columns > 1`` the write is a key-value outer product, ``S_t = A(x) S_{t-1} + b(x) k(x)^T c_{t-1}``
    with ``k`` unit-norm over the ``P`` columns: column ``j`` is the write channel with the write ``b(x) k_j(x)``.
    """

    def __init__(self, config):
        self.factor_size = config.rank
        super().__init__(config)
        N, H, R = config.num_heads, config.state_size, config.rank
        self.u_rows = R  # projection rows per head for the input factors u; the write channel's rows follow
        self.W1 = nn.Parameter(torch.empty(N, H, R))
        self.W2 = nn.Parameter(torch.empty(N, H, R))
        if config.write_channel:
            self.state_size = H + 1
            self.input_size = R + H + 1  # [u | b | gamma]
            if self.columns > 1:
                self.input_size += self.columns  # the key k

    def input_init_std(self):
        std = super().input_init_std()
        std[self.u_rows:] = self.config.initializer_range  # the write channel's rows: plain projections
        return std

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        N, H, R = self.W1.shape
        q, _ = torch.linalg.qr(torch.randn(N, max(H, R), min(H, R)))
        q = q if H >= R else q.transpose(1, 2)
        init.copy_(self.W1, q)
        init.copy_(self.W2, q)

    def input_factors(self, raw):
        """The first ``u_rows`` projections -> the input factors ``u`` ``[..., factor_size]``."""
        return super().factors(raw)

    def factors(self, raw):
        u = self.input_factors(raw[..., :self.u_rows])
        if not self.config.write_channel:
            return u
        write = raw[..., self.u_rows:]  # [b | log gamma]: factors [u | b | gamma]
        return torch.cat([u, write[..., :-1], write[..., -1:].exp()], dim=-1)

    def column_factors(self, raw):
        if not (self.config.write_channel and self.columns > 1):
            return super().column_factors(raw)
        P, R, H = self.columns, self.factor_size, self.config.state_size
        u, b, gamma = self.factors(raw[..., :-P]).split([R, H, 1], dim=-1)
        k = F.normalize(raw[..., -P:], dim=-1)[..., None]  # [B, T, N, P, 1]
        shape = (*k.shape[:-1], -1)
        return torch.cat([u[..., None, :].expand(shape), k * b[..., None, :], gamma[..., None, :].expand(shape)], -1)

    def map(self, dtype):
        W1, W2 = self.W1.to(dtype), self.W2.to(dtype)
        if self.config.write_channel:
            return CPWriteTransition(W1, W2)
        return CPTransition(W1, W2)


class Identity(CP):
    """``A = I`` (``W1 = W2 = I`` fixed, ``u = 1``; nothing learned): with the write channel and ``state_columns``,
    ``S_t = S_{t-1} + b(x) k(x)^T c_{t-1}`` with ``c_t = gamma(x) c_{t-1}`` is gated linear attention, the ablation
    of ``A`` (every projection row it reads is the write's)."""

    def __init__(self, config):
        super().__init__(config)
        N, H = config.num_heads, config.state_size
        del self.W1, self.W2, self.factor_bias
        self.register_buffer("W1", torch.eye(H).expand(N, H, H).clone(), persistent=False)
        self.register_buffer("W2", self.W1.clone(), persistent=False)
        self.input_size -= self.u_rows  # no rows for u
        self.u_rows, self.factor_size = 0, H

    def reset_parameters(self):
        pass

    def input_factors(self, raw):
        """``u = 1``, from no projection rows."""
        return raw.new_ones(*raw.shape[:-1], self.factor_size)


class Full(Transition):
    """``A(x) = sum_k u_k(x) W_k``: one ``H x H`` matrix per input factor (``rank`` of them), ``W: [N, H, H, R]``."""

    def __init__(self, config):
        self.factor_size = config.rank
        super().__init__(config)
        self.W = nn.Parameter(torch.empty(config.num_heads, *self.block_shape(config), config.rank))

    @staticmethod
    def block_shape(config):
        return config.state_size, config.state_size

    @torch.no_grad()
    def reset_parameters(self):
        """``W_k = I / R + noise``: the factors sum to about the identity."""
        super().reset_parameters()
        b, R = self.W.shape[-2], self.W.shape[-1]
        eye = torch.eye(b).unsqueeze(-1) / R
        init.copy_(self.W, eye.expand(self.W.shape) + torch.randn(self.W.shape) / (b * math.sqrt(R)))

    def map(self, dtype):
        return partial(full_transition, W=self.W.to(dtype))


class BlockDiagonal(Full):
    """Full bilinear blocks of size ``block_size`` on the diagonal, ``W: [N, H / b, b, b, R]``."""

    @staticmethod
    def block_shape(config):
        b = config.block_size
        return config.state_size // b, b, b

    def map(self, dtype):
        return partial(block_diagonal_transition, W=self.W.to(dtype))


class Rotation(Transition):
    """2x2 rotation/scaling blocks (a complex diagonal), each entry linear in ``x``: factors ``(a, c)`` per block,
    ``[[a, -c], [c, a]]``; starts at ``(1, 0)``, the identity."""

    def __init__(self, config):
        self.factor_size = config.state_size
        super().__init__(config)

    @torch.no_grad()
    def reset_parameters(self):
        init.copy_(self.factor_bias, torch.tensor([1.0, 0.0]).repeat(self.num_heads, self.factor_size // 2))

    def map(self, dtype):
        return rotation_transition


class Diagonal(Transition):
    """A real diagonal, linear in ``x`` (may be negative: solves parity, not modular addition)."""

    def __init__(self, config):
        self.factor_size = config.state_size
        super().__init__(config)

    def map(self, dtype):
        return diagonal_transition


class PositiveDiagonal(Diagonal):
    """A diagonal in ``(0, 1)`` (``sigmoid``), Mamba-like; starts at slow decays in ``(0.9, 0.999)``, as Mamba."""

    @torch.no_grad()
    def reset_parameters(self):
        decay = torch.linspace(0.9, 0.999, self.factor_size).repeat(self.num_heads, 1)
        init.copy_(self.factor_bias, torch.logit(decay))

    def activation(self, factors):
        return torch.sigmoid(factors)


# mixer_type -> class (the expressivity hierarchy: full > cp > block_diagonal > rotation > diagonal > positive; identity
# is the ablation of A, linear attention with the write channel).
TRANSITIONS = {"cp": CP, "identity": Identity, "full": Full, "block_diagonal": BlockDiagonal, "rotation": Rotation,
               "diagonal": Diagonal, "positive_diagonal": PositiveDiagonal}
