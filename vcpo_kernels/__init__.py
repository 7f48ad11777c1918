"""vcpo_kernels: fused ops for variance-controlled off-policy policy gradients (math: docs/contract.md).

Each op takes `backend="auto" | "torch" | "cpu" | "triton" | "cuda"`; "torch" is the float64-capable
reference, "cpu" the compiled C++ kernel, "triton" the Triton kernels (CUDA tensors, or CPU tensors under the
interpreter), "auto" the compiled kernel on CPU tensors and the reference elsewhere (docs/api.md)."""

from .backends import BACKENDS, available_backends
from .ops import (
    Baseline,
    EffectiveSampleSize,
    LinearLogprobs,
    PolicyLossResult,
    SequenceStats,
    advantages,
    effective_sample_size,
    linear_logprobs,
    opob_baseline,
    policy_loss,
    sequence_stats,
)
from .options import PolicyLossOptions
from .reference import ess_lr_scale
from .truncation import check_sampling, sampling_support, truncates

__all__ = [
    "BACKENDS",
    "available_backends",
    "sequence_stats",
    "effective_sample_size",
    "opob_baseline",
    "advantages",
    "policy_loss",
    "linear_logprobs",
    "LinearLogprobs",
    "ess_lr_scale",
    "sampling_support",
    "truncates",
    "check_sampling",
    "PolicyLossOptions",
    "PolicyLossResult",
    "SequenceStats",
    "EffectiveSampleSize",
    "Baseline",
]
