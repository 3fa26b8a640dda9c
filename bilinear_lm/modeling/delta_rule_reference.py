"""The memory heads' recurrence: a projective gated delta rule beside the bilinear state
(``BilinearConfig.memory_heads``). :func:`reference_delta_rule` is the specification (a plain loop, fp64-capable),
:func:`delta_rule_step` one step of it (decoding); ``delta_rule_chunk.py`` runs it in blocks, and ``dispatch.py``
chooses.
"""

import torch

from .chunked_normalization import is_boundary


def reference_delta_rule(q, k, v, g, beta, memory, mask=None, chunk: int = 64, offset: int = 0, reset=None):
    """Reference loop of the memory heads: per head, a matrix ``S`` and a coordinate ``c`` updated by

    ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t c_{t-1} v_t k_t^T``, ``c_t = c_{t-1}``, read out as
    ``o_t = S_t q_t / c_t``,

    with ``alpha_t = exp(g_t)`` in ``(0, 1]``, ``beta_t`` in ``(0, 2)`` and unit keys: the update is linear in
    ``[S; c]`` with no additive term (homogeneous of degree 1, as the bilinear state's), and ``S / c`` follows the
    gated delta rule with negative eigenvalues, a non-expansive transition. ``mask``, ``chunk``, ``offset`` and
    ``reset`` work as in :func:`~.bilinear_reference.reference_recurrence`: padded positions keep the memory; at every chunk boundary
    ``[S; c]`` is divided by its own detached norm (never jointly with the bilinear state), which changes no output;
    a reset empties ``S``.

    Args:
        q, k: ``[B, T, N, Dk]`` queries and unit keys; v: ``[B, T, N, Dv]``; g, beta: ``[B, T, N]``.
        memory: ``(S [B, N, Dv, Dk], c [B, N])``, the incoming memory.
    Returns:
        ``(outputs [B, T, N, Dv], (S, c))``.
    """
    outputs = []
    for t in range(q.shape[1]):
        memory, o = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], memory,
                                    None if mask is None else mask[:, t], is_boundary(chunk, offset, t),
                                    None if reset is None else reset[:, t])
        outputs.append(o)
    return torch.stack(outputs, dim=1), memory


def delta_rule_step(q_t, k_t, v_t, g_t, beta_t, memory, keep_t=None, boundary=False, reset_t=None):
    """One step of :func:`reference_delta_rule` (decoding): ``q_t, k_t [B, N, Dk]``, ``v_t [B, N, Dv]``,
    ``g_t, beta_t [B, N]``, ``memory = (S, c)``; ``keep_t``, ``reset_t``: ``[B]`` bool or None; ``boundary``: a bool or
    a 0-d bool tensor (selected with ``torch.where``: nothing for a compiled step to branch on). Returns
    ``((S, c), o_t [B, N, Dv])``."""
    S, c = memory
    keep = None if keep_t is None else keep_t.bool()[:, None]
    S_prev = S
    if reset_t is not None:
        restart = reset_t.bool()[:, None] if keep is None else reset_t.bool()[:, None] & keep
        S_prev = torch.where(restart[..., None, None], torch.zeros_like(S), S)
    alpha, beta_t = g_t.exp()[..., None, None], beta_t[..., None, None]
    read = S_prev @ k_t[..., None]  # [B, N, Dv, 1]
    S_new = alpha * S_prev + beta_t * (c[..., None, None] * v_t[..., None] - alpha * read) * k_t[..., None, :]
    if keep is not None:
        S_new = torch.where(keep[..., None, None], S_new, S)
    o_t = (S_new @ q_t[..., None])[..., 0] / c[..., None]
    if not (isinstance(boundary, torch.Tensor) or boundary):
        return (S_new, c), o_t
    scale = memory_scale(S_new, c, keep)
    if isinstance(boundary, torch.Tensor):
        scale = torch.where(boundary, scale, torch.ones_like(scale))
    return (S_new * scale[..., None, None], c * scale), o_t


def memory_scale(S, c, keep=None):
    """The detached factor ``1 / |[S; c]|`` per (row, head) that normalizes the memory by its own norm (1 where
    ``keep [B, 1]`` is False: a padded position)."""
    norm = (S.detach().pow(2).sum((-2, -1)) + c.detach().pow(2)).sqrt()
    scale = norm.clamp_min(torch.finfo(S.dtype).tiny).reciprocal()
    return scale if keep is None else torch.where(keep, scale, torch.ones_like(scale))
