"""The "torch" backend: plain PyTorch ops, float64-capable; the executable form of docs/contract.md that
every other backend is tested against."""

from .advantages import advantage_terms
from .effective_sample_size import effective_sample_size, ess_lr_scale
from .linear_logprobs import linear_logprobs
from .opob_baseline import opob_baseline
from .policy_loss import policy_loss
from .sequence_stats import sequence_stats

__all__ = ["sequence_stats", "effective_sample_size", "ess_lr_scale", "opob_baseline", "advantage_terms",
           "policy_loss", "linear_logprobs"]
