// Fused elementwise blocks of a training step on CPU, forward and backward, each one pass over memory with one
// output (PyTorch runs each as 3-10 separate ops, each allocating its result): the SwiGLU of the MLP, the RMSNorm of
// every block and the mixer's per-head norm of its states. The twins of the PyTorch formulas in bilinear_lm/modeling/dispatch.py (tested against them).
#include <ATen/ATen.h>  // not torch/extension.h: half the build time (bindings.cpp has the Python side)
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// exp(x) for float in a form the compiler vectorizes: 2^n e^f with n = round(x / ln 2) and f = x - n ln 2 (ln 2 in two
// parts), e^f by Cephes' expf polynomial; x clamped to where the result is a normal float (sigmoid saturates there).
inline float vector_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double vector_exp(double x) { return std::exp(x); }

template <typename scalar_t>
inline scalar_t sigmoid(scalar_t x) {
  return scalar_t(1) / (scalar_t(1) + vector_exp(-x));
}

// gate_up: [rows, 2I] (gate | up) -> h = silu(gate) * up, [rows, I].
template <typename scalar_t>
void swiglu_forward_rows(const scalar_t* gu, scalar_t* h, int64_t I, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* __restrict__ g = gu + row * 2 * I;
    const scalar_t* __restrict__ u = g + I;
    scalar_t* __restrict__ o = h + row * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
  }
}

at::Tensor swiglu_forward(at::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto h = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES(gate_up.scalar_type(), "swiglu_forward", [&] {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      swiglu_forward_rows(gate_up.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), I, begin, end);
    });
  });
  return h;
}

// The gradient of gate_up from dh, written as one [rows, 2I] tensor (no concatenation of two halves):
// d up = dh silu(gate), d gate = dh up sigmoid(gate) (1 + gate (1 - sigmoid(gate))).
template <typename scalar_t>
void swiglu_backward_rows(const scalar_t* gu, const scalar_t* dh, scalar_t* dgu, int64_t I, int64_t begin,
                          int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* __restrict__ g = gu + row * 2 * I;
    const scalar_t* __restrict__ u = g + I;
    const scalar_t* __restrict__ d = dh + row * I;
    scalar_t* __restrict__ dg = dgu + row * 2 * I;
    scalar_t* __restrict__ du = dg + I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const scalar_t s = sigmoid(g[i]);
      du[i] = d[i] * g[i] * s;
      dg[i] = d[i] * u[i] * s * (scalar_t(1) + g[i] * (scalar_t(1) - s));
    }
  }
}

at::Tensor swiglu_backward(at::Tensor gate_up, at::Tensor dh) {
  gate_up = gate_up.contiguous();
  dh = dh.contiguous();
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto d_gate_up = at::empty_like(gate_up);
  AT_DISPATCH_FLOATING_TYPES(gate_up.scalar_type(), "swiglu_backward", [&] {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      swiglu_backward_rows(gate_up.data_ptr<scalar_t>(), dh.data_ptr<scalar_t>(), d_gate_up.data_ptr<scalar_t>(), I,
                           begin, end);
    });
  });
  return d_gate_up;
}

// x: [rows, D] -> (y = weight x rstd, rstd = 1 / max(sqrt(mean(x^2) + eps), floor) [rows]), weight [G, D]: row r
// takes weight row r % G (G = 1: the RMSNorm of a block; G = heads: the per-head norm of the mixer's states).
template <typename scalar_t>
void rms_norm_forward_rows(const scalar_t* x, const scalar_t* weight, scalar_t* y, scalar_t* rstd, int64_t D,
                           int64_t G, double eps, double floor, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* __restrict__ xr = x + row * D;
    const scalar_t* __restrict__ w = weight + (row % G) * D;
    scalar_t* __restrict__ yr = y + row * D;
    scalar_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const scalar_t r = scalar_t(1) / std::max(std::sqrt(sum / scalar_t(D) + scalar_t(eps)), scalar_t(floor));
    rstd[row] = r;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) yr[i] = w[i] * (xr[i] * r);
  }
}

std::vector<at::Tensor> rms_norm_forward(at::Tensor x, at::Tensor weight, double eps, double floor) {
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D, G = weight.numel() / D;
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_forward", [&] {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      rms_norm_forward_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                            rstd.data_ptr<scalar_t>(), D, G, eps, floor, begin, end);
    });
  });
  return {y, rstd};
}

// The gradients of x and weight: with g = weight dy, dx = rstd (g - x rstd^2 mean(g x)) (dx = rstd g where the floor
// held); dweight = the sum over rows of dy x rstd, accumulated per block of rows into dw_block ([G, D]), then summed
// (the same result for any number of threads).
template <typename scalar_t>
void rms_norm_backward_rows(const scalar_t* dy, const scalar_t* x, const scalar_t* weight, const scalar_t* rstd,
                            scalar_t* dx, scalar_t* dw_block, int64_t D, int64_t G, double floor, int64_t begin,
                            int64_t end) {
  std::fill(dw_block, dw_block + G * D, scalar_t(0));
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* __restrict__ dyr = dy + row * D;
    const scalar_t* __restrict__ xr = x + row * D;
    const scalar_t* __restrict__ w = weight + (row % G) * D;
    scalar_t* __restrict__ dxr = dx + row * D;
    scalar_t* __restrict__ dw = dw_block + (row % G) * D;
    const scalar_t r = rstd[row];
    scalar_t dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; ++i) dot += w[i] * dyr[i] * xr[i];
    const scalar_t c = r * scalar_t(floor) >= scalar_t(1) ? scalar_t(0) : r * r * dot / scalar_t(D);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) {
      dxr[i] = r * (w[i] * dyr[i] - xr[i] * c);
      dw[i] += dyr[i] * xr[i] * r;
    }
  }
}

std::vector<at::Tensor> rms_norm_backward(at::Tensor dy, at::Tensor x, at::Tensor weight, at::Tensor rstd,
                                          double floor) {
  dy = dy.contiguous();
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D, G = weight.numel() / D;
  const int64_t block = 256, blocks = (rows + block - 1) / block;
  auto dx = at::empty_like(x);
  auto partial = at::empty({blocks, G, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        rms_norm_backward_rows(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                               rstd.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                               partial.data_ptr<scalar_t>() + b * G * D, D, G, floor, b * block,
                               std::min(rows, (b + 1) * block));
    });
  });
  return {dx, partial.sum(0).view(weight.sizes())};
}
