// The fused loss's scalar options, shared by the CPU and CUDA kernels: passed to the ops packed as `int[] codes`
// and `float[] values` (positions LossCode and LossValue of options.h, filled by PolicyLossOptions.packed in
// vcpo_kernels/options.py; an absent clip bound is NaN), unpacked here once, and the per-token parameters the
// token passes read. Math: docs/contract.md, "Loss".
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "options.h"

namespace vcpo {

struct LossOptions {
  IsLevel is_level;
  IsCorrection is_correction;
  bool ess_on_corrected;
  LrRule lr_rule;
  Advantage advantage;  // Given when the caller passes advantages
  bool norm_by_std;
  bool opob_length_norm;
  OpobWeight opob_weight;
  LossAgg loss_agg;
  OpobAggregation opob_aggregation;
  bool opob_leave_one_out;           // A_i against b_-i, the weighted mean of the other members
  TrustRegion trust_region;
  double sapo_tau_pos, sapo_tau_neg;
  double log_threshold, log_threshold_low;  // log C, log C_low
  double ess_base_ratio;
  std::optional<double> clip_low, clip_high, clip_c;  // PPO clipping and its dual clip, when on
  double norm_length;
  double winsorize_low, winsorize_high;  // the quantiles of opob_aggregation = winsorized_mean
  std::optional<double> m2_threshold;     // batch_m2's threshold given by the caller (a DP group's), else none
  // The rejection criteria (bit j: criterion j of Rejection) and their bounds.
  int64_t rejection;
  double reject_low[kNumRejection], reject_high[kNumRejection];
  bool rejects(Rejection j) const { return (rejection >> static_cast<int64_t>(j)) & 1; }
  double low(Rejection j) const { return reject_low[static_cast<int64_t>(j)]; }
  double high(Rejection j) const { return reject_high[static_cast<int64_t>(j)]; }
  // beyond the token_k* bits and batch_m2 (a per-token mask with a threshold of the batch's)
  bool rejects_sequences() const {
    return rejection & ~(int64_t(0b111) | (int64_t(1) << static_cast<int64_t>(Rejection::BatchM2)));
  }
};

inline LossOptions unpack_loss_options(c10::ArrayRef<int64_t> codes, c10::ArrayRef<double> values,
                                       bool advantages_given) {
  TORCH_CHECK(codes.size() == kNumLossCodes && values.size() == kNumLossValues, "vcpo: the loss ops take ",
              int64_t(kNumLossCodes), " option codes and ", int64_t(kNumLossValues), " option values, got ",
              codes.size(), " and ", values.size(), ": pack them with PolicyLossOptions.packed()");
  auto given = [](double x) { return std::isnan(x) ? std::nullopt : std::optional<double>(x); };
  LossOptions o;
  o.is_level = static_cast<IsLevel>(codes[kIsLevel]);
  o.is_correction = static_cast<IsCorrection>(codes[kIsCorrection]);
  o.ess_on_corrected = codes[kEssOnCorrected] != 0;
  o.lr_rule = static_cast<LrRule>(codes[kLrRule]);
  o.advantage = advantages_given ? Advantage::Given : static_cast<Advantage>(codes[kAdvantage]);
  o.norm_by_std = codes[kNormByStd] != 0;
  o.opob_length_norm = codes[kOpobLengthNorm] != 0;
  o.opob_weight = static_cast<OpobWeight>(codes[kOpobWeight]);
  o.loss_agg = static_cast<LossAgg>(codes[kLossAgg]);
  o.opob_aggregation = static_cast<OpobAggregation>(codes[kOpobAggregation]);
  o.opob_leave_one_out = codes[kOpobLeaveOneOut] != 0;
  o.trust_region = static_cast<TrustRegion>(codes[kTrustRegion]);
  o.sapo_tau_pos = values[kSapoTauPos];
  o.sapo_tau_neg = values[kSapoTauNeg];
  o.log_threshold = values[kLogThreshold];
  o.log_threshold_low = values[kLogThresholdLow];
  o.ess_base_ratio = values[kEssBaseRatio];
  o.clip_low = given(values[kClipLow]);
  o.clip_high = given(values[kClipHigh]);
  o.clip_c = given(values[kClipC]);
  o.norm_length = values[kNormLength];
  o.winsorize_low = values[kWinsorizeLow];
  o.winsorize_high = values[kWinsorizeHigh];
  o.m2_threshold = given(values[kM2Threshold]);
  o.rejection = codes[kRejection];
  for (int64_t j = 0; j < kNumRejection; ++j) {
    o.reject_low[j] = values[kRejectionLow[j]];
    o.reject_high[j] = values[kRejectionHigh[j]];
  }
  return o;
}

// What the per-token pass reads, in the type it computes in.
template <typename real_t>
struct LossParams {
  IsLevel level;
  IsCorrection correction;
  real_t log_hi, log_lo;  // log C and log C_low
  TrustRegion rule;
  bool clip;                  // PPO's clip of the ratio (Ppo, Gspo)
  real_t ratio_lo, ratio_hi;  // 1 - eps_low, 1 + eps_high
  real_t eps_lo, eps_hi;      // the bounds as given (Gmpo: of log rho; DppoTv: of pi - pi_anchor)
  bool dual_clip;             // Ppo, Gspo: the dual clip at dual_c; DppoTv: the ratio capped at dual_c
  real_t dual_c;
  real_t tau_pos, tau_neg;    // Sapo's gate
  bool reject_k1, reject_k2, reject_k3;  // token_k1/k2/k3 criteria: log r in [k1_lo, k1_hi], k2 <= k2_hi, ...
  real_t k1_lo, k1_hi, k2_hi, k3_hi;
  // batch_m2 (M2PO): Delta^2 < m2_threshold, the batch's threshold for the mean bound m2_bound (second_moment.h)
  bool reject_m2, m2_given;
  double m2_bound, m2_threshold;
  bool token_reject() const { return reject_k1 || reject_k2 || reject_k3 || reject_m2; }
};

template <typename real_t>
LossParams<real_t> loss_params(const LossOptions& o) {
  LossParams<real_t> p;
  p.level = o.is_level;
  p.correction = o.is_correction;
  p.log_hi = static_cast<real_t>(o.log_threshold);
  p.log_lo = static_cast<real_t>(o.log_threshold_low);
  p.rule = o.trust_region;
  p.clip = (p.rule == TrustRegion::Ppo || p.rule == TrustRegion::Gspo) && o.clip_low.has_value() &&
           o.clip_high.has_value();
  p.ratio_lo = static_cast<real_t>(1.0 - o.clip_low.value_or(0.0));
  p.ratio_hi = static_cast<real_t>(1.0 + o.clip_high.value_or(0.0));
  p.eps_lo = static_cast<real_t>(o.clip_low.value_or(0.0));
  p.eps_hi = static_cast<real_t>(o.clip_high.value_or(0.0));
  p.dual_clip = o.clip_c.has_value();
  p.dual_c = static_cast<real_t>(o.clip_c.value_or(0.0));
  p.tau_pos = static_cast<real_t>(o.sapo_tau_pos);
  p.tau_neg = static_cast<real_t>(o.sapo_tau_neg);
  p.reject_k1 = o.rejects(Rejection::TokenK1);
  p.reject_k2 = o.rejects(Rejection::TokenK2);
  p.reject_k3 = o.rejects(Rejection::TokenK3);
  p.k1_lo = static_cast<real_t>(o.low(Rejection::TokenK1));
  p.k1_hi = static_cast<real_t>(o.high(Rejection::TokenK1));
  p.k2_hi = static_cast<real_t>(o.high(Rejection::TokenK2));
  p.k3_hi = static_cast<real_t>(o.high(Rejection::TokenK3));
  p.reject_m2 = o.rejects(Rejection::BatchM2);
  p.m2_bound = o.high(Rejection::BatchM2);
  // the caller's, or set from the tokens before a pass that reads it (second_moment.h)
  p.m2_given = o.m2_threshold.has_value();
  p.m2_threshold = o.m2_threshold.value_or(std::numeric_limits<double>::infinity());
  return p;
}

}  // namespace vcpo
