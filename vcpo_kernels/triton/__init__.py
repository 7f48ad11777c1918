"""The "triton" backend: Triton kernels for CUDA tensors, and for CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1, how the tests run them on a machine without a GPU). Sums are deterministic: segmented
reductions write per-chunk partials that one program adds in order, never float atomics (segments.py).
Importing this package raises ImportError when triton is not installed."""

from .effective_sample_size import effective_sample_size
from .linear_logprobs import linear_logprobs
from .opob_baseline import opob_baseline
from .policy_loss import policy_loss
from .sequence_stats import sequence_stats

__all__ = ["sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "linear_logprobs"]
