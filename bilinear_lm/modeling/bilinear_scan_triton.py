"""The CP rank-space scan as Triton GPU kernels: the same entry points as ``scan`` (see its docstring).

Each program runs one head for a block of ``BLOCK_B`` batch rows over the whole sequence: ``M^T`` and ``W1^T`` stay
on-chip, the state ``p`` in registers, and every step is one ``tl.dot([BLOCK_B, R], [R, R])``. The chunked
normalization and the overflow guard run in the kernel (no host synchronization): a segment in which a row's peak
``|g|`` leaves ``(SAFE_MIN, SAFE_MAX)`` or turns NaN is recomputed for those rows, normalizing every step.
Computation is in fp32 (fp64 for fp64 inputs); the products are exact fp32 up to rank 64 and TF32 on tensor cores
above (``dot_precision``: IEEE products spill registers there). Triton's interpreter computes them exactly. Rank
and state are padded to powers of two >= 16 with masks.
"""

import os

import torch

from .chunked_normalization import SAFE_MAX, SAFE_MIN
from .bilinear_scan import sequence_major

try:  # optional: a CPU-only install never needs Triton (transformers' remote-code check skips try blocks)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_B = 16


def available(device_type: str) -> bool:
    """Whether the Triton scan can run on tensors of ``device_type``: Triton imports and the device is CUDA (or the
    interpreter is on, ``TRITON_INTERPRET=1``, which runs the kernels on CPU tensors)."""
    if triton is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _padded(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def num_warps(padded_rank: int) -> int:
    """Warps per program: 8 from rank 64 up, so that the on-chip M^T never spills registers (ptxas, sm_90, tested)."""
    return 8 if padded_rank >= 64 else 4


def dot_precision(padded_rank: int) -> str:
    """Exact fp32 products (``"ieee"``) up to rank 64; TF32 on tensor cores above, where IEEE products spill
    registers (ptxas, sm_90, tested) and TF32 does not."""
    return "ieee" if padded_rank <= 64 else "tf32"


if triton is not None:
    _SAFE_MIN, _SAFE_MAX = tl.constexpr(SAFE_MIN), tl.constexpr(SAFE_MAX)  # kernels read only constexpr globals

    @triton.jit
    def _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, p, mt, w1t, p_start, seqs, rows, row_ok, cols,
                 col_ok, redo, store, t0, t1, T, B, R, chunk, offset, HAS_KEEP: tl.constexpr,
                 HAS_RESTART: tl.constexpr, PRECISION: tl.constexpr):
        """Steps [t0, t1) for the block's rows -> (p after the last step, rows whose |g| stayed in range).

        ``seqs``: each row's sequence in the sequence-major u, G, P and S. ``redo`` rows normalize at every step;
        only ``store`` rows write G, P and S."""
        ok = row_ok | (row_ok == 0)  # all true
        for t in range(t0, t1):
            if HAS_RESTART:
                restart = tl.load(restart_ptr + t * B + rows, mask=row_ok, other=0) != 0
                p = tl.where(restart[:, None], p_start, p)
            tile = (seqs * T + t)[:, None] * R + cols[None, :]
            tile_ok = store[:, None] & col_ok[None, :]
            g = tl.load(u_ptr + tile, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(p.dtype) * p
            if HAS_KEEP:
                keep = tl.load(keep_ptr + t * B + rows, mask=row_ok, other=1) != 0
            else:
                keep = row_ok | (row_ok == 0)
            boundary = (chunk > 0) & ((offset + t + 1) % tl.maximum(chunk, 1) == 0)
            normalize = (redo | boundary) & keep
            h = tl.dot(g, w1t, input_precision=PRECISION)  # [rows, H]: the state whose norm is divided out
            norm = tl.sqrt(tl.sum(h * h, axis=1))
            tiny = tl.full(norm.shape, 1.1754943508222875e-38, norm.dtype)
            s = tl.where(normalize, 1.0 / tl.maximum(norm, tiny), 1.0)
            g = g * s[:, None]
            tl.store(G_ptr + tile, g, mask=tile_ok)
            tl.store(S_ptr + seqs * T + t, s, mask=store)
            peak = tl.max(tl.where(col_ok[None, :], tl.abs(g), 0.0), axis=1)
            nan = tl.max((g != g).to(tl.float32), axis=1)
            ok = ok & (peak < _SAFE_MAX) & (peak > _SAFE_MIN) & (nan == 0)
            p = tl.where(keep[:, None], tl.dot(g, mt, input_precision=PRECISION), p)
            tl.store(P_ptr + tile, p, mask=tile_ok)
        return p, ok | (row_ok == 0)

    @triton.jit
    def _forward_kernel(u_ptr, mt_ptr, w1t_ptr, keep_ptr, p0_ptr, restart_ptr, p_start_ptr, G_ptr, P_ptr, S_ptr, T, B,
                        R, H, chunk, offset, HAS_KEEP: tl.constexpr, HAS_RESTART: tl.constexpr,
                        BLOCK_B: tl.constexpr, RP: tl.constexpr, HP: tl.constexpr, PRECISION: tl.constexpr):
        n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        seqs = n * B + rows
        cols = tl.arange(0, RP)
        col_ok = cols < R
        hs = tl.arange(0, HP)
        mt = tl.load(mt_ptr + n * R * R + cols[:, None] * R + cols[None, :],
                     mask=col_ok[:, None] & col_ok[None, :], other=0.0)
        dtype = mt.dtype
        w1t = tl.load(w1t_ptr + n * R * H + cols[:, None] * H + hs[None, :],
                      mask=col_ok[:, None] & (hs < H)[None, :], other=0.0).to(dtype)
        p = tl.load(p0_ptr + (n * B + rows[:, None]) * R + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(dtype)
        p_start = tl.zeros([BLOCK_B, RP], dtype)
        if HAS_RESTART:  # the start state [N, R], the same for every row
            p_start = tl.load(p_start_ptr + n * R + cols[None, :] + 0 * rows[:, None],
                              mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(dtype)
        no_rows = row_ok & (row_ok == 0)
        t0 = 0
        while t0 < T:
            t1 = T
            if chunk > 0:
                t1 = tl.minimum(T, t0 + chunk - (offset + t0) % chunk)
            first, ok = _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, p, mt, w1t, p_start, seqs, rows,
                                 row_ok, cols, col_ok, no_rows, row_ok, t0, t1, T, B, R, chunk, offset,
                                 HAS_KEEP, HAS_RESTART, PRECISION)
            if (chunk > 0) & (tl.sum((ok == 0).to(tl.int32)) > 0):
                redo = ok == 0
                again, _ = _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, p, mt, w1t, p_start, seqs,
                                    rows, row_ok, cols, col_ok, redo, redo & row_ok, t0, t1, T, B, R, chunk,
                                    offset, HAS_KEEP, HAS_RESTART, PRECISION)
                first = tl.where(redo[:, None], again, first)
            p = first
            t0 = t1

    @triton.jit
    def _backward_kernel(dG_ptr, u_ptr, S_ptr, P_ptr, p0_ptr, p_start_ptr, mtt_ptr, keep_ptr, restart_ptr, du_ptr,
                         DP_ptr, dp0_ptr, dps_ptr, T, B, R, HAS_KEEP: tl.constexpr, HAS_RESTART: tl.constexpr,
                         BLOCK_B: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr):
        """Per step from the last: ``dgt = dG_t + DP_t Mt^T`` (never stored), ``du_t = s_t p_in dgt`` (``p_in``: the
        step's input) and the gradient ``s_t u_t dgt`` into the previous step's ``p``; every ``[T, N, B, R]`` tensor
        sequence-major."""
        n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        cols = tl.arange(0, RP)
        col_ok = cols < R
        tile_ok = row_ok[:, None] & col_ok[None, :]
        mtt = tl.load(mtt_ptr + n * R * R + cols[:, None] * R + cols[None, :],
                      mask=col_ok[:, None] & col_ok[None, :], other=0.0)
        dtype = mtt.dtype
        dp = tl.zeros([BLOCK_B, RP], dtype)
        dps = tl.zeros([BLOCK_B, RP], dtype)
        seqs = n * B + rows
        out = seqs[:, None] * R + cols[None, :]  # [N, B, R] tensors
        for i in range(0, T):
            t = T - 1 - i
            if HAS_KEEP:
                keep = tl.load(keep_ptr + t * B + rows, mask=row_ok, other=1) != 0
            else:
                keep = row_ok | (row_ok == 0)
            tile = (seqs * T + t)[:, None] * R + cols[None, :]
            dp_in = tl.where(keep[:, None], dp, 0.0)
            dgt = tl.load(dG_ptr + tile, mask=tile_ok, other=0.0).to(dtype) + tl.dot(dp_in, mtt,
                                                                                   input_precision=PRECISION)
            tl.store(DP_ptr + tile, dp_in, mask=tile_ok)
            s = tl.load(S_ptr + seqs * T + t, mask=row_ok, other=0.0).to(dtype)[:, None]
            if t > 0:  # step t's input: step t - 1's output, p0 at the first step
                p = tl.load(P_ptr + tile - R, mask=tile_ok, other=0.0).to(dtype)
            else:
                p = tl.load(p0_ptr + out, mask=tile_ok, other=0.0).to(dtype)
            if HAS_RESTART:
                restart = tl.load(restart_ptr + t * B + rows, mask=row_ok, other=0) != 0
                p = tl.where(restart[:, None], tl.load(p_start_ptr + n * R + cols[None, :] + 0 * rows[:, None],
                                                       mask=tile_ok, other=0.0).to(dtype), p)  # p_start at a restart
            tl.store(du_ptr + tile, s * p * dgt, mask=tile_ok)
            dp = s * tl.load(u_ptr + tile, mask=tile_ok, other=0.0).to(dtype) * dgt + tl.where(keep[:, None], 0.0, dp)
            if HAS_RESTART:  # this step's input was p_start, not the previous step's output
                dps += tl.where(restart[:, None], dp, 0.0)
                dp = tl.where(restart[:, None], 0.0, dp)
        tl.store(dp0_ptr + out, dp, mask=tile_ok)
        tl.store(dps_ptr + out, dps, mask=tile_ok)


def _in_sequence_major(x):
    """``x`` (``[T, N, B, R]``) laid out as ``bilinear_scan.sequence_major``: itself if it is, else a copy (the kernels address
    every tensor that way: one offset tile for all of them keeps the programs within their registers)."""
    T, N, B, R = x.shape
    return x if x.stride() == (R, B * T * R, T * R, 1) else sequence_major(x, T, N, B, R).copy_(x)


def scan_forward(u, Mt, W1, keep, p0, chunk: int, offset: int, restart, p_start):
    """The scan's forward (``bilinear_scan.scan_forward``'s signature and results)."""
    T, N, B, R = u.shape
    H = W1.shape[1]
    RP = _padded(R)
    G, P, S = sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, 1)
    dummy = u.new_empty(1, dtype=torch.int8)
    _forward_kernel[(N, triton.cdiv(B, BLOCK_B))](
        _in_sequence_major(u), Mt.contiguous(), W1.transpose(1, 2).contiguous(),
        keep.to(torch.int8) if keep.numel() else dummy, p0.contiguous(),
        restart.to(torch.int8) if restart.numel() else dummy,
        p_start.contiguous() if restart.numel() else u.new_empty(1), G, P, S, T, B, R, H, chunk, offset,
        HAS_KEEP=keep.numel() > 0, HAS_RESTART=restart.numel() > 0, BLOCK_B=BLOCK_B, RP=RP, HP=_padded(H),
        PRECISION=dot_precision(RP), num_warps=num_warps(RP))
    return G, P, S


