"""C++ CPU kernels, built by :func:`load_kernel` (the model calls it on its first CPU forward; cached by torch).

* ``scan_forward`` / ``scan_backward`` (``SCAN_SOURCE``): the CP rank-space scan, the same entry points as
  ``torch_scan.forward/backward``. Every (head, batch row) evolves independently, so each is one thread's
  sequential loop over time with no per-step synchronization or dispatch (tested against the PyTorch scan and the
  reference loop).
* ``small_batch_linear`` (``GEMV_SOURCE``): a GEMV for a few rows (decoding), used by :class:`Linear`.
* ``decode_block`` (``DECODE_BLOCK_SOURCE``): one decoding step of a whole ``BilinearBlock`` in one call, its
  weights passed by name (:class:`DecodeBlockWeights`; tested against the modules).

:func:`load_kernel` returns ``None`` when the kernels cannot be built (no compiler); the PyTorch paths (scan loop,
``F.linear``, the modules) are used instead.
"""

import hashlib
import logging
import os
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .recurrence import SAFE_MAX, SAFE_MIN

logger = logging.getLogger(__name__)

# Shared by the kernels: the overflow guard's range test (bounds from recurrence.SAFE_MIN/SAFE_MAX), the norm and a
# small vector-matrix product.
COMMON_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// The overflow guard's test (recurrence.in_safe_range): the peak |v_i| lies in (kSafeMin, kSafeMax); a NaN fails.
template <typename scalar_t>
bool in_safe_range(const scalar_t* v, int64_t n) {
  scalar_t peak = 0;
  int nan = 0;
#pragma omp simd reduction(max : peak) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t a = std::abs(v[i]);
    peak = a > peak ? a : peak;
    nan |= a != a;
  }
  return !nan && peak < scalar_t(kSafeMax) && peak > scalar_t(kSafeMin);
}

// ||v|| clamped to the smallest normal number, as in recurrence.scale_at_boundary and BilinearStateNorm.
template <typename scalar_t>
scalar_t clamped_norm(const scalar_t* v, int64_t n) {
  scalar_t norm2 = 0;
#pragma omp simd reduction(+ : norm2)
  for (int64_t i = 0; i < n; ++i) norm2 += v[i] * v[i];
  return std::max(std::sqrt(norm2), std::numeric_limits<scalar_t>::min());
}

// out[c] = base[c] + sum_r g[r] M[r, c] (no base: 0) for M [R, C] row-major: a row vector times a small matrix,
// in column blocks whose accumulators stay in registers (the step-to-step chain of the scans and decoding).
template <typename scalar_t, int W>
inline void vec_mat_block(const scalar_t* __restrict__ g, const scalar_t* __restrict__ M, const scalar_t* base,
                          int64_t R, int64_t C, int64_t c0, scalar_t* __restrict__ out) {
  scalar_t acc[W];
  for (int j = 0; j < W; ++j) acc[j] = base ? base[c0 + j] : scalar_t(0);
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t gr = g[r];
    const scalar_t* __restrict__ Mr = M + r * C + c0;
    for (int j = 0; j < W; ++j) acc[j] += gr * Mr[j];
  }
  for (int j = 0; j < W; ++j) out[c0 + j] = acc[j];
}

template <typename scalar_t>
inline void vec_mat(const scalar_t* g, const scalar_t* M, int64_t R, int64_t C, scalar_t* out,
                    const scalar_t* base = nullptr) {
  int64_t c0 = 0;
  for (; c0 + 64 <= C; c0 += 64) vec_mat_block<scalar_t, 64>(g, M, base, R, C, c0, out);
  if (c0 + 32 <= C) { vec_mat_block<scalar_t, 32>(g, M, base, R, C, c0, out); c0 += 32; }
  if (c0 + 16 <= C) { vec_mat_block<scalar_t, 16>(g, M, base, R, C, c0, out); c0 += 16; }
  for (; c0 < C; ++c0) vec_mat_block<scalar_t, 1>(g, M, base, R, C, c0, out);
}
"""

# The CP rank-space scan: the C++ twin of torch_scan.scan_forward/scan_backward.
SCAN_SOURCE = r"""
// Layout: u, G, P: [T(+1), N, B, R]; S: [T, N, B, 1]; Mt: [N, R, R] (p_new = g @ Mt); W1: [N, H, R];
// keep, restart: [T, B] bool or empty; p_start: [N, R]. Each (head, row) runs its whole sequence in one thread,
// chunk by chunk; a chunk whose peak |g| leaves the safe range is recomputed for that (head, row) normalizing
// every step. A restart step reads p_start instead of the previous p (P holds each step's input).
template <typename scalar_t>
struct RowScan {
  const scalar_t* u; const scalar_t* M; const scalar_t* W1T; const bool* keep; const bool* restart;
  const scalar_t* p_start; scalar_t* P; scalar_t* G; scalar_t* S;
  int64_t N, B, R, H, n, b, chunk, offset;

