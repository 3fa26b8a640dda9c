"""The CP rank-space scan as Triton GPU kernels: the same entry points as ``scan`` (see its docstring).

Each program runs one head for a block of ``block_rows(columns)`` batch rows (whole groups of ``columns``: the
columns of a matrix state, normalized together) over the whole sequence: ``M^T`` and ``W1^T`` stay
on-chip, the state ``p`` in registers, and every step is one ``tl.dot([rows, R], [R, R])`` (the write channel's coordinate, the
last of the layout, is a vector of its own beside the tile, so it pads nothing; its forward kernel spills 16-20 bytes
of registers from rank 64 up for sm_90, ptxas, tested). The chunked
normalization and the overflow guard run in the kernel (no host synchronization): a segment in which a row's peak
``|g|`` leaves ``(SAFE_MIN, SAFE_MAX)`` or turns NaN is recomputed for those rows, normalizing every step.
Computation is in fp32 (fp64 for fp64 inputs); the products are exact fp32 up to rank 64 and TF32 on tensor cores
above (``dot_precision``: IEEE products spill registers there). Triton's interpreter computes them exactly. Rank
and state are padded to powers of two >= 16 with masks.
"""

import os

import torch

from .recurrence import SAFE_MAX, SAFE_MIN

try:  # optional: a CPU-only install never needs Triton (transformers' remote-code check skips try blocks)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_B = 16


