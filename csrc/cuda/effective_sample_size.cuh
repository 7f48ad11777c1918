// The ESS of the sequence weights in log space and the lr scale: one block over the batch, fp64. Part of the "cuda"
// backend (ops.cu: the entry points; docs/contract.md: the math).
#pragma once

#include "common.cuh"

namespace vcpo {
namespace {

__device__ double ess_lr_scale(double ratio, double base, LrRule rule) {
  if (ratio != ratio) return 0.0;  // NaN weights skip the step, never a full lr
  const double x = min(ratio / base, 1.0);
  return rule == LrRule::Sqrt ? sqrt(x) : rule == LrRule::Linear ? x : 1.0;
}

// (ess, ratio, lr) over the valid sequences, by the whole block; truncate: min(lw, log_hi), NaN kept.
template <typename acc_t>
__device__ void ess_of(const acc_t* lw, const acc_t* length, int64_t n, bool truncate, double log_hi, double base,
                       LrRule rule, double* out) {
  double m = -kInf, count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (length && !(length[i] > 0)) continue;
    double x = lw[i];
    if (truncate && x > log_hi) x = log_hi;
    m = (x > m || x != x) ? x : m;
    count += 1;
  }
  m = block_reduce<double, true>(m);
  count = block_reduce(count);
  const double shift = finite(m) ? m : 0.0;  // +inf/NaN propagate; all -inf gives 0/0
  double s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (length && !(length[i] > 0)) continue;
    double x = lw[i];
    if (truncate && x > log_hi) x = log_hi;
    const double e = exp(x - shift);
    s1 += e;
    s2 += e * e;
  }
  s1 = block_reduce(s1);
  s2 = block_reduce(s2);
  const double ess = count > 0 ? s1 * s1 / s2 : 0.0;
  const double ratio = count > 0 ? ess / count : 0.0;
  out[0] = ess;
  out[1] = ratio;
  out[2] = ess_lr_scale(ratio, base, rule);
}

template <typename acc_t>
__global__ void ess_kernel(const acc_t* lw, const acc_t* length, int64_t n, double base, LrRule rule, acc_t* out) {
  double r[3];
  ess_of(lw, length, n, false, 0.0, base, rule, r);
  if (threadIdx.x == 0) {
    for (int j = 0; j < 3; ++j) out[j] = static_cast<acc_t>(r[j]);
  }
}

}  // namespace
}  // namespace vcpo