def scan_backward(dG, u, S, P, p0, p_start, MtT, keep, restart):
    """The scan's reverse loop (``bilinear_scan.scan_backward``'s signature and results)."""
    T, N, B, R = u.shape
    RP = _padded(R)
    du, DP = sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, R)
    dp0, dp_start = u.new_empty(N, B, R), u.new_empty(N, B, R)
    dummy = u.new_empty(1, dtype=torch.int8)
    _backward_kernel[(N, triton.cdiv(B, BLOCK_B))](
        _in_sequence_major(dG), _in_sequence_major(u), _in_sequence_major(S), _in_sequence_major(P), p0.contiguous(),
        p_start.contiguous() if restart.numel() else u.new_empty(1), MtT.contiguous(),
        keep.to(torch.int8) if keep.numel() else dummy, restart.to(torch.int8) if restart.numel() else dummy, du, DP,
        dp0, dp_start, T, B, R, HAS_KEEP=keep.numel() > 0, HAS_RESTART=restart.numel() > 0, BLOCK_B=BLOCK_B, RP=RP,
        PRECISION=dot_precision(RP), num_warps=num_warps(RP))
    like_u = torch.empty_like(u)  # du in u's layout, as the other scans return it
    return du if du.stride() == like_u.stride() else like_u.copy_(du), DP, dp0, dp_start