def block_rows(columns: int) -> int:
    """Rows per program: ``BLOCK_B``, or one whole group of ``columns`` rows (a power of two) if that is more. Up to
    16 columns compile without register spills for sm_90 (ptxas, tested); the 64-row blocks of 64 columns spill
    (0.2-3.7 KB from rank 32 up, measured): correct, but slower than they could be."""
    if columns & (columns - 1):
        raise ValueError(f"the Triton scan needs a power-of-two number of state columns, got {columns}")
    return max(BLOCK_B, columns)


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
    def _over_columns(x, rows, COLUMNS: tl.constexpr, MAX: tl.constexpr):
        """``x [rows]`` summed (``MAX``: maximized) over each row's group of ``COLUMNS`` rows."""
        if COLUMNS == 1:
            return x
        ROWS: tl.constexpr = x.shape[0]
        groups = tl.reshape(x, (ROWS // COLUMNS, COLUMNS))
        reduced = tl.max(groups, axis=1) if MAX else tl.sum(groups, axis=1)
        return tl.reshape(tl.broadcast_to(reduced[:, None], (ROWS // COLUMNS, COLUMNS)), (ROWS,))

    @triton.jit
    def _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, write_ptr, v_ptr, p, c, mt, w1t, p_start,
                 c_start, n, rows, row_ok, cols, col_ok, hs, redo, store, t0, t1, N, B, R, H, chunk, offset,
                 HAS_KEEP: tl.constexpr, HAS_RESTART: tl.constexpr, HAS_WRITE: tl.constexpr,
                 PRECISION: tl.constexpr, COLUMNS: tl.constexpr):
        """Steps [t0, t1) for the block's rows -> (p and c after the last step, rows whose group's |g| stayed in
        range). ``c``: the write coordinate (column ``R - 1`` of the layout; ``HAS_WRITE``), kept out of the tile.

        ``redo`` rows normalize at every step; only ``store`` rows write G, P and S."""
        ok = row_ok | (row_ok == 0)  # all true
        for t in range(t0, t1):
            base = (t * N + n) * B + rows
            if HAS_RESTART:
                restart = tl.load(restart_ptr + t * B + rows, mask=row_ok, other=0) != 0
                p = tl.where(restart[:, None], p_start, p)
                c = tl.where(restart, c_start, c)
            tile = base[:, None] * R + cols[None, :]
            tile_ok = store[:, None] & col_ok[None, :]
            tl.store(P_ptr + tile, p, mask=tile_ok)  # the step's input
            g = tl.load(u_ptr + tile, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(p.dtype) * p
            if HAS_KEEP:
                keep = tl.load(keep_ptr + t * B + rows, mask=row_ok, other=1) != 0
            else:
                keep = row_ok | (row_ok == 0)
            boundary = (chunk > 0) & ((offset + t + 1) % tl.maximum(chunk, 1) == 0)
            normalize = (redo | boundary) & keep
            h = tl.dot(g, w1t, input_precision=PRECISION)  # [rows, H]: the state whose norm is divided out
            if HAS_WRITE:  # [h; c] = [W1 g + v e; gamma e] with e = c (its factor is 1); v read where it normalizes
                tl.store(P_ptr + base * R + R - 1, c, mask=store)
                gamma = tl.load(write_ptr + base * R + R - 1, mask=row_ok, other=0.0).to(p.dtype)
                v = tl.load(v_ptr + base[:, None] * H + hs[None, :], mask=normalize[:, None] & (hs < H)[None, :],
                            other=0.0).to(p.dtype)
                h = h + c[:, None] * v
                norm2 = tl.sum(h * h, axis=1) + gamma * c * gamma * c
            else:
                norm2 = tl.sum(h * h, axis=1)
            norm = tl.sqrt(_over_columns(norm2, rows, COLUMNS, False))
            tiny = tl.full(norm.shape, 1.1754943508222875e-38, norm.dtype)
            s = tl.where(normalize, 1.0 / tl.maximum(norm, tiny), 1.0)
            g = g * s[:, None]
            tl.store(G_ptr + tile, g, mask=tile_ok)
            tl.store(S_ptr + base, s, mask=store)
            peak = tl.max(tl.where(col_ok[None, :], tl.abs(g), 0.0), axis=1)
            nan = tl.max((g != g).to(tl.float32), axis=1)
            p_new = tl.dot(g, mt, input_precision=PRECISION)
            if HAS_WRITE:
                e = c * s
                tl.store(G_ptr + base * R + R - 1, e, mask=store)
                peak = tl.maximum(peak, tl.abs(e))
                nan = tl.maximum(nan, (e != e).to(tl.float32))
                beta = tl.load(write_ptr + tile, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(p.dtype)
                p_new = p_new + e[:, None] * beta
                c = tl.where(keep, gamma * e, c)
            peak = _over_columns(peak, rows, COLUMNS, True)
            nan = _over_columns(nan, rows, COLUMNS, True) > 0
            ok = ok & (peak < _SAFE_MAX) & (peak > _SAFE_MIN) & (nan == 0)
            p = tl.where(keep[:, None], p_new, p)
        return p, c, ok | (row_ok == 0)

    @triton.jit
    def _forward_kernel(u_ptr, mt_ptr, w1t_ptr, keep_ptr, p0_ptr, restart_ptr, p_start_ptr, write_ptr, v_ptr, G_ptr,
                        P_ptr, S_ptr, T, N, B, R, H, chunk, offset, HAS_KEEP: tl.constexpr,
                        HAS_RESTART: tl.constexpr, HAS_WRITE: tl.constexpr, BLOCK_B: tl.constexpr, RP: tl.constexpr,
                        HP: tl.constexpr, PRECISION: tl.constexpr, COLUMNS: tl.constexpr):
        n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        cols = tl.arange(0, RP)
        col_ok = cols < R - HAS_WRITE  # the tile; with the write, column R - 1 (c) is a vector of its own
        hs = tl.arange(0, HP)
        mt = tl.load(mt_ptr + n * R * R + cols[:, None] * R + cols[None, :],
                     mask=col_ok[:, None] & col_ok[None, :], other=0.0)
        dtype = mt.dtype
        w1t = tl.load(w1t_ptr + n * R * H + cols[:, None] * H + hs[None, :],
                      mask=col_ok[:, None] & (hs < H)[None, :], other=0.0).to(dtype)
        p = tl.load(p0_ptr + (n * B + rows[:, None]) * R + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(dtype)
        p_start = tl.zeros([BLOCK_B, RP], dtype)
        c = tl.zeros([BLOCK_B], dtype)
        c_start = tl.zeros([BLOCK_B], dtype)
        if HAS_WRITE:
            c = tl.load(p0_ptr + (n * B + rows) * R + R - 1, mask=row_ok, other=0.0).to(dtype)
        if HAS_RESTART:  # each row's column of the start state [N, COLUMNS, R]
            start = (n * COLUMNS + rows % COLUMNS) * R
            p_start = tl.load(p_start_ptr + start[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                              other=0.0).to(dtype)
            if HAS_WRITE:
                c_start = tl.load(p_start_ptr + start + R - 1, mask=row_ok, other=0.0).to(dtype)
        no_rows = row_ok & (row_ok == 0)
        t0 = 0
        while t0 < T:
            t1 = T
            if chunk > 0:
                t1 = tl.minimum(T, t0 + chunk - (offset + t0) % chunk)
            first, first_c, ok = _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, write_ptr, v_ptr, p, c,
                                          mt, w1t, p_start, c_start, n, rows, row_ok, cols, col_ok, hs, no_rows,
                                          row_ok, t0, t1, N, B, R, H, chunk, offset, HAS_KEEP, HAS_RESTART,
                                          HAS_WRITE, PRECISION, COLUMNS)
            if (chunk > 0) & (tl.sum((ok == 0).to(tl.int32)) > 0):
                redo = ok == 0
                again, again_c, _ = _segment(u_ptr, G_ptr, P_ptr, S_ptr, keep_ptr, restart_ptr, write_ptr, v_ptr, p,
                                             c, mt, w1t, p_start, c_start, n, rows, row_ok, cols, col_ok, hs, redo,
                                             redo & row_ok, t0, t1, N, B, R, H, chunk, offset, HAS_KEEP,
                                             HAS_RESTART, HAS_WRITE, PRECISION, COLUMNS)
                first = tl.where(redo[:, None], again, first)
                first_c = tl.where(redo, again_c, first_c)
            p, c = first, first_c
            t0 = t1
        last = (T * N + n) * B + rows
        tl.store(P_ptr + last[:, None] * R + cols[None, :], p, mask=row_ok[:, None] & col_ok[None, :])
        if HAS_WRITE:
            tl.store(P_ptr + last * R + R - 1, c, mask=row_ok)

    @triton.jit
    def _backward_kernel(dG_ptr, su_ptr, mtt_ptr, keep_ptr, restart_ptr, write_ptr, e_ptr, DGT_ptr, DP_ptr, dp0_ptr,
                         dps_ptr, T, N, B, R, HAS_KEEP: tl.constexpr, HAS_RESTART: tl.constexpr,
                         HAS_WRITE: tl.constexpr, BLOCK_B: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr):
        n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        cols = tl.arange(0, RP)
        col_ok = cols < R - HAS_WRITE  # with the write, column R - 1 (c) is a vector of its own
        tile_ok = row_ok[:, None] & col_ok[None, :]
        mtt = tl.load(mtt_ptr + n * R * R + cols[:, None] * R + cols[None, :],
                      mask=col_ok[:, None] & col_ok[None, :], other=0.0)
        dtype = mtt.dtype
        dp = tl.zeros([BLOCK_B, RP], dtype)
        dps = tl.zeros([BLOCK_B, RP], dtype)
        dc = tl.zeros([BLOCK_B], dtype)
        dcs = tl.zeros([BLOCK_B], dtype)
        for i in range(0, T):
            t = T - 1 - i
            tile = ((t * N + n) * B + rows[:, None]) * R + cols[None, :]
            if HAS_KEEP:
                keep = tl.load(keep_ptr + t * B + rows, mask=row_ok, other=1) != 0
            else:
                keep = row_ok | (row_ok == 0)
            dp_in = tl.where(keep[:, None], dp, 0.0)
            dgt = tl.load(dG_ptr + tile, mask=tile_ok, other=0.0).to(dtype) + tl.dot(dp_in, mtt, input_precision=PRECISION)
            tl.store(DP_ptr + tile, dp_in, mask=tile_ok)
            tl.store(DGT_ptr + tile, dgt, mask=tile_ok)
            if HAS_WRITE:  # the write coordinate in log form (scan's docstring): dc is c_t dL/dc_t
                last = ((t * N + n) * B + rows) * R + R - 1
                dc_in = tl.where(keep, dc, 0.0)
                beta = tl.load(write_ptr + tile, mask=tile_ok, other=0.0).to(dtype)
                e = tl.load(e_ptr + (t * N + n) * B + rows, mask=row_ok, other=0.0).to(dtype)
                de = e * (tl.load(dG_ptr + last, mask=row_ok, other=0.0).to(dtype) + tl.sum(beta * dp_in, axis=1)) \
                    + dc_in
                tl.store(DP_ptr + last, dc_in, mask=row_ok)
                tl.store(DGT_ptr + last, de, mask=row_ok)
                dc = de + tl.where(keep, 0.0, dc)
            dp = tl.load(su_ptr + tile, mask=tile_ok, other=0.0).to(dtype) * dgt + tl.where(keep[:, None], 0.0, dp)
            if HAS_RESTART:  # this step's input was p_start, not the previous step's output
                restart = tl.load(restart_ptr + t * B + rows, mask=row_ok, other=0) != 0
                dps += tl.where(restart[:, None], dp, 0.0)
                dp = tl.where(restart[:, None], 0.0, dp)
                dcs += tl.where(restart, dc, 0.0)
                dc = tl.where(restart, 0.0, dc)
        out = (n * B + rows[:, None]) * R + cols[None, :]
        tl.store(dp0_ptr + out, dp, mask=tile_ok)
        tl.store(dps_ptr + out, dps, mask=tile_ok)
        if HAS_WRITE:
            last = (n * B + rows) * R + R - 1
            tl.store(dp0_ptr + last, dc, mask=row_ok)
            tl.store(dps_ptr + last, dcs, mask=row_ok)


def scan_forward(u, Mt, W1, keep, p0, chunk: int, offset: int, restart, p_start, columns: int, write, v):
    """The scan's forward (``scan.scan_forward``'s signature and results)."""
    T, N, B, R = u.shape
    H = W1.shape[1]
    rows = block_rows(columns)
    has_write = write.numel() > 0
    RP = _padded(R - has_write)  # the write coordinate stays out of the tile
    G, P = torch.empty_like(u), u.new_empty(T + 1, N, B, R)
    S = u.new_empty(T, N, B, 1)
    dummy = u.new_empty(1, dtype=torch.int8)
    _forward_kernel[(N, triton.cdiv(B, rows))](
        u, Mt.contiguous(), W1.transpose(1, 2).contiguous(), keep.to(torch.int8) if keep.numel() else dummy,
        p0.contiguous(), restart.to(torch.int8) if restart.numel() else dummy,
        p_start.contiguous() if restart.numel() else u.new_empty(1), write.contiguous() if has_write else u,
        v.contiguous() if has_write else u, G, P, S, T, N, B, R, H, chunk, offset, HAS_KEEP=keep.numel() > 0,
        HAS_RESTART=restart.numel() > 0, HAS_WRITE=has_write, BLOCK_B=rows, RP=RP, HP=_padded(H),
        PRECISION=dot_precision(RP), COLUMNS=columns, num_warps=num_warps(RP))
    return G, P, S


def scan_backward(dG, su, MtT, keep, restart, DGT, DP, write, e):
    """The scan's reverse loop (``scan.scan_backward``'s signature and results)."""
    T, N, B, R = su.shape
    has_write = write.numel() > 0
    RP = _padded(R - has_write)
    dp0, dp_start = su.new_empty(N, B, R), su.new_empty(N, B, R)
    dummy = su.new_empty(1, dtype=torch.int8)
    _backward_kernel[(N, triton.cdiv(B, BLOCK_B))](
        dG.contiguous(), su.contiguous(), MtT.contiguous(), keep.to(torch.int8) if keep.numel() else dummy,
        restart.to(torch.int8) if restart.numel() else dummy, write.contiguous() if has_write else su,
        e.contiguous() if has_write else su, DGT, DP, dp0, dp_start, T, N, B, R, HAS_KEEP=keep.numel() > 0,
        HAS_RESTART=restart.numel() > 0, HAS_WRITE=has_write, BLOCK_B=BLOCK_B, RP=RP, PRECISION=dot_precision(RP),
        num_warps=num_warps(RP))
    return dp0, dp_start
