// The per-token pass of the fused loss for the trust regions beyond PPO (GSPO, GMPO, CISPO, DPPO's binary TV
// mask, SAPO): the loss terms of one sequence in the forward, d loss / d lp in the backward. Contract:
// docs/contract.md, "Trust regions". The sequence-ratio rules take a first pass for the sequence's mean log
// ratio over its kept tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "token_pass.h"

namespace vcpo {

// A token's IS coefficient (after rejection) and the statistics the correction adds for it.
template <typename acc_t>
struct TokenCoef {
  acc_t c, changed, coef;
  bool rejected;
};

template <bool TokenLevel, typename acc_t>
inline TokenCoef<acc_t> token_coef(acc_t delta, const LossParams<acc_t>& p) {
  TokenCoef<acc_t> out{acc_t(1), acc_t(0), acc_t(0), false};
  if (TokenLevel) {
    out.c = is_coef(delta, p);
    out.changed = is_changed(delta, p);
    out.coef = out.c;
  }
  if (p.token_reject() && token_rejected(delta, p)) {
    out.rejected = true;
    out.c = 0;
  }
  return out;
}

// The surrogate's value, its derivative d p / d lp and whether the rule acted, for one kept token.
template <typename acc_t>
struct TokenSurrogate {
  acc_t val, dval;
  bool acted;
};

// PPO's clip (and dual clip) of the ratio rho, whose derivative w.r.t. lp is drho.
template <typename acc_t>
inline TokenSurrogate<acc_t> clipped_ratio(acc_t rho, acc_t drho, acc_t adv, const LossParams<acc_t>& p) {
  const acc_t p1 = -adv * rho;
  const acc_t rc = rho < p.ratio_lo ? p.ratio_lo : (rho > p.ratio_hi ? p.ratio_hi : rho);
  const acc_t p2 = -adv * rc;
  TokenSurrogate<acc_t> out{p1, -adv * drho, false};
  if (!(p1 >= p2)) out = {p2, acc_t(0), true};  // ties go to the unclipped branch
  const acc_t limit = -adv * p.dual_c;
  if (p.dual_clip && adv < 0 && !(out.val <= limit)) out = {limit, acc_t(0), true};
  return out;
}

template <typename acc_t>
inline TokenSurrogate<acc_t> rule_surrogate(acc_t cur, acc_t anchor, acc_t seq_ratio, acc_t adv,
                                            const LossParams<acc_t>& p) {
  const acc_t delta = cur - anchor;
  switch (p.rule) {
    case TrustRegion::Gspo:  // the token form: the sequence's ratio, d rho / d lp = rho
      return clipped_ratio(seq_ratio, seq_ratio, adv, p);
    case TrustRegion::Gmpo: {
      const bool inside = adv > 0 ? delta <= p.eps_hi : adv < 0 ? delta >= -p.eps_lo : delta == delta;  // NaN: not
      return {-adv * seq_ratio, inside ? -adv * seq_ratio : acc_t(0), !inside};
    }
    case TrustRegion::Cispo: {
      const acc_t rho = std::exp(delta);
      const acc_t w = rho < p.ratio_lo ? p.ratio_lo : (rho > p.ratio_hi ? p.ratio_hi : rho);
      return {-adv * w * cur, -adv * w, w != rho};
    }
    case TrustRegion::DppoTv: {
      const acc_t moved = std::exp(cur) - std::exp(anchor);
      const bool inside = adv > 0 ? moved <= p.eps_hi : moved >= -p.eps_lo;
      const acc_t rho = std::exp(delta);
      const acc_t w = !inside ? acc_t(0) : (p.dual_clip && rho > p.dual_c ? p.dual_c : rho);
      return {-adv * w * cur, -adv * w, !inside};
    }
    default: {  // Sapo: the gate (4 / tau) sigmoid(tau (rho - 1)); its slope 4 s (1 - s) rho, formed from
                // e = exp(-|x|) so that it stays 0 (not 0 * inf) where rho overflows
      const acc_t tau = adv > 0 ? p.tau_pos : p.tau_neg;
      const acc_t rho = std::exp(delta);
      const acc_t x = tau * (rho - 1);
      const acc_t e = std::exp(-std::fabs(x));
      const acc_t sig = x >= 0 ? 1 / (1 + e) : e / (1 + e);
      const acc_t slope = std::isinf(rho) ? acc_t(0) : 4 * e / ((1 + e) * (1 + e)) * rho;
      return {-adv * 4 / tau * sig, -adv * slope, false};
    }
  }
}

// One sequence under a rule beyond PPO (see token_pass_one for the arguments and the statistics).
template <bool HasOld, bool HasMask, bool TokenLevel, bool WriteGrad, typename lp_t, typename ref_t, typename acc_t>
void trust_region_pass_one(const TokenView& v, int64_t i, acc_t adv, acc_t grad_scale, const LossParams<acc_t>& p,
                           const TokenSums<acc_t>& sums, lp_t* grad) {
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  const int64_t begin = v.cu_seqlens[i], end = v.cu_seqlens[i + 1];
  const bool linear_in_lp = p.rule == TrustRegion::Cispo || p.rule == TrustRegion::DppoTv;
  auto counted = [&](int64_t t) { return !HasMask || v.mask[t]; };
  auto prox_at = [&](int64_t t) { return HasOld ? load<acc_t>(old, t) : load<acc_t>(lp, t); };
  auto anchor_at = [&](int64_t t) { return HasOld ? load<acc_t>(old, t) : load<acc_t>(mu, t); };
  // A token contributes when it counts, its coefficient is not 0 and, under a rule linear in lp, lp > -inf.
  auto kept = [&](int64_t t, acc_t c) {
    return grad_scale != acc_t(0) && c != acc_t(0) && !(linear_in_lp && load<acc_t>(lp, t) == -kInf<acc_t>);
  };
  acc_t seq_ratio = 0;
  if (p.rule == TrustRegion::Gspo || p.rule == TrustRegion::Gmpo) {
    acc_t total = 0, count = 0;
    for (int64_t t = begin; t < end; ++t) {
      if (!counted(t)) continue;
      const acc_t c = token_coef<TokenLevel>(prox_at(t) - load<acc_t>(mu, t), p).c;
      if (!kept(t, c)) continue;
      acc_t d = load<acc_t>(lp, t) - anchor_at(t);
      if (p.rule == TrustRegion::Gmpo) d = adv > 0 ? std::min(d, p.eps_hi) : adv < 0 ? std::max(d, -p.eps_lo) : d;
      total += d;
      count += 1;
    }
    seq_ratio = std::exp(total / (count > 0 ? count : acc_t(1)));
  }
  acc_t loss = 0, changed = 0, coef_sum = 0, acted = 0, rejected = 0;
  for (int64_t t = begin; t < end; ++t) {
    if (!counted(t)) {
      if (WriteGrad) store(grad, t, acc_t(0));
      continue;
    }
    const TokenCoef<acc_t> tc = token_coef<TokenLevel>(prox_at(t) - load<acc_t>(mu, t), p);
    changed += tc.changed;
    coef_sum += tc.coef;
    rejected += tc.rejected ? acc_t(1) : acc_t(0);
    if (!kept(t, tc.c)) {
      if (WriteGrad) store(grad, t, acc_t(0));
      continue;
    }
    const TokenSurrogate<acc_t> s = rule_surrogate(load<acc_t>(lp, t), anchor_at(t), seq_ratio, adv, p);
    loss += tc.c * s.val;
    acted += s.acted ? acc_t(1) : acc_t(0);
    if (WriteGrad) store(grad, t, grad_scale * tc.c * s.dval);
  }
  if (!WriteGrad) sums.store(i, loss, changed, coef_sum, acted, rejected);
}

}  // namespace vcpo
