"""The memory heads' recurrence in chunks (``delta_rule_reference.reference_delta_rule`` is its
specification).

Within a block of ``C`` positions the gated delta rule is solved at once in the WY / UT form of flash-linear-attention's
``chunk_delta_rule``: with ``G`` the cumulative log decay, ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` in the same
document (0 otherwise) and ``S_0`` the incoming matrix,

``(I + tril(diag(beta) (D * K K^T), -1)) U = diag(beta) (V - exp(G) * (K S_0^T))``,
``O = exp(G) * (Q S_0^T) + (D * Q K^T) U``, ``S_C = exp(G_C) S_0 + U^T diag(D[C, :]) K``,

one triangular solve per block instead of ``C`` sequential steps. The homogeneous coordinate ``c`` is constant between
normalizations, so the blocks run on values ``c v`` and divide the outputs by ``c``; blocks never cross a normalization
boundary (``chunked_normalization.segments``), where ``[S; c]`` is divided by its own norm as in the loop. A padded position
enters with ``g = 0, beta = 0`` (the memory unchanged); a reset (document start) cuts ``D`` and the incoming matrix's
terms at the positions from it on, which is the loop's emptied memory.
"""

import torch

from .chunked_normalization import is_boundary, segments
from .delta_rule_reference import memory_scale

BLOCK = 64  # positions solved at once: the solve costs C^2 per position, the sequential steps' Python overhead 1/C


def chunk_delta_rule(q, k, v, g, beta, memory, mask=None, chunk: int = 64, offset: int = 0, reset=None):
    """Equal to ``reference_delta_rule(q, k, v, g, beta, memory, mask, chunk, offset, reset)`` (same arguments, same
    ``(outputs [B, T, N, Dv], (S, c))``), in blocks of at most ``BLOCK`` positions."""
    S, c = memory
    if mask is not None:
        keep = mask.bool()[..., None]
        g, beta = torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
    restart = None
    if reset is not None:
        restart = (reset.bool() if mask is None else reset.bool() & mask.bool())[:, None]  # [B, 1, T]
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))  # heads first: [B, N, T, ...]
    outputs = []
    for t0, t1 in segments(q.shape[2], chunk, offset):
        for s0 in range(t0, t1, BLOCK):
            s = slice(s0, min(t1, s0 + BLOCK))
            o, S = _block(q[:, :, s], k[:, :, s], v[:, :, s] * c[..., None, None], g[:, :, s], beta[:, :, s], S,
                          None if restart is None else restart[..., s])
            outputs.append(o / c[..., None, None])
        if is_boundary(chunk, offset, t1 - 1):
            scale = memory_scale(S, c, None if mask is None else mask[:, t1 - 1].bool()[:, None])
            S, c = S * scale[..., None, None], c * scale
    return torch.cat(outputs, dim=2).transpose(1, 2), (S, c)


def _block(q, k, v, g, beta, S, restart):
    """One block: ``q, k [B, N, C, Dk]``, ``v [B, N, C, Dv]`` (times ``c``), ``g, beta [B, N, C]``, ``S [B, N, Dv,
    Dk]``, ``restart [B, 1, C]`` or None -> ``(S q [B, N, C, Dv], S after the block)``."""
    C = q.shape[2]
    G = g.cumsum(-1)
    same = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    carried = None
    if restart is not None:
        document = restart.long().cumsum(-1)  # the incoming memory is document 0
        same = same & (document[..., :, None] == document[..., None, :])
        carried = document == 0
    D = torch.where(same, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [B, N, C, C]
    decay = G.exp() if carried is None else torch.where(carried, G.exp(), 0.0)  # what reaches S_0 at each position
    A = (beta[..., None] * D * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[..., None] * (v - decay[..., None] * (k @ S.transpose(-1, -2)))
    U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    o = decay[..., None] * (q @ S.transpose(-1, -2)) + (D * (q @ k.transpose(-1, -2))) @ U
    S = decay[..., -1, None, None] * S + (U * D[..., -1, :, None]).transpose(-1, -2) @ k
    return o, S
