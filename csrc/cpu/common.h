// Shared pieces of the CPU kernels: the option codes (options.h), element loads, branch-free selects and a
// vectorisable exp. Everything a per-token loop calls is VCPO_INLINE (always
// inlined) so that it is compiled for the instruction set of the loop it lands in (see dispatch.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "acc_type.h"
#include "options.h"

#define VCPO_INLINE inline __attribute__((always_inline))

namespace vcpo {

template <typename T>
constexpr T kInf = std::numeric_limits<T>::infinity();


// All-ones or all-zeros integer of the accumulation type's width: the mask as a bit pattern.
template <typename acc_t>
using bits_type = typename std::conditional<std::is_same<acc_t, double>::value, int64_t, int32_t>::type;

template <typename acc_t>
VCPO_INLINE bits_type<acc_t> mask_bits(const bool* mask, int64_t t) {
  return -static_cast<bits_type<acc_t>>(reinterpret_cast<const uint8_t*>(mask)[t]);
}

// x where bits is all-ones, +0 where it is zero; a NaN or inf in a masked-out x never leaks (0 * NaN would).
template <typename acc_t>
VCPO_INLINE acc_t keep(acc_t x, bits_type<acc_t> bits) {
  return __builtin_bit_cast(acc_t, __builtin_bit_cast(bits_type<acc_t>, x) & bits);
}

template <typename acc_t, typename T>
VCPO_INLINE acc_t load(const T* p, int64_t i) {
  return static_cast<acc_t>(p[i]);
}
// bf16 is the top half of an fp32: a shift, which vectorises (c10's conversion is not always inlined).
template <>
VCPO_INLINE float load<float, c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  const uint16_t raw = reinterpret_cast<const uint16_t*>(p)[i];
  return __builtin_bit_cast(float, static_cast<uint32_t>(raw) << 16);
}

template <typename T, typename acc_t>
VCPO_INLINE void store(T* p, int64_t i, acc_t x) {
  p[i] = static_cast<T>(x);
}
// Round to nearest even, NaN kept, in integer ops that vectorise.
template <>
VCPO_INLINE void store<c10::BFloat16, float>(c10::BFloat16* p, int64_t i, float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// exp(x) = 2^k exp(r) with r = x - k ln2, |r| <= ln2 / 2 (Cody-Waite reduction), and
// exp(r) = 1 + r + r^2 q(r) with a degree-5 q: within 2 ulp. 2^k is applied as two factors 2^(k/2), so
// k from -150 (denormal results) to 128 (up to FLT_MAX) needs no special case.
struct ExpParts {
  float scale_lo, scale_hi, r, r2q;
  int32_t k;
};
VCPO_INLINE ExpParts exp_parts(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 88.7228391f ? 88.7228391f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float k = xc * 1.44269504088896341f + shifter;
  const int32_t ki = __builtin_bit_cast(int32_t, k) - __builtin_bit_cast(int32_t, shifter);
  k -= shifter;
  float r = xc - k * 0.693145751953125f;
  r -= k * 1.42860682030941723212e-6f;
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  const int32_t k_lo = ki >> 1, k_hi = ki - k_lo;
  return {__builtin_bit_cast(float, (k_lo + 127) << 23), __builtin_bit_cast(float, (k_hi + 127) << 23), r,
          r * r * q, ki};
}

// exp in fp32 that vectorises inside `omp simd` loops (std::exp does not without -ffast-math): 0 below -104,
// +inf above 88.72, NaN stays NaN.
VCPO_INLINE float exp_fast(float x) {
  const ExpParts e = exp_parts(x);
  float y = (e.r2q + e.r + 1.0f) * e.scale_lo * e.scale_hi;
  y = x < -104.0f ? 0.0f : y;
  y = x > 88.7228391f ? kInf<float> : y;
  return x != x ? x : y;
}
VCPO_INLINE double exp_fast(double x) { return std::exp(x); }

// exp(d) - 1 - d, the K3 KL term. Where the reduction leaves d alone (k = 0, |d| <= ln2 / 2) it is exactly
// r^2 q(r), with no cancellation; elsewhere it is >= 0.06 and the direct form is accurate (1.5e-6 relative).
VCPO_INLINE float k3_term(float d) {
  const ExpParts e = exp_parts(d);
  float y = e.k == 0 ? e.r2q : ((e.r2q + e.r + 1.0f) * e.scale_lo * e.scale_hi - 1.0f) - d;
  y = d > 88.7228391f ? kInf<float> : y;
  return d != d ? d : y;
}
VCPO_INLINE double k3_term(double d) { return std::expm1(d) - d; }

// min(x, hi) that keeps a NaN x (std::min's result depends on argument order).
template <typename T>
VCPO_INLINE T min_keep_nan(T x, T hi) {
  return x > hi ? hi : x;
}

// max over values that keeps NaN.
template <typename T>
VCPO_INLINE T max_keep_nan(T m, T x) {
  return (x > m || x != x) ? x : m;
}

}  // namespace vcpo
