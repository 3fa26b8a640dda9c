"""C++ CPU kernel of the CP rank-space scan, compiled on first use and cached by torch.

Every (head, batch row) evolves independently, so each is one thread's sequential loop over time with no
per-step synchronization or dispatch. It computes exactly what the PyTorch loop in ``recurrence._CPScan``
computes (tested against it and against the reference loop). :func:`load_kernel` returns ``None`` when the kernel
cannot be built (no compiler), and the PyTorch loop is used instead.
"""

import hashlib
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// Layout: u, G, P: [T(+1), N, B, R]; S: [T, N, B, 1]; Mt: [N, R, R] (p_new = g @ Mt); W1: [N, H, R];
// keep: [T, B] bool or empty (no padding). Each (head, row) runs its whole sequence in one thread, chunk by
// chunk; a chunk whose peak |g| leaves [2^-60, 2^60] is recomputed for that (head, row) normalizing every step.
template <typename scalar_t>
struct RowScan {
  const scalar_t* u; const scalar_t* M; const scalar_t* W; const bool* keep;
  scalar_t* P; scalar_t* G; scalar_t* S;
  int64_t N, B, R, H, n, b, chunk, offset;

  // Steps [t0, t1); returns whether every step's peak |g| stayed in the safe range.
  bool run(int64_t t0, int64_t t1, bool every_step) {
    const scalar_t tiny = std::numeric_limits<scalar_t>::min();
    bool in_range = true;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = (t * N + n) * B + b;
      const scalar_t* __restrict__ ut = u + row * R;
      const scalar_t* __restrict__ pt = P + row * R;
      scalar_t* __restrict__ pn = P + (row + N * B) * R;
      scalar_t* __restrict__ g = G + row * R;
      const bool keep_t = keep ? keep[t * B + b] : true;
      for (int64_t r = 0; r < R; ++r) g[r] = ut[r] * pt[r];
      scalar_t s = 1;
      const bool boundary = chunk > 0 && (offset + t + 1) % chunk == 0;
      if ((every_step || boundary) && keep_t) {
        scalar_t norm2 = 0;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t acc = 0;
          for (int64_t r = 0; r < R; ++r) acc += W[h * R + r] * g[r];
          norm2 += acc * acc;
        }
        s = scalar_t(1) / std::max(std::sqrt(norm2), tiny);
        for (int64_t r = 0; r < R; ++r) g[r] *= s;
      }
      S[row] = s;
      scalar_t peak = 0;
      for (int64_t r = 0; r < R; ++r) peak = std::max(peak, std::abs(g[r]));
      in_range = in_range && peak < scalar_t(0x1p60) && peak > scalar_t(0x1p-60);  // NaN fails both
      if (keep_t) {
        for (int64_t c = 0; c < R; ++c) pn[c] = 0;
        for (int64_t r = 0; r < R; ++r) {
          const scalar_t gr = g[r];
          const scalar_t* __restrict__ Mr = M + r * R;
          for (int64_t c = 0; c < R; ++c) pn[c] += gr * Mr[c];
        }
      } else {
        for (int64_t c = 0; c < R; ++c) pn[c] = pt[c];
      }
    }
    return in_range;
  }
};

