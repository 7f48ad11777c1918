// Group baselines and advantages: the off-policy optimal baseline (OPOB) and the classic estimators.
// Contract: docs/contract.md, "Advantages". Serial over B with fp64 group accumulators.
#pragma once

#include <vector>

#include "common.h"

namespace vcpo {

template <typename acc_t>
struct GroupInputs {
  const acc_t* rewards;     // [B]
  const acc_t* length;      // [B]: sequence i is valid when length[i] > 0
  const int64_t* group;     // [B] or nullptr (one group)
  int64_t num_seqs;
  int64_t num_groups;
  int64_t group_of(int64_t i) const { return group ? group[i] : 0; }
  bool valid(int64_t i) const { return length[i] > 0; }
};

// Plain per-group moments over valid members: count, mean, population variance.
template <typename acc_t>
struct GroupMoments {
  std::vector<double> count, mean, var;
  explicit GroupMoments(const GroupInputs<acc_t>& in)
      : count(in.num_groups, 0.0), mean(in.num_groups, 0.0), var(in.num_groups, 0.0) {
    for (int64_t i = 0; i < in.num_seqs; ++i) {
      if (!in.valid(i)) continue;
      const int64_t g = in.group_of(i);
      count[g] += 1;
      mean[g] += in.rewards[i];
    }
    for (int64_t g = 0; g < in.num_groups; ++g) mean[g] = count[g] > 0 ? mean[g] / count[g] : 0.0;
    for (int64_t i = 0; i < in.num_seqs; ++i) {
      if (!in.valid(i)) continue;
      const int64_t g = in.group_of(i);
      const double d = in.rewards[i] - mean[g];
      var[g] += d * d;
    }
    for (int64_t g = 0; g < in.num_groups; ++g) var[g] = count[g] > 0 ? var[g] / count[g] : 0.0;
  }
};

// b_g = sum W R / sum W with log W_j = 2 lw_j + log G_j (- 2 log L_j), max-shifted per group.
template <typename acc_t>
void opob_baseline(const GroupInputs<acc_t>& in, const acc_t* log_weight, const acc_t* grad_sq_norm,
                   bool length_norm, bool norm_by_std, acc_t* baseline, acc_t* advantages) {
  const GroupMoments<acc_t> mom(in);
  std::vector<double> log_w(in.num_seqs, -kInf<double>);
  std::vector<double> shift(in.num_groups, -kInf<double>);
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) continue;
    double lw = 2.0 * static_cast<double>(log_weight[i]);
    if (grad_sq_norm) lw += std::log(static_cast<double>(grad_sq_norm[i]));
    if (length_norm) lw -= 2.0 * std::log(static_cast<double>(in.length[i]));
    log_w[i] = lw;
    shift[in.group_of(i)] = max_keep_nan(shift[in.group_of(i)], lw);
  }
  // b = mean + sum W (R - mean) / sum W: exact for one-member and constant-reward groups.
  std::vector<double> sum_w(in.num_groups, 0.0), sum_wd(in.num_groups, 0.0);
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) continue;
    const int64_t g = in.group_of(i);
    const double sh = std::isfinite(shift[g]) ? shift[g] : 0.0;  // NaN/+inf propagate
    const double w = std::exp(log_w[i] - sh);
    sum_w[g] += w;
    sum_wd[g] += w * (in.rewards[i] - mom.mean[g]);
  }
  for (int64_t g = 0; g < in.num_groups; ++g) {
    // Every W of the group is 0 (shift = -inf): fall back to the plain mean.
    baseline[g] = shift[g] == -kInf<double> ? mom.mean[g] : mom.mean[g] + sum_wd[g] / sum_w[g];
  }
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) {
      advantages[i] = 0;
      continue;
    }
    const int64_t g = in.group_of(i);
    const double sigma = std::sqrt(mom.var[g]);
    double a = static_cast<double>(in.rewards[i]) - baseline[g];
    if (norm_by_std && sigma > 1e-8) a /= sigma;
    advantages[i] = a;
  }
}

// GRPO, RLOO, REINFORCE and "none" (see the contract for each formula).
template <typename acc_t>
void classic_advantages(const GroupInputs<acc_t>& in, Advantage kind, bool norm_by_std, acc_t* baseline,
                        acc_t* advantages) {
  const GroupMoments<acc_t> mom(in);
  double batch_mean = 0, batch_count = 0;
  for (int64_t g = 0; g < in.num_groups; ++g) {
    batch_mean += mom.mean[g] * mom.count[g];
    batch_count += mom.count[g];
  }
  batch_mean = batch_count > 0 ? batch_mean / batch_count : 0.0;
  for (int64_t g = 0; g < in.num_groups; ++g) {
    baseline[g] = kind == Advantage::Reinforce ? batch_mean : kind == Advantage::None ? 0.0 : mom.mean[g];
  }
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) {
      advantages[i] = 0;
      continue;
    }
    const int64_t g = in.group_of(i);
    const double r = in.rewards[i], n = mom.count[g];
    double a = 0;
    switch (kind) {
      case Advantage::Grpo: {
        a = r - mom.mean[g];
        if (norm_by_std) {
          const double std_unbiased = n > 1 ? std::sqrt(mom.var[g] * n / (n - 1)) : 0.0;
          a /= std_unbiased + 1e-6;
        }
        break;
      }
      case Advantage::Rloo: a = n > 1 ? (r - mom.mean[g]) * n / (n - 1) : 0.0; break;
      case Advantage::Reinforce: a = r - batch_mean; break;
      default: a = r; break;
    }
    advantages[i] = a;
  }
}

}  // namespace vcpo
