// The fused loss: the batch step (ESS, a_i c_i), the token pass (forward partials and backward gradient) and the last
// block that writes the loss and the statistics. Part of the "cuda" backend (ops.cu: the entry points;
// docs/contract.md: the math).
#pragma once

#include "common.cuh"
#include "effective_sample_size.cuh"

namespace vcpo {
namespace {

using Params = LossParams<double>;  // cast to acc_t where read

template <typename acc_t>
__device__ __forceinline__ acc_t is_coef(acc_t lw, const Params& p) {
  if (p.correction == IsCorrection::Truncate) return exp(lw > acc_t(p.log_hi) ? acc_t(p.log_hi) : lw);
  if (p.correction == IsCorrection::Mask) return (lw >= acc_t(p.log_lo) && lw <= acc_t(p.log_hi)) ? acc_t(1) : acc_t(0);
  return acc_t(1);
}

template <typename acc_t>
__device__ __forceinline__ acc_t is_changed(acc_t lw, const Params& p) {
  const bool out = p.correction == IsCorrection::Truncate ? lw > acc_t(p.log_hi)
                   : p.correction == IsCorrection::Mask   ? !(lw >= acc_t(p.log_lo) && lw <= acc_t(p.log_hi))
                                             : false;
  return out ? acc_t(1) : acc_t(0);
}

// work[]: num_tokens, num_seqs, kl sum, non-finite count, ess, ratio, lr, sequence-level changed and coef sums
enum : int { kWTokens = 0, kWSeqs, kWKl, kWNonfinite, kWEss, kWRatio, kWLr, kWChanged, kWCoef, kNumWork };

template <typename acc_t>
__global__ void batch_step_kernel(const acc_t* s, const acc_t* length, const acc_t* kl, int64_t n, Params p,
                                  bool ess_on_corrected, double base, LrRule rule, LossAgg agg, double norm_length,
                                  acc_t* grad_scale, double* work) {
  double tokens = 0, seqs = 0, kl_sum = 0, nonfinite = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!(length[i] > 0)) continue;
    tokens += length[i];
    seqs += 1;
    kl_sum += kl[i];
    nonfinite += finite(s[i]) ? 0.0 : 1.0;
  }
  tokens = block_reduce(tokens);
  seqs = block_reduce(seqs);
  kl_sum = block_reduce(kl_sum);
  nonfinite = block_reduce(nonfinite);
  double ess[3];
  ess_of(s, length, n, ess_on_corrected, p.log_hi, base, rule, ess);
  double changed = 0, coef = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double len = length[i];
    if (!(len > 0)) {
      grad_scale[i] = 0;
      continue;
    }
    const double a = agg == LossAgg::TokenMean           ? 1.0 / tokens
                     : agg == LossAgg::SeqMeanTokenMean ? 1.0 / (seqs * len)
                     : agg == LossAgg::SeqMeanTokenSum  ? 1.0 / seqs
                                                : 1.0 / (seqs * norm_length);
    acc_t c = 1;
    if (p.level != IsLevel::Token) {
      const acc_t lw = p.level == IsLevel::Geometric ? s[i] / static_cast<acc_t>(len) : s[i];
      c = is_coef(lw, p);
      changed += is_changed(lw, p);
      coef += c;
    }
    grad_scale[i] = static_cast<acc_t>(a * c);
  }
  changed = block_reduce(changed);
  coef = block_reduce(coef);
  if (threadIdx.x == 0) {
    const double w[kNumWork] = {tokens, seqs, kl_sum, nonfinite, ess[0], ess[1], ess[2], changed, coef};
    for (int j = 0; j < kNumWork; ++j) work[j] = w[j];
  }
}

// Whether a token criterion rejects a token of log ratio d (a NaN statistic fails); m2: M2PO's threshold of Delta^2.
template <typename acc_t>
__device__ __forceinline__ bool token_rejected(acc_t d, const Params& p, double m2) {
  const acc_t k2 = acc_t(0.5) * d * d, k3 = k3_term(d);
  return (p.reject_k1 && !(d >= acc_t(p.k1_lo) && d <= acc_t(p.k1_hi))) || (p.reject_k2 && !(k2 <= acc_t(p.k2_hi))) ||
         (p.reject_k3 && !(k3 <= acc_t(p.k3_hi))) ||
         (p.reject_m2 && !(static_cast<double>(d) * static_cast<double>(d) < m2));
}

