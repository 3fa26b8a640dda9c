"""The CP rank-space scan in PyTorch: any device, one batched matmul over heads per step.

The same two entry points as the C++ kernel (``bilinear_lm/kernels/cpu/bilinear_scan.cpp``) and the Triton kernel
(``bilinear_scan_triton``), which compute exactly this (tested against it and against the reference loop). Shapes
``[T, N, B, R]`` (time, heads, batch, rank); the inputs ``u`` and ``dG`` may have any strides with the rank
contiguous (the mixer passes its ``[B, T, N, R]`` factors permuted, no copy); the scans return ``G``, ``P``, ``S``
and ``DP`` laid out by :func:`sequence_major` (each head and row's sequence contiguous: the per-head matmuls that
consume ``G`` and ``DP`` read them in place) and ``du`` laid out like ``u``:

* ``scan_forward(u, Mt, W1, keep, p0, chunk, offset, restart, p_start) -> (G, P, S)`` runs
  ``g_t = s_t u_t p_{t-1}``, ``p_t = g_t Mt`` (``p_t = p_{t-1}`` where padded), with ``Mt = (W2^T W1)^T``,
  ``p_t = W2^T h_t`` and ``h_t = W1 g_t``. ``s_t`` is the detached factor that normalizes ``h_t`` at chunk boundaries
  (1 elsewhere); a segment whose ``g`` leaves the safe range is recomputed for those (head, row) pairs normalizing
  every step. ``keep``: ``[T, B]`` bool, or empty when nothing is padded. ``restart``: ``[T, B]`` bool (or empty):
  step ``t`` starts from ``p_start`` (``[N, R]``) instead of ``p_{t-1}`` (document boundaries; only at unpadded
  steps). Returns every ``g_t`` ``[T,N,B,R]``, every ``p_t`` ``[T,N,B,R]`` and ``s_t`` ``[T,N,B,1]``.
* ``scan_backward(dG, u, S, P, p0, p_start, MtT, keep, restart) -> (du, DP, dp0, dp_start)``: the reverse loop,
  given ``dL/dg_t`` and the forward's inputs and outputs: the gradient of ``u`` (``s_t p_in_t DGT_t``, with ``p_in_t``
  step ``t``'s input and ``DGT_t`` the total gradient of ``g_t``), ``DP`` (gradient of ``p_t`` leaving step ``t``,
  zero where padded), ``dL/dp_0`` and the gradient reaching ``p_start`` per row (``[N, B, R]``). The gradient of
  ``Mt`` follows from ``G`` and ``DP`` in bulk (``dispatch``).
"""

from functools import partial

import torch

from .chunked_normalization import in_safe_range, is_boundary, scale_at_boundary, segments


def sequence_major(like: torch.Tensor, T: int, N: int, B: int, R: int) -> torch.Tensor:
    """An empty ``[T, N, B, R]`` tensor (``like``'s dtype and device) whose memory is ``[N, B, T, R]``."""
    return like.new_empty(N, B, T, R).permute(2, 0, 1, 3)


def scan_forward(u, Mt, W1, keep, p0, chunk: int, offset: int, restart, p_start):
    """The scan's forward loop (see the module docstring)."""
    T, N, B, R = u.shape
    G, P, S = sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, 1)
    S.fill_(1)
    keep4 = keep[:, None, :, None] if keep.numel() else None
    inputs = partial(step_inputs, p0=p0, p_start=p_start, restart=restart)

    def run(t0, t1, every_step, G, P, S):
        for t in range(t0, t1):
            p = inputs(P, t)
            g = torch.mul(u[t], p, out=G[t])
            keep_t = None if keep4 is None else keep4[t]
            if every_step or is_boundary(chunk, offset, t):
                S[t] = scale_at_boundary(torch.einsum("nhr,nbr->nbh", W1, g), keep_t)
                g.mul_(S[t])
            torch.bmm(g, Mt, out=P[t])
            if keep_t is not None:
                torch.where(keep_t, P[t], p, out=P[t])

    for t0, t1 in segments(T, chunk, offset):
        run(t0, t1, False, G, P, S)
        if chunk:
            ok = in_safe_range(G[t0:t1]).all(dim=0)[..., None]
            if not bool(ok.all()):  # recompute out-of-range (head, row) pairs normalizing every step
                G2, P2, S2 = G.clone(), P.clone(), torch.ones_like(S)
                run(t0, t1, True, G2, P2, S2)
                for full, redo in ((G, G2), (P, P2), (S, S2)):
                    full[t0:t1] = torch.where(ok, full[t0:t1], redo[t0:t1])
    return G, P, S


def step_inputs(P, t: int, p0, p_start, restart):
    """Step ``t``'s input ``p``: ``p0`` or the previous step's output (``P[t - 1]``), ``p_start`` where the row
    restarts."""
    p = p0 if t == 0 else P[t - 1]
    return torch.where(restart[t, None, :, None], p_start[:, None], p) if restart.numel() else p


def scan_backward(dG, u, S, P, p0, p_start, MtT, keep, restart):
    """The scan's backward loop (see the module docstring): ``(du, DP, dp0, dp_start)``."""
    T, N, B, R = u.shape
    keep4 = keep[:, None, :, None] if keep.numel() else None
    restart4 = restart[:, None, :, None] if restart.numel() else None
    su = S * u
    DGT, DP, du = torch.empty_like(su), sequence_major(u, T, N, B, R), torch.empty_like(u)
    dp = torch.zeros_like(su[0])
    dp_start = torch.zeros_like(su[0])
    for t in range(T - 1, -1, -1):
        DP[t] = dp if keep4 is None else torch.where(keep4[t], dp, 0.0)
        torch.baddbmm(dG[t], DP[t], MtT, out=DGT[t])
        torch.mul(S[t] * step_inputs(P, t, p0, p_start, restart), DGT[t], out=du[t])
        dp = su[t] * DGT[t] if keep4 is None else su[t] * DGT[t] + torch.where(keep4[t], 0.0, dp)
        if restart4 is not None:  # this step's input was p_start, not the previous step's output
            dp_start += torch.where(restart4[t], dp, 0.0)
            dp = torch.where(restart4[t], 0.0, dp)
    return du, DP, dp, dp_start
