"""State recurrences of the bilinear mixer.

Every mixer runs, per head, ``h_t = A(x_t) h_{t-1}`` (plus ``b_t`` only in the additive ablation), with

* ``mask``: positions where ``mask[b, t] == 0`` (padding) leave the state unchanged;
* chunked normalization: at every position ``p`` with ``p % chunk == 0`` (``p = offset + t + 1`` counts
  positions since the start of the stream), each head's state is divided by its detached norm, except at
  padded positions. Since outputs normalize each head's state, this never changes an output.
* overflow guard: the positions are processed in those chunks; where a (row, head) state leaves
  ``[2**-40, 2**40]`` (or turns non-finite) within a chunk, that row and head recompute the chunk normalizing
  at every position. A fast-growing transition (or a decaying one) thus stays finite over any length, in fp32
  as in bf16 autocast. The state is only defined up to a positive per-head factor, so this changes no output.
  (The reference checks the state ``h``, the fast paths their rank-space ``g``: in guard cases their states may
  differ by a positive factor per head.)

Shapes: batch ``B``, time ``T``, heads ``N``, state ``H``, input factors ``F``. States are ``[B, T, N, H]``,
initial and final states ``[B, N, H]`` (an initial state ``[N, H]`` is broadcast over the batch).

:func:`reference_recurrence` is the specification: a plain loop, generic over the transition, usable in fp64.
:func:`cp_recurrence` is the fast path of the CP-factored transition ``A(x) = W1 diag(u) W2^T`` and returns
the same states: it runs the loop in rank space (``p_t = M g_t``, ``M = W2^T W1``) inside a custom autograd
function that builds no per-step graph and computes the gradients of ``u`` and ``M`` in bulk after its loop.
"""

from functools import partial
from typing import Callable

import torch

from .cpu_kernels import kernel_available_for, load_kernel


def cp_transition(h, u_t, W1, W2):
    """``A(x_t) h = W1 (u_t * (W2^T h))`` with ``W1, W2: [N, H, R]`` and ``u_t: [B, N, R]``."""
    # One matmul per head with the batch as rows: 2-4x faster than einsum, and 3-9x faster (with backward) than a
    # broadcast [B, N, 1, H] @ [N, H, R], which runs one vector-matrix product per row.
    p = torch.bmm(h.transpose(0, 1), W2)  # [N, B, R]
    return torch.bmm(u_t.transpose(0, 1) * p, W1.transpose(1, 2)).transpose(0, 1)


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


