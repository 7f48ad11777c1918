// The fused VCPO policy loss: sequence sums (pass 1), the small per-batch/per-group step (ESS, advantages,
// IS coefficients), the per-token pass for the loss value (pass 2, only when the token terms differ within
// a sequence), and the backward pass that writes d loss / d logp. Contract: docs/contract.md.
// The per-token loops live in sequence_stats.h and token_pass.h; dispatch.h picks their instruction set.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "advantages.h"
#include "common.h"
#include "dispatch.h"
#include "effective_sample_size.h"
#include "second_moment.h"

namespace vcpo {

// Whether r or c vary within a sequence. If not (bypass mode without a trust region, sequence-level weights), every
// counted token of sequence i has loss -c_i A_i and gradient -a_i c_i A_i, and no token pass is needed.
template <typename acc_t>
inline bool needs_token_pass(const TokenView& v, const LossParams<acc_t>& p) {
  return v.old_logp != nullptr || p.level == IsLevel::Token || p.token_reject() || p.rule != TrustRegion::None;
}

// Whether a sequence-level rejection criterion (seq_sum / seq_mean / seq_max) rejects sequence i.
template <typename lp_t, typename ref_t, typename acc_t>
bool sequence_rejected(const TokenView& v, int64_t i, acc_t length, const LossOptions& o) {
  const lp_t* lp = static_cast<const lp_t*>(v.logp);
  const ref_t* mu = static_cast<const ref_t*>(v.behavior_logp);
  const ref_t* old = static_cast<const ref_t*>(v.old_logp);
  acc_t sum[3] = {0, 0, 0}, top[3] = {-kInf<acc_t>, -kInf<acc_t>, -kInf<acc_t>};
  for (int64_t t = v.cu_seqlens[i]; t < v.cu_seqlens[i + 1]; ++t) {
    if (v.mask != nullptr && !v.mask[t]) continue;
    const acc_t d = (old ? load<acc_t>(old, t) : load<acc_t>(lp, t)) - load<acc_t>(mu, t);
    const acc_t k[3] = {d, acc_t(0.5) * d * d, std::expm1(d) - d};
    for (int j = 0; j < 3; ++j) {
      sum[j] += k[j];
      top[j] = max_keep_nan(top[j], k[j]);
    }
  }
  auto fails = [&](Rejection r, int j, acc_t stat) {
    if (!o.rejects(r)) return false;
    return j == 0 ? !(stat >= o.low(r) && stat <= o.high(r)) : !(stat <= o.high(r));
  };
  const Rejection sums[3] = {Rejection::SeqSumK1, Rejection::SeqSumK2, Rejection::SeqSumK3};
  const Rejection means[3] = {Rejection::SeqMeanK1, Rejection::SeqMeanK2, Rejection::SeqMeanK3};
  bool out = fails(Rejection::SeqMaxK2, 1, top[1]) || fails(Rejection::SeqMaxK3, 2, top[2]);
  for (int j = 0; j < 3; ++j) out = out || fails(sums[j], j, sum[j]) || fails(means[j], j, sum[j] / length);
  return out;
}

// Grain for at::parallel_for over sequences: small batches stay on one thread.
inline int64_t sequence_grain(int64_t num_seqs, int64_t num_tokens) {
  constexpr int64_t kTokensPerTask = 32768;
  if (num_tokens <= kTokensPerTask || num_seqs == 0) return num_seqs + 1;
  const int64_t per_seq = num_tokens / num_seqs + 1;
  const int64_t grain = kTokensPerTask / per_seq;
  return grain < 1 ? 1 : grain;
}

struct SequenceInputs {
  const void* rewards;       // acc_t [B] or nullptr when advantages are given
  const void* advantages;    // acc_t [B] or nullptr
  const int64_t* group;      // [B] or nullptr
  int64_t num_groups;
  const void* grad_sq_norm;  // acc_t [B] or nullptr
};

template <typename acc_t>
struct ForwardOutputs {
  acc_t* loss;            // [1]
  acc_t* scalars;         // [kNumScalars]
  acc_t* baseline;        // [num_groups]
  acc_t* advantages;      // [B]
  acc_t* seq_log_weight;  // [B]
  acc_t* grad_scale;      // [B]: d loss / d(token surrogate), a_i c_i
};

// What the phases add up for the loss and its statistics, in double (docs/contract.md, "Statistics").
struct LossTotals {
  double num_tokens = 0, num_seqs = 0, kl_sum = 0, nonfinite = 0;  // over sequences with counted tokens
  double is_changed = 0, is_coef = 0;  // over the units the IS correction acts on: sequences, or tokens
  double loss = 0, ppo_clipped = 0, rejected = 0;
  double opob_max_share = 0;  // over the groups: the largest W_j / sum W of OPOB's weights
};

template <typename acc_t>
LossTotals count_sequences(const acc_t* s, const acc_t* length, const acc_t* kl, int64_t B) {
  LossTotals tot;
  for (int64_t i = 0; i < B; ++i) {
    if (!(length[i] > 0)) continue;
    tot.num_tokens += length[i];
    tot.num_seqs += 1;
    tot.kl_sum += kl[i];
    tot.nonfinite += std::isfinite(static_cast<double>(s[i])) ? 0 : 1;
  }
  return tot;
}

// Truncated log weights min(s, log C), for the ESS and OPOB options that use them.
template <typename acc_t>
std::vector<acc_t> truncated_log_weights(const acc_t* s, int64_t B, const LossParams<acc_t>& p) {
  std::vector<acc_t> out(B);
  for (int64_t i = 0; i < B; ++i) out[i] = min_keep_nan(s[i], p.log_hi);
  return out;
}

// Which sequences a sequence-level rejection criterion removes (none without such a criterion).
template <typename lp_t, typename ref_t, typename acc_t>
std::vector<char> rejected_sequences(const TokenView& v, const acc_t* length, const LossOptions& o, int64_t grain) {
  std::vector<char> out(v.num_seqs, 0);
  if (!o.rejects_sequences()) return out;
  at::parallel_for(0, v.num_seqs, grain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) out[i] = length[i] > 0 && sequence_rejected<lp_t, ref_t, acc_t>(v, i, length[i], o);
  });
  return out;
}