// The chunk's sums of k1, k2, k3 and maxima of k2, k3 over its counted tokens (a NaN wins a maximum: it fails).
template <typename lp_t, typename ref_t, typename acc_t>
__global__ void rejection_partials_kernel(Tokens t, acc_t* sums, acc_t* maxima) {
  const Span sp = chunk_span(t, blockIdx.x);
  if (sp.seq >= t.num_seqs) return;  // uniform over the block
  acc_t k1 = 0, k2 = 0, k3 = 0, top2 = -INFINITY, top3 = -INFINITY;
  visit_tokens<lp_t, ref_t, acc_t>(t, sp.first, sp.last, static_cast<lp_t*>(nullptr),
                                   [&](int64_t, bool counted, acc_t, acc_t mu, acc_t prox) {
    if (counted) {
      const acc_t d = prox - mu, half_square = acc_t(0.5) * d * d, k3_d = k3_term(d);
      k1 += d;
      k2 += half_square;
      k3 += k3_d;
      top2 = half_square > top2 || half_square != half_square ? half_square : top2;
      top3 = k3_d > top3 || k3_d != k3_d ? k3_d : top3;
    }
    return acc_t(0);
  });
  k1 = block_reduce(k1);
  k2 = block_reduce(k2);
  k3 = block_reduce(k3);
  top2 = block_reduce<acc_t, true>(top2);
  top3 = block_reduce<acc_t, true>(top3);
  if (threadIdx.x == 0) {
    sums[blockIdx.x * 3] = k1;
    sums[blockIdx.x * 3 + 1] = k2;
    sums[blockIdx.x * 3 + 2] = k3;
    maxima[blockIdx.x * 2] = top2;
    maxima[blockIdx.x * 2 + 1] = top3;
  }
}

// p, d p / d lp and whether the rule acted, for the rules beyond PPO's clip of a ratio (docs/contract.md, "Trust
// regions"); d = lp - lp_anchor, rho_seq the sequence's ratio of GSPO and GMPO.
template <typename acc_t>
struct Surrogate {
  acc_t val, dlp;
  bool acted;
};

template <typename acc_t>
__device__ __forceinline__ Surrogate<acc_t> rule_terms(acc_t cur, acc_t anchor, acc_t d, acc_t rho_seq, acc_t adv,
                                                        const Params& p) {
  const acc_t eps_lo = acc_t(p.eps_lo), eps_hi = acc_t(p.eps_hi);
  if (p.rule == TrustRegion::Gmpo) {
    const bool inside = adv > 0 ? d <= eps_hi : adv < 0 ? d >= -eps_lo : d == d;  // a NaN d is not inside
    return {-adv * rho_seq, inside ? -adv * rho_seq : acc_t(0), !inside};
  }
  const acc_t rho = exp(d);
  if (p.rule == TrustRegion::Cispo) {
    const acc_t w = rho < acc_t(p.ratio_lo) ? acc_t(p.ratio_lo) : (rho > acc_t(p.ratio_hi) ? acc_t(p.ratio_hi) : rho);
    return {-adv * w * cur, -adv * w, w != rho};
  }
  if (p.rule == TrustRegion::DppoTv) {
    const acc_t moved = exp(cur) - exp(anchor);
    const bool inside = adv > 0 ? moved <= eps_hi : moved >= -eps_lo;
    const acc_t w = !inside ? acc_t(0) : (p.dual_clip && rho > acc_t(p.dual_c) ? acc_t(p.dual_c) : rho);
    return {-adv * w * cur, -adv * w, !inside};
  }
  // Sapo: the gate (4 / tau) sigmoid(tau (rho - 1)); its slope 4 s (1 - s) rho from e = exp(-|x|), 0 where rho
  // overflows (not 0 * inf)
  const acc_t tau = adv > 0 ? acc_t(p.tau_pos) : acc_t(p.tau_neg);
  const acc_t x = tau * (rho - 1);
  const acc_t e = exp(-fabs(x));
  const acc_t sig = x >= 0 ? 1 / (1 + e) : e / (1 + e);
  const acc_t slope = isinf(rho) ? acc_t(0) : 4 * e / ((1 + e) * (1 + e)) * rho;
  return {-adv * 4 / tau * sig, -adv * slope, false};
}

