// ESS of the sequence weights in log space, and the learning-rate scale derived from it.
// Contract: docs/contract.md, "Effective sample size". Serial over B (a few microseconds).
#pragma once

#include "common.h"

namespace vcpo {

inline double ess_lr_scale(double ess_ratio, double base, LrRule rule) {
  if (ess_ratio != ess_ratio) return 0.0;  // NaN weights skip the step, never a full lr
  double x = ess_ratio / base;
  x = x < 1.0 ? x : 1.0;
  switch (rule) {
    case LrRule::Sqrt: return std::sqrt(x);
    case LrRule::Linear: return x;
    case LrRule::None: return 1.0;
  }
  return 1.0;
}

struct EssResult {
  double ess, ess_ratio, lr_scale;
};

// length == nullptr: every sequence is valid; else sequence i is valid when length[i] > 0.
template <typename acc_t>
EssResult effective_sample_size(const acc_t* log_weight, const acc_t* length, int64_t n, double base,
                                LrRule rule) {
  double m = -kInf<double>;
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (length && !(length[i] > 0)) continue;
    m = max_keep_nan(m, static_cast<double>(log_weight[i]));
    ++valid;
  }
  if (valid == 0) return {0.0, 0.0, ess_lr_scale(0.0, base, rule)};
  const double shift = std::isfinite(m) ? m : 0.0;  // +inf/NaN propagate; all -inf gives 0/0
  double s1 = 0, s2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (length && !(length[i] > 0)) continue;
    const double e = std::exp(static_cast<double>(log_weight[i]) - shift);
    s1 += e;
    s2 += e * e;
  }
  const double ess = s1 * s1 / s2;
  const double ratio = ess / static_cast<double>(valid);
  return {ess, ratio, ess_lr_scale(ratio, base, rule)};
}

}  // namespace vcpo
