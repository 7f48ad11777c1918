// M2PO's mask, the rejection criterion batch_m2 (docs/contract.md, "Rejection"): the threshold of the batch's
// Delta^2 above which tokens are masked, from a sort of the counted tokens' values. Part of the fused loss.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"
#include "loss_options.h"
#include "sequence_stats.h"

namespace vcpo {

// With v_1 >= v_2 >= ... >= v_n the counted tokens' Delta^2 (NaN left out: such a token is masked anyway), the
// smallest k whose rest v_{k+1..n} has a mean <= bound (an empty rest: 0), and v_k (+inf for k = 0). The rest's sums
// run from the smallest value up, as the reference's.
template <typename lp_t, typename ref_t, typename acc_t>
double second_moment_threshold(const TokenView& v, double bound) {
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  std::vector<double> values;
  for (int64_t t = 0; t < v.cu_seqlens[v.num_seqs]; ++t) {
    if (v.mask != nullptr && !v.mask[t]) continue;
    const acc_t d = (old ? load<acc_t>(old, t) : load<acc_t>(lp, t)) - load<acc_t>(mu, t);
    const double square = static_cast<double>(d) * static_cast<double>(d);
    if (!std::isnan(square)) values.push_back(square);
  }
  std::sort(values.begin(), values.end(), std::greater<double>());
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<double> rest(n + 1, 0.0);  // rest[k] = v_{k+1} + ... + v_n (0-based: values[k..n-1])
  for (int64_t k = n - 1; k >= 0; --k) rest[k] = rest[k + 1] + values[k];
  int64_t first = n;
  for (int64_t k = 0; k < n; ++k) {
    if (rest[k] / static_cast<double>(n - k) <= bound) {
      first = k;
      break;
    }
  }
  return first == 0 ? std::numeric_limits<double>::infinity() : values[first - 1];
}

// `p` with the batch's M2PO threshold, when batch_m2 is in use and the caller gave none.
template <typename lp_t, typename ref_t, typename acc_t>
LossParams<acc_t> with_second_moment_threshold(const TokenView& v, LossParams<acc_t> p) {
  if (p.reject_m2 && !p.m2_given) p.m2_threshold = second_moment_threshold<lp_t, ref_t, acc_t>(v, p.m2_bound);
  return p;
}

}  // namespace vcpo
