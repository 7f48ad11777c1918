// Per-sequence sums in one pass over the tokens: s_i = sum_t (lp_prox - mu), L_i = counted tokens,
// k3_i = sum_t (exp(Delta) - Delta - 1). Contract: docs/contract.md, "Per-sequence statistics".
#pragma once

#include "common.h"

namespace vcpo {

struct TokenView {
  const void* logp;
  const void* behavior_logp;
  const void* old_logp;  // nullptr in bypass mode
  const bool* mask;      // nullptr: every token counts
  const int64_t* cu_seqlens;
  int64_t num_seqs;
};

template <typename acc_t>
struct SequenceSums {
  acc_t* log_weight;
  acc_t* length;
  acc_t* kl_k3;
};

// One sequence; HasOld/HasMask are template flags so the inner loop has no branches and vectorises.
template <bool HasOld, bool HasMask, typename lp_t, typename ref_t, typename acc_t>
inline void sequence_sums_one(const TokenView& v, int64_t i, const SequenceSums<acc_t>& out) {
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  const bool* mask = v.mask;
  const int64_t begin = v.cu_seqlens[i], end = v.cu_seqlens[i + 1];
  acc_t s = 0, len = 0, k3 = 0;
#pragma omp simd reduction(+ : s, len, k3)
  for (int64_t t = begin; t < end; ++t) {
    const bool counted = HasMask ? mask[t] : true;
    const acc_t prox = HasOld ? load<acc_t>(old, t) : load<acc_t>(lp, t);
    const acc_t d = counted ? prox - load<acc_t>(mu, t) : acc_t(0);
    s += d;
    len += counted ? acc_t(1) : acc_t(0);
    k3 += k3_term(d);
  }
  out.log_weight[i] = s;
  out.length[i] = len;
  out.kl_k3[i] = k3;
}

template <typename Body>
inline void for_each_flag(bool has_old, bool has_mask, Body&& body) {
  if (has_old) {
    if (has_mask) body(std::true_type{}, std::true_type{});
    else body(std::true_type{}, std::false_type{});
  } else {
    if (has_mask) body(std::false_type{}, std::true_type{});
    else body(std::false_type{}, std::false_type{});
  }
}

// Sums for sequences [first, last); the caller parallelises over sequence ranges.
template <typename lp_t, typename ref_t, typename acc_t>
void sequence_sums(const TokenView& v, int64_t first, int64_t last, const SequenceSums<acc_t>& out) {
  for_each_flag(v.old_logp != nullptr, v.mask != nullptr, [&](auto has_old, auto has_mask) {
    for (int64_t i = first; i < last; ++i) {
      sequence_sums_one<decltype(has_old)::value, decltype(has_mask)::value, lp_t, ref_t, acc_t>(v, i, out);
    }
  });
}

}  // namespace vcpo
