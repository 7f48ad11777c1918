"""The "cpu" backend: the compiled C++ ops of csrc/ (one pass over the tokens per direction), registered as
torch.ops.vcpo.* with fake kernels here and autograd in csrc/autograd.cpp, so they work under torch.compile
and torch.library.opcheck. Importing this package raises ImportError when the extension was not built."""

from .effective_sample_size import effective_sample_size
from .linear_logprobs import linear_logprobs
from .opob_baseline import opob_baseline
from .policy_loss import policy_loss
from .sequence_stats import sequence_stats

__all__ = ["sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "linear_logprobs"]
