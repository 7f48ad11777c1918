// What the CPU and CUDA entry points share: argument checks, the accumulation dtype and the dispatch over the
// token dtypes. Python validates values and raises ValueError; these checks keep memory access safe whatever a
// caller passes to the ops directly (validate=False, torch.ops).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <optional>
#include <utility>

namespace vcpo {

// The accumulation dtype of logp's dtype (acc_type.h): fp64 for fp64, fp32 for the others.
inline at::ScalarType acc_dtype(at::ScalarType logp) { return logp == at::kDouble ? at::kDouble : at::kFloat; }

// A kernel indexes every pointer of a call on one device: a tensor elsewhere (another GPU, the host) would be
// read through a foreign address, so it is refused.
inline void check_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device, "vcpo: ", name, " is on ", t.device(), " but the op runs on ", device,
              ": every input must be on one device");
  TORCH_CHECK(t.is_contiguous(), "vcpo: ", name, " must be contiguous");
}

// An optional per-sequence (or per-row) tensor: shape [n], `dtype`, on `device`.
inline void check_seq(const std::optional<at::Tensor>& t, const char* name, int64_t n, at::ScalarType dtype,
                      const at::Device& device) {
  if (!t) return;
  check_tensor(*t, name, device);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n, "vcpo: ", name, " must have shape [", n, "]");
  TORCH_CHECK(t->scalar_type() == dtype, "vcpo: ", name, " must have dtype ", dtype);
}

// logits [n, V] in fp32 or fp64 and targets [n] int64, both on `device`.
inline void check_logits(const at::Tensor& logits, const at::Tensor& targets, const at::Device& device) {
  check_tensor(logits, "logits", device);
  TORCH_CHECK(logits.dim() == 2, "vcpo: logits must be [n, V]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
              "vcpo: logits must be float32 or float64");
  check_seq(targets, "targets", logits.size(0), at::kLong, device);
}

// The token tensors of the loss ops: logp [N] (fp32/fp64/bf16/fp16), behavior_logp and old_logp [N] in logp's
// dtype or fp32, mask [N] bool, cu_seqlens [B + 1] int64, all on `device`.
inline void check_token_inputs(const at::Tensor& logp, const at::Tensor& behavior,
                               const std::optional<at::Tensor>& old, const std::optional<at::Tensor>& mask,
                               const at::Tensor& cu_seqlens, const at::Device& device) {
  check_tensor(logp, "logp", device);
  check_tensor(behavior, "behavior_logp", device);
  check_tensor(cu_seqlens, "cu_seqlens", device);
  TORCH_CHECK(logp.dim() == 1, "vcpo: logp must be 1-D (packed)");
  TORCH_CHECK(behavior.sizes() == logp.sizes(), "vcpo: behavior_logp must match logp");
  TORCH_CHECK(behavior.scalar_type() == logp.scalar_type() || behavior.scalar_type() == at::kFloat,
              "vcpo: behavior_logp must have logp's dtype or float32");
  if (old) {
    check_tensor(*old, "old_logp", device);
    TORCH_CHECK(old->sizes() == logp.sizes(), "vcpo: old_logp must match logp");
    TORCH_CHECK(old->scalar_type() == behavior.scalar_type(), "vcpo: old_logp must have behavior_logp's dtype");
  }
  check_seq(mask, "mask", logp.numel(), at::kBool, device);
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1 && cu_seqlens.scalar_type() == at::kLong,
              "vcpo: cu_seqlens must be a 1-D int64 tensor");
}

// The inputs of effective_sample_size: log_weight [B] fp32/fp64 and seq_length [B] of its dtype.
inline void check_log_weight(const at::Tensor& log_weight, const std::optional<at::Tensor>& seq_length,
                             const at::Device& device) {
  check_tensor(log_weight, "log_weight", device);
  TORCH_CHECK(log_weight.dim() == 1, "vcpo: log_weight must be 1-D");
  TORCH_CHECK(log_weight.scalar_type() == at::kFloat || log_weight.scalar_type() == at::kDouble,
              "vcpo: log_weight must be float32 or float64");
  check_seq(seq_length, "seq_length", log_weight.numel(), log_weight.scalar_type(), device);
}

