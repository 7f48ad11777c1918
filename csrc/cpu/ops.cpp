// CPU implementations of the vcpo:: ops (schemas in csrc/registration.cpp). Python validates the arguments
// and raises ValueError; the checks here keep memory access safe whatever the caller passes (validate=False,
// or the ops called directly): O(B) reads of CPU tensors, no device sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "entry_points.h"
#include "policy_loss.h"

namespace vcpo {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

const at::Device kCpu(at::kCPU);  // where every tensor of a call to these kernels must be

// Group indices in range: a read of CPU memory (the CUDA kernels clip indices instead, without a host sync).
void check_groups(const OptTensor& group_index, int64_t num_groups) {
  if (!group_index) return;
  const int64_t* g = group_index->data_ptr<int64_t>();
  for (int64_t i = 0; i < group_index->numel(); ++i) {
    TORCH_CHECK(g[i] >= 0 && g[i] < num_groups, "vcpo: group_index must lie in [0, num_groups)");
  }
}

TokenView token_view(const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp,
                     const OptTensor& mask, const Tensor& cu_seqlens) {
  check_token_inputs(logp, behavior_logp, old_logp, mask, cu_seqlens, kCpu);
  const int64_t n = logp.numel();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t b = cu_seqlens.numel() - 1;
  TORCH_CHECK(cu[0] == 0 && cu[b] == n, "vcpo: cu_seqlens must start at 0 and end at ", n);
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(cu[i] <= cu[i + 1], "vcpo: cu_seqlens must be non-decreasing");
  return TokenView{logp.data_ptr(), behavior_logp.data_ptr(), old_logp ? old_logp->data_ptr() : nullptr,
                   mask ? mask->data_ptr<bool>() : nullptr, cu, b};
}

template <typename acc_t>
const acc_t* opt_ptr(const OptTensor& t) {
  return t ? t->data_ptr<acc_t>() : nullptr;
}

std::tuple<Tensor, Tensor, Tensor> sequence_stats_cpu(const Tensor& logp, const Tensor& behavior_logp,
                                                      const OptTensor& old_logp, const OptTensor& mask,
                                                      const Tensor& cu_seqlens) {
  const TokenView v = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens);
  const auto opts = logp.options().dtype(acc_dtype(logp.scalar_type()));
  Tensor s = at::empty({v.num_seqs}, opts), len = at::empty({v.num_seqs}, opts), kl = at::empty({v.num_seqs}, opts);
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    const SequenceSums<acc_t> out{s.data_ptr<acc_t>(), len.data_ptr<acc_t>(), kl.data_ptr<acc_t>()};
    at::parallel_for(0, v.num_seqs, sequence_grain(v.num_seqs, logp.numel()),
                     [&](int64_t a, int64_t b) { sequence_sums<lp_t, ref_t, acc_t>(v, a, b, out); });
  });
  return {s, len, kl};
}

std::tuple<Tensor, Tensor, Tensor> effective_sample_size_cpu(const Tensor& log_weight, const OptTensor& seq_length,
                                                             double ess_base_ratio, int64_t lr_rule) {
  check_log_weight(log_weight, seq_length, kCpu);
  const int64_t b = log_weight.numel();
  Tensor ess = at::empty({}, log_weight.options()), ratio = at::empty({}, log_weight.options()),
         lr = at::empty({}, log_weight.options());
  AT_DISPATCH_FLOATING_TYPES(log_weight.scalar_type(), "vcpo_ess", [&] {
    const EssResult r = effective_sample_size<scalar_t>(log_weight.data_ptr<scalar_t>(),
                                                        opt_ptr<scalar_t>(seq_length), b, ess_base_ratio,
                                                        static_cast<LrRule>(lr_rule));
    ess.fill_(r.ess);
    ratio.fill_(r.ess_ratio);
    lr.fill_(r.lr_scale);
  });
  return {ess, ratio, lr};
}

std::tuple<Tensor, Tensor> opob_baseline_cpu(const Tensor& rewards, const Tensor& log_weight,
                                             const OptTensor& grad_sq_norm, const OptTensor& group_index,
                                             const OptTensor& seq_length, int64_t num_groups, bool length_norm,
                                             bool norm_by_std) {
  check_baseline_inputs(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, kCpu);
  check_groups(group_index, num_groups);
  const int64_t b = log_weight.numel();
  const auto dtype = log_weight.scalar_type();
  Tensor length = seq_length ? *seq_length : at::ones({b}, log_weight.options());
  Tensor baseline = at::empty({num_groups}, log_weight.options()), adv = at::empty({b}, log_weight.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_opob", [&] {
    const GroupInputs<scalar_t> in{rewards.data_ptr<scalar_t>(), length.data_ptr<scalar_t>(),
                                   opt_ptr<int64_t>(group_index), b, num_groups};
    opob_baseline(in, log_weight.data_ptr<scalar_t>(), opt_ptr<scalar_t>(grad_sq_norm), length_norm, norm_by_std,
                  baseline.data_ptr<scalar_t>(), adv.data_ptr<scalar_t>());
  });
  return {baseline, adv};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> policy_loss_cpu(
    const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp, const OptTensor& mask,
    const Tensor& cu_seqlens, const OptTensor& rewards, const OptTensor& advantages, const OptTensor& group_index,
    int64_t num_groups, const OptTensor& grad_sq_norm, c10::IntArrayRef codes, c10::ArrayRef<double> values) {
  const TokenView v = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens);
  const int64_t b = v.num_seqs;
  const auto acc = acc_dtype(logp.scalar_type());
  check_sequence_inputs(rewards, advantages, grad_sq_norm, group_index, num_groups, b, acc, kCpu);
  check_groups(group_index, num_groups);
  const auto opts = logp.options().dtype(acc);
  Tensor loss = at::empty({}, opts), scalars = at::empty({kNumScalars}, opts), baseline = at::empty({num_groups}, opts),
         adv = at::empty({b}, opts), seq_log_weight = at::empty({b}, opts), grad_scale = at::empty({b}, opts);
  const LossOptions o = unpack_loss_options(codes, values, advantages.has_value());
  const SequenceInputs seq{rewards ? rewards->data_ptr() : nullptr, advantages ? advantages->data_ptr() : nullptr,
                           opt_ptr<int64_t>(group_index), num_groups,
                           grad_sq_norm ? grad_sq_norm->data_ptr() : nullptr};
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    const auto p = loss_params<acc_t>(o);
    const ForwardOutputs<acc_t> out{loss.data_ptr<acc_t>(),     scalars.data_ptr<acc_t>(),
                                    baseline.data_ptr<acc_t>(), adv.data_ptr<acc_t>(),
                                    seq_log_weight.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>()};
    policy_loss_forward<lp_t, ref_t, acc_t>(v, seq, p, o, out);
  });
  return {loss, scalars, baseline, adv, seq_log_weight, grad_scale};
}

