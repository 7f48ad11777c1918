// Per-sequence sums s_i, L_i, k3_i: one block per chunk of tokens, partial sums combined per sequence. Part of the
// "cuda" backend (ops.cu: the entry points; docs/contract.md: the math).
#pragma once

#include "common.cuh"

namespace vcpo {
namespace {

template <typename lp_t, typename ref_t, typename acc_t>
__global__ void sequence_partials_kernel(Tokens t, acc_t* partials) {
  const Span sp = chunk_span(t, blockIdx.x);
  if (sp.seq >= t.num_seqs) return;  // uniform over the block
  acc_t s = 0, len = 0, k3 = 0;
  visit_tokens<lp_t, ref_t, acc_t>(t, sp.first, sp.last, static_cast<lp_t*>(nullptr),
                                   [&](int64_t, bool counted, acc_t, acc_t mu, acc_t prox) {
    if (counted) {
      const acc_t d = prox - mu;
      s += d;
      len += 1;
      if (d != -INFINITY) k3 += k3_term(d);  // a zero weight (log pi = -inf): left out of the KL
    }
    return acc_t(0);
  });
  s = block_reduce(s);
  len = block_reduce(len);
  k3 = block_reduce(k3);
  if (threadIdx.x == 0) {
    partials[blockIdx.x * 3] = s;
    partials[blockIdx.x * 3 + 1] = len;
    partials[blockIdx.x * 3 + 2] = k3;
  }
}

}  // namespace
}  // namespace vcpo