// The inputs of opob_baseline besides log_weight and seq_length: [B] tensors of log_weight's dtype, int64 groups.
inline void check_baseline_inputs(const at::Tensor& rewards, const at::Tensor& log_weight,
                                  const std::optional<at::Tensor>& grad_sq_norm,
                                  const std::optional<at::Tensor>& group_index,
                                  const std::optional<at::Tensor>& seq_length, int64_t num_groups, bool length_norm,
                                  const at::Device& device) {
  check_log_weight(log_weight, seq_length, device);
  const int64_t b = log_weight.numel();
  check_seq(rewards, "rewards", b, log_weight.scalar_type(), device);
  check_seq(grad_sq_norm, "grad_sq_norm", b, log_weight.scalar_type(), device);
  check_seq(group_index, "group_index", b, at::kLong, device);
  TORCH_CHECK(num_groups >= 1, "vcpo: num_groups must be >= 1");
  TORCH_CHECK(!length_norm || seq_length, "vcpo: length_norm needs seq_length");
}

// The per-sequence inputs of the fused loss: exactly one of rewards and advantages, [B] in the accumulation dtype.
inline void check_sequence_inputs(const std::optional<at::Tensor>& rewards, const std::optional<at::Tensor>& advantages,
                                  const std::optional<at::Tensor>& grad_sq_norm,
                                  const std::optional<at::Tensor>& group_index, int64_t num_groups, int64_t b,
                                  at::ScalarType acc, const at::Device& device) {
  TORCH_CHECK(rewards.has_value() != advantages.has_value(), "vcpo: pass exactly one of rewards, advantages");
  check_seq(rewards, "rewards", b, acc, device);
  check_seq(advantages, "advantages", b, acc, device);
  check_seq(grad_sq_norm, "grad_sq_norm", b, acc, device);
  check_seq(group_index, "group_index", b, at::kLong, device);
  TORCH_CHECK(num_groups >= 1, "vcpo: num_groups must be >= 1");
}

// What the loss's backward adds to its token inputs: the scalar upstream gradient and the forward's [B] outputs.
inline void check_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& grad_scale,
                                  const at::Tensor& advantages, int64_t b, at::ScalarType acc,
                                  const at::Device& device) {
  TORCH_CHECK(grad_loss.numel() == 1, "vcpo: grad_loss must be a scalar");
  check_seq(grad_scale, "grad_scale", b, acc, device);
  check_seq(advantages, "advantages", b, acc, device);
}

// The inputs of logit_rows_backward: logits and targets, and [n] row statistics and upstream gradients.
inline void check_logit_rows_backward(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& targets,
                                      const std::optional<at::Tensor>& g_logp,
                                      const std::optional<at::Tensor>& g_entropy,
                                      const std::optional<at::Tensor>& g_sum_p2,
                                      const std::optional<at::Tensor>& entropy,
                                      const std::optional<at::Tensor>& sum_p2, const at::Device& device) {
  check_logits(logits, targets, device);
  const int64_t n = logits.size(0);
  const auto dtype = logits.scalar_type();
  check_seq(lse, "lse", n, dtype, device);
  for (const auto& [t, name] : {std::pair{&g_logp, "g_logp"}, {&g_entropy, "g_entropy"}, {&g_sum_p2, "g_sum_p2"},
                                {&entropy, "entropy"}, {&sum_p2, "sum_p2"}}) {
    check_seq(*t, name, n, dtype, device);
  }
  TORCH_CHECK(!g_entropy || entropy, "vcpo: g_entropy needs the forward's entropy");
  TORCH_CHECK(!g_sum_p2 || sum_p2, "vcpo: g_sum_p2 needs the forward's sum_p2");
}

// The softcap of the logit-row passes (none, or a finite number > 0) as the kernels take it: 0 for none.
inline double logit_softcap(const std::optional<double>& softcap) {
  TORCH_CHECK(!softcap || (*softcap > 0 && std::isfinite(*softcap)), "vcpo: softcap must be a finite number > 0, got ",
              *softcap);
  return softcap ? *softcap : 0.0;
}

// Calls body(lp_t{}, ref_t{}) for logp's dtype and the dtype of behavior_logp (logp's own or float32).
template <typename Body>
void dispatch_logp(const at::Tensor& logp, const at::Tensor& behavior_logp, Body&& body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logp.scalar_type(), "vcpo", [&] {
    if (behavior_logp.scalar_type() == logp.scalar_type()) {
      body(scalar_t{}, scalar_t{});
    } else {
      body(scalar_t{}, float{});
    }
  });
}

}  // namespace vcpo