  // Steps [t0, t1); returns whether every step's peak |g| stayed in the safe range.
  bool run(int64_t t0, int64_t t1, bool every_step) {
    bool in_range = true;
    std::vector<scalar_t> hv(H);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = (t * N + n) * B + b;
      const scalar_t* __restrict__ ut = u + row * R;
      scalar_t* __restrict__ pt = P + row * R;
      if (restart && restart[t * B + b])
        for (int64_t r = 0; r < R; ++r) pt[r] = p_start[r];
      scalar_t* __restrict__ pn = P + (row + N * B) * R;
      scalar_t* __restrict__ g = G + row * R;
      const bool keep_t = keep ? keep[t * B + b] : true;
      for (int64_t r = 0; r < R; ++r) g[r] = ut[r] * pt[r];
      scalar_t s = 1;
      const bool boundary = chunk > 0 && (offset + t + 1) % chunk == 0;
      if ((every_step || boundary) && keep_t) {
        vec_mat(g, W1T, R, H, hv.data());  // h = W1 g
        s = scalar_t(1) / clamped_norm(hv.data(), H);
        for (int64_t r = 0; r < R; ++r) g[r] *= s;
      }
      S[row] = s;
      in_range = in_safe_range(g, R) && in_range;
      if (keep_t) {
        vec_mat(g, M, R, R, pn);
      } else {
        for (int64_t c = 0; c < R; ++c) pn[c] = pt[c];
      }
    }
    return in_range;
  }
};

std::vector<torch::Tensor> scan_forward(torch::Tensor u, torch::Tensor Mt, torch::Tensor W1, torch::Tensor keep,
                                        torch::Tensor p0, int64_t chunk, int64_t offset, torch::Tensor restart,
                                        torch::Tensor p_start) {
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3), H = W1.size(1);
  auto G = torch::empty_like(u);
  auto P = torch::empty({T + 1, N, B, R}, u.options());
  auto S = torch::empty({T, N, B, 1}, u.options());
  auto W1T = W1.transpose(1, 2).contiguous();  // [N, R, H]: h = W1 g is a vec_mat
  P[0].copy_(p0);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "cp_scan_forward", [&] {
    const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
    const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
    at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) {
        const int64_t n = nb / B, b = nb % B;
        RowScan<scalar_t> scan{u.data_ptr<scalar_t>(), Mt.data_ptr<scalar_t>() + n * R * R,
                               W1T.data_ptr<scalar_t>() + n * R * H, kp, rp,
                               rp ? p_start.data_ptr<scalar_t>() + n * R : nullptr, P.data_ptr<scalar_t>(),
                               G.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(), N, B, R, H, n, b, chunk, offset};
        for (int64_t t0 = 0; t0 < T;) {
          const int64_t t1 = chunk > 0 ? std::min(T, t0 + chunk - (offset + t0) % chunk) : T;
          if (!scan.run(t0, t1, false) && chunk > 0) scan.run(t0, t1, true);
          t0 = t1;
        }
      }
    });
  });
  return {G, P, S};
}