std::vector<torch::Tensor> forward(torch::Tensor u, torch::Tensor Mt, torch::Tensor W1, torch::Tensor keep,
                                   torch::Tensor p0, int64_t chunk, int64_t offset) {
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3), H = W1.size(1);
  auto G = torch::empty_like(u);
  auto P = torch::empty({T + 1, N, B, R}, u.options());
  auto S = torch::empty({T, N, B, 1}, u.options());
  P[0].copy_(p0);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "cp_scan_forward", [&] {
    const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
    at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) {
        const int64_t n = nb / B, b = nb % B;
        RowScan<scalar_t> scan{u.data_ptr<scalar_t>(), Mt.data_ptr<scalar_t>() + n * R * R,
                               W1.data_ptr<scalar_t>() + n * H * R, kp, P.data_ptr<scalar_t>(),
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
// DP (grad of p_t entering step t's matmul, zero where padded); returns the grad of p_0: [N, B, R].
template <typename scalar_t>
void backward_kernel(const torch::Tensor& dG, const torch::Tensor& su, const torch::Tensor& MtT,
                     const torch::Tensor& keep, torch::Tensor& DGT, torch::Tensor& DP, torch::Tensor& dp0) {
  const int64_t T = su.size(0), N = su.size(1), B = su.size(2), R = su.size(3);
  const scalar_t* dgp = dG.data_ptr<scalar_t>();
  const scalar_t* sup = su.data_ptr<scalar_t>();
  const scalar_t* mp = MtT.data_ptr<scalar_t>();
  const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
  scalar_t* dgtp = DGT.data_ptr<scalar_t>();
  scalar_t* dpp = DP.data_ptr<scalar_t>();
  scalar_t* outp = dp0.data_ptr<scalar_t>();
  at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> dp(R);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb / B, b = nb % B;
      const scalar_t* M = mp + n * R * R;
      std::fill(dp.begin(), dp.end(), scalar_t(0));
      for (int64_t t = T - 1; t >= 0; --t) {
        const int64_t row = (t * N + n) * B + b;
        const bool keep_t = kp ? kp[t * B + b] : true;
        scalar_t* __restrict__ dpt = dpp + row * R;
        scalar_t* __restrict__ dgt = dgtp + row * R;
        const scalar_t* __restrict__ dgo = dgp + row * R;
        const scalar_t* __restrict__ sut = sup + row * R;
        for (int64_t r = 0; r < R; ++r) { dpt[r] = keep_t ? dp[r] : scalar_t(0); dgt[r] = dgo[r]; }
        if (keep_t) {
          for (int64_t c = 0; c < R; ++c) {
            const scalar_t dc = dpt[c];
            const scalar_t* __restrict__ Mc = M + c * R;
            for (int64_t r = 0; r < R; ++r) dgt[r] += dc * Mc[r];
          }
          for (int64_t r = 0; r < R; ++r) dp[r] = sut[r] * dgt[r];
        } else {
          for (int64_t r = 0; r < R; ++r) dp[r] += sut[r] * dgt[r];
        }
      }
      scalar_t* out = outp + (n * B + b) * R;
      for (int64_t r = 0; r < R; ++r) out[r] = dp[r];
    }
  });
}

torch::Tensor backward(torch::Tensor dG, torch::Tensor su, torch::Tensor MtT, torch::Tensor keep,
                       torch::Tensor DGT, torch::Tensor DP) {
  auto dp0 = torch::empty({su.size(1), su.size(2), su.size(3)}, su.options());
  AT_DISPATCH_FLOATING_TYPES(su.scalar_type(), "cp_scan_backward", [&] {
    backward_kernel<scalar_t>(dG, su, MtT, keep, DGT, DP, dp0);
  });
  return dp0;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def _cpu_tag() -> str:
    """Build cache key for ``-march=native``: a kernel built on one CPU is never loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags + CPP_SOURCE).encode()).hexdigest()[:12]


def load_kernel():
    """The compiled kernel module, or ``None`` if it cannot be built here (the PyTorch loop is used then)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                logger.info("building the bilinear CP scan kernel (once; cached by torch)")
                _module = load_inline(
                    name=f"bilinear_cp_scan_{_cpu_tag()}",
                    cpp_sources=CPP_SOURCE,
                    functions=["forward", "backward"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=os.environ.get("BILINEAR_LM_VERBOSE_BUILD") == "1",
                )
            except Exception as error:  # no compiler or headers: fall back, say so once
                _failed = True
                logger.warning("bilinear CP scan kernel unavailable (%s); using the PyTorch loop", error)
    return _module


def kernel_available_for(tensor: torch.Tensor) -> bool:
    """Whether the compiled kernel can run on this tensor (CPU, fp32/fp64) and builds on this machine."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64) and load_kernel() is not None