def _scale_at_boundary(h, keep_t):
    """The detached per-head factor that normalizes ``h`` (1 at padded rows)."""
    norm = h.detach().norm(dim=-1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
    scale = norm.reciprocal()
    if keep_t is not None:
        scale = torch.where(keep_t, scale, torch.ones_like(scale))
    return scale


def _is_boundary(chunk: int, offset: int, t: int) -> bool:
    return chunk > 0 and (offset + t + 1) % chunk == 0


def _segments(T: int, chunk: int, offset: int):
    """``[t0, t1)`` ranges each ending at a normalization boundary (the last may end early)."""
    t0 = 0
    while t0 < T:
        t1 = min(T, t0 + chunk - (offset + t0) % chunk) if chunk else T
        yield t0, t1
        t0 = t1


_SAFE_MIN, _SAFE_MAX = 2.0 ** -40, 2.0 ** 40  # squares of in-range states stay normal fp32 numbers


def _rows_in_safe_range(x):
    """``[..., rows, heads]`` mask: every step of ``x`` ``[steps, ..., state]`` keeps its peak in the safe range."""
    peak = x.detach().abs().amax(dim=-1)
    return ((peak < _SAFE_MAX) & (peak > _SAFE_MIN)).all(dim=0)  # NaN fails both comparisons


def reference_recurrence(
    transition: Callable, factors, h0, mask=None, chunk: int = 64, offset: int = 0, additive=None
):
    """Reference loop: ``h_t = transition(h_{t-1}, factors[:, t]) (+ additive[:, t])``.

    Args:
        transition: ``(h [B,N,H], factors_t [B,N,F]) -> A(x_t) h``.
        factors: ``[B, T, N, F]`` per-step input factors.
        h0: ``[N, H]`` or ``[B, N, H]`` initial state.
        mask: optional ``[B, T]``; 0 marks padding (state kept).
        chunk: normalization interval (0: never). offset: positions already consumed before ``factors``.
        additive: optional ``[B, T, N, H]`` additive input (the paper's ablation).
    Returns:
        ``(states [B, T, N, H], final [B, N, H])``.
    """
    B, T = factors.shape[:2]
    h = h0.expand(B, *h0.shape[-2:])

    def run(t0, t1, every_step=None):
        """Steps [t0, t1); ``every_step``: ``[B, N, 1]`` rows that normalize at every step (None: none)."""
        segment, h_t = [], h
        for t in range(t0, t1):
            h_new = transition(h_t, factors[:, t])
            if additive is not None:
                h_new = h_new + additive[:, t]
            keep_t = None if mask is None else mask[:, t].bool()[:, None, None]
            if keep_t is not None:
                h_new = torch.where(keep_t, h_new, h_t)
            if _is_boundary(chunk, offset, t):
                h_new = h_new * _scale_at_boundary(h_new, keep_t)
            elif every_step is not None:
                h_new = h_new * torch.where(every_step, _scale_at_boundary(h_new, keep_t), 1.0)
            h_t = h_new
            segment.append(h_t)
        return torch.stack(segment)

    states = []
    for t0, t1 in _segments(T, chunk, offset):
        segment = run(t0, t1)
        if chunk:
            ok = _rows_in_safe_range(segment)[..., None]
            if not bool(ok.all()):  # redo rather than select: a discarded inf branch would poison gradients
                segment = run(t0, t1, every_step=~ok)
        states.append(segment)
        h = segment[-1]
    return torch.cat(states).transpose(0, 1), h


class _CPScan(torch.autograd.Function):
    """Rank-space scan ``g_t = s_t u_t p_{t-1}``, ``p_t = M g_t`` (``p_t = p_{t-1}`` where padded).

    ``p_t = W2^T h_t`` and ``h_t = W1 g_t``; ``s_t`` is the detached normalization factor (1 off boundaries).
    Layout ``[T, N, B, R]``; ``keep``: ``[T, B]`` bool, or empty when nothing is padded. The loops run in the compiled kernel when one is
    given, else in PyTorch (one batched matmul over heads per step). Returns all ``g_t``.
    """

    @staticmethod
    def forward(ctx, u, Mt, p0, keep, W1, chunk, offset, kernel):
        scan_forward = _torch_scan_forward if kernel is None else kernel.forward
        G, P, S = scan_forward(u, Mt, W1, keep, p0.contiguous(), chunk, offset)
        ctx.save_for_backward(u, Mt, G, P, S, keep)
        ctx.kernel = kernel
        return G

    @staticmethod
    def backward(ctx, dG):
        u, Mt, G, P, S, keep = ctx.saved_tensors
        T = u.shape[0]
        su = S * u
        MtT = Mt.transpose(1, 2).contiguous()
        DGT = torch.empty_like(u)  # total gradient of each g_t
        DP = torch.empty_like(u)  # gradient of p_t flowing into step t's matmul (zero where padded)
        scan_backward = _torch_scan_backward if ctx.kernel is None else ctx.kernel.backward
        dp = scan_backward(dG.contiguous(), su, MtT, keep, DGT, DP)
        du = S * P[:T] * DGT
        dMt = torch.einsum("tnbr,tnbs->nrs", G, DP)
        return du, dMt, dp, None, None, None, None, None


def _torch_scan_forward(u, Mt, W1, keep, p0, chunk, offset):
    """The scan's forward loop in PyTorch, same signature as the kernel's: ``(G, P, S)`` (see :class:`_CPScan`)."""
    T = u.shape[0]
    G = torch.empty_like(u)
    P = torch.empty((T + 1, *u.shape[1:]), dtype=u.dtype, device=u.device)
    S = torch.ones((T, *u.shape[1:-1], 1), dtype=u.dtype, device=u.device)
    P[0] = p0
    keep4 = keep[:, None, :, None] if keep.numel() else None

    def run(t0, t1, every_step, G, P, S):
        for t in range(t0, t1):
            g = torch.mul(u[t], P[t], out=G[t])
            keep_t = None if keep4 is None else keep4[t]
            if every_step or _is_boundary(chunk, offset, t):
                S[t] = _scale_at_boundary(torch.einsum("nhr,nbr->nbh", W1, g), keep_t)
                g.mul_(S[t])
            torch.bmm(g, Mt, out=P[t + 1])
            if keep_t is not None:
                torch.where(keep_t, P[t + 1], P[t], out=P[t + 1])

    for t0, t1 in _segments(T, chunk, offset):
        run(t0, t1, False, G, P, S)
        if chunk:
            ok = _rows_in_safe_range(G[t0:t1])[..., None]
            if not bool(ok.all()):  # recompute out-of-range (head, row) pairs normalizing every step
                G2, P2, S2 = G.clone(), P.clone(), torch.ones_like(S)
                run(t0, t1, True, G2, P2, S2)
                for full, redo in ((G, G2), (S, S2)):
                    full[t0:t1] = torch.where(ok, full[t0:t1], redo[t0:t1])
                P[t0 + 1:t1 + 1] = torch.where(ok, P[t0 + 1:t1 + 1], P2[t0 + 1:t1 + 1])
    return G, P, S


def _torch_scan_backward(dG, su, MtT, keep, DGT, DP):
    """The scan's backward loop in PyTorch, same signature as the kernel's: fills DGT, DP, returns dL/dp_0."""
    keep4 = keep[:, None, :, None] if keep.numel() else None
    dp = torch.zeros_like(su[0])
    for t in range(su.shape[0] - 1, -1, -1):
        if keep4 is None:
            DP[t] = dp
            torch.baddbmm(dG[t], dp, MtT, out=DGT[t])
            dp = su[t] * DGT[t]
        else:
            DP[t] = torch.where(keep4[t], dp, 0.0)
            torch.baddbmm(dG[t], DP[t], MtT, out=DGT[t])
            dp = su[t] * DGT[t] + torch.where(keep4[t], 0.0, dp)
    return dp


def cp_recurrence(u, W1, W2, h0, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto"):
    """Fast CP-factored recurrence, equal to ``reference_recurrence(cp_transition, u, h0, ...)``.

    Args:
        u: ``[B, T, N, R]`` input factors. W1, W2: ``[N, H, R]``. h0: ``[N, H]`` or ``[B, N, H]``.
        mask, chunk, offset: as in :func:`reference_recurrence`.
        impl: ``"cpp"`` (compiled CPU kernel), ``"torch"`` (PyTorch loop, any device) or ``"auto"`` (the kernel
            when the tensors are on the CPU and it builds here, else the PyTorch loop; the state-space loop when
            ``rank > 2 * state``). A single step (``T == 1``, decoding) always applies the transition directly.
    Returns:
        ``(states [B, T, N, H], final [B, N, H])``.
    """
    B, T, N, R = u.shape
    kernel = None
    if impl in ("auto", "cpp") and kernel_available_for(u):
        kernel = load_kernel()
    elif impl == "cpp":
        raise RuntimeError(
            "recurrence_impl='cpp' needs CPU fp32/fp64 tensors and a C++ compiler for the kernel build; "
            "use recurrence_impl='auto' or 'torch'"
        )
    # One step (decoding): the scan's setup (M, layout changes) would cost more than the step itself. And with
    # rank > 2 * state the rank-space scans (rank^2 per step) cost more than the state-space loop (2 * rank * state).
    if T == 1 or (impl == "auto" and R > 2 * W1.shape[1]):
        return reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, h0, mask, chunk, offset)
    h0 = h0.expand(B, N, W1.shape[1])
    p0 = torch.einsum("nhr,bnh->nbr", W2, h0)
    Mt = torch.einsum("nhr,nhs->nrs", W1, W2)  # M^T with M = W2^T W1
    keep = torch.empty(0, dtype=torch.bool, device=u.device) if mask is None else mask.bool().t().contiguous()
    G = _CPScan.apply(u.permute(1, 2, 0, 3).contiguous(), Mt.contiguous(), p0, keep, W1.detach().contiguous(),
                      chunk, offset, kernel)
    states = torch.einsum("nhr,tnbr->btnh", W1, G)
    if mask is not None:
        # A padded position keeps the last unpadded state (h0 before any): gather it.
        positions = torch.arange(1, T + 1, device=u.device).expand(B, T)
        last = torch.where(mask.bool(), positions, 0).cummax(dim=1).values
        with_h0 = torch.cat([h0[:, None], states], dim=1)
        states = with_h0.gather(1, last[:, :, None, None].expand(-1, -1, *states.shape[2:]))
    return states, states[:, -1]
