"""The "triton" backend: Triton kernels for CUDA tensors, and for CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1, how the tests run them on a machine without a GPU). Importing this package raises
ImportError when triton is not installed."""

from .linear_logprobs import linear_logprobs

__all__ = ["linear_logprobs"]