// Backward of the whole scan. su = S * u; MtT = Mt^T contiguous. Writes DGT (total grad of g_t) and
// DP (grad of p_t entering step t's matmul, zero where padded), and the grads of p_0 and of p_start per row.
template <typename scalar_t>
void backward_kernel(const torch::Tensor& dG, const torch::Tensor& su, const torch::Tensor& MtT,
                     const torch::Tensor& keep, const torch::Tensor& restart, torch::Tensor& DGT, torch::Tensor& DP,
                     torch::Tensor& dp0, torch::Tensor& dp_start) {
  const int64_t T = su.size(0), N = su.size(1), B = su.size(2), R = su.size(3);
  const scalar_t* dgp = dG.data_ptr<scalar_t>();
  const scalar_t* sup = su.data_ptr<scalar_t>();
  const scalar_t* mp = MtT.data_ptr<scalar_t>();
  const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
  const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
  scalar_t* dsp = dp_start.data_ptr<scalar_t>();
  scalar_t* dgtp = DGT.data_ptr<scalar_t>();
  scalar_t* dpp = DP.data_ptr<scalar_t>();
  scalar_t* outp = dp0.data_ptr<scalar_t>();
  at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> dp(R);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb / B, b = nb % B;
      const scalar_t* M = mp + n * R * R;
      scalar_t* ds = dsp + (n * B + b) * R;
      std::fill(dp.begin(), dp.end(), scalar_t(0));
      std::fill(ds, ds + R, scalar_t(0));
      for (int64_t t = T - 1; t >= 0; --t) {
        const int64_t row = (t * N + n) * B + b;
        const bool keep_t = kp ? kp[t * B + b] : true;
        scalar_t* __restrict__ dpt = dpp + row * R;
        scalar_t* __restrict__ dgt = dgtp + row * R;
        const scalar_t* __restrict__ dgo = dgp + row * R;
        const scalar_t* __restrict__ sut = sup + row * R;
        for (int64_t r = 0; r < R; ++r) dpt[r] = keep_t ? dp[r] : scalar_t(0);
        if (keep_t) {
          vec_mat(dpt, M, R, R, dgt, dgo);  // dgt = dgo + dp @ Mt^T
          for (int64_t r = 0; r < R; ++r) dp[r] = sut[r] * dgt[r];
        } else {
          for (int64_t r = 0; r < R; ++r) dgt[r] = dgo[r];
          for (int64_t r = 0; r < R; ++r) dp[r] += sut[r] * dgt[r];
        }
        if (rp && rp[t * B + b]) {  // this step's input was p_start, not the previous step's output
          for (int64_t r = 0; r < R; ++r) { ds[r] += dp[r]; dp[r] = 0; }
        }
      }
      scalar_t* out = outp + (n * B + b) * R;
      for (int64_t r = 0; r < R; ++r) out[r] = dp[r];
    }
  });
}

std::vector<torch::Tensor> scan_backward(torch::Tensor dG, torch::Tensor su, torch::Tensor MtT, torch::Tensor keep,
                                         torch::Tensor restart, torch::Tensor DGT, torch::Tensor DP) {
  auto dp0 = torch::empty({su.size(1), su.size(2), su.size(3)}, su.options());
  auto dp_start = torch::empty_like(dp0);
  AT_DISPATCH_FLOATING_TYPES(su.scalar_type(), "cp_scan_backward", [&] {
    backward_kernel<scalar_t>(dG, su, MtT, keep, restart, DGT, DP, dp0, dp_start);
  });
  return {dp0, dp_start};
}
"""

# A few-row GEMV (decoding).
GEMV_SOURCE = r"""
// y = x @ W^T for a few rows of x ([M, K], M small: decoding) and W [N, K] row-major: the output features are
// split across threads and each weight row is streamed from memory once for all M rows. (MKL's GEMV reaches a
// third of this CPU's memory bandwidth; this is what makes a decode step weight-bandwidth bound.)
template <typename scalar_t>
void small_batch_linear_kernel(const scalar_t* xp, const scalar_t* wp, scalar_t* yp, int64_t M, int64_t K,
                               int64_t N) {
  // Four weight rows at a time: four independent accumulators keep the FMA units busy.
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t n0 = 4 * q, rows = std::min<int64_t>(4, N - n0);
      const scalar_t* __restrict__ w0 = wp + n0 * K;
      const scalar_t* __restrict__ w1 = wp + (n0 + std::min<int64_t>(1, rows - 1)) * K;
      const scalar_t* __restrict__ w2 = wp + (n0 + std::min<int64_t>(2, rows - 1)) * K;
      const scalar_t* __restrict__ w3 = wp + (n0 + std::min<int64_t>(3, rows - 1)) * K;
      for (int64_t m = 0; m < M; ++m) {
        const scalar_t* __restrict__ xm = xp + m * K;
        scalar_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          a0 += w0[k] * xm[k];
          a1 += w1[k] * xm[k];
          a2 += w2[k] * xm[k];
          a3 += w3[k] * xm[k];
        }
        const scalar_t acc[4] = {a0, a1, a2, a3};
        for (int64_t i = 0; i < rows; ++i) yp[m * N + n0 + i] = acc[i];
      }
    }
  });
}

torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor W) {
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1) && x.is_contiguous() && W.is_contiguous() &&
              x.device().is_cpu() && W.device().is_cpu() && x.scalar_type() == W.scalar_type(),
              "small_batch_linear: x [M, K] and W [N, K] must be contiguous CPU tensors of one dtype");
  auto y = torch::empty({x.size(0), W.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "small_batch_linear", [&] {
    small_batch_linear_kernel<scalar_t>(x.data_ptr<scalar_t>(), W.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                        x.size(0), x.size(1), W.size(0));
  });
  return y;
}
"""

# One decoding step of a whole block.
DECODE_BLOCK_SOURCE = r"""
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t M, int64_t D, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    scalar_t ms = 0;
    for (int64_t d = 0; d < D; ++d) ms += x[m * D + d] * x[m * D + d];
    const scalar_t r = scalar_t(1) / std::sqrt(ms / D + scalar_t(eps));
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = w[d] * (x[m * D + d] * r);
  }
}

template <typename scalar_t>
inline scalar_t silu(scalar_t z) { return z / (scalar_t(1) + std::exp(-z)); }

// One decoding step (one position, a few rows) of a whole block: RMSNorm -> CP mixer (one recurrence step with the
// reference loop's normalization and overflow guard, normalized and gated readout) -> residual -> RMSNorm -> SwiGLU
// -> residual. The same computation as the modules' forward, in one call instead of about fifty small ops.
// x: [B, D]; h: [B, N, H] (updated in place); keep: [B] bool or empty; in_proj rows: [N*R factors | N*H gate or none]
// (the factors are in_proj x * factor_scale + bias: BilinearConfig.input_factor_multiplier);
// MLP weights empty when the block has no MLP.
template <typename scalar_t>
void decode_block_kernel(scalar_t* x, scalar_t* h, const bool* keep, bool boundary, bool guard, int64_t B, int64_t D,
                         int64_t N, int64_t H, int64_t R, bool gated, const scalar_t* mixer_norm_w, double eps,
                         scalar_t factor_scale, const scalar_t* in_w, const scalar_t* bias, const scalar_t* W1,
                         const scalar_t* W2, const scalar_t* state_w, const scalar_t* out_w,
                         const scalar_t* mlp_norm_w, const scalar_t* gate_up_w, const scalar_t* down_w, int64_t I) {
  const int64_t F = N * R, G = gated ? N * H : 0;
  std::vector<scalar_t> xn(B * D), z(B * (F + G)), y(B * N * H), o(B * D), p(R), g(R);
  rms_norm_rows(x, mixer_norm_w, xn.data(), B, D, eps);
  small_batch_linear_kernel(xn.data(), in_w, z.data(), B, D, F + G);
  for (int64_t b = 0; b < B; ++b) {
    const bool keep_b = keep ? keep[b] : true;
    for (int64_t n = 0; n < N; ++n) {
      scalar_t* hb = h + (b * N + n) * H;
      const scalar_t* w1 = W1 + n * H * R;
      const scalar_t* w2 = W2 + n * H * R;
      if (keep_b) {
        vec_mat(hb, w2, H, R, p.data());  // p = W2^T h
        for (int64_t r = 0; r < R; ++r) g[r] = (z[b * (F + G) + n * R + r] * factor_scale + bias[n * R + r]) * p[r];
        for (int64_t k = 0; k < H; ++k) {
          scalar_t acc = 0;
          for (int64_t r = 0; r < R; ++r) acc += w1[k * R + r] * g[r];
          hb[k] = acc;
        }
        if (boundary || (guard && !in_safe_range(hb, H))) {
          const scalar_t scale = scalar_t(1) / clamped_norm(hb, H);
          for (int64_t k = 0; k < H; ++k) hb[k] *= scale;
        }
      }
      const scalar_t norm = clamped_norm(hb, H), root = std::sqrt(scalar_t(H));
      for (int64_t k = 0; k < H; ++k) {
        scalar_t v = hb[k] / norm * (root * state_w[n * H + k]);
        if (gated) v *= silu(z[b * (F + G) + F + n * H + k]);
        y[(b * N + n) * H + k] = v;
      }
    }
  }
  small_batch_linear_kernel(y.data(), out_w, o.data(), B, N * H, D);
  for (int64_t i = 0; i < B * D; ++i) x[i] += o[i];
  if (!mlp_norm_w) return;
  std::vector<scalar_t> gu(B * 2 * I), a(B * I);
  rms_norm_rows(x, mlp_norm_w, xn.data(), B, D, eps);
  small_batch_linear_kernel(xn.data(), gate_up_w, gu.data(), B, D, 2 * I);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i) a[b * I + i] = silu(gu[b * 2 * I + i]) * gu[b * 2 * I + I + i];
  small_batch_linear_kernel(a.data(), down_w, o.data(), B, I, D);
  for (int64_t i = 0; i < B * D; ++i) x[i] += o[i];
}