Tensor policy_loss_backward_cpu(const Tensor& grad_loss, const Tensor& logp, const Tensor& behavior_logp,
                                const OptTensor& old_logp, const OptTensor& mask, const Tensor& cu_seqlens,
                                const Tensor& grad_scale, const Tensor& advantages, c10::IntArrayRef codes,
                                c10::ArrayRef<double> values) {
  const TokenView v = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens);
  const auto acc = acc_dtype(logp.scalar_type());
  check_backward_inputs(grad_loss, grad_scale, advantages, v.num_seqs, acc, kCpu);
  const double g = grad_loss.item<double>();  // a CPU tensor: no device sync
  Tensor grad = at::empty_like(logp);
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    const auto p = loss_params<acc_t>(unpack_loss_options(codes, values, true));
    policy_loss_backward<lp_t, ref_t, acc_t>(v, static_cast<acc_t>(g), grad_scale.data_ptr<acc_t>(),
                                             advantages.data_ptr<acc_t>(), p, grad.data_ptr<lp_t>());
  });
  return grad;
}

template <typename acc_t>
LogitRows<acc_t> logit_rows(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                            const std::optional<double>& softcap) {
  const double cap = logit_softcap(softcap);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int64_t* y = targets.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(y[t] == ignore_index || (y[t] >= 0 && y[t] < vocab), "vcpo: targets must lie in [0, V) or be ",
                "ignore_index");
  }
  return LogitRows<acc_t>{logits.data_ptr<acc_t>(), n, vocab, y, ignore_index, static_cast<acc_t>(cap)};
}

// Rows per task: a row is V elements, so a few rows already amortise a task.
constexpr int64_t kRowsPerTask = 4;

std::tuple<Tensor, Tensor, Tensor, Tensor> logit_rows_forward_cpu(const Tensor& logits, const Tensor& targets,
                                                                  int64_t ignore_index,
                                                                  const std::optional<double>& softcap) {
  check_logits(logits, targets, kCpu);
  const int64_t n = logits.size(0);
  const auto opts = logits.options();
  Tensor lse = at::empty({n}, opts), logp = at::empty({n}, opts), entropy = at::empty({n}, opts),
         sum_p2 = at::empty({n}, opts);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vcpo_logit_rows_forward", [&] {
    const auto rows = logit_rows<scalar_t>(logits, targets, ignore_index, softcap);
    const RowStats<scalar_t> out{lse.data_ptr<scalar_t>(), logp.data_ptr<scalar_t>(), entropy.data_ptr<scalar_t>(),
                                 sum_p2.data_ptr<scalar_t>()};
    at::parallel_for(0, n, kRowsPerTask, [&](int64_t a, int64_t b) { logit_rows_forward(rows, a, b, out); });
  });
  return {lse, logp, entropy, sum_p2};
}

void logit_rows_backward_cpu(const Tensor& logits, const Tensor& lse, const Tensor& targets, int64_t ignore_index,
                             const OptTensor& g_logp, const OptTensor& g_entropy, const OptTensor& g_sum_p2,
                             const OptTensor& entropy, const OptTensor& sum_p2, double scale,
                             const std::optional<double>& softcap) {
  check_logit_rows_backward(logits, lse, targets, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, kCpu);
  const int64_t n = logits.size(0);
  const auto dtype = logits.scalar_type();
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_logit_rows_backward", [&] {
    const auto rows = logit_rows<scalar_t>(logits, targets, ignore_index, softcap);
    const RowGrads<scalar_t> g{lse.data_ptr<scalar_t>(),     opt_ptr<scalar_t>(g_logp),  opt_ptr<scalar_t>(g_entropy),
                               opt_ptr<scalar_t>(g_sum_p2), opt_ptr<scalar_t>(entropy), opt_ptr<scalar_t>(sum_p2),
                               static_cast<scalar_t>(scale)};
    at::parallel_for(0, n, kRowsPerTask, [&](int64_t a, int64_t b) { logit_rows_backward(rows, a, b, g); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(vcpo, CPU, m) {
  m.impl("sequence_stats", &sequence_stats_cpu);
  m.impl("effective_sample_size", &effective_sample_size_cpu);
  m.impl("opob_baseline", &opob_baseline_cpu);
  m.impl("policy_loss", &policy_loss_cpu);
  m.impl("policy_loss_backward", &policy_loss_backward_cpu);
  m.impl("logit_rows_forward", &logit_rows_forward_cpu);
  m.impl("logit_rows_backward", &logit_rows_backward_cpu);
}

}  // namespace vcpo
