// The per-token pass of the fused loss: IS coefficient, ratio, PPO branch and d loss / d lp for each token
// of one sequence. Contract: docs/contract.md, "Loss".
#pragma once

#include "common.h"
#include "loss_options.h"
#include "sequence_stats.h"

namespace vcpo {

// IS coefficient of a unit with log weight lw.
template <typename acc_t>
VCPO_INLINE acc_t is_coef(acc_t lw, const LossParams<acc_t>& p) {
  const acc_t truncated = exp_fast(min_keep_nan(lw, p.log_hi));
  const acc_t kept = (lw >= p.log_lo && lw <= p.log_hi) ? acc_t(1) : acc_t(0);
  return p.correction == IsCorrection::Truncate ? truncated : p.correction == IsCorrection::Mask ? kept : acc_t(1);
}
// 1 if the correction changed the unit's weight, else 0.
template <typename acc_t>
VCPO_INLINE acc_t is_changed(acc_t lw, const LossParams<acc_t>& p) {
  const bool out = p.correction == IsCorrection::Truncate ? lw > p.log_hi
                   : p.correction == IsCorrection::Mask   ? !(lw >= p.log_lo && lw <= p.log_hi)
                                                          : false;
  return out ? acc_t(1) : acc_t(0);
}

// Per-sequence results of the token pass.
template <typename acc_t>
struct TokenSums {
  acc_t* loss;         // sum_t c_tok * p(r)
  acc_t* changed;      // token-level units the IS correction changed
  acc_t* coef;         // sum_t c_tok
  acc_t* ppo_clipped;  // tokens the trust region acted on
  acc_t* rejected;     // tokens a token_k* or batch_m2 rejection criterion removed
  VCPO_INLINE void store(int64_t i, acc_t l, acc_t ch, acc_t co, acc_t cl, acc_t re) const {
    loss[i] = l;
    changed[i] = ch;
    coef[i] = co;
    ppo_clipped[i] = cl;
    rejected[i] = re;
  }
};

// Whether a token_k* criterion rejects the token with log ratio d (a NaN statistic fails).
template <typename acc_t>
VCPO_INLINE bool token_rejected(acc_t d, const LossParams<acc_t>& p) {
  const acc_t k2 = acc_t(0.5) * d * d, k3 = std::expm1(d) - d;
  return (p.reject_k1 && !(d >= p.k1_lo && d <= p.k1_hi)) || (p.reject_k2 && !(k2 <= p.k2_hi)) ||
         (p.reject_k3 && !(k3 <= p.k3_hi)) ||
         (p.reject_m2 && !(static_cast<double>(d) * static_cast<double>(d) < p.m2_threshold));
}

// One sequence. In the forward it accumulates the loss and statistics (WriteGrad = false); in the backward
// it writes grad[t] = grad_scale * c * dp/dr * r (WriteGrad = true). grad_scale is a_i c_i (times the
// upstream gradient in the backward): 0 exactly when the sequence-level coefficient c_i is 0.
template <bool HasOld, bool HasMask, bool TokenLevel, bool WriteGrad, typename lp_t, typename ref_t,
          typename acc_t>
VCPO_INLINE void token_pass_one(const TokenView& v, int64_t i, acc_t adv, acc_t grad_scale,
                                const LossParams<acc_t>& p, const TokenSums<acc_t>& sums, lp_t* grad) {
  using bits_t = bits_type<acc_t>;
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  const bool* mask = v.mask;
  const int64_t begin = v.cu_seqlens[i], end = v.cu_seqlens[i + 1];
  // The ratio's anchor: old_logp; in bypass mode the behaviour policy under PPO's clip, else r = 1.
  const bool mu_anchor = !HasOld && p.rule != TrustRegion::None;
  const bool dual = p.dual_clip && adv < 0;
  const acc_t dual_limit = -adv * p.dual_c;
  acc_t loss = 0, changed = 0, coef_sum = 0, clipped = 0, rejected = 0;
#pragma omp simd reduction(+ : loss, changed, coef_sum, clipped, rejected)
  for (int64_t t = begin; t < end; ++t) {
    const bits_t counted = HasMask ? mask_bits<acc_t>(mask, t) : bits_t(-1);
    const acc_t cur = keep(load<acc_t>(lp, t), counted);
    const acc_t prox = HasOld ? keep(load<acc_t>(old, t), counted) : cur;
    acc_t c = 1;
    if (TokenLevel) {
      const acc_t d = keep(prox - load<acc_t>(mu, t), counted);
      c = is_coef(d, p);
      changed += keep(is_changed(d, p), counted);
      coef_sum += keep(c, counted);
    }
    if (p.token_reject()) {  // after the IS statistics: they are those without rejection
      const bool out = token_rejected(keep(prox - load<acc_t>(mu, t), counted), p);
      rejected += keep(out ? acc_t(1) : acc_t(0), counted);
      c = out ? acc_t(0) : c;
    }
    // A unit the correction removed (c = 0) contributes exactly 0, even where r or the advantage are not
    // finite (e.g. lp_prox = -inf): selected away, never multiplied by 0.
    const bool dropped = c == acc_t(0) || grad_scale == acc_t(0);
    const acc_t anchor = mu_anchor ? keep(load<acc_t>(mu, t), counted) : prox;
    const acc_t r = HasOld || mu_anchor ? exp_fast(dropped ? acc_t(0) : cur - anchor) : acc_t(1);
    const acc_t p1 = -adv * r;
    acc_t val = p1, dval = -adv;  // d p / d r
    bool on_clip = false;
    if (p.clip) {
      const acc_t rc = r < p.ratio_lo ? p.ratio_lo : (r > p.ratio_hi ? p.ratio_hi : r);
      const acc_t p2 = -adv * rc;
      const bool take_unclipped = p1 >= p2;  // ties go to the unclipped branch
      val = take_unclipped ? p1 : p2;
      dval = take_unclipped ? dval : acc_t(0);
      on_clip = !take_unclipped;
      const bool take_dual = dual && !(val <= dual_limit);
      val = take_dual ? dual_limit : val;
      dval = take_dual ? acc_t(0) : dval;
      on_clip = on_clip || take_dual;
    }
    loss += keep(dropped ? acc_t(0) : c * val, counted);
    clipped += keep(on_clip && !dropped ? acc_t(1) : acc_t(0), counted);
    if (WriteGrad) store(grad, t, keep(dropped ? acc_t(0) : grad_scale * c * dval * r, counted));
  }
  if (!WriteGrad) sums.store(i, loss, changed, coef_sum, clipped, rejected);
}

}  // namespace vcpo
