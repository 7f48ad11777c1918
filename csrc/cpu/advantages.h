// Group baselines and advantages: the off-policy optimal baseline (OPOB) and the classic estimators.
// Contract: docs/contract.md, "Advantages". Serial over B with fp64 group accumulators.
#pragma once

#include <algorithm>
#include <limits>
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

// opob_aggregation "median" / "winsorized_mean": b_g from weighted quantiles of the group's rewards, with
// w_j = W_j / max W (1 for every member when all W_j are 0). The q-quantile is the smallest R_k whose running
// weight F_k = sum_j w_j [R_j <= R_k] reaches q sum_j w_j (the largest R if rounding leaves none): O(n_g^2).
inline double robust_baseline(const std::vector<double>& r, const std::vector<double>& w, OpobAggregation agg,
                              double q_lo, double q_hi) {
  const size_t n = r.size();
  double total = 0, top = -kInf<double>;
  for (size_t j = 0; j < n; ++j) {
    total += w[j];
    top = std::max(top, r[j]);
  }
  std::vector<double> cum(n, 0.0);
  for (size_t k = 0; k < n; ++k) {
    for (size_t j = 0; j < n; ++j) cum[k] += r[j] <= r[k] ? w[j] : 0.0;
  }
  auto quantile = [&](double q) {
    double low = kInf<double>;
    for (size_t k = 0; k < n; ++k) {
      if (cum[k] >= q * total) low = std::min(low, r[k]);
    }
    return low == kInf<double> ? top : low;
  };
  if (agg == OpobAggregation::Median) return quantile(0.5);
  // lo + sum w (clip(R, lo, hi) - lo) / sum w: exact for one-member and constant-reward groups
  const double lo = quantile(q_lo), hi = quantile(q_hi);
  double sum = 0;
  for (size_t j = 0; j < n; ++j) sum += w[j] * (std::min(std::max(r[j], lo), hi) - lo);
  return lo + sum / total;
}

// The leave-one-out deviations R_i - b_-i, b_-i = mean + sum_{j != i} W_j (R_j - mean) / sum_{j != i} W_j over i's
// group (w_j = W_j / max W, sum_w and sum_wd their group sums). The sums over the others are shifted by their own
// maximum: for i not its group's first argmax, the group's sums minus i's term (w_i <= 1, and the argmax's 1
// stays: no cancellation); for the argmax, sums over the others shifted by the second largest W, formed without
// subtracting. No other member, or every other W_j = 0: the unweighted mean of the others (the RLOO deviation,
// 0 for one member); a NaN or +inf W_j in the group: NaN.
template <typename acc_t>
std::vector<double> leave_one_out_deviations(const GroupInputs<acc_t>& in, const GroupMoments<acc_t>& mom,
                                             const std::vector<double>& log_w, const std::vector<double>& shift,
                                             const std::vector<double>& sum_w, const std::vector<double>& sum_wd) {
  std::vector<int64_t> first(in.num_groups, -1);
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    const int64_t g = in.group_of(i);
    if (in.valid(i) && first[g] < 0 && log_w[i] == shift[g]) first[g] = i;
  }
  std::vector<double> shift2(in.num_groups, -kInf<double>), sum_w2(in.num_groups, 0.0), sum_wd2(in.num_groups, 0.0);
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    const int64_t g = in.group_of(i);
    if (in.valid(i) && i != first[g]) shift2[g] = max_keep_nan(shift2[g], log_w[i]);
  }
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    const int64_t g = in.group_of(i);
    if (!in.valid(i) || i == first[g]) continue;
    const double w = std::exp(log_w[i] - (std::isfinite(shift2[g]) ? shift2[g] : 0.0));
    sum_w2[g] += w;
    sum_wd2[g] += w * (in.rewards[i] - mom.mean[g]);
  }
  std::vector<double> dev(in.num_seqs, 0.0);
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) continue;
    const int64_t g = in.group_of(i);
    const double d = in.rewards[i] - mom.mean[g], n = mom.count[g];
    const bool is_first = i == first[g];
    const double w = std::exp(log_w[i] - (std::isfinite(shift[g]) ? shift[g] : 0.0));
    const double den = is_first ? sum_w2[g] : sum_w[g] - w;
    const double num = is_first ? sum_wd2[g] : sum_wd[g] - w * d;
    const bool none = (is_first ? shift2[g] : shift[g]) == -kInf<double>;
    const bool bad = std::isnan(shift[g]) || shift[g] == kInf<double>;
    dev[i] = bad ? std::numeric_limits<double>::quiet_NaN() : none ? (n > 1 ? d * n / (n - 1) : 0.0) : d - num / den;
  }
  return dev;
}

// b_g = sum W R / sum W (or the weighted median or winsorized mean) with log W_j = 2 lw_j + log G_j
// (- 2 log L_j), max-shifted per group; with leave_one_out, A_i against b_-i (leave_one_out_deviations).
// max_share (when given): the largest W_j / sum W of a group (1 / n_g where every W is 0, NaN for a NaN or
// +inf W), over the groups with members (0 if none).
template <typename acc_t>
void opob_baseline(const GroupInputs<acc_t>& in, const acc_t* log_weight, const acc_t* grad_sq_norm,
                   bool length_norm, bool norm_by_std, acc_t* baseline, acc_t* advantages,
                   OpobAggregation aggregation = OpobAggregation::Mean, double q_lo = 0, double q_hi = 1,
                   bool leave_one_out = false, double* max_share = nullptr) {
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
  if (aggregation != OpobAggregation::Mean) {
    std::vector<std::vector<double>> r(in.num_groups), w(in.num_groups);  // each group's members, in order
    for (int64_t i = 0; i < in.num_seqs; ++i) {
      if (!in.valid(i)) continue;
      const int64_t g = in.group_of(i);
      r[g].push_back(in.rewards[i]);
      w[g].push_back(shift[g] == -kInf<double> ? 1.0 : std::exp(log_w[i] - shift[g]));
    }
    for (int64_t g = 0; g < in.num_groups; ++g) {
      const bool bad = std::isnan(shift[g]) || shift[g] == kInf<double>;  // a NaN or +inf W_j
      baseline[g] = r[g].empty() ? 0.0
                    : bad        ? std::numeric_limits<double>::quiet_NaN()
                                 : robust_baseline(r[g], w[g], aggregation, q_lo, q_hi);
    }
  }
  if (max_share) {
    double top = 0;
    for (int64_t g = 0; g < in.num_groups; ++g) {
      if (mom.count[g] == 0) continue;
      const bool bad = std::isnan(shift[g]) || shift[g] == kInf<double>;
      top = max_keep_nan(top, bad ? std::numeric_limits<double>::quiet_NaN()
                              : shift[g] == -kInf<double> ? 1.0 / mom.count[g] : 1.0 / sum_w[g]);
    }
    *max_share = top;
  }
  const std::vector<double> loo =
      leave_one_out ? leave_one_out_deviations(in, mom, log_w, shift, sum_w, sum_wd) : std::vector<double>();
  for (int64_t i = 0; i < in.num_seqs; ++i) {
    if (!in.valid(i)) {
      advantages[i] = 0;
      continue;
    }
    const int64_t g = in.group_of(i);
    const double sigma = std::sqrt(mom.var[g]);
    double a = leave_one_out ? loo[i] : static_cast<double>(in.rewards[i]) - baseline[g];
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
