"""The "cuda" backend: the CUDA kernels of csrc/cuda/, registered under the same torch.ops.vcpo.* names as
the C++ CPU ops, so they share the CPU backend's entry points, fake kernels and C++ autograd
(vcpo_kernels/cpu/); the dispatcher runs the CUDA kernel for CUDA tensors. Built only against a CUDA build
of torch (setup.py); importing this package raises ImportError when the extension has no CUDA kernels."""

import torch

from ..cpu import effective_sample_size, linear_logprobs, opob_baseline, policy_loss, sequence_stats

if not torch._C._dispatch_has_kernel_for_dispatch_key("vcpo::policy_loss", "CUDA"):
    raise ImportError("vcpo_kernels._C was built without its CUDA kernels (a CPU build of torch, or "
                      "VCPO_BUILD_CUDA=0)")


__all__ = ["sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "linear_logprobs"]