// Returns (x_new [B, D], h_new [B, N, H]); see decode_block_kernel.
// The weights' names are the fields of cpu_kernels.DecodeBlockWeights (bound as keyword arguments).
std::vector<torch::Tensor> decode_block(torch::Tensor x, torch::Tensor h, torch::Tensor keep, bool boundary, bool guard,
                                        double eps, double factor_scale, torch::Tensor mixer_norm_w, torch::Tensor in_w,
                                        torch::Tensor bias, torch::Tensor W1, torch::Tensor W2, torch::Tensor state_w,
                                        torch::Tensor out_w, torch::Tensor mlp_norm_w, torch::Tensor gate_up_w,
                                        torch::Tensor down_w) {
  const int64_t B = x.size(0), D = x.size(1), N = W1.size(0), H = W1.size(1), R = W1.size(2);
  const bool gated = in_w.size(0) > N * R;
  const bool mlp = mlp_norm_w.numel() > 0;
  for (const auto& t : {x, h, mixer_norm_w, in_w, bias, W1, W2, state_w, out_w, mlp_norm_w, gate_up_w, down_w}) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == x.scalar_type(),
                "decode_block: every tensor must be contiguous, on the CPU, and of x's dtype");
  }
  TORCH_CHECK(keep.numel() == 0 || (keep.numel() == B && keep.scalar_type() == torch::kBool && keep.is_contiguous()),
              "decode_block: keep must be empty or B contiguous bools");
  TORCH_CHECK(h.numel() == B * N * H && mixer_norm_w.numel() == D && W2.sizes() == W1.sizes() &&
              bias.numel() == N * R && state_w.numel() == N * H && in_w.size(1) == D &&
              (in_w.size(0) == N * R || in_w.size(0) == N * R + N * H) && out_w.size(0) == D &&
              out_w.size(1) == N * H, "decode_block: mixer weight shapes do not match x [B, D] and W1 [N, H, R]");
  TORCH_CHECK(!mlp || (mlp_norm_w.numel() == D && gate_up_w.size(1) == D && down_w.size(0) == D &&
                       gate_up_w.size(0) == 2 * down_w.size(1)),
              "decode_block: MLP weight shapes do not match x [B, D]");
  auto xo = x.clone();
  auto ho = h.clone();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_block", [&] {
    decode_block_kernel<scalar_t>(
        xo.data_ptr<scalar_t>(), ho.data_ptr<scalar_t>(), keep.numel() ? keep.data_ptr<bool>() : nullptr, boundary,
        guard, B, D, N, H, R, gated, mixer_norm_w.data_ptr<scalar_t>(), eps, scalar_t(factor_scale),
        in_w.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(), W1.data_ptr<scalar_t>(), W2.data_ptr<scalar_t>(),
        state_w.data_ptr<scalar_t>(), out_w.data_ptr<scalar_t>(), mlp ? mlp_norm_w.data_ptr<scalar_t>() : nullptr,
        mlp ? gate_up_w.data_ptr<scalar_t>() : nullptr, mlp ? down_w.data_ptr<scalar_t>() : nullptr,
        mlp ? down_w.size(1) : 0);
  });
  return {xo, ho};
}
"""

BINDINGS_SOURCE = r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("scan_forward", &scan_forward, arg("u"), arg("Mt"), arg("W1"), arg("keep"), arg("p0"), arg("chunk"),
        arg("offset"), arg("restart"), arg("p_start"));
  m.def("scan_backward", &scan_backward, arg("dG"), arg("su"), arg("MtT"), arg("keep"), arg("restart"), arg("DGT"),
        arg("DP"));
  m.def("small_batch_linear", &small_batch_linear, arg("x"), arg("W"));
  m.def("decode_block", &decode_block, arg("x"), arg("h"), arg("keep"), arg("boundary"), arg("guard"), arg("eps"),
        arg("factor_scale"), arg("mixer_norm"), arg("in_proj"), arg("factor_bias"), arg("W1"), arg("W2"),
        arg("state_norm"), arg("out_proj"), arg("mlp_norm"), arg("gate_up_proj"), arg("down_proj"));
}
"""


