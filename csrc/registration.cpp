// Schemas of the vcpo:: ops, shared by every compiled backend (CPU here; CUDA registers the same names).
// Contract: docs/contract.md. Python wrappers, fake (meta) kernels and autograd: vcpo_kernels/cpu/.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import vcpo_kernels._C` loads this library, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(vcpo, m) {
  m.def("sequence_stats(Tensor logp, Tensor behavior_logp, Tensor? old_logp, Tensor? mask, Tensor cu_seqlens)"
        " -> (Tensor seq_log_weight, Tensor seq_length, Tensor seq_kl_k3)");
  m.def("effective_sample_size(Tensor log_weight, Tensor? seq_length, float ess_base_ratio, int lr_rule)"
        " -> (Tensor ess, Tensor ess_ratio, Tensor lr_scale)");
  m.def("opob_baseline(Tensor rewards, Tensor log_weight, Tensor? grad_sq_norm, Tensor? group_index,"
        " Tensor? seq_length, int num_groups, bool length_norm, bool norm_by_std)"
        " -> (Tensor baseline, Tensor advantages)");
  // The loss's scalar options are packed by position (csrc/loss_options.h, vcpo_kernels/options.py).
  m.def("policy_loss(Tensor logp, Tensor behavior_logp, Tensor? old_logp, Tensor? mask, Tensor cu_seqlens,"
        " Tensor? rewards, Tensor? advantages, Tensor? group_index, int num_groups, Tensor? grad_sq_norm,"
        " int[] codes, float[] values) -> (Tensor loss, Tensor scalars, Tensor baseline, Tensor advantages,"
        " Tensor seq_log_weight, Tensor grad_scale)");
  m.def("policy_loss_backward(Tensor grad_loss, Tensor logp, Tensor behavior_logp, Tensor? old_logp,"
        " Tensor? mask, Tensor cu_seqlens, Tensor grad_scale, Tensor advantages, int[] codes, float[] values)"
        " -> Tensor grad_logp");
  // The passes over a chunk of logits of linear_logprobs (the GEMMs around them are torch's); with a softcap c
  // they read each logit z as c tanh(z / c).
  m.def("logit_rows_forward(Tensor logits, Tensor targets, int ignore_index, float? softcap)"
        " -> (Tensor lse, Tensor logp, Tensor entropy, Tensor sum_p2)");
  m.def("logit_rows_backward(Tensor(a!) logits, Tensor lse, Tensor targets, int ignore_index, Tensor? g_logp,"
        " Tensor? g_entropy, Tensor? g_sum_p2, Tensor? entropy, Tensor? sum_p2, float scale, float? softcap) -> ()");
}