// One chunk of tokens. Forward (WriteGrad false): partial sums of c p (times grad_scale), changed units, c and the
// tokens the trust region acted on. Backward: grad[t] = g grad_scale c (d p / d lp), exactly 0 where the token does
// not count or its unit was removed (c = 0), even where r or A are not finite. SeqPass (GSPO, GMPO): the partial
// sums of the kept tokens' log ratios (GMPO: clipped on the advantage's side) and their count.
// kParts partial sums per chunk: c p (times grad_scale), changed units, c, the tokens acted on, the tokens rejected.
constexpr int kParts = 5;

template <bool WriteGrad, bool SeqPass, typename lp_t, typename ref_t, typename acc_t>
__global__ void token_pass_kernel(Tokens t, Params p, const acc_t* adv_in, const acc_t* grad_scale,
                                  const acc_t* rho_seq, const double* m2, const uint8_t* seq_rejected,
                                  const acc_t* grad_loss, acc_t* partials, lp_t* grad) {
  const Span sp = chunk_span(t, blockIdx.x);
  if (sp.seq >= t.num_seqs) return;
  const acc_t adv = adv_in[sp.seq];
  const double m2_threshold = m2 != nullptr ? *m2 : kInf;
  const bool seq_rej = seq_rejected != nullptr && seq_rejected[sp.seq];  // its tokens are counted there
  const bool token_criteria = p.reject_k1 || p.reject_k2 || p.reject_k3 || p.reject_m2;
  const acc_t gs = grad_scale[sp.seq] * (WriteGrad ? *grad_loss : acc_t(1));
  const acc_t rho = rho_seq != nullptr ? rho_seq[sp.seq] : acc_t(1);
  const bool token_level = p.level == IsLevel::Token, has_old = t.old != nullptr;
  // the ratio's anchor: old_logp; in bypass mode the behaviour policy under a trust region, else r = 1
  const bool mu_anchor = !has_old && p.rule != TrustRegion::None;
  const bool linear_in_lp = p.rule == TrustRegion::Cispo || p.rule == TrustRegion::DppoTv;
  const bool ppo_form = p.rule == TrustRegion::None || p.rule == TrustRegion::Ppo || p.rule == TrustRegion::Gspo;
  acc_t loss = 0, changed = 0, coef_sum = 0, clipped = 0, rejected = 0, kept = 0;
  visit_tokens<lp_t, ref_t, acc_t>(t, sp.first, sp.last, WriteGrad ? grad : nullptr,
                                   [&](int64_t, bool counted, acc_t cur, acc_t mu, acc_t prox) {
    if (!counted) return acc_t(0);
    acc_t c = 1;
    if (token_level) {
      const acc_t d = prox - mu;
      c = is_coef(d, p);
      changed += is_changed(d, p);
      coef_sum += c;
    }
    if (token_criteria) {  // after the IS statistics: they are those without rejection
      const bool out = token_rejected(prox - mu, p, m2_threshold);
      rejected += out && !seq_rej ? acc_t(1) : acc_t(0);
      c = out ? acc_t(0) : c;
    }
    // a token outside the sampling support (lp = -inf) adds nothing to a rule linear in lp
    const bool dropped = c == acc_t(0) || gs == acc_t(0) || (linear_in_lp && cur == -INFINITY);
    const acc_t anchor = mu_anchor ? mu : prox;
    acc_t d = dropped ? acc_t(0) : cur - anchor;
    if (SeqPass) {
      if (p.rule == TrustRegion::Gmpo) {  // not min / max (fmin, fmax): a NaN must stay NaN
        d = adv > 0 && d > acc_t(p.eps_hi) ? acc_t(p.eps_hi) : adv < 0 && d < -acc_t(p.eps_lo) ? -acc_t(p.eps_lo) : d;
      }
      loss += dropped ? acc_t(0) : d;
      kept += dropped ? acc_t(0) : acc_t(1);
      return acc_t(0);
    }
    Surrogate<acc_t> sur;
    if (ppo_form) {
      const acc_t r = p.rule == TrustRegion::Gspo ? rho : has_old || mu_anchor ? exp(d) : acc_t(1);
      const acc_t p1 = -adv * r;
      acc_t val = p1, dval = -adv;
      bool on_clip = false;
      if (p.clip) {
        const acc_t rc = r < acc_t(p.ratio_lo) ? acc_t(p.ratio_lo) : (r > acc_t(p.ratio_hi) ? acc_t(p.ratio_hi) : r);
        const acc_t p2 = -adv * rc;
        const bool take_unclipped = p1 >= p2;  // ties go to the unclipped branch
        val = take_unclipped ? p1 : p2;
        dval = take_unclipped ? dval : acc_t(0);
        on_clip = !take_unclipped;
        const acc_t limit = -adv * acc_t(p.dual_c);
        const bool take_dual = p.dual_clip && adv < 0 && !(val <= limit);
        val = take_dual ? limit : val;
        dval = take_dual ? acc_t(0) : dval;
        on_clip = on_clip || take_dual;
      }
      sur = {val, dval * r, on_clip};
    } else {
      sur = rule_terms(cur, anchor, d, rho, adv, p);
    }
    if (dropped) return acc_t(0);
    clipped += sur.acted ? acc_t(1) : acc_t(0);
    loss += c * sur.val;
    return gs * c * sur.dlp;
  });
  if (WriteGrad) return;
  loss = block_reduce(loss);
  if (SeqPass) {
    kept = block_reduce(kept);
    if (threadIdx.x == 0) {
      partials[blockIdx.x * 2] = loss;
      partials[blockIdx.x * 2 + 1] = kept;
    }
    return;
  }
  changed = block_reduce(changed);
  coef_sum = block_reduce(coef_sum);
  clipped = block_reduce(clipped);
  rejected = block_reduce(rejected);
  if (threadIdx.x == 0) {
    acc_t* out = partials + blockIdx.x * kParts;
    out[0] = gs != acc_t(0) ? gs * loss : acc_t(0);
    out[1] = changed;
    out[2] = coef_sum;
    out[3] = clipped;
    out[4] = rejected;
  }
}

