// Shared pieces of the CPU kernels: option codes (mirrored in vcpo_kernels/options.py), element
// loads, and a vectorisable exp. No torch headers here, so the kernels stay plain C++.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace vcpo {

enum class IsLevel : int64_t { Sequence = 0, Token = 1, Geometric = 2 };
enum class IsCorrection : int64_t { Truncate = 0, Mask = 1, None = 2 };
enum class LrRule : int64_t { None = 0, Sqrt = 1, Linear = 2 };
enum class Advantage : int64_t { Opob = 0, Grpo = 1, Rloo = 2, Reinforce = 3, None = 4, Given = 5 };
enum class OpobWeight : int64_t { Raw = 0, Truncated = 1, ReferenceCompat = 2 };
enum class LossAgg : int64_t {
  TokenMean = 0,
  SeqMeanTokenMean = 1,
  SeqMeanTokenSum = 2,
  SeqMeanTokenSumNorm = 3,
};

// Order of the packed scalar statistics returned by the fused loss (see docs/contract.md).
enum Scalar : int64_t {
  kEss = 0,
  kEssRatio,
  kLrScale,
  kIsClipFraction,
  kMeanIsCoef,
  kKlK3,
  kNumTokens,
  kNumSeqs,
  kNumNonfinite,
  kPpoClipFraction,
  kNumScalars,
};

template <typename T>
constexpr T kInf = std::numeric_limits<T>::infinity();

// Accumulation type: fp64 inputs accumulate in fp64, everything else in fp32.
template <typename T>
using acc_type = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

template <typename acc_t, typename T>
inline acc_t load(const T* p, int64_t i) {
  return static_cast<acc_t>(p[i]);
}

// exp in fp32 that GCC vectorises inside `omp simd` loops (std::exp does not without -ffast-math).
// Cody-Waite range reduction, degree-7 polynomial: within 2 ulp on [-87, 88]; below that it flushes
// to 0, above 88.72 it is +inf, NaN stays NaN.
inline float exp_approx(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float k = xc * 1.44269504088896341f + shifter;
  const int32_t ki = __builtin_bit_cast(int32_t, k) - __builtin_bit_cast(int32_t, shifter);
  k -= shifter;
  float r = xc - k * 0.693145751953125f;
  r -= k * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = __builtin_bit_cast(float, (ki + 127) << 23);
  float y = p * scale;
  y = x < -87.0f ? 0.0f : y;
  y = x > 88.7228391f ? kInf<float> : y;
  return x != x ? x : y;
}

inline float exp_fast(float x) { return exp_approx(x); }
inline double exp_fast(double x) { return std::exp(x); }

// exp(d) - 1 - d, the K3 KL term, without the cancellation of the direct formula near d = 0:
// a short series for |d| < 1/4 in fp32 (truncation error below 1e-8 relative), expm1 in fp64.
inline float k3_term(float d) {
  const float series =
      d * d * (0.5f + d * (1.0f / 6 + d * (1.0f / 24 + d * (1.0f / 120 + d * (1.0f / 720 + d * (1.0f / 5040))))));
  const float direct = exp_approx(d) - 1.0f - d;
  const float ad = d < 0 ? -d : d;
  return ad < 0.25f ? series : direct;
}
inline double k3_term(double d) { return std::expm1(d) - d; }

// min(x, hi) that keeps a NaN x (std::min's result depends on argument order).
template <typename T>
inline T min_keep_nan(T x, T hi) {
  return x > hi ? hi : x;
}

// max over values that keeps NaN.
template <typename T>
inline T max_keep_nan(T m, T x) {
  return (x > m || x != x) ? x : m;
}

}  // namespace vcpo
