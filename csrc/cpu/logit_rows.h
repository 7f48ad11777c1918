// The two passes over a chunk of logits z [n, V] of linear_logprobs (docs/contract.md, "Log-probs from
// hidden states"); the GEMMs around them are torch's. Row by row, in the accumulation type:
//   forward:  m = max z, s = sum e, with e = exp(z - m): lse = m + log s, logp = z_y - lse,
//             entropy = log s - sum e (z - m) / s, sum p^2 = sum e^2 / s^2 (shifted by m: no cancellation);
//   backward: d z = p (c0 + a1 x + a2 p) + a [v = y], x = z - lse = log p, overwriting z, then * scale,
//             with c0 = -a - e H - 2 q S2, a1 = -e, a2 = 2 q (a, e, q: the upstream gradients).
#pragma once

#include "common.h"

namespace vcpo {

template <typename acc_t>
struct LogitRows {
  acc_t* z;  // [n, V], row-major
  int64_t num_rows, vocab;
  const int64_t* targets;
  int64_t ignore_index;
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

template <typename acc_t>
VCPO_INLINE void logit_row_forward(const LogitRows<acc_t>& r, int64_t t, const RowStats<acc_t>& out) {
  const acc_t* z = r.z + t * r.vocab;
  const int64_t V = r.vocab;
  acc_t m = -kInf<acc_t>;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = z[v] > m ? z[v] : m;
  acc_t s = 0, sx = 0, s2 = 0;
#pragma omp simd reduction(+ : s, sx, s2)
  for (int64_t v = 0; v < V; ++v) {
    const acc_t x = z[v] - m;  // NaN or +inf logits make x, and every output, NaN
    const acc_t e = exp_fast(x);
    s += e;
    sx += e * x;
    s2 += e * e;
  }
  const acc_t log_s = std::log(s), lse = m + log_s;
  out.lse[t] = lse;
  const bool counts = target_counts(r, t);
  out.logp[t] = counts ? z[r.targets[t]] - lse : acc_t(0);
  out.entropy[t] = counts ? log_s - sx / s : acc_t(0);
  out.sum_p2[t] = counts ? s2 / (s * s) : acc_t(0);
}

template <typename acc_t>
VCPO_INLINE void logit_row_backward(const LogitRows<acc_t>& r, int64_t t, const RowGrads<acc_t>& g) {
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
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    const acc_t x = z[v] - lse;
    const acc_t p = exp_fast(x);
    z[v] = p * (c + a1 * x + a2 * p);
  }
  z[r.targets[t]] += a * g.scale;
}

}  // namespace vcpo
