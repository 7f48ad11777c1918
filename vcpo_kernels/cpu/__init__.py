"""The "cpu" backend: the compiled C++ ops of csrc/ (one pass over the tokens per direction), registered as
torch.ops.vcpo.* with fake kernels here and autograd in csrc/autograd.cpp, so they work under torch.compile
and torch.library.opcheck. Importing this package raises ImportError when the extension was not built, or was
built against another torch than the one installed (its C++ symbols would not match: an undefined-symbol
error at best, a crash at worst)."""

import torch

REBUILD = "rebuild it against this torch: pip install --no-build-isolation -e . (or setup.py build_ext --inplace)"
try:
    from .._build import TORCH_VERSION as _BUILT_WITH
except ImportError:
    raise ImportError(f"vcpo_kernels._C is not built; {REBUILD}") from None
if _BUILT_WITH != torch.__version__:
    raise ImportError(f"vcpo_kernels._C was built against torch {_BUILT_WITH}, but torch {torch.__version__} is "
                      f"installed; {REBUILD}")

from .effective_sample_size import effective_sample_size
from .linear_logprobs import linear_logprobs
from .opob_baseline import opob_baseline
from .policy_loss import policy_loss
from .sequence_stats import sequence_stats

__all__ = ["sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "linear_logprobs"]
