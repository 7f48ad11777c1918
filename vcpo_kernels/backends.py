"""Backend selection: "auto" picks the fastest available implementation for the input's device."""

from __future__ import annotations

import torch

from . import reference

try:
    from . import cpu as _cpu

    _CPU_ERROR = None
except ImportError as exc:  # the C++ extension was not built
    _cpu, _CPU_ERROR = None, str(exc)

BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    device = torch.device(device)
    return ["torch"] + (["cpu"] if device.type == "cpu" and _cpu is not None else [])


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
    raise ValueError(f"backend={backend!r} is not available in this build (available: 'torch', 'cpu')")
