"""Backend selection. "auto" picks the compiled C++ op for CPU tensors and the reference elsewhere: the Triton
kernels are chosen for CUDA tensors only once they have been measured on a GPU (docs/api.md)."""

from __future__ import annotations

import os
import warnings

import torch

from . import reference

try:
    from . import cpu as _cpu

    _CPU_ERROR = None
except ImportError as exc:  # not built, or built against another torch
    _cpu, _CPU_ERROR = None, str(exc)
    warnings.warn(f"vcpo_kernels: the compiled ops are unavailable, backend='auto' runs the PyTorch reference: "
                  f"{exc}", stacklevel=2)

BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


def _triton():
    """The Triton backend module, or an error message: it runs CUDA tensors, and CPU tensors under the
    interpreter (TRITON_INTERPRET=1)."""
    try:
        from . import triton as module
    except ImportError as exc:
        return None, f"triton is not installed ({exc})"
    return module, None


def _cuda():
    """The CUDA backend module, or an error message."""
    if _cpu is None:
        return None, f"the C++ extension failed to load ({_CPU_ERROR})"
    try:
        from . import cuda as module
    except ImportError as exc:
        return None, str(exc)
    return module, None


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on `device`: "triton" on CPU tensors only under the Triton interpreter."""
    device = torch.device(device)
    names = ["torch"] + (["cpu"] if device.type == "cpu" and _cpu is not None else [])
    if device.type == "cuda" and _cuda()[0] is not None:
        names.append("cuda")
    if _triton_runs_on(device) and _triton()[0] is not None:
        names.append("triton")
    return names


def resolve(backend: str, device: torch.device):
    """The backend module for `backend` on `device`; ValueError if it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cpu" if device.type == "cpu" and _cpu is not None else "torch"
    if backend == "torch":
        return reference
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}")
        if _cpu is None:
            raise ValueError(f"backend='cpu' is not available: the C++ extension failed to load ({_CPU_ERROR})")
        return _cpu
    if backend == "triton":
        if not _triton_runs_on(device):
            raise ValueError(f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; got "
                             f"tensors on {device}")
        module, error = _triton()
        if module is None:
            raise ValueError(f"backend='triton' is not available: {error}")
        return module
    module, error = _cuda()  # backend == "cuda"
    if device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
    if module is None:
        raise ValueError(f"backend='cuda' is not available: {error}")
    return module


def kernel(op: str, backend: str, device: torch.device):
    """The function computing `op` with `backend` on `device`; "auto" falls back to the reference where the
    chosen backend has no kernel for `op`."""
    fn = getattr(resolve(backend, device), op, None)
    if fn is None:
        if backend != "auto":
            raise ValueError(f"{op} has no {backend!r} kernel yet; use backend='torch' or 'auto'")
        fn = getattr(reference, op)
    return fn
