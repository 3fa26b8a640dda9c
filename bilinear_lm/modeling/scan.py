"""The CP rank-space scan in PyTorch: any device, one batched matmul over heads per step.

The same two entry points as the C++ kernel (``bilinear_lm/kernels/cpu/scan.cpp``) and the Triton kernel
(``scan_triton``), which compute exactly this (tested against it and against the reference loop). Layout
``[T, N, B, R]`` (time, heads, batch, rank):

* ``scan_forward(u, Mt, W1, keep, p0, chunk, offset, restart, p_start) -> (G, P, S)`` runs
  ``g_t = s_t u_t p_{t-1}``, ``p_t = g_t Mt`` (``p_t = p_{t-1}`` where padded), with ``Mt = (W2^T W1)^T``,
  ``p_t = W2^T h_t`` and ``h_t = W1 g_t``. ``s_t`` is the detached factor that normalizes ``h_t`` at chunk boundaries
  (1 elsewhere); a segment whose ``g`` leaves the safe range is recomputed for those (head, row) pairs normalizing
  every step. ``keep``: ``[T, B]`` bool, or empty when nothing is padded. ``restart``: ``[T, B]`` bool (or empty):
  step ``t`` starts from ``p_start`` (``[N, R]``) instead of ``p_{t-1}`` (document boundaries; only at unpadded
  steps). Returns every ``g_t`` ``[T,N,B,R]``, the inputs ``p`` of every step then the last ``p_T``
  (``[T+1,N,B,R]``) and ``s_t`` ``[T,N,B,1]``.
* ``scan_backward(dG, su, MtT, keep, restart, DGT, DP) -> (dp0, dp_start)``: the reverse loop, given
  ``dL/dg_t`` and ``su = S * u``; fills ``DGT`` (total gradient of each ``g_t``) and ``DP`` (gradient of ``p_t``
  leaving step ``t``, zero where padded) and returns ``dL/dp_0`` and the gradient reaching ``p_start`` per row
  (``[N, B, R]``). The gradients of ``u`` and ``Mt`` follow from them in bulk (``dispatch``).
"""

import torch

from .recurrence import in_safe_range, is_boundary, scale_at_boundary, segments


def scan_forward(u, Mt, W1, keep, p0, chunk: int, offset: int, restart, p_start):
    """The scan's forward loop (see the module docstring)."""
    T = u.shape[0]
    G = torch.empty_like(u)
    P = torch.empty((T + 1, *u.shape[1:]), dtype=u.dtype, device=u.device)
    S = torch.ones((T, *u.shape[1:-1], 1), dtype=u.dtype, device=u.device)
    P[0] = p0
    keep4 = keep[:, None, :, None] if keep.numel() else None
    restart4 = restart[:, None, :, None] if restart.numel() else None
    p_start = p_start[:, None] if restart.numel() else p_start  # [N, 1, R]: every row's start

    def run(t0, t1, every_step, G, P, S):
        for t in range(t0, t1):
            if restart4 is not None:
                torch.where(restart4[t], p_start, P[t], out=P[t])
            g = torch.mul(u[t], P[t], out=G[t])
            keep_t = None if keep4 is None else keep4[t]
            if every_step or is_boundary(chunk, offset, t):
                S[t] = scale_at_boundary(torch.einsum("nhr,nbr->nbh", W1, g), keep_t)
                g.mul_(S[t])
            torch.bmm(g, Mt, out=P[t + 1])
            if keep_t is not None:
                torch.where(keep_t, P[t + 1], P[t], out=P[t + 1])

    for t0, t1 in segments(T, chunk, offset):
        run(t0, t1, False, G, P, S)
        if chunk:
            ok = in_safe_range(G[t0:t1]).all(dim=0)[..., None]
            if not bool(ok.all()):  # recompute out-of-range (head, row) pairs normalizing every step
                G2, P2, S2 = G.clone(), P.clone(), torch.ones_like(S)
                run(t0, t1, True, G2, P2, S2)
                for full, redo in ((G, G2), (S, S2)):
                    full[t0:t1] = torch.where(ok, full[t0:t1], redo[t0:t1])
                P[t0 + 1:t1 + 1] = torch.where(ok, P[t0 + 1:t1 + 1], P2[t0 + 1:t1 + 1])
    return G, P, S


def scan_backward(dG, su, MtT, keep, restart, DGT, DP):
    """The scan's backward loop (see the module docstring): fills ``DGT`` and ``DP``, returns ``(dp0, dp_start)``."""
    keep4 = keep[:, None, :, None] if keep.numel() else None
    restart4 = restart[:, None, :, None] if restart.numel() else None
    dp = torch.zeros_like(su[0])
    dp_start = torch.zeros_like(su[0])
    for t in range(su.shape[0] - 1, -1, -1):
        DP[t] = dp if keep4 is None else torch.where(keep4[t], dp, 0.0)
        torch.baddbmm(dG[t], DP[t], MtT, out=DGT[t])
        dp = su[t] * DGT[t] if keep4 is None else su[t] * DGT[t] + torch.where(keep4[t], 0.0, dp)
        if restart4 is not None:  # this step's input was p_start, not the previous step's output
            dp_start += torch.where(restart4[t], dp, 0.0)
            dp = torch.where(restart4[t], 0.0, dp)
    return dp, dp_start
