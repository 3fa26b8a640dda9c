// The CP state recurrence on CPU: the rank-space scan, the C++ twin of bilinear_lm/modeling/bilinear_scan.py (scan_forward /
// scan_backward, same signatures and results; tested against it and against the reference loop), and one decoding
// step of the state (cp_step, tested against bilinear_reference.reference_step). In the scan every (head, batch row) evolves
// independently, so each is one thread's sequential loop over time with no per-step synchronization or dispatch.
// Built by bilinear_lm/kernels/cpu/__init__.py (torch.utils.cpp_extension). The overflow guard's range
// (safe_min, safe_max) is an argument: the caller owns it (chunked_normalization.py's SAFE_MIN, SAFE_MAX).
#include <ATen/ATen.h>  // not torch/extension.h: half the build time (bindings.cpp has the Python side)
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// The overflow guard's test (chunked_normalization.in_safe_range): the peak |v_i| lies in (safe_min, safe_max); a NaN fails.
template <typename scalar_t>
bool in_safe_range(const scalar_t* v, int64_t n, double safe_min, double safe_max) {
  scalar_t peak = 0;
  int nan = 0;
#pragma omp simd reduction(max : peak) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t a = std::abs(v[i]);
    peak = a > peak ? a : peak;
    nan |= a != a;
  }
  return !nan && peak < scalar_t(safe_max) && peak > scalar_t(safe_min);
}

template <typename scalar_t>
scalar_t sum_squares(const scalar_t* v, int64_t n) {
  scalar_t norm2 = 0;
#pragma omp simd reduction(+ : norm2)
  for (int64_t i = 0; i < n; ++i) norm2 += v[i] * v[i];
  return norm2;
}

// 1 / ||v|| from the squared norm, the norm clamped to the smallest normal number (chunked_normalization.scale_at_boundary).
template <typename scalar_t>
scalar_t inverse_norm(scalar_t norm2) {
  return scalar_t(1) / std::max(std::sqrt(norm2), std::numeric_limits<scalar_t>::min());
}

// out[c] = base[c] + sum_r g[r] M[r, c] (no base: 0) for M [R, C] row-major: a row vector times a small matrix,
// in column blocks whose accumulators stay in registers (the step-to-step chain of the scan).
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

// The layout of G, P, S and DP: shape [T, N, B, R], memory [N, B, T, R] (scan.py's sequence_major): each (head, row)
// sequence contiguous.
static at::Tensor sequence_major(const at::Tensor& like, int64_t T, int64_t N, int64_t B, int64_t R) {
  return at::empty({N, B, T, R}, like.options()).permute({2, 0, 1, 3});
}

// One (head, row)'s sequence: u (any strides, the rank contiguous) advances by u_step per step, G and P
// (sequence-major) by R, S by 1; Mt: [R, R] (p_t = g_t @ Mt); W1T: [R, H]; keep, restart: [T, B] bool or null; p0, p_start: [R].
// Runs chunk by chunk; a chunk whose peak |g| leaves the safe range is recomputed normalizing every step. A restart
// step reads p_start instead of the previous step's p.
template <typename scalar_t>
struct RowScan {
  const scalar_t* u; const scalar_t* M; const scalar_t* W1T; const bool* keep; const bool* restart;
  const scalar_t* p0; const scalar_t* p_start; scalar_t* P; scalar_t* G; scalar_t* S;
  int64_t u_step, B, R, H, b, chunk, offset;
  double safe_min, safe_max;

  // Step t's input p.
  const scalar_t* input(int64_t t) const {
    if (restart && restart[t * B + b]) return p_start;
    return t == 0 ? p0 : P + (t - 1) * R;
  }

  // Steps [t0, t1); returns whether the peak |g| stayed in the safe range at every step.
  bool run(int64_t t0, int64_t t1, bool every_step) {
    bool in_range = true;
    std::vector<scalar_t> hv(H);
    for (int64_t t = t0; t < t1; ++t) {
      const bool keep_t = keep ? keep[t * B + b] : true;
      const bool boundary = chunk > 0 && (offset + t + 1) % chunk == 0;
      const scalar_t* __restrict__ ut = u + t * u_step;
      const scalar_t* __restrict__ pt = input(t);
      scalar_t* __restrict__ g = G + t * R;
      for (int64_t r = 0; r < R; ++r) g[r] = ut[r] * pt[r];
      scalar_t s = 1;
      if ((every_step || boundary) && keep_t) {
        vec_mat(g, W1T, R, H, hv.data());  // h = W1 g
        s = inverse_norm(sum_squares(hv.data(), H));
        for (int64_t r = 0; r < R; ++r) g[r] *= s;
      }
      S[t] = s;
      in_range = in_range && in_safe_range(g, R, safe_min, safe_max);
      scalar_t* __restrict__ pn = P + t * R;
      if (keep_t)
        vec_mat(g, M, R, R, pn);
      else
        for (int64_t c = 0; c < R; ++c) pn[c] = pt[c];
    }
    return in_range;
  }
};

