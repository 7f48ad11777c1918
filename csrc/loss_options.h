// The fused loss's scalar options, shared by the CPU and CUDA kernels: passed to the ops packed as `int[] codes`
// and `float[] values` (positions LossCode and LossValue of options.h, filled by PolicyLossOptions.packed in
// vcpo_kernels/options.py; an absent clip bound is NaN), unpacked here once, and the per-token parameters the
// token passes read. Math: docs/contract.md, "Loss".
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "options.h"

namespace vcpo {

constexpr int64_t kNumRejection = 11;  // REJECTION_CRITERIA

// The criteria of PolicyLossOptions.rejection, in REJECTION_CRITERIA order (vcpo_kernels/options.py).
enum class Rejection : int64_t {
  TokenK1, TokenK2, TokenK3, SeqSumK1, SeqSumK2, SeqSumK3, SeqMeanK1, SeqMeanK2, SeqMeanK3, SeqMaxK2, SeqMaxK3
};

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
  OpobAggregation opob_aggregation;  // the CUDA kernels have the mean only (refused in Python otherwise)
  double log_threshold, log_threshold_low;  // log C, log C_low
  double ess_base_ratio;
  std::optional<double> clip_low, clip_high, clip_c;  // PPO clipping and its dual clip, when on
  double norm_length;
  double winsorize_low, winsorize_high;  // the quantiles of opob_aggregation = winsorized_mean
  // The rejection criteria (bit j: criterion j of Rejection, the CPU kernels' only) and their bounds.
  int64_t rejection;
  double reject_low[kNumRejection], reject_high[kNumRejection];
  bool rejects(Rejection j) const { return (rejection >> static_cast<int64_t>(j)) & 1; }
  bool rejects_sequences() const { return rejection & ~int64_t(0b111); }  // beyond the token_k* bits
};

inline LossOptions unpack_loss_options(c10::ArrayRef<int64_t> codes, c10::ArrayRef<double> values,
                                       bool advantages_given) {
  TORCH_CHECK(codes.size() == kNumLossCodes && values.size() == kNumLossValues, "vcpo: the loss ops take ",
              int64_t(kNumLossCodes), " option codes and ", int64_t(kNumLossValues), " option values, got ",
              codes.size(), " and ", values.size(), ": pack them with PolicyLossOptions.packed()");
  auto given = [](double x) { return std::isnan(x) ? std::nullopt : std::optional<double>(x); };
  LossOptions o{static_cast<IsLevel>(codes[kIsLevel]),
                     static_cast<IsCorrection>(codes[kIsCorrection]),
                     codes[kEssOnCorrected] != 0,
                     static_cast<LrRule>(codes[kLrRule]),
                     advantages_given ? Advantage::Given : static_cast<Advantage>(codes[kAdvantage]),
                     codes[kNormByStd] != 0,
                     codes[kOpobLengthNorm] != 0,
                     static_cast<OpobWeight>(codes[kOpobWeight]),
                     static_cast<LossAgg>(codes[kLossAgg]),
                     static_cast<OpobAggregation>(codes[kOpobAggregation]),
                     values[kLogThreshold],
                     values[kLogThresholdLow],
                     values[kEssBaseRatio],
                     given(values[kClipLow]),
                     given(values[kClipHigh]),
                     given(values[kClipC]),
                     values[kNormLength],
                     values[kWinsorizeLow],
                     values[kWinsorizeHigh],
                     codes[kRejection],
                     {},
                     {}};
  for (int64_t j = 0; j < kNumRejection; ++j) {
    o.reject_low[j] = values[kTokenK1Low + 2 * j];
    o.reject_high[j] = values[kTokenK1Low + 2 * j + 1];
  }
  return o;
}

// What the per-token pass reads, in the type it computes in.
template <typename real_t>
struct LossParams {
  IsLevel level;
  IsCorrection correction;
  real_t log_hi, log_lo;  // log C and log C_low
  bool clip;
  real_t ratio_lo, ratio_hi;  // 1 - eps_low, 1 + eps_high
  bool dual_clip;
  real_t dual_c;
  bool reject_k1, reject_k2, reject_k3;  // token_k1/k2/k3 criteria: log r in [k1_lo, k1_hi], k2 <= k2_hi, ...
  real_t k1_lo, k1_hi, k2_hi, k3_hi;
  bool token_reject() const { return reject_k1 || reject_k2 || reject_k3; }
};

template <typename real_t>
LossParams<real_t> loss_params(const LossOptions& o) {
  const bool clip = o.clip_low.has_value() && o.clip_high.has_value();
  return LossParams<real_t>{o.is_level,
                            o.is_correction,
                            static_cast<real_t>(o.log_threshold),
                            static_cast<real_t>(o.log_threshold_low),
                            clip,
                            static_cast<real_t>(1.0 - o.clip_low.value_or(0.0)),
                            static_cast<real_t>(1.0 + o.clip_high.value_or(0.0)),
                            clip && o.clip_c.has_value(),
                            static_cast<real_t>(o.clip_c.value_or(0.0)),
                            o.rejects(Rejection::TokenK1),
                            o.rejects(Rejection::TokenK2),
                            o.rejects(Rejection::TokenK3),
                            static_cast<real_t>(o.reject_low[0]),
                            static_cast<real_t>(o.reject_high[0]),
                            static_cast<real_t>(o.reject_high[1]),
                            static_cast<real_t>(o.reject_high[2])};
}

}  // namespace vcpo
