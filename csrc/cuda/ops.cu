// CUDA implementations of the vcpo:: ops (schemas in csrc/registration.cpp; math in docs/contract.md): the entry
// points here, the kernels one op per header beside this file (one translation unit: one nvcc run). The
// same pipeline as the Triton backend (vcpo_kernels/triton/): per-chunk partial sums of the tokens (read with
// 16-byte vector loads where aligned) combined per sequence in chunk order, one block for the batch step
// (ESS, a_i c_i), one block per group (baselines), one block per chunk for the token pass; fp64 for the
// per-batch and per-group sums. No float atomics (every result is deterministic) and no host sync: every
// count stays on the device.
// Python validates the arguments; the checks here are those of shapes, dtypes and devices, and every index
// read from a tensor is clipped so that unvalidated input cannot read or write out of bounds.
#include <torch/library.h>

#include "advantages.cuh"
#include "effective_sample_size.cuh"
#include "logit_rows.cuh"
#include "policy_loss.cuh"
#include "sequence_stats.cuh"

namespace vcpo {
namespace {

// The device every tensor of the call must share: that of the op's first tensor, which must be a CUDA tensor.
at::Device cuda_device_of(const Tensor& anchor, const char* name) {
  TORCH_CHECK(anchor.is_cuda(), "vcpo: ", name, " is on ", anchor.device(),
              " but the op runs on CUDA: every input must be on one CUDA device");
  return anchor.device();
}

Tokens token_view(const Tensor& logp, const Tensor& behavior, const OptTensor& old, const OptTensor& mask,
                  const Tensor& cu, const Tensor& chunk_end) {
  check_token_inputs(logp, behavior, old, mask, cu, cuda_device_of(logp, "logp"));
  // Vector loads need each array to start on a multiple of its pack: 16 bytes of logp, as many tokens of the others.
  const int64_t vec = 16 / logp.element_size();
  auto on = [](const Tensor& x, int64_t bytes) { return reinterpret_cast<uintptr_t>(x.data_ptr()) % bytes == 0; };
  const bool aligned = on(logp, 16) && on(behavior, vec * behavior.element_size()) &&
                       (!old || on(*old, vec * old->element_size())) && (!mask || on(*mask, vec));
  return Tokens{logp.data_ptr(), behavior.data_ptr(), old ? old->data_ptr() : nullptr,
                mask ? mask->data_ptr<bool>() : nullptr, cu.data_ptr<int64_t>(), chunk_end.data_ptr<int64_t>(),
                cu.numel() - 1, logp.numel(), aligned};
}

int64_t blocks_for(int64_t n) { return (n + kThreads - 1) / kThreads; }

// [3, B] (s, L, k3) and the chunk plan.
template <typename lp_t, typename ref_t>
Tensor sequence_sums(const Tokens& t, int64_t grid, const at::TensorOptions& opts) {
  using acc_t = acc_type<lp_t>;
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor partials = at::zeros({std::max<int64_t>(grid, 1), 3}, opts);
  if (grid > 0 && t.num_seqs > 0) {
    sequence_partials_kernel<lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(t, partials.data_ptr<acc_t>());
  }
  Tensor out = at::empty({3, t.num_seqs}, opts);
  if (t.num_seqs > 0) {
    combine_kernel<acc_t><<<blocks_for(t.num_seqs), kThreads, 0, stream>>>(
        partials.data_ptr<acc_t>(), t.chunk_end, t.num_seqs, partials.size(0), 3, out.data_ptr<acc_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// GSPO's and GMPO's ratio of each sequence [B], exp of the mean log ratio over its kept tokens (GMPO: each clipped on
// the advantage's side); undefined for the other rules.
template <typename lp_t, typename ref_t>
Tensor sequence_ratios(const Tokens& t, int64_t grid, const Params& p, const Tensor& adv, const Tensor& grad_scale,
                       const Tensor& m2, const at::TensorOptions& opts) {
  using acc_t = acc_type<lp_t>;
  if (p.rule != TrustRegion::Gspo && p.rule != TrustRegion::Gmpo) return Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor partials = at::zeros({std::max<int64_t>(grid, 1), 2}, opts);
  if (grid > 0 && t.num_seqs > 0) {
    token_pass_kernel<false, true, lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(
        t, p, adv.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>(), nullptr, m2.data_ptr<double>(), nullptr, nullptr,
        partials.data_ptr<acc_t>(), nullptr);
  }
  Tensor sums = at::zeros({2, t.num_seqs}, opts);
  if (t.num_seqs > 0) {
    combine_kernel<acc_t><<<blocks_for(t.num_seqs), kThreads, 0, stream>>>(
        partials.data_ptr<acc_t>(), t.chunk_end, t.num_seqs, partials.size(0), 2, sums.data_ptr<acc_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return at::exp(sums[0] / sums[1].clamp_min(1)).contiguous();
}

// [B] uint8: the sequences a sequence criterion (seq_sum, seq_mean, seq_max) rejects, from per-chunk sums and maxima of
// k1, k2, k3 combined per sequence; all 0 without one (docs/contract.md, "Rejection").
template <typename lp_t, typename ref_t>
Tensor sequence_rejection(const Tokens& t, int64_t grid, const LossOptions& o, const Tensor& length,
                          const at::TensorOptions& opts) {
  using acc_t = acc_type<lp_t>;
  const int64_t b = t.num_seqs;
  Tensor rejected = at::zeros({b}, opts.dtype(at::kBool));
  if (!o.rejects_sequences() || b == 0) return rejected.to(at::kByte);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t parts = std::max<int64_t>(grid, 1);
  Tensor sums = at::zeros({parts, 3}, opts), maxima = at::full({parts, 2}, -INFINITY, opts);
  if (grid > 0) {
    rejection_partials_kernel<lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(t, sums.data_ptr<acc_t>(),
                                                                                 maxima.data_ptr<acc_t>());
  }
  Tensor seq_sums = at::empty({3, b}, opts), seq_max = at::empty({2, b}, opts);
  combine_kernel<acc_t><<<blocks_for(b), kThreads, 0, stream>>>(sums.data_ptr<acc_t>(), t.chunk_end, b, parts, 3,
                                                                seq_sums.data_ptr<acc_t>());
  combine_kernel<acc_t, true><<<blocks_for(b), kThreads, 0, stream>>>(maxima.data_ptr<acc_t>(), t.chunk_end, b, parts,
                                                                      2, seq_max.data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Rejection sum_of[3] = {Rejection::SeqSumK1, Rejection::SeqSumK2, Rejection::SeqSumK3};
  const Rejection mean_of[3] = {Rejection::SeqMeanK1, Rejection::SeqMeanK2, Rejection::SeqMeanK3};
  auto fails = [&](Rejection r, int kind, const Tensor& stat) {  // kind 0: k1 (both bounds); a NaN fails
    const Tensor keep = kind == 0 ? (stat >= o.low(r)) & (stat <= o.high(r)) : stat <= o.high(r);
    return rejected.logical_or_(~keep);
  };
  for (int j = 0; j < 3; ++j) {
    if (o.rejects(sum_of[j])) fails(sum_of[j], j, seq_sums[j]);
    if (o.rejects(mean_of[j])) fails(mean_of[j], j, seq_sums[j] / length.clamp_min(1));
  }
  if (o.rejects(Rejection::SeqMaxK2)) fails(Rejection::SeqMaxK2, 1, seq_max[0]);
  if (o.rejects(Rejection::SeqMaxK3)) fails(Rejection::SeqMaxK3, 2, seq_max[1]);
  return rejected.logical_and_(length > 0).to(at::kByte).contiguous();
}

// [1] float64: M2PO's threshold (rejection batch_m2; docs/contract.md, "Rejection"): with v_1 >= ... >= v_n the counted
// tokens' Delta^2 (Delta in the accumulation dtype, squared in float64, as the token pass; NaN left out), v_k for the
// smallest k whose rest has a mean <= the bound (an empty rest: 0; +inf for k = 0). A device sort: no host sync.
// The caller's threshold (a DP group's, o.m2_threshold) as it is.
Tensor second_moment_threshold(const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp,
                               const OptTensor& mask, const LossOptions& o, at::ScalarType acc) {
  const auto doubles = logp.options().dtype(at::kDouble);
  if (!o.rejects(Rejection::BatchM2)) return at::full({1}, INFINITY, doubles);
  if (o.m2_threshold) return at::full({1}, *o.m2_threshold, doubles);
  const Tensor prox = old_logp ? *old_logp : logp.detach();
  const Tensor d = (prox.to(acc) - behavior_logp.to(acc)).to(at::kDouble).flatten();
  const Tensor counted = mask ? mask->flatten() : at::ones_like(d, d.options().dtype(at::kBool));
  const Tensor square = d * d;
  const Tensor values = at::where(counted & ~at::isnan(square), square, at::full({}, -INFINITY, doubles));
  const Tensor v = std::get<0>(at::sort(values, 0, /*descending=*/true));
  const int64_t size = v.numel();
  const Tensor n = (v > -INFINITY).sum();
  const Tensor index = at::arange(size, doubles.dtype(at::kLong));
  const Tensor inside = index < n;
  const Tensor suffix = at::flip(at::cumsum(at::flip(at::where(inside, v, at::zeros({}, doubles)), {0}), 0), {0});
  const Tensor rest_mean = suffix / (n - index).clamp_min(1);
  const Tensor first = at::cat({at::where(inside & (rest_mean <= o.high(Rejection::BatchM2)), index, n),
                                n.reshape({1})}).min();
  const Tensor padded = at::cat({at::full({1}, INFINITY, doubles), v});  // padded[k] = v_k
  return padded.index_select(0, first.clamp_max(size).reshape({1})).contiguous();
}

std::tuple<Tensor, Tensor, Tensor> sequence_stats_cuda(const Tensor& logp, const Tensor& behavior_logp,
                                                       const OptTensor& old_logp, const OptTensor& mask,
                                                       const Tensor& cu_seqlens) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  Tensor sums;
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    sums = sequence_sums<decltype(lp), decltype(ref)>(t, grid, logp.options().dtype(acc_dtype(logp.scalar_type())));
  });
  return {sums[0], sums[1], sums[2]};
}

std::tuple<Tensor, Tensor, Tensor> effective_sample_size_cuda(const Tensor& log_weight, const OptTensor& seq_length,
                                                              double ess_base_ratio, int64_t lr_rule) {
  const at::Device device = cuda_device_of(log_weight, "log_weight");
  const c10::cuda::CUDAGuard guard(device);
  check_log_weight(log_weight, seq_length, device);
  const auto dtype = log_weight.scalar_type();
  Tensor out = at::empty({3}, log_weight.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_ess_cuda", [&] {
    ess_kernel<scalar_t><<<1, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        log_weight.data_ptr<scalar_t>(), seq_length ? seq_length->data_ptr<scalar_t>() : nullptr, log_weight.numel(),
        ess_base_ratio, static_cast<LrRule>(lr_rule), out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out[0], out[1], out[2]};
}

std::tuple<Tensor, Tensor> opob_baseline_cuda(const Tensor& rewards, const Tensor& log_weight,
                                              const OptTensor& grad_sq_norm, const OptTensor& group_index,
                                              const OptTensor& seq_length, int64_t num_groups, bool length_norm,
                                              bool norm_by_std) {
  const at::Device device = cuda_device_of(log_weight, "log_weight");
  const c10::cuda::CUDAGuard guard(device);
  check_baseline_inputs(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, device);
  const int64_t b = log_weight.numel();
  const auto dtype = log_weight.scalar_type();
  std::tuple<Tensor, Tensor, Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_opob_cuda", [&] {
    const Groups g{rewards.data_ptr(), seq_length ? seq_length->data_ptr() : nullptr,
                   group_index ? group_index->data_ptr<int64_t>() : nullptr, b, num_groups, log_weight.data_ptr(),
                   grad_sq_norm ? grad_sq_norm->data_ptr() : nullptr, length_norm, OpobWeight::Raw, 0.0,
                   nullptr, nullptr, false};
    out = advantages<scalar_t>(g, group_index, Advantage::Opob, norm_by_std, log_weight.options());
  });
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> policy_loss_cuda(
    const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp, const OptTensor& mask,
    const Tensor& cu_seqlens, const OptTensor& rewards, const OptTensor& advantages_in, const OptTensor& group_index,
    int64_t num_groups, const OptTensor& grad_sq_norm, c10::IntArrayRef codes, c10::ArrayRef<double> values) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  const int64_t b = t.num_seqs;
  const auto acc = acc_dtype(logp.scalar_type());
  check_sequence_inputs(rewards, advantages_in, grad_sq_norm, group_index, num_groups, b, acc, device);
  const auto opts = logp.options().dtype(acc);
  const LossOptions o = unpack_loss_options(codes, values, advantages_in.has_value());
  const Params p = loss_params<double>(o);
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor loss = at::empty({}, opts), scalars = at::empty({kNumScalars}, opts), baseline, adv, share;
  Tensor grad_scale = at::empty({b}, opts), seq_log_weight;
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    const Tensor sums = sequence_sums<lp_t, ref_t>(t, grid, opts);
    seq_log_weight = sums[0];
    const Tensor length = sums[1].contiguous(), kl = sums[2].contiguous(), s = seq_log_weight.contiguous();
    Tensor work = at::empty({kNumWork}, opts.dtype(at::kDouble));
    batch_step_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        s.data_ptr<acc_t>(), length.data_ptr<acc_t>(), kl.data_ptr<acc_t>(), b, p, o.ess_on_corrected,
        o.ess_base_ratio, o.lr_rule, o.loss_agg, o.norm_length, grad_scale.data_ptr<acc_t>(),
        work.data_ptr<double>());
    if (advantages_in) {
      baseline = at::zeros({num_groups}, opts);
      adv = at::where(length > 0, *advantages_in, at::zeros({}, opts));
      share = at::zeros({}, opts.dtype(at::kDouble));
    } else {
      const Groups g{rewards->data_ptr(), length.data_ptr(), group_index ? group_index->data_ptr<int64_t>() : nullptr,
                     b, num_groups, s.data_ptr(), grad_sq_norm ? grad_sq_norm->data_ptr() : nullptr,
                     o.opob_length_norm, o.opob_weight, o.log_threshold, nullptr, nullptr, o.opob_leave_one_out,
                     o.opob_aggregation, o.winsorize_low, o.winsorize_high};
      std::tie(baseline, adv, share) = advantages<acc_t>(g, group_index, o.advantage, o.norm_by_std, opts);
    }
    const bool token_pass = old_logp.has_value() || o.is_level == IsLevel::Token || p.rule != TrustRegion::None ||
                            p.token_reject();
    // rejection, after the IS statistics (those without it): a rejected sequence's grad_scale is 0
    const Tensor seq_rejected = sequence_rejection<lp_t, ref_t>(t, grid, o, length, opts);
    grad_scale.masked_fill_(seq_rejected.to(at::kBool), 0);
    const Tensor m2 = second_moment_threshold(logp, behavior_logp, old_logp, mask, o, acc);
    const Tensor rho = sequence_ratios<lp_t, ref_t>(t, grid, p, adv, grad_scale, m2, opts);
    Tensor partials = at::zeros({std::max<int64_t>(grid, 1), kParts}, opts);
    if (token_pass && grid > 0 && b > 0) {
      token_pass_kernel<false, false, lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(
          t, p, adv.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>(), rho.defined() ? rho.data_ptr<acc_t>() : nullptr,
          m2.data_ptr<double>(), seq_rejected.data_ptr<uint8_t>(), nullptr, partials.data_ptr<acc_t>(), nullptr);
    }
    finish_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        partials.data_ptr<acc_t>(), token_pass ? grid : 0, work.data_ptr<double>(), grad_scale.data_ptr<acc_t>(),
        adv.data_ptr<acc_t>(), length.data_ptr<acc_t>(), share.data_ptr<double>(), seq_rejected.data_ptr<uint8_t>(),
        b, token_pass, o.is_level == IsLevel::Token, loss.data_ptr<acc_t>(), scalars.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, scalars, baseline, adv, seq_log_weight, grad_scale};
}

Tensor policy_loss_backward_cuda(const Tensor& grad_loss, const Tensor& logp, const Tensor& behavior_logp,
                                 const OptTensor& old_logp, const OptTensor& mask, const Tensor& cu_seqlens,
                                 const Tensor& grad_scale, const Tensor& advantages_in, c10::IntArrayRef codes,
                                 c10::ArrayRef<double> values) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  const auto acc = acc_dtype(logp.scalar_type());
  check_backward_inputs(grad_loss, grad_scale, advantages_in, t.num_seqs, acc, device);
  const Tensor g = grad_loss.to(logp.device(), acc).reshape({1}).contiguous();  // read on the device: no sync
  const LossOptions o = unpack_loss_options(codes, values, true);
  const Params p = loss_params<double>(o);
  // Every token lies in a chunk of valid offsets, so each element is written; unvalidated bad offsets leave
  // some unwritten (never out of bounds).
  Tensor grad = at::empty_like(logp);
  if (grid == 0 || t.num_seqs == 0) return grad.zero_();
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    // M2PO's threshold and GSPO's and GMPO's sequence ratios, formed again as in the forward (the same kernels on the
    // same inputs); a rejected sequence's grad_scale is 0 already
    const Tensor m2 = second_moment_threshold(logp, behavior_logp, old_logp, mask, o, acc);
    const Tensor rho = sequence_ratios<lp_t, ref_t>(t, grid, p, advantages_in, grad_scale, m2, grad_scale.options());
    token_pass_kernel<true, false, lp_t, ref_t, acc_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        t, p, advantages_in.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>(),
        rho.defined() ? rho.data_ptr<acc_t>() : nullptr, m2.data_ptr<double>(), nullptr, g.data_ptr<acc_t>(), nullptr,
        grad.data_ptr<lp_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> logit_rows_forward_cuda(const Tensor& logits, const Tensor& targets,
                                                                   int64_t ignore_index,
                                                                   const std::optional<double>& softcap) {
  const at::Device device = cuda_device_of(logits, "logits");
  const c10::cuda::CUDAGuard guard(device);
  check_logits(logits, targets, device);
  const double cap = logit_softcap(softcap);
  const int64_t n = logits.size(0);
  Tensor lse = at::empty({n}, logits.options()), logp = at::empty({n}, logits.options()),
         entropy = at::empty({n}, logits.options()), sum_p2 = at::empty({n}, logits.options());
  if (n == 0) return {lse, logp, entropy, sum_p2};
  const int64_t vocab = logits.size(1), segments = row_segments(vocab);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vcpo_logit_rows_forward_cuda", [&] {
    const int64_t bytes = n * segments * int64_t(sizeof(SegmentSums<scalar_t>));
    Tensor parts = at::empty({bytes}, logits.options().dtype(at::kByte));
    auto* p = reinterpret_cast<SegmentSums<scalar_t>*>(parts.data_ptr());
    logit_segments_kernel<scalar_t><<<n * segments, kThreads, 0, stream>>>(logits.data_ptr<scalar_t>(), vocab,
                                                                          segments, static_cast<scalar_t>(cap), p);
    logit_rows_merge_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), p, targets.data_ptr<int64_t>(), n, vocab, segments, ignore_index,
        static_cast<scalar_t>(cap), lse.data_ptr<scalar_t>(), logp.data_ptr<scalar_t>(), entropy.data_ptr<scalar_t>(),
        sum_p2.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {lse, logp, entropy, sum_p2};
}