// The weight a_i of sequence i in the loss aggregation.
inline double aggregation_weight(const LossOptions& o, const LossTotals& tot, double length) {
  switch (o.loss_agg) {
    case LossAgg::TokenMean: return 1.0 / tot.num_tokens;
    case LossAgg::SeqMeanTokenMean: return 1.0 / (tot.num_seqs * length);
    case LossAgg::SeqMeanTokenSum: return 1.0 / tot.num_seqs;
    case LossAgg::SeqMeanTokenSumNorm: return 1.0 / (tot.num_seqs * o.norm_length);
  }
  return 0;
}

// grad_scale_i = a_i c_i with the sequence-level IS coefficient c_i; a rejected sequence gets 0 (after the IS
// statistics, which are those without rejection).
template <typename acc_t>
void sequence_weights(const acc_t* s, const acc_t* length, const char* rejected, int64_t B,
                      const LossParams<acc_t>& p, const LossOptions& o, LossTotals& tot, acc_t* grad_scale) {
  for (int64_t i = 0; i < B; ++i) {
    if (!(length[i] > 0)) {
      grad_scale[i] = 0;
      continue;
    }
    const double a = aggregation_weight(o, tot, length[i]);
    acc_t c = 1;
    if (p.level != IsLevel::Token) {
      const acc_t lw = p.level == IsLevel::Geometric ? s[i] / length[i] : s[i];
      c = is_coef(lw, p);
      tot.is_changed += is_changed(lw, p);
      tot.is_coef += c;
    }
    grad_scale[i] = rejected[i] ? acc_t(0) : static_cast<acc_t>(a * c);
    tot.rejected += rejected[i] ? length[i] : 0.0;
  }
}

