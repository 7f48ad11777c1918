// The two passes over a chunk of logits z [n, V] of linear_logprobs (docs/contract.md, "Log-probs from
// hidden states"); the GEMMs around them are torch's. Row by row, in the accumulation type:
//   forward:  m = max z, s = sum e, with e = exp(z - m): lse = m + log s, logp = z_y - lse,
//             entropy = log s - sum e (z - m) / s, sum p^2 = sum e^2 / s^2 (shifted by m: no cancellation);
//   backward: d z = p (c0 + a1 x + a2 p) + a [v = y], x = z - lse = log p, overwriting z, then * scale,
//             with c0 = -a - e H - 2 q S2, a1 = -e, a2 = 2 q (a, e, q: the upstream gradients).
// With a cap c > 0 both passes read each logit z as c tanh(z / c) (the max as the capped max: tanh rises), and
// the backward multiplies its d z by 1 - tanh^2(z / c) as it writes it.
#pragma once

#include "common.h"

namespace vcpo {

template <typename acc_t>
struct LogitRows {
  acc_t* z;  // [n, V], row-major
  int64_t num_rows, vocab;
  const int64_t* targets;
  int64_t ignore_index;
  acc_t cap;  // 0: no softcap
};

template <typename acc_t>
struct RowStats {
  acc_t* lse;
  acc_t* logp;
  acc_t* entropy;
  acc_t* sum_p2;
};

// Upstream gradients (nullptr: none) and the forward's entropy and sum p^2 that d z needs.
template <typename acc_t>
struct RowGrads {
  const acc_t* lse;
  const acc_t* g_logp;
  const acc_t* g_entropy;
  const acc_t* g_sum_p2;
  const acc_t* entropy;
  const acc_t* sum_p2;
  acc_t scale;
};

template <typename acc_t>
VCPO_INLINE bool target_counts(const LogitRows<acc_t>& r, int64_t t) {
  return r.targets[t] != r.ignore_index;
}

// tanh u and its slope 1 - tanh^2 u, from e = exp(-2 |u|): tanh |u| = -expm1(-2 |u|) / (1 + e) and the slope
// 4 e / (1 + e)^2, which stays relative where tanh rounds to +-1. In fp32 expm1 comes from exp's reduction
// (r + r^2 q where it leaves the argument alone: no cancellation near 0), so tanh is within a few ulp, and
// the whole vectorises like exp_fast; NaN stays NaN.
template <typename acc_t>
struct Tanh {
  acc_t t, slope;
};
VCPO_INLINE Tanh<float> tanh_fast(float u) {
  const float x = -2.0f * std::fabs(u);
  const ExpParts p = exp_parts(x);
  const float e = x < -104.0f ? 0.0f : (p.r2q + p.r + 1.0f) * p.scale_lo * p.scale_hi;
  const float expm1 = p.k == 0 ? p.r + p.r2q : e - 1.0f, inv = 1.0f / (1.0f + e);
  return {std::copysign(-expm1 * inv, u), 4.0f * e * inv * inv};
}
VCPO_INLINE Tanh<double> tanh_fast(double u) {
  const double e = std::exp(-2 * std::fabs(u)), inv = 1 / (1 + e);
  return {std::tanh(u), 4 * e * inv * inv};
}

// The logit as the passes read it: c tanh(z / c) with a cap, else z.
template <bool kCap, typename acc_t>
VCPO_INLINE acc_t read_logit(acc_t z, acc_t cap, acc_t inv_cap) {
  return kCap ? cap * tanh_fast(z * inv_cap).t : z;
}

template <bool kCap, typename acc_t>
VCPO_INLINE void row_forward(const LogitRows<acc_t>& r, int64_t t, const RowStats<acc_t>& out) {
  const acc_t* z = r.z + t * r.vocab;
  const int64_t V = r.vocab;
  const acc_t cap = r.cap, inv_cap = kCap ? 1 / cap : acc_t(0);
  acc_t m = -kInf<acc_t>;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = z[v] > m ? z[v] : m;
  m = read_logit<kCap>(m, cap, inv_cap);
  acc_t s = 0, sx = 0, s2 = 0;
#pragma omp simd reduction(+ : s, sx, s2)
  for (int64_t v = 0; v < V; ++v) {
    // NaN logits make x, and every output, NaN; so do +inf ones without a cap (with one they read as c)
    const acc_t x = read_logit<kCap>(z[v], cap, inv_cap) - m;
    const acc_t e = exp_fast(x);
    s += e;
    sx += e * x;
    s2 += e * e;
  }
  const acc_t log_s = std::log(s), lse = m + log_s;
  out.lse[t] = lse;
  const bool counts = target_counts(r, t);
  out.logp[t] = counts ? read_logit<kCap>(z[r.targets[t]], cap, inv_cap) - lse : acc_t(0);
  out.entropy[t] = counts ? log_s - sx / s : acc_t(0);
  out.sum_p2[t] = counts ? s2 / (s * s) : acc_t(0);
}

template <bool kCap, typename acc_t>
VCPO_INLINE void row_backward(const LogitRows<acc_t>& r, int64_t t, const RowGrads<acc_t>& g) {
  acc_t* z = r.z + t * r.vocab;
  const int64_t V = r.vocab;
  if (!target_counts(r, t)) {  // ignored targets contribute nothing
    for (int64_t v = 0; v < V; ++v) z[v] = acc_t(0);
    return;
  }
  const acc_t a = g.g_logp ? g.g_logp[t] : acc_t(0);
  const acc_t e = g.g_entropy ? g.g_entropy[t] : acc_t(0);
  const acc_t q = g.g_sum_p2 ? g.g_sum_p2[t] : acc_t(0);
  const acc_t c0 = -a - (e != 0 ? e * g.entropy[t] : acc_t(0)) - (q != 0 ? 2 * q * g.sum_p2[t] : acc_t(0));
  const acc_t a1 = -e * g.scale, a2 = 2 * q * g.scale, c = c0 * g.scale, lse = g.lse[t];
  const acc_t cap = r.cap, inv_cap = kCap ? 1 / cap : acc_t(0);
  const int64_t y = r.targets[t];
  acc_t d_y = a * g.scale;  // the target's one-hot term, chain-ruled before the loop overwrites its logit
  if constexpr (kCap) {
    d_y *= tanh_fast(z[y] * inv_cap).slope;
  }
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    if constexpr (kCap) {
      const Tanh<acc_t> th = tanh_fast(z[v] * inv_cap);
      const acc_t x = cap * th.t - lse;
      const acc_t p = exp_fast(x);
      z[v] = p * (c + a1 * x + a2 * p) * th.slope;
    } else {
      const acc_t x = z[v] - lse;
      const acc_t p = exp_fast(x);
      z[v] = p * (c + a1 * x + a2 * p);
    }
  }
  z[y] += d_y;
}

template <typename acc_t>
VCPO_INLINE void logit_row_forward(const LogitRows<acc_t>& r, int64_t t, const RowStats<acc_t>& out) {
  r.cap > 0 ? row_forward<true>(r, t, out) : row_forward<false>(r, t, out);
}

template <typename acc_t>
VCPO_INLINE void logit_row_backward(const LogitRows<acc_t>& r, int64_t t, const RowGrads<acc_t>& g) {
  r.cap > 0 ? row_backward<true>(r, t, g) : row_backward<false>(r, t, g);
}

}  // namespace vcpo