void logit_rows_backward_cuda(const Tensor& logits, const Tensor& lse, const Tensor& targets, int64_t ignore_index,
                              const OptTensor& g_logp, const OptTensor& g_entropy, const OptTensor& g_sum_p2,
                              const OptTensor& entropy, const OptTensor& sum_p2, double scale,
                              const std::optional<double>& softcap) {
  const at::Device device = cuda_device_of(logits, "logits");
  const c10::cuda::CUDAGuard guard(device);
  check_logit_rows_backward(logits, lse, targets, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, device);
  const double cap = logit_softcap(softcap);
  const int64_t n = logits.size(0);
  const auto dtype = logits.scalar_type();
  if (n == 0) return;
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_logit_rows_backward_cuda", [&] {
    auto ptr = [](const OptTensor& t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
    const int64_t vocab = logits.size(1), segments = row_segments(vocab);
    logit_rows_backward_kernel<scalar_t><<<n * segments, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        logits.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), vocab, segments,
        ignore_index, ptr(g_logp), ptr(g_entropy), ptr(g_sum_p2), ptr(entropy), ptr(sum_p2),
        static_cast<scalar_t>(scale), static_cast<scalar_t>(cap));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(vcpo, CUDA, m) {
  m.impl("sequence_stats", &sequence_stats_cuda);
  m.impl("effective_sample_size", &effective_sample_size_cuda);
  m.impl("opob_baseline", &opob_baseline_cuda);
  m.impl("policy_loss", &policy_loss_cuda);
  m.impl("policy_loss_backward", &policy_loss_backward_cuda);
  m.impl("logit_rows_forward", &logit_rows_forward_cuda);
  m.impl("logit_rows_backward", &logit_rows_backward_cuda);
}

}  // namespace vcpo