// Baselines and advantages: given, OPOB (over the log weights the options pick) or a classic estimator.
template <typename acc_t>
void sequence_advantages(const SequenceInputs& seq, const acc_t* s, const acc_t* s_trunc, const acc_t* length,
                         int64_t B, const LossOptions& o, const ForwardOutputs<acc_t>& out, double& max_share) {
  max_share = 0;  // no OPOB weights
  if (o.advantage == Advantage::Given) {
    const acc_t* given = static_cast<const acc_t*>(seq.advantages);
    for (int64_t g = 0; g < seq.num_groups; ++g) out.baseline[g] = 0;
    for (int64_t i = 0; i < B; ++i) out.advantages[i] = length[i] > 0 ? given[i] : acc_t(0);
    return;
  }
  const GroupInputs<acc_t> groups{static_cast<const acc_t*>(seq.rewards), length, seq.group, B, seq.num_groups};
  if (o.advantage != Advantage::Opob) {
    classic_advantages(groups, o.advantage, o.norm_by_std, out.baseline, out.advantages);
    return;
  }
  std::vector<acc_t> log_weight(B);
  for (int64_t i = 0; i < B; ++i) {
    log_weight[i] = o.opob_weight == OpobWeight::Raw         ? s[i]
                    : o.opob_weight == OpobWeight::Truncated ? s_trunc[i]
                                                             : s[i] + s_trunc[i];
  }
  opob_baseline(groups, log_weight.data(), static_cast<const acc_t*>(seq.grad_sq_norm), o.opob_length_norm,
                o.norm_by_std, out.baseline, out.advantages, o.opob_aggregation, o.winsorize_low, o.winsorize_high,
                o.opob_leave_one_out, &max_share);
}

// The loss and the token-level statistics from a pass over the tokens.
template <typename lp_t, typename ref_t, typename acc_t>
void token_terms(const TokenView& v, const acc_t* length, const char* rejected, const LossParams<acc_t>& p,
                 int64_t grain, const ForwardOutputs<acc_t>& out, LossTotals& tot) {
  const int64_t B = v.num_seqs;
  std::vector<acc_t> tl(B), tc(B), tk(B), tp(B), tr(B);
  const TokenSums<acc_t> ts{tl.data(), tc.data(), tk.data(), tp.data(), tr.data()};
  at::parallel_for(0, B, grain, [&](int64_t a, int64_t b) {
    token_pass<false, lp_t, ref_t, acc_t>(v, a, b, out.advantages, out.grad_scale, p, ts, nullptr);
  });
  for (int64_t i = 0; i < B; ++i) {
    if (!(length[i] > 0)) continue;
    if (out.grad_scale[i] != 0) tot.loss += static_cast<double>(out.grad_scale[i]) * tl[i];  // c_i = 0: exactly 0
    tot.ppo_clipped += tp[i];
    tot.rejected += rejected[i] ? 0.0 : static_cast<double>(tr[i]);
    tot.is_changed += tc[i];
    tot.is_coef += tk[i];
  }
}

// The loss when the token terms are constant within each sequence: -sum_i grad_scale_i A_i L_i.
template <typename acc_t>
void constant_token_terms(const acc_t* length, int64_t B, const ForwardOutputs<acc_t>& out, LossTotals& tot) {
  for (int64_t i = 0; i < B; ++i) {
    if (length[i] > 0 && out.grad_scale[i] != 0) {
      tot.loss -= static_cast<double>(out.grad_scale[i]) * out.advantages[i] * length[i];
    }
  }
}

template <typename acc_t>
void write_results(const LossTotals& tot, const EssResult& ess, bool token_level, const ForwardOutputs<acc_t>& out) {
  const double units = token_level ? tot.num_tokens : tot.num_seqs;
  out.loss[0] = static_cast<acc_t>(tot.loss);
  acc_t* sc = out.scalars;
  sc[kEss] = ess.ess;
  sc[kEssRatio] = ess.ess_ratio;
  sc[kLrScale] = ess.lr_scale;
  sc[kIsClipFraction] = units > 0 ? tot.is_changed / units : 0.0;
  sc[kMeanIsCoef] = units > 0 ? tot.is_coef / units : 0.0;
  sc[kKlK3] = tot.num_tokens > 0 ? tot.kl_sum / tot.num_tokens : 0.0;
  sc[kNumTokens] = tot.num_tokens;
  sc[kNumSeqs] = tot.num_seqs;
  sc[kNumNonfinite] = tot.nonfinite;
  sc[kPpoClipFraction] = tot.num_tokens > 0 ? tot.ppo_clipped / tot.num_tokens : 0.0;
  sc[kRejectedFraction] = tot.num_tokens > 0 ? tot.rejected / tot.num_tokens : 0.0;
  sc[kOpobMaxShare] = tot.opob_max_share;
}