_lock = threading.Lock()
_module = None
_failed = False


def _sources() -> list[str]:
    """The kernels' C++ sources, the guard's bounds taken from the reference loop's (exact hex literals)."""
    bounds = f"constexpr double kSafeMin = {SAFE_MIN.hex()};\nconstexpr double kSafeMax = {SAFE_MAX.hex()};\n"
    return [bounds + COMMON_SOURCE + SCAN_SOURCE + GEMV_SOURCE + DECODE_BLOCK_SOURCE + BINDINGS_SOURCE]


def _cpu_tag(sources: list[str]) -> str:
    """Build cache key for ``-march=native``: a kernel built on one CPU is never loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags + "".join(sources)).encode()).hexdigest()[:12]


def load_kernel():
    """Build (once per process; the build itself is cached by torch) and return the compiled kernels module, or
    ``None`` if it cannot be built here (the PyTorch paths are used then). The model builds it on its first CPU
    forward (:func:`build_kernels`); :func:`built_kernel` never builds."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                logger.info("building the bilinear CPU kernels (once; cached by torch)")
                sources = _sources()
                _module = load_inline(
                    name=f"bilinear_cpu_kernels_{_cpu_tag(sources)}",
                    cpp_sources=sources,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=os.environ.get("BILINEAR_LM_VERBOSE_BUILD") == "1",
                )
            except Exception as error:  # no compiler or headers: fall back, say so once
                _failed = True
                logger.warning("bilinear CPU kernels unavailable (%s); using the PyTorch paths", error)
    return _module


def built_kernel():
    """The compiled kernels module if :func:`load_kernel` has built it, else ``None`` (never builds)."""
    return _module


@torch.compiler.assume_constant_result
def build_kernels() -> bool:
    """Build the kernels (once) and say whether they are usable here. ``torch.compile`` runs this while tracing and
    keeps its answer, so the build (its lock) is never traced."""
    return load_kernel() is not None


def kernel_available_for(tensor: torch.Tensor) -> bool:
    """Whether the compiled kernels can run on this tensor (CPU, fp32/fp64) and build on this machine."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64) and build_kernels()


SMALL_BATCH_ROWS = 4


class DecodeBlockWeights(NamedTuple):
    """The weights of one block for the compiled decoding step (``decode_block``'s keyword arguments)."""

    mixer_norm: torch.Tensor
    in_proj: torch.Tensor
    factor_bias: torch.Tensor
    W1: torch.Tensor
    W2: torch.Tensor
    state_norm: torch.Tensor
    out_proj: torch.Tensor
    mlp_norm: torch.Tensor  # the MLP's three are empty when the block has no MLP
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose few-row, gradient-free CPU calls (decoding) run the compiled GEMV.

    MKL's matrix-vector product reaches about a third of this kind of CPU's memory bandwidth, and a decode step
    is a chain of matrix-vector products, so the kernel about halves the time of a step. Anything else (training,
    prefill, autocast, other devices, or before the model's first CPU forward has built the kernels) is
    ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        rows = x.numel() // self.in_features
        kernel = built_kernel()
        if (kernel is not None and rows <= SMALL_BATCH_ROWS and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.float64) and x.dtype == self.weight.dtype
                and not torch.is_autocast_enabled(x.device.type)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            y = kernel.small_batch_linear(x.reshape(rows, self.in_features).contiguous(), self.weight.contiguous())
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight)
