"""Chunked normalization and the overflow guard, shared by both recurrences (the bilinear state and the memory heads).

The updates are homogeneous (no additive term), so a state can be divided by a positive factor at any position without
changing an output: at every position ``p = offset + t + 1`` with ``p % chunk == 0`` each state is divided by its
detached norm, and a (row, head) state that leaves ``[SAFE_MIN, SAFE_MAX]`` within a chunk is renormalized at every
position of that chunk (``bilinear_reference.py`` says how).
"""

import torch


def scale_at_boundary(h, keep_t):
    """The detached per-head factor that normalizes ``h`` (1 at padded rows)."""
    h = h.detach()
    scale = h.pow(2).sum(-1, keepdim=True).sqrt().clamp_min(torch.finfo(h.dtype).tiny).reciprocal()
    if keep_t is not None:
        scale = torch.where(keep_t, scale, torch.ones_like(scale))
    return scale


def is_boundary(chunk: int, offset, t: int):
    """Whether step ``t`` (position ``offset + t + 1`` of the stream) ends with a chunked normalization: a bool, or a
    0-d bool tensor where ``offset`` is a tensor (a static cache's count, which a compiled step must not branch on)."""
    return chunk > 0 and (offset + t + 1) % chunk == 0


def segments(T: int, chunk: int, offset: int):
    """``[t0, t1)`` ranges each ending at a normalization boundary (the last may end early)."""
    t0 = 0
    while t0 < T:
        t1 = min(T, t0 + chunk - (offset + t0) % chunk) if chunk else T
        yield t0, t1
        t0 = t1


SAFE_MIN, SAFE_MAX = 2.0 ** -40, 2.0 ** 40  # the guard's range; squares of in-range states stay normal fp32 numbers


def in_safe_range(x):
    """``x [..., state] -> [...]`` mask: the peak ``|x_i|`` lies in ``(SAFE_MIN, SAFE_MAX)`` (NaN fails)."""
    peak = x.detach().abs().amax(dim=-1)
    return (peak < SAFE_MAX) & (peak > SAFE_MIN)  # NaN fails both comparisons
