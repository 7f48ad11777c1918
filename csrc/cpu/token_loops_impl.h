// Definitions of the per-token loops for the instruction set named by VCPO_ISA; included only by
// loops_generic.cpp and loops_avx2.cpp (see token_loops.h).
#include "token_loops.h"

namespace vcpo {
namespace VCPO_ISA {

template <typename lp_t, typename ref_t, typename acc_t>
void sequence_sums(const TokenView& v, int64_t first, int64_t last, const SequenceSums<acc_t>& out) {
  const bool has_old = v.old_logp != nullptr, has_mask = v.mask != nullptr;
  for (int64_t i = first; i < last; ++i) {
    if (has_old && has_mask) sequence_sums_one<true, true, lp_t, ref_t, acc_t>(v, i, out);
    else if (has_old) sequence_sums_one<true, false, lp_t, ref_t, acc_t>(v, i, out);
    else if (has_mask) sequence_sums_one<false, true, lp_t, ref_t, acc_t>(v, i, out);
    else sequence_sums_one<false, false, lp_t, ref_t, acc_t>(v, i, out);
  }
}

template <bool WriteGrad, bool TokenLevel, typename lp_t, typename ref_t, typename acc_t>
void token_pass_range(const TokenView& v, int64_t first, int64_t last, const acc_t* adv, const acc_t* grad_scale,
                      const LossParams<acc_t>& p, const TokenSums<acc_t>& sums, lp_t* grad) {
  const bool has_old = v.old_logp != nullptr, has_mask = v.mask != nullptr;
  if (p.rule != TrustRegion::None && p.rule != TrustRegion::Ppo) {
    for (int64_t i = first; i < last; ++i) {
      if (has_old && has_mask)
        trust_region_pass_one<true, true, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
      else if (has_old)
        trust_region_pass_one<true, false, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
      else if (has_mask)
        trust_region_pass_one<false, true, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
      else
        trust_region_pass_one<false, false, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
    }
    return;
  }
  for (int64_t i = first; i < last; ++i) {
    if (has_old && has_mask)
      token_pass_one<true, true, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
    else if (has_old)
      token_pass_one<true, false, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
    else if (has_mask)
      token_pass_one<false, true, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
    else
      token_pass_one<false, false, TokenLevel, WriteGrad, lp_t, ref_t, acc_t>(v, i, adv[i], grad_scale[i], p, sums, grad);
  }
}

template <typename acc_t>
void logit_rows_forward(const LogitRows<acc_t>& r, int64_t first, int64_t last, const RowStats<acc_t>& out) {
  for (int64_t t = first; t < last; ++t) logit_row_forward(r, t, out);
}

template <typename acc_t>
void logit_rows_backward(const LogitRows<acc_t>& r, int64_t first, int64_t last, const RowGrads<acc_t>& g) {
  for (int64_t t = first; t < last; ++t) logit_row_backward(r, t, g);
}

VCPO_INSTANTIATE_LOOPS()

}  // namespace VCPO_ISA
}  // namespace vcpo