std::vector<at::Tensor> scan_forward(at::Tensor u, at::Tensor Mt, at::Tensor W1, at::Tensor keep, at::Tensor p0,
                                     int64_t chunk, int64_t offset, at::Tensor restart, at::Tensor p_start,
                                     double safe_min, double safe_max) {
  TORCH_CHECK(u.stride(3) == 1, "scan_forward: u's rank dimension must be contiguous");
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3), H = W1.size(1);
  auto G = sequence_major(u, T, N, B, R);
  auto P = sequence_major(u, T, N, B, R);
  auto S = sequence_major(u, T, N, B, 1);
  auto W1T = W1.transpose(1, 2).contiguous();  // [N, R, H]: h = W1 g is a vec_mat
  p0 = p0.contiguous();
  p_start = p_start.contiguous();
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "cp_scan_forward", [&] {
    const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
    const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
    at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) {
        const int64_t n = nb / B, b = nb % B;
        RowScan<scalar_t> scan{u.data_ptr<scalar_t>() + n * u.stride(1) + b * u.stride(2),
                               Mt.data_ptr<scalar_t>() + n * R * R, W1T.data_ptr<scalar_t>() + n * R * H, kp, rp,
                               p0.data_ptr<scalar_t>() + nb * R, rp ? p_start.data_ptr<scalar_t>() + n * R : nullptr,
                               P.data_ptr<scalar_t>() + nb * T * R, G.data_ptr<scalar_t>() + nb * T * R,
                               S.data_ptr<scalar_t>() + nb * T, u.stride(0), B, R, H, b, chunk, offset, safe_min,
                               safe_max};
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

// Backward of the whole scan, per (head, row) from the last step: DGT_t = dG_t + DP_t @ Mt^T (the total gradient of
// g_t, never stored), du_t = S_t p_in_t DGT_t (p_in_t: step t's input; written in u's layout) and dp = S_t u_t DGT_t
// into the previous step; DP (gradient of p_t leaving step t, zero where padded), the grads of p_0 and of p_start
// per row. dG, u: any strides with the rank contiguous (dG is copied otherwise); S, P, p0 ([N, B, R]), p_start
// ([N, R]): read in place when laid out as the forward uses them; MtT = Mt^T contiguous.
template <typename scalar_t>
void backward_kernel(const at::Tensor& dG, const at::Tensor& u, const at::Tensor& S, const at::Tensor& P,
                     const at::Tensor& p0, const at::Tensor& p_start, const at::Tensor& MtT, const at::Tensor& keep,
                     const at::Tensor& restart, at::Tensor& du, at::Tensor& DP, at::Tensor& dp0,
                     at::Tensor& dp_start) {
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3);
  const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
  const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
  at::parallel_for(0, N * B, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> dp(R), dgt(R);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb / B, b = nb % B;
      const scalar_t* M = MtT.data_ptr<scalar_t>() + n * R * R;
      const scalar_t* dgo = dG.data_ptr<scalar_t>() + n * dG.stride(1) + b * dG.stride(2);
      const scalar_t* ub = u.data_ptr<scalar_t>() + n * u.stride(1) + b * u.stride(2);
      scalar_t* dub = du.data_ptr<scalar_t>() + n * du.stride(1) + b * du.stride(2);
      const scalar_t* sb = S.data_ptr<scalar_t>() + nb * T;
      const scalar_t* pb = P.data_ptr<scalar_t>() + nb * T * R;
      const scalar_t* p0b = p0.data_ptr<scalar_t>() + nb * R;
      const scalar_t* psb = rp ? p_start.data_ptr<scalar_t>() + n * R : nullptr;
      scalar_t* dpb = DP.data_ptr<scalar_t>() + nb * T * R;
      scalar_t* ds = dp_start.data_ptr<scalar_t>() + nb * R;
      std::fill(dp.begin(), dp.end(), scalar_t(0));
      std::fill(ds, ds + R, scalar_t(0));
      for (int64_t t = T - 1; t >= 0; --t) {
        const bool keep_t = kp ? kp[t * B + b] : true;
        const bool restart_t = rp && rp[t * B + b];
        scalar_t* __restrict__ dpt = dpb + t * R;
        const scalar_t* __restrict__ dgot = dgo + t * dG.stride(0);
        const scalar_t* __restrict__ ut = ub + t * u.stride(0);
        const scalar_t* __restrict__ pt = restart_t ? psb : t == 0 ? p0b : pb + (t - 1) * R;  // step t's input
        scalar_t* __restrict__ dut = dub + t * du.stride(0);
        const scalar_t s = sb[t];
        for (int64_t r = 0; r < R; ++r) dpt[r] = keep_t ? dp[r] : scalar_t(0);
        if (keep_t)
          vec_mat(dpt, M, R, R, dgt.data(), dgot);  // dgt = dgo + dp @ Mt^T
        else
          for (int64_t r = 0; r < R; ++r) dgt[r] = dgot[r];
        for (int64_t r = 0; r < R; ++r) {
          dut[r] = s * pt[r] * dgt[r];
          dp[r] = s * ut[r] * dgt[r] + (keep_t ? scalar_t(0) : dp[r]);
        }
        if (restart_t) {  // this step's input was p_start, not the previous step's output
          for (int64_t r = 0; r < R; ++r) { ds[r] += dp[r]; dp[r] = 0; }
        }
      }
      std::copy(dp.begin(), dp.end(), dp0.data_ptr<scalar_t>() + nb * R);
    }
  });
}