// The loss and the statistics (docs/contract.md, "Statistics"): from the chunk partials, or, when the token
// terms are constant within each sequence, from -sum_i grad_scale_i A_i L_i.
template <typename acc_t>
__global__ void finish_kernel(const acc_t* partials, int64_t num_parts, const double* work, const acc_t* grad_scale,
                              const acc_t* adv, const acc_t* length, const double* share, const uint8_t* seq_rejected,
                              int64_t n, bool token_pass, bool token_level, acc_t* loss_out, acc_t* scalars) {
  double loss = 0, changed = 0, coef = 0, clipped = 0, rejected = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) rejected += seq_rejected[i] ? double(length[i]) : 0.0;
  if (token_pass) {
    for (int64_t j = threadIdx.x; j < num_parts; j += blockDim.x) {
      loss += partials[j * kParts];
      changed += partials[j * kParts + 1];
      coef += partials[j * kParts + 2];
      clipped += partials[j * kParts + 3];
      rejected += partials[j * kParts + 4];
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (length[i] > 0 && grad_scale[i] != acc_t(0)) loss -= static_cast<double>(grad_scale[i]) * adv[i] * length[i];
    }
  }
  loss = block_reduce(loss);
  changed = block_reduce(changed);
  coef = block_reduce(coef);
  clipped = block_reduce(clipped);
  rejected = block_reduce(rejected);
  if (threadIdx.x != 0) return;
  const double tokens = work[kWTokens], seqs = work[kWSeqs];
  const double units = token_level ? tokens : seqs;
  const double unit_changed = token_level ? changed : work[kWChanged];
  const double unit_coef = token_level ? coef : work[kWCoef];
  *loss_out = static_cast<acc_t>(loss);
  scalars[kEss] = static_cast<acc_t>(work[kWEss]);
  scalars[kEssRatio] = static_cast<acc_t>(work[kWRatio]);
  scalars[kLrScale] = static_cast<acc_t>(work[kWLr]);
  scalars[kIsClipFraction] = static_cast<acc_t>(units > 0 ? unit_changed / units : 0.0);
  scalars[kMeanIsCoef] = static_cast<acc_t>(units > 0 ? unit_coef / units : 0.0);
  scalars[kKlK3] = static_cast<acc_t>(tokens > 0 ? work[kWKl] / tokens : 0.0);
  scalars[kNumTokens] = static_cast<acc_t>(tokens);
  scalars[kNumSeqs] = static_cast<acc_t>(seqs);
  scalars[kNumNonfinite] = static_cast<acc_t>(work[kWNonfinite]);
  scalars[kPpoClipFraction] = static_cast<acc_t>(tokens > 0 ? clipped / tokens : 0.0);
  scalars[kRejectedFraction] = static_cast<acc_t>(tokens > 0 ? rejected / tokens : 0.0);
  scalars[kOpobMaxShare] = static_cast<acc_t>(*share);
}

}  // namespace
}  // namespace vcpo
