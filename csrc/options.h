// Generated from vcpo_kernels/options.py by `python tools/options_header.py > csrc/options.h`: edit
// that file, not this one (tests/kernels/test_option_codes.py checks that they agree).
#pragma once

#include <cstdint>

namespace vcpo {

enum class IsLevel : int64_t { Sequence = 0, Token = 1, Geometric = 2 };
enum class IsCorrection : int64_t { Truncate = 0, Mask = 1, None = 2 };
enum class LrRule : int64_t { None = 0, Sqrt = 1, Linear = 2 };
enum class Advantage : int64_t { Opob = 0, Grpo = 1, Rloo = 2, Reinforce = 3, None = 4, Given = 5 };
enum class OpobWeight : int64_t { Raw = 0, Truncated = 1, ReferenceCompat = 2 };
enum class LossAgg : int64_t { TokenMean = 0, SeqMeanTokenMean = 1, SeqMeanTokenSum = 2, SeqMeanTokenSumNorm = 3 };
enum class OpobAggregation : int64_t { Mean = 0, Median = 1, WinsorizedMean = 2 };
enum class Rejection : int64_t { TokenK1 = 0, TokenK2 = 1, TokenK3 = 2, SeqSumK1 = 3, SeqSumK2 = 4, SeqSumK3 = 5, SeqMeanK1 = 6, SeqMeanK2 = 7, SeqMeanK3 = 8, SeqMaxK2 = 9, SeqMaxK3 = 10, BatchM2 = 11 };
enum class TrustRegion : int64_t { None = 0, Ppo = 1, Gspo = 2, Gmpo = 3, Cispo = 4, DppoTv = 5, Sapo = 6 };

constexpr int64_t kNumRejection = 12;

enum Scalar : int64_t {
  kEss = 0,
  kEssRatio = 1,
  kLrScale = 2,
  kIsClipFraction = 3,
  kMeanIsCoef = 4,
  kKlK3 = 5,
  kNumTokens = 6,
  kNumSeqs = 7,
  kNumNonfinite = 8,
  kPpoClipFraction = 9,
  kRejectedFraction = 10,
  kOpobMaxShare = 11,
  kNumScalars = 12,
};
enum LossCode : int64_t {
  kIsLevel = 0,
  kIsCorrection = 1,
  kEssOnCorrected = 2,
  kLrRule = 3,
  kAdvantage = 4,
  kNormByStd = 5,
  kOpobLengthNorm = 6,
  kOpobWeight = 7,
  kLossAgg = 8,
  kOpobAggregation = 9,
  kRejection = 10,
  kOpobLeaveOneOut = 11,
  kTrustRegion = 12,
  kNumLossCodes = 13,
};
enum LossValue : int64_t {
  kLogThreshold = 0,
  kLogThresholdLow = 1,
  kEssBaseRatio = 2,
  kClipLow = 3,
  kClipHigh = 4,
  kClipC = 5,
  kNormLength = 6,
  kWinsorizeLow = 7,
  kWinsorizeHigh = 8,
  kSapoTauPos = 9,
  kSapoTauNeg = 10,
  kM2Threshold = 11,
  kTokenK1Low = 12,
  kTokenK1High = 13,
  kTokenK2Low = 14,
  kTokenK2High = 15,
  kTokenK3Low = 16,
  kTokenK3High = 17,
  kSeqSumK1Low = 18,
  kSeqSumK1High = 19,
  kSeqSumK2Low = 20,
  kSeqSumK2High = 21,
  kSeqSumK3Low = 22,
  kSeqSumK3High = 23,
  kSeqMeanK1Low = 24,
  kSeqMeanK1High = 25,
  kSeqMeanK2Low = 26,
  kSeqMeanK2High = 27,
  kSeqMeanK3Low = 28,
  kSeqMeanK3High = 29,
  kSeqMaxK2Low = 30,
  kSeqMaxK2High = 31,
  kSeqMaxK3Low = 32,
  kSeqMaxK3High = 33,
  kBatchM2Low = 34,
  kBatchM2High = 35,
  kNumLossValues = 36,
};

// The LossValue of each Rejection criterion's low and high bound, in Rejection order.
constexpr LossValue kRejectionLow[kNumRejection] = {
  kTokenK1Low,
  kTokenK2Low,
  kTokenK3Low,
  kSeqSumK1Low,
  kSeqSumK2Low,
  kSeqSumK3Low,
  kSeqMeanK1Low,
  kSeqMeanK2Low,
  kSeqMeanK3Low,
  kSeqMaxK2Low,
  kSeqMaxK3Low,
  kBatchM2Low,
};
constexpr LossValue kRejectionHigh[kNumRejection] = {
  kTokenK1High,
  kTokenK2High,
  kTokenK3High,
  kSeqSumK1High,
  kSeqSumK2High,
  kSeqSumK3High,
  kSeqMeanK1High,
  kSeqMeanK2High,
  kSeqMeanK3High,
  kSeqMaxK2High,
  kSeqMaxK3High,
  kBatchM2High,
};

}  // namespace vcpo
