// Argument checks shared by the CPU and CUDA entry points. Python validates values and raises ValueError;
// these keep memory access safe whatever a caller passes to the ops directly (validate=False, torch.ops).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace vcpo {

// fp64 inputs accumulate in fp64, everything else in fp32.
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

}  // namespace vcpo
