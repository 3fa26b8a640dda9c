// A GEMV for a few rows (a decoding step's projections): y = x @ W^T. The decoding path routes its linear layers'
// F.linear calls here (bilinear_lm/modeling/dispatch.py, decoding_linear); the layers themselves are plain nn.Linear.
#include <ATen/ATen.h>  // not torch/extension.h: half the build time (bindings.cpp has the Python side)
#include <ATen/Parallel.h>
#include <algorithm>

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

at::Tensor small_batch_linear(at::Tensor x, at::Tensor W) {
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1) && x.is_contiguous() && W.is_contiguous() &&
              x.device().is_cpu() && W.device().is_cpu() && x.scalar_type() == W.scalar_type(),
              "small_batch_linear: x [M, K] and W [N, K] must be contiguous CPU tensors of one dtype");
  auto y = at::empty({x.size(0), W.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "small_batch_linear", [&] {
    small_batch_linear_kernel<scalar_t>(x.data_ptr<scalar_t>(), W.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                        x.size(0), x.size(1), W.size(0));
  });
  return y;
}
