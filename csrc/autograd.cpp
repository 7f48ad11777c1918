// Autograd of vcpo::policy_loss, in C++ so a training step pays no Python autograd overhead (the Python
// register_autograd path cost about 0.35 ms per call). Device independent: it calls the forward and
// backward ops through the dispatcher. The gradient flows to logp only (docs/contract.md, "Loss").
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace vcpo {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Codes = c10::ArrayRef<int64_t>;
using Values = c10::ArrayRef<double>;

using ForwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, int64_t, const OptTensor&, Codes, Values);
using BackwardSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                           const Tensor&, const Tensor&, const Tensor&, Codes, Values);
constexpr size_t kNumForwardArgs = 12;  // the inputs of ForwardSig: one gradient slot each

Tensor or_undefined(const OptTensor& t) { return t ? *t : Tensor(); }
OptTensor or_nullopt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class PolicyLoss : public torch::autograd::Function<PolicyLoss> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logp, const Tensor& behavior_logp,
                               const OptTensor& old_logp, const OptTensor& mask, const Tensor& cu_seqlens,
                               const OptTensor& rewards, const OptTensor& advantages, const OptTensor& group_index,
                               int64_t num_groups, const OptTensor& grad_sq_norm, Codes codes, Values values) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("vcpo::policy_loss", "").typed<ForwardSig>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, scalars, baseline, adv, seq_log_weight, grad_scale] = op.call(
        logp, behavior_logp, old_logp, mask, cu_seqlens, rewards, advantages, group_index, num_groups, grad_sq_norm,
        codes, values);
    ctx->save_for_backward(
        {logp, behavior_logp, or_undefined(old_logp), or_undefined(mask), cu_seqlens, grad_scale, adv});
    ctx->saved_data["codes"] = codes.vec();
    ctx->saved_data["values"] = values.vec();
    ctx->mark_non_differentiable({scalars, baseline, adv, seq_log_weight, grad_scale});
    return {loss, scalars, baseline, adv, seq_log_weight, grad_scale};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(kNumForwardArgs);
    if (!grad_outputs[0].defined()) return grads;
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("vcpo::policy_loss_backward", "").typed<BackwardSig>();
    const auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> codes = ctx->saved_data.at("codes").toIntVector();
    const std::vector<double> values = ctx->saved_data.at("values").toDoubleVector();
    grads[0] = op.call(grad_outputs[0], saved[0], saved[1], or_nullopt(saved[2]), or_nullopt(saved[3]), saved[4],
                       saved[5], saved[6], codes, values);
    return grads;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> policy_loss_autograd(
    const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp, const OptTensor& mask,
    const Tensor& cu_seqlens, const OptTensor& rewards, const OptTensor& advantages, const OptTensor& group_index,
    int64_t num_groups, const OptTensor& grad_sq_norm, Codes codes, Values values) {
  auto out = PolicyLoss::apply(logp, behavior_logp, old_logp, mask, cu_seqlens, rewards, advantages, group_index,
                               num_groups, grad_sq_norm, codes, values);
  return {out[0], out[1], out[2], out[3], out[4], out[5]};
}

}  // namespace

TORCH_LIBRARY_IMPL(vcpo, Autograd, m) { m.impl("policy_loss", &policy_loss_autograd); }

}  // namespace vcpo
