"""State recurrences of the bilinear mixer.

Every mixer runs, per head, ``h_t = A(x_t) h_{t-1}`` (plus ``b_t`` only in the additive ablation), with

* ``mask``: positions where ``mask[b, t] == 0`` (padding) leave the state unchanged;
* chunked normalization: at every position ``p`` with ``p % chunk == 0`` (``p = offset + t + 1`` counts
  positions since the start of the stream), each head's state is divided by its detached norm, except at
  padded positions. Since outputs normalize each head's state, this never changes an output.
* overflow guard: the positions are processed in those chunks; where a (row, head) state leaves
  ``[SAFE_MIN, SAFE_MAX] = [2**-40, 2**40]`` (or turns non-finite) within a chunk, that row and head recompute the
  chunk normalizing at every position. A fast-growing transition (or a decaying one) thus stays finite over any length, in fp32
  as in bf16 autocast. The state is only defined up to a positive per-head factor, so this changes no output.
  (The reference checks the state ``h``, the fast paths their rank-space ``g``: in guard cases their states may
  differ by a positive factor per head.)

Shapes: batch ``B``, time ``T``, heads ``N``, state ``H``, input factors ``F``. States are ``[B, T, N, H]``,
initial and final states ``[B, N, H]`` (an initial state ``[N, H]`` is broadcast over the batch).

:func:`reference_recurrence` is the specification: a plain loop, generic over the transition, usable in fp64;
:func:`reference_step` is one step of it (decoding). The fast implementations of the CP transition (PyTorch, C++,
Triton scans) are ``bilinear_scan.py`` and ``bilinear_scan_triton.py`` (and the C++ ``bilinear_scan.cpp``); the
one function that chooses among them is in ``dispatch.py``.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .chunked_normalization import in_safe_range, is_boundary, scale_at_boundary, segments


def cp_transition(h, u_t, W1, W2):
    """``A(x_t) h = W1 (u_t * (W2^T h))`` with ``W1, W2: [N, H, R]`` and ``u_t: [B, N, R]``."""
    # One matmul per head with the batch as rows: 2-4x faster than einsum, and 3-9x faster (with backward) than a
    # broadcast [B, N, 1, H] @ [N, H, R], which runs one vector-matrix product per row.
    p = torch.bmm(h.transpose(0, 1), W2)  # [N, B, R]
    return torch.bmm(u_t.transpose(0, 1) * p, W1.transpose(1, 2)).transpose(0, 1)


@dataclass(frozen=True)
class CPTransition:
    """The CP transition with its weights bound: ``CPTransition(W1, W2)(h, u_t) = cp_transition(h, u_t, W1, W2)``.

    The one transition with fast implementations (``dispatch.recurrence`` recognises it)."""

    W1: torch.Tensor
    W2: torch.Tensor

    def __call__(self, h, u_t):
        return cp_transition(h, u_t, self.W1, self.W2)


def full_transition(h, u_t, W):
    """``A(x_t) h = sum_k u_k W_k h`` with ``W: [N, H, H, K]`` and ``u_t: [B, N, K]``.

    The state is contracted against every ``W_k`` at once, then the factors weight the results (about 6x
    faster than letting einsum pick the order of the three-operand contraction).
    """
    return torch.einsum("bnik,bnk->bni", torch.einsum("nijk,bnj->bnik", W, h), u_t)


def block_diagonal_transition(h, u_t, W):
    """Full bilinear transitions on diagonal blocks: ``W: [N, nb, b, b, K]``, ``u_t: [B, N, K]``.

    The blocks are small, so the transition matrices are built first (``[B, N, nb, b, b]``, one matmul per head with
    the batch as rows) and then applied (10x faster than contracting the state against every ``W_k``, which pays
    off only for large blocks).
    """
    B, N, H = h.shape
    nb, b, K = W.shape[1], W.shape[2], W.shape[-1]
    A = torch.bmm(u_t.transpose(0, 1), W.reshape(N, -1, K).transpose(1, 2)).transpose(0, 1).reshape(B, N, nb, b, b)
    return (A * h.reshape(B, N, nb, 1, b)).sum(-1).reshape(B, N, H)


def rotation_transition(h, u_t):
    """2x2 rotation/scaling blocks: ``u_t: [B, N, H]`` holds ``(a, c)`` per block, ``[[a, -c], [c, a]]``."""
    a, c = u_t[..., 0::2], u_t[..., 1::2]
    x, y = h[..., 0::2], h[..., 1::2]
    return torch.stack((a * x - c * y, c * x + a * y), dim=-1).flatten(-2)


def diagonal_transition(h, u_t):
    """Diagonal transition ``u_t * h`` (``u_t: [B, N, H]``)."""
    return u_t * h


def reference_recurrence(
    transition: Callable, factors, h0, mask=None, chunk: int = 64, offset: int = 0, additive=None, reset=None,
    h_start=None,
):
    """Reference loop: ``h_t = transition(h_{t-1}, factors[:, t]) (+ additive[:, t])``.

    Args:
        transition: ``(h [B,N,H], factors_t [B,N,F]) -> A(x_t) h``.
        factors: ``[B, T, N, F]`` per-step input factors.
        h0: ``[N, H]`` or ``[B, N, H]`` initial state.
        mask: optional ``[B, T]``; 0 marks padding (state kept).
        chunk: normalization interval (0: never). offset: positions already consumed before ``factors``.
        additive: optional ``[B, T, N, H]`` additive input (the paper's ablation).
        reset: optional ``[B, T]`` bool; where set (and not padded), the step starts from ``h_start`` (``[N, H]`` or
            ``[B, N, H]``).
    Returns:
        ``(states [B, T, N, H], final [B, N, H])``.
    """
    B, T = factors.shape[:2]
    h = h0.expand(B, *h0.shape[-2:])

    def run(t0, t1, every_step=None):
        """Steps [t0, t1); ``every_step``: ``[B, N, 1]`` rows that normalize at every step (None: none)."""
        segment, h_t = [], h
        for t in range(t0, t1):
            keep_t = None if mask is None else mask[:, t].bool()
            boundary = is_boundary(chunk, offset, t)
            h_t = reference_step(transition, factors[:, t], h_t, keep_t, boundary, guard=False,
                                 additive_t=None if additive is None else additive[:, t],
                                 reset_t=None if reset is None else reset[:, t], h_start=h_start)
            if every_step is not None and not boundary:
                keep = None if keep_t is None else keep_t[:, None, None]
                h_t = h_t * torch.where(every_step, scale_at_boundary(h_t, keep), 1.0)
            segment.append(h_t)
        return torch.stack(segment)

    states = []
    for t0, t1 in segments(T, chunk, offset):
        segment = run(t0, t1)
        if chunk:
            ok = in_safe_range(segment).all(dim=0)[..., None]
            if not bool(ok.all()):  # redo rather than select: a discarded inf branch would poison gradients
                segment = run(t0, t1, every_step=~ok)
        states.append(segment)
        h = segment[-1]
    return torch.cat(states).transpose(0, 1), h


def reference_step(transition: Callable, factors_t, h, keep_t=None, boundary: bool = False, guard: bool = True,
                   additive_t=None, reset_t=None, h_start=None):
    """One step of :func:`reference_recurrence` (decoding): ``(h [B,N,H], factors_t [B,N,F]) -> h_new [B,N,H]``.

    ``keep_t``: ``[B]`` bool or None (padded rows keep ``h``); ``boundary``: this position ends a chunk (a bool, or a
    0-d bool tensor, which selects the factor with ``torch.where`` instead of a branch: the same arithmetic, and
    nothing for a compiled step to branch on); ``guard``: renormalize a (row, head) whose new state left the safe
    range (the loop's guard on a one-step segment; on whenever ``chunk > 0``); ``reset_t``: ``[B]`` bool or None, rows
    that start from ``h_start`` (unless padded).
    """
    keep = None if keep_t is None else keep_t.bool()[:, None, None]
    h_prev = h
    if reset_t is not None:
        restart = reset_t.bool()[:, None, None] if keep is None else reset_t.bool()[:, None, None] & keep
        h_prev = torch.where(restart, h_start.to(h.dtype), h)
    h_new = transition(h_prev, factors_t)
    if additive_t is not None:
        h_new = h_new + additive_t
    if keep is not None:
        h_new = torch.where(keep, h_new, h)
    if isinstance(boundary, torch.Tensor):
        renormalize = boundary | ~in_safe_range(h_new)[..., None] if guard else boundary
        return h_new * torch.where(renormalize, scale_at_boundary(h_new, keep), 1.0)
    if boundary:
        return h_new * scale_at_boundary(h_new, keep)
    if guard:
        return h_new * torch.where(in_safe_range(h_new)[..., None], 1.0, scale_at_boundary(h_new, keep))
    return h_new
