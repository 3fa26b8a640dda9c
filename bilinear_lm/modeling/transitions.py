"""Transition types of the bilinear mixer: one small class each, ``h_t = A(x_t) h_{t-1}`` per head.

A transition owns its parameters, their initialization, the checks it needs of the config, the number of input
factors it reads per head, how raw projections become factors (offset, scale, activation), the map ``h -> A(u) h``,
its explicit matrices (the tests' reference) and its defaults in the probes; :meth:`Transition.forward` runs the
whole recurrence through the one dispatch point (``dispatch.recurrence``). The mixer owns the projections and the
readout only. A new type is a subclass here, registered in ``TRANSITIONS`` under a name listed in
``configuration_bilinear.MIXER_TYPES`` (the config validates names only; a test checks the two agree).

Shapes: batch ``B``, time ``T``, heads ``N``, state ``H``, rank ``R``; factors ``[B, T, N, F]``.
"""

import math
from functools import partial

import torch
from torch import nn
from transformers import initialization as init

from .dispatch import cpu_kernels_available, recurrence
from .bilinear_reference import CPTransition, block_diagonal_transition, diagonal_transition, full_transition, \
    rotation_transition


class Transition(nn.Module):
    """Base class. Subclasses set ``factor_size`` (factors per head the map reads) and define :meth:`map` and
    :meth:`matrices`.

    Factors are ``factor_bias + input_factor_multiplier * raw`` (then :meth:`activation`), so under Adam the
    multiplier is their learning rate relative to the other weights' (the projection starts at
    ``input_factor_init_std / multiplier``: the same model at initialization).
    """

    factor_size: int

    def __init__(self, config):
        super().__init__()
        self.validate(config)
        self.config = config
        self.num_heads, self.state_size = config.num_heads, config.state_size
        self.factor_bias = nn.Parameter(torch.empty(config.num_heads, self.factor_size))

    @classmethod
    def validate(cls, config) -> None:
        """Raise a ``ValueError`` naming the field and the fix if ``config`` does not fit this type (none by
        default)."""

    @classmethod
    def probe_overrides(cls, probe, num_symbols: int) -> dict:
        """``BilinearConfig`` fields of this type's probe model, from a ``ProbeConfig`` (``rank``, ``state_size``,
        ``block_size``) and the task's number of symbols: ``rank = probe.rank``, else the state size."""
        return {"rank": probe.rank or probe.state_size}

    def input_init_std(self) -> torch.Tensor:
        """``[factor_size]``: the initialization std of each projection row this transition reads."""
        cfg = self.config
        return torch.full((self.factor_size,), cfg.input_factor_init_std / cfg.input_factor_multiplier)

    @torch.no_grad()
    def reset_parameters(self):
        """Transitions start near the identity (factors ``1 + small noise``), so that long products of them neither
        explode nor vanish: what made training work in our measurements (plain random init was much worse)."""
        init.ones_(self.factor_bias)

    def activation(self, factors):
        return factors

    def factors(self, raw):
        """``[B, T, N, factor_size]`` projections -> factors (in the dtype of ``raw``)."""
        if self.config.input_factor_multiplier != 1:
            raw = raw * self.config.input_factor_multiplier
        return self.activation(raw + self.factor_bias.to(raw.dtype))

    def map(self, dtype):
        """The map ``(h [B, N, H], u_t [B, N, F]) -> A(u_t) h`` with the weights cast to ``dtype`` once
        (a :class:`~.bilinear_reference.CPTransition` where the fast rank-space scans apply)."""
        raise NotImplementedError

    def matrices(self, u):
        """``A(u)`` written out, ``[..., N, H, H]`` for factors ``u [..., N, F]``: the textbook form the tests check
        :meth:`map` against (independent code)."""
        raise NotImplementedError

    def forward(self, raw, h0, h_start, mask=None, offset: int = 0, additive=None, reset=None):
        """Run the recurrence: ``raw`` ``[B, T, N, factor_size]`` projections, ``h0`` the incoming state (``[N, H]``
        or ``[B, N, H]``), ``h_start`` ``[N, H]`` the learned start (a document restarts from it where ``reset``).
        Returns ``(states [B, T, N, H], final [B, N, H])`` in ``raw``'s dtype (at least fp32)."""
        u = self.factors(raw)
        cfg = self.config
        return recurrence(self.map(u.dtype), u, h0.to(u.dtype), mask, cfg.norm_chunk_size, offset,
                          cfg.recurrence_impl, additive, reset, h_start.to(u.dtype))


class CP(Transition):
    """``A(x) = W1 diag(u(x)) W2^T`` (CP-factored, rank ``R``), with ``W1, W2: [N, H, R]``; ``W1 = W2 = Q`` with
    orthonormal columns at init, so ``M = W2^T W1 = I``. The one type with fast rank-space scans."""

    def __init__(self, config):
        self.factor_size = config.rank
        super().__init__(config)
        N, H, R = config.num_heads, config.state_size, config.rank
        self.W1 = nn.Parameter(torch.empty(N, H, R))
        self.W2 = nn.Parameter(torch.empty(N, H, R))

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        N, H, R = self.W1.shape
        q, _ = torch.linalg.qr(torch.randn(N, max(H, R), min(H, R)))
        q = q if H >= R else q.transpose(1, 2)
        init.copy_(self.W1, q)
        init.copy_(self.W2, q)

    def map(self, dtype):
        return CPTransition(self.W1.to(dtype), self.W2.to(dtype))

    def matrices(self, u):
        return torch.einsum("nir,...nr,njr->...nij", self.W1, u, self.W2)