std::vector<at::Tensor> scan_backward(at::Tensor dG, at::Tensor u, at::Tensor S, at::Tensor P, at::Tensor p0,
                                      at::Tensor p_start, at::Tensor MtT, at::Tensor keep, at::Tensor restart) {
  TORCH_CHECK(u.stride(3) == 1, "scan_backward: u's rank dimension must be contiguous");
  if (dG.stride(3) != 1) dG = dG.contiguous();
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3);
  S = S.permute({1, 2, 0, 3}).contiguous();  // [N, B, T, 1]: no copy of the forward's sequence-major S and P
  P = P.permute({1, 2, 0, 3}).contiguous();
  p0 = p0.contiguous();
  p_start = p_start.contiguous();
  auto du = at::empty_like(u);
  auto DP = sequence_major(u, T, N, B, R);
  auto dp0 = at::empty({N, B, R}, u.options());
  auto dp_start = at::empty_like(dp0);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "cp_scan_backward", [&] {
    backward_kernel<scalar_t>(dG, u, S, P, p0, p_start, MtT, keep, restart, du, DP, dp0, dp_start);
  });
  return {du, DP, dp0, dp_start};
}

// One decoding step of the state (bilinear_reference.reference_step for the CP map, no gradients): per (row, head)
// h' = W1 (u * (W2^T h_prev)), h_prev = h_start where the row restarts, then normalized at a chunk boundary or
// where the guard finds the head's state outside the safe range; a padded row keeps h. u: [B, N, R]; h: [B, N, H];
// W1, W2: [N, H, R]; keep, restart: [B] bool or empty; h_start: [N, H] (read only where restart).
std::vector<at::Tensor> cp_step(at::Tensor u, at::Tensor h, at::Tensor W1, at::Tensor W2, at::Tensor keep,
                                at::Tensor restart, at::Tensor h_start, bool boundary, bool guard, double safe_min,
                                double safe_max) {
  const int64_t B = h.size(0), N = h.size(1), H = h.size(2), R = W1.size(2);
  auto out = at::empty_like(h);
  auto W1T = W1.transpose(1, 2).contiguous();  // [N, R, H]: h' = W1 g is a vec_mat
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "cp_step", [&] {
    const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
    const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
    const scalar_t* up = u.data_ptr<scalar_t>();
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* w2 = W2.data_ptr<scalar_t>();
    const scalar_t* w1t = W1T.data_ptr<scalar_t>();
    const scalar_t* hs = rp ? h_start.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    std::vector<scalar_t> g(R);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        scalar_t* h_new = op + (b * N + n) * H;
        if (kp && !kp[b]) {  // padding: the row keeps its state
          std::copy(hp + (b * N + n) * H, hp + (b * N + n + 1) * H, h_new);
          continue;
        }
        const scalar_t* h_prev = rp && rp[b] ? hs + n * H : hp + (b * N + n) * H;
        vec_mat(h_prev, w2 + n * H * R, H, R, g.data());  // W2^T h
        const scalar_t* ub = up + (b * N + n) * R;
        for (int64_t r = 0; r < R; ++r) g[r] *= ub[r];
        vec_mat(g.data(), w1t + n * R * H, R, H, h_new);  // W1 g
        if (boundary || (guard && !in_safe_range(h_new, H, safe_min, safe_max))) {
          const scalar_t s = inverse_norm(sum_squares(h_new, H));
          for (int64_t k = 0; k < H; ++k) h_new[k] *= s;
        }
      }
    }
  });
  return {out};
}
