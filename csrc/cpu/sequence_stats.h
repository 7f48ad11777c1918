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

// Narrows [begin, end) to the span from the first to the last counted token, 8 mask bytes at a time: in a
// padded batch the prompt and the padding need not be read at all (they add nothing to any sum).
VCPO_INLINE void trim_to_counted(const bool* mask, int64_t& begin, int64_t& end) {
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask);
  while (end - begin >= 8) {
    uint64_t word;
    __builtin_memcpy(&word, m + begin, 8);
    if (word != 0) break;
    begin += 8;
  }
  while (begin < end && m[begin] == 0) ++begin;
  while (end - begin >= 8) {
    uint64_t word;
    __builtin_memcpy(&word, m + end - 8, 8);
    if (word != 0) break;
    end -= 8;
  }
  while (end > begin && m[end - 1] == 0) --end;
}

// One sequence; HasOld/HasMask are template flags so the inner loop has no branches and vectorises.
template <bool HasOld, bool HasMask, typename lp_t, typename ref_t, typename acc_t>
VCPO_INLINE void sequence_sums_one(const TokenView& v, int64_t i, const SequenceSums<acc_t>& out) {
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  const bool* mask = v.mask;
  int64_t begin = v.cu_seqlens[i], end = v.cu_seqlens[i + 1];
  if (HasMask) trim_to_counted(mask, begin, end);
  acc_t s = 0, len = 0, k3 = 0;
#pragma omp simd reduction(+ : s, len, k3)
  for (int64_t t = begin; t < end; ++t) {
    const bits_type<acc_t> counted = HasMask ? mask_bits<acc_t>(mask, t) : bits_type<acc_t>(-1);
    const acc_t prox = HasOld ? load<acc_t>(old, t) : load<acc_t>(lp, t);
    const acc_t d = keep(prox - load<acc_t>(mu, t), counted);
    s += d;
    len += keep(acc_t(1), counted);
    k3 += d == -kInf<acc_t> ? acc_t(0) : k3_term(d);  // a zero weight (log pi = -inf): left out of the KL
  }
  out.log_weight[i] = s;
  out.length[i] = len;
  out.kl_k3[i] = k3;
}

}  // namespace vcpo