class Full(Transition):
    """``A(x) = sum_k u_k(x) W_k``: one ``H x H`` matrix per input factor (``rank`` of them), ``W: [N, H, H, R]``."""

    def __init__(self, config):
        self.factor_size = config.rank
        super().__init__(config)
        self.W = nn.Parameter(torch.empty(config.num_heads, *self.block_shape(config), config.rank))

    @classmethod
    def probe_overrides(cls, probe, num_symbols: int) -> dict:
        """One state matrix per task symbol (``rank = num_symbols``: the paper's ``A(x) = sum_s x_s W_s`` for one-hot
        ``x``) unless ``probe.rank`` is set."""
        return {"rank": probe.rank or num_symbols}

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

    def matrices(self, u):
        return torch.einsum("nijk,...nk->...nij", self.W, u)


class BlockDiagonal(Full):
    """Full bilinear blocks of size ``block_size`` on the diagonal, ``W: [N, H / b, b, b, R]``."""

    @classmethod
    def validate(cls, config) -> None:
        if config.state_size % config.block_size:
            raise ValueError(f"BilinearConfig.state_size ({config.state_size}) must be divisible by block_size "
                             f"({config.block_size}) for mixer_type='block_diagonal'")

    @classmethod
    def probe_overrides(cls, probe, num_symbols: int) -> dict:
        return {"rank": probe.rank or probe.state_size, "block_size": probe.block_size}

    @staticmethod
    def block_shape(config):
        b = config.block_size
        return config.state_size // b, b, b

    def map(self, dtype):
        return partial(block_diagonal_transition, W=self.W.to(dtype))

    def matrices(self, u):
        blocks = torch.einsum("nzijk,...nk->...nzij", self.W, u)  # [..., N, nb, b, b]
        A = u.new_zeros(*blocks.shape[:-3], self.state_size, self.state_size)
        b = blocks.shape[-1]
        for z in range(blocks.shape[-3]):
            A[..., z * b:(z + 1) * b, z * b:(z + 1) * b] = blocks[..., z, :, :]
        return A


class Rotation(Transition):
    """2x2 rotation/scaling blocks (a complex diagonal), each entry linear in ``x``: factors ``(a, c)`` per block,
    ``[[a, -c], [c, a]]``; starts at ``(1, 0)``, the identity."""

    def __init__(self, config):
        self.factor_size = config.state_size
        super().__init__(config)

    @classmethod
    def validate(cls, config) -> None:
        if config.state_size % 2:
            raise ValueError(f"BilinearConfig.state_size ({config.state_size}) must be even for "
                             "mixer_type='rotation' (2x2 blocks)")

    @torch.no_grad()
    def reset_parameters(self):
        init.copy_(self.factor_bias, torch.tensor([1.0, 0.0]).repeat(self.num_heads, self.factor_size // 2))

    def map(self, dtype):
        return rotation_transition

    def matrices(self, u):
        A = u.new_zeros(*u.shape, self.state_size)
        for k in range(self.state_size // 2):
            a, c = u[..., 2 * k], u[..., 2 * k + 1]
            A[..., 2 * k, 2 * k], A[..., 2 * k, 2 * k + 1] = a, -c
            A[..., 2 * k + 1, 2 * k], A[..., 2 * k + 1, 2 * k + 1] = c, a
        return A


class Diagonal(Transition):
    """A real diagonal, linear in ``x`` (may be negative: solves parity, not modular addition)."""

    def __init__(self, config):
        self.factor_size = config.state_size
        super().__init__(config)

    def map(self, dtype):
        return diagonal_transition

    def matrices(self, u):
        return torch.diag_embed(u)


class PositiveDiagonal(Diagonal):
    """A diagonal in ``(0, 1)`` (``sigmoid``), Mamba-like; starts at slow decays in ``(0.9, 0.999)``, as Mamba."""

    @torch.no_grad()
    def reset_parameters(self):
        decay = torch.linspace(0.9, 0.999, self.factor_size).repeat(self.num_heads, 1)
        init.copy_(self.factor_bias, torch.logit(decay))

    def activation(self, factors):
        return torch.sigmoid(factors)


# mixer_type -> class (the expressivity hierarchy: full > cp > block_diagonal > rotation > diagonal > positive).
TRANSITIONS = {"cp": CP, "full": Full, "block_diagonal": BlockDiagonal, "rotation": Rotation, "diagonal": Diagonal,
               "positive_diagonal": PositiveDiagonal}


def build_kernels(config, device_type: str) -> None:
    """Build now what ``config.recurrence_impl`` will compile on ``device_type`` (the C++ scan on CPU), so that the
    first training step (and its tokens/s) does not pay for the build. A no-op where nothing would be built (only
    the CP transitions without additive input run a scan)."""
    if device_type == "cpu" and config.recurrence_impl in ("auto", "cpp") \
            and issubclass(TRANSITIONS[config.mixer_type], CP) and not config.additive_input:
        cpu_kernels_available()
