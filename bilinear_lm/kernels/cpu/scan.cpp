// The CP state recurrence on CPU: the rank-space scan, the C++ twin of bilinear_lm/modeling/scan.py (scan_forward /
// scan_backward, same signatures and results; tested against it and against the reference loop), and one decoding
// step of the state (cp_step, tested against recurrence.reference_step). In the scan every (head, batch row) evolves
// independently, so each is one thread's sequential loop over time with no per-step synchronization or dispatch.
// Built by bilinear_lm/kernels/cpu/__init__.py (torch.utils.cpp_extension). The overflow guard's range
// (safe_min, safe_max) is an argument: the caller owns it (recurrence.py's SAFE_MIN, SAFE_MAX).
#include <ATen/ATen.h>  // not torch/extension.h: half the build time (bindings.cpp has the Python side)
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// The overflow guard's test (recurrence.in_safe_range): the peak |v_i| lies in (safe_min, safe_max); a NaN fails.
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

// 1 / ||v|| from the squared norm, the norm clamped to the smallest normal number (recurrence.scale_at_boundary).
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

// Layout: u, G, P: [T(+1), N, B, R]; S: [T, N, B, 1]; Mt: [N, R, R] (p_new = g @ Mt); W1: [N, H, R];
// keep, restart: [T, B] bool or empty; p_start: [N, R]. Each (head, row) runs its whole sequence in one thread,
// chunk by chunk; a chunk whose peak |g| leaves the safe range is recomputed for that (head, row) normalizing every
// step. A restart step reads p_start instead of the previous p (P holds each step's input).
template <typename scalar_t>
struct RowScan {
  const scalar_t* u; const scalar_t* M; const scalar_t* W1T; const bool* keep; const bool* restart;
  const scalar_t* p_start; scalar_t* P; scalar_t* G; scalar_t* S;
  int64_t N, B, R, H, n, b, chunk, offset;
  double safe_min, safe_max;

  // Steps [t0, t1); returns whether the peak |g| stayed in the safe range at every step.
  bool run(int64_t t0, int64_t t1, bool every_step) {
    bool in_range = true;
    std::vector<scalar_t> hv(H);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = (t * N + n) * B + b;
      const bool keep_t = keep ? keep[t * B + b] : true;
      const bool boundary = chunk > 0 && (offset + t + 1) % chunk == 0;
      const scalar_t* __restrict__ ut = u + row * R;
      scalar_t* __restrict__ pt = P + row * R;
      if (restart && restart[t * B + b])
        for (int64_t r = 0; r < R; ++r) pt[r] = p_start[r];
      scalar_t* __restrict__ g = G + row * R;
      for (int64_t r = 0; r < R; ++r) g[r] = ut[r] * pt[r];
      scalar_t s = 1;
      if ((every_step || boundary) && keep_t) {
        vec_mat(g, W1T, R, H, hv.data());  // h = W1 g
        s = inverse_norm(sum_squares(hv.data(), H));
        for (int64_t r = 0; r < R; ++r) g[r] *= s;
      }
      S[row] = s;
      in_range = in_range && in_safe_range(g, R, safe_min, safe_max);
      scalar_t* __restrict__ pn = P + (row + N * B) * R;
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
  const int64_t T = u.size(0), N = u.size(1), B = u.size(2), R = u.size(3), H = W1.size(1);
  auto G = at::empty_like(u);
  auto P = at::empty({T + 1, N, B, R}, u.options());
  auto S = at::empty({T, N, B, 1}, u.options());
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
                               G.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(), N, B, R, H, n, b, chunk, offset,
                               safe_min, safe_max};
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

// Backward of the whole scan. su = S * u; MtT = Mt^T contiguous. Writes DGT (total grad of g_t) and DP (grad of p_t
// leaving step t, zero where padded), and the grads of p_0 and of p_start per row.
template <typename scalar_t>
void backward_kernel(const at::Tensor& dG, const at::Tensor& su, const at::Tensor& MtT, const at::Tensor& keep,
                     const at::Tensor& restart, at::Tensor& DGT, at::Tensor& DP, at::Tensor& dp0,
                     at::Tensor& dp_start) {
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
        if (keep_t)
          vec_mat(dpt, M, R, R, dgt, dgo);  // dgt = dgo + dp @ Mt^T
        else
          for (int64_t r = 0; r < R; ++r) dgt[r] = dgo[r];
        for (int64_t r = 0; r < R; ++r) dp[r] = sut[r] * dgt[r] + (keep_t ? scalar_t(0) : dp[r]);
        if (rp && rp[t * B + b]) {  // this step's input was p_start, not the previous step's output
          for (int64_t r = 0; r < R; ++r) { ds[r] += dp[r]; dp[r] = 0; }
        }
      }
      scalar_t* out = outp + (n * B + b) * R;
      for (int64_t r = 0; r < R; ++r) out[r] = dp[r];
    }
  });
}

std::vector<at::Tensor> scan_backward(at::Tensor dG, at::Tensor su, at::Tensor MtT, at::Tensor keep,
                                      at::Tensor restart, at::Tensor DGT, at::Tensor DP) {
  auto dp0 = at::empty({su.size(1), su.size(2), su.size(3)}, su.options());
  auto dp_start = at::empty_like(dp0);
  AT_DISPATCH_FLOATING_TYPES(su.scalar_type(), "cp_scan_backward", [&] {
    backward_kernel<scalar_t>(dG, su, MtT, keep, restart, DGT, DP, dp0, dp_start);
  });
  return {dp0, dp_start};
}

// One decoding step of the state (recurrence.reference_step for the CP map, no gradients): per (row, head)
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