// The phases in the order of the CUDA op (ops.cu, policy_loss.cuh): sequence sums, batch step (counts, ESS,
// a_i c_i), advantages, token terms, results.
template <typename lp_t, typename ref_t, typename acc_t>
void policy_loss_forward(const TokenView& v, const SequenceInputs& seq, const LossParams<acc_t>& params,
                         const LossOptions& o, const ForwardOutputs<acc_t>& out) {
  const LossParams<acc_t> p = with_second_moment_threshold<lp_t, ref_t, acc_t>(v, params);
  const int64_t B = v.num_seqs;
  const int64_t grain = sequence_grain(B, v.cu_seqlens[B]);
  std::vector<acc_t> length(B), kl(B);
  const SequenceSums<acc_t> sums{out.seq_log_weight, length.data(), kl.data()};
  at::parallel_for(0, B, grain, [&](int64_t a, int64_t b) { sequence_sums<lp_t, ref_t, acc_t>(v, a, b, sums); });
  const acc_t* s = out.seq_log_weight;

  LossTotals tot = count_sequences(s, length.data(), kl.data(), B);
  const std::vector<acc_t> s_trunc = truncated_log_weights(s, B, p);
  const EssResult ess = effective_sample_size(o.ess_on_corrected ? s_trunc.data() : s, length.data(), B,
                                              o.ess_base_ratio, o.lr_rule);
  const std::vector<char> rejected = rejected_sequences<lp_t, ref_t, acc_t>(v, length.data(), o, grain);
  sequence_weights(s, length.data(), rejected.data(), B, p, o, tot, out.grad_scale);

  sequence_advantages(seq, s, s_trunc.data(), length.data(), B, o, out, tot.opob_max_share);
  if (needs_token_pass(v, p)) {
    token_terms<lp_t, ref_t, acc_t>(v, length.data(), rejected.data(), p, grain, out, tot);
  } else {
    constant_token_terms(length.data(), B, out, tot);
  }
  write_results(tot, ess, p.level == IsLevel::Token, out);
}

// Where no token pass is needed, every counted token of sequence i has the gradient -scale_i A_i (0 where scale_i
// is 0, whatever A_i): the token pass's value with c = r = 1, written without reading the log-probs.
template <typename lp_t, typename acc_t>
void constant_token_grad(const TokenView& v, int64_t first, int64_t last, const acc_t* adv, const acc_t* scale,
                         lp_t* grad) {
  for (int64_t i = first; i < last; ++i) {
    const acc_t g = scale[i] == acc_t(0) ? acc_t(0) : scale[i] * -adv[i];
    for (int64_t t = v.cu_seqlens[i]; t < v.cu_seqlens[i + 1]; ++t) {
      store(grad, t, v.mask == nullptr || v.mask[t] ? g : acc_t(0));
    }
  }
}

// d loss / d logp for every token (zero on tokens that do not count).
template <typename lp_t, typename ref_t, typename acc_t>
void policy_loss_backward(const TokenView& v, acc_t grad_loss, const acc_t* grad_scale, const acc_t* adv,
                          const LossParams<acc_t>& params, lp_t* grad) {
  const LossParams<acc_t> p = with_second_moment_threshold<lp_t, ref_t, acc_t>(v, params);  // as in the forward
  const int64_t B = v.num_seqs;
  const int64_t N = v.cu_seqlens[B];
  std::vector<acc_t> scale(B);
  for (int64_t i = 0; i < B; ++i) scale[i] = grad_loss * grad_scale[i];
  const TokenSums<acc_t> unused{nullptr, nullptr, nullptr, nullptr, nullptr};
  const bool per_token = needs_token_pass(v, p);
  at::parallel_for(0, B, sequence_grain(B, N), [&](int64_t a, int64_t b) {
    if (per_token) {
      token_pass<true, lp_t, ref_t, acc_t>(v, a, b, adv, scale.data(), p, unused, grad);
    } else {
      constant_token_grad<lp_t, acc_t>(v, a, b, adv, scale.data(), grad);
    }
  });
}

}  // namespace vcpo
