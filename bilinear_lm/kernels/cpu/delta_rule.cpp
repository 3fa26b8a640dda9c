// The memory heads' state update on CPU: one decoding step of the projective gated delta rule
// (delta_rule_step, the twin of bilinear_lm/modeling/delta_rule_reference.py's delta_rule_step, no gradients; tested
// against it). Per (row, head), with S [Dv, Dk] and the coordinate c:
//   S_prev = 0 where the row restarts (a document starts), else S;
//   S' = alpha S_prev + beta (c v - alpha S_prev k) k^T, alpha = exp(g);   o = S' q / c;
//   at a chunk boundary [S'; c] is divided by its norm (after o is read); a padded row keeps S and c.
// One pass over S per step: the read S_prev k, then the rank-one update and the read-out S' q row by row.
#include <ATen/ATen.h>  // not torch/extension.h: half the build time (bindings.cpp has the Python side)
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
void delta_rule_step_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& S, const at::Tensor& c, const bool* keep,
                            const bool* restart, bool boundary, at::Tensor& S_out, at::Tensor& c_out,
                            at::Tensor& o_out) {
  const int64_t B = S.size(0), N = S.size(1), Dv = S.size(2), Dk = S.size(3);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const scalar_t* gp = g.data_ptr<scalar_t>();
  const scalar_t* bp = beta.data_ptr<scalar_t>();
  const scalar_t* Sp = S.data_ptr<scalar_t>();
  const scalar_t* cp = c.data_ptr<scalar_t>();
  scalar_t* So = S_out.data_ptr<scalar_t>();
  scalar_t* co = c_out.data_ptr<scalar_t>();
  scalar_t* oo = o_out.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b) {
    const bool pad = keep && !keep[b];
    const bool fresh = !pad && restart && restart[b];
    for (int64_t n = 0; n < N; ++n) {
      const int64_t bn = b * N + n;
      const scalar_t* Sbn = Sp + bn * Dv * Dk;
      const scalar_t* qv = qp + bn * Dk;
      const scalar_t* kv = kp + bn * Dk;
      const scalar_t* vv = vp + bn * Dv;
      scalar_t* Snew = So + bn * Dv * Dk;
      scalar_t* o = oo + bn * Dv;
      const scalar_t cc = cp[bn];
      const scalar_t alpha = pad ? scalar_t(1) : std::exp(gp[bn]);
      const scalar_t bt = pad ? scalar_t(0) : bp[bn];
      scalar_t norm2 = cc * cc;
      for (int64_t i = 0; i < Dv; ++i) {
        const scalar_t* row = Sbn + i * Dk;
        scalar_t* out = Snew + i * Dk;
        scalar_t read = 0;
        if (!fresh) {
#pragma omp simd reduction(+ : read)
          for (int64_t j = 0; j < Dk; ++j) read += row[j] * kv[j];
        }
        const scalar_t write = bt * (cc * vv[i] - alpha * read);  // the row's rank-one coefficient
        const scalar_t decay = fresh ? scalar_t(0) : alpha;
        scalar_t dot = 0, sq = 0;
#pragma omp simd reduction(+ : dot, sq)
        for (int64_t j = 0; j < Dk; ++j) {
          const scalar_t s = pad ? row[j] : decay * row[j] + write * kv[j];
          out[j] = s;
          dot += s * qv[j];
          sq += s * s;
        }
        o[i] = dot / cc;
        norm2 += sq;
      }
      scalar_t scale = 1;
      if (boundary && !pad) {
        scale = scalar_t(1) / std::max(std::sqrt(norm2), std::numeric_limits<scalar_t>::min());
        for (int64_t j = 0; j < Dv * Dk; ++j) Snew[j] *= scale;
      }
      co[bn] = cc * scale;
    }
  }
}

// q, k: [B, N, Dk]; v: [B, N, Dv]; g, beta: [B, N]; S: [B, N, Dv, Dk]; c: [B, N] (all contiguous, one dtype);
// keep, restart: [B] bool or empty. Returns {S', c', o [B, N, Dv]}.
std::vector<at::Tensor> delta_rule_step(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                                        at::Tensor S, at::Tensor c, at::Tensor keep, at::Tensor restart,
                                        bool boundary) {
  auto S_out = at::empty_like(S);
  auto c_out = at::empty_like(c);
  auto o_out = at::empty_like(v);
  const bool* kp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
  const bool* rp = restart.numel() ? restart.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(S.scalar_type(), "delta_rule_step", [&] {
    delta_rule_step_kernel<scalar_t>(q, k, v, g, beta, S, c, kp, rp, boundary, S_out, c_out, o_out);
  });
  return {S_out, c_out, o_out};
}
