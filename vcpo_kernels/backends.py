"""Backend selection: "auto" picks the fastest available implementation for the input's device."""

from __future__ import annotations

import importlib

import torch

BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")
_MODULES = {"torch": "vcpo_kernels.reference", "cpu": "vcpo_kernels.cpu"}
_load_errors: dict[str, str] = {}


def _load(name: str):
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as exc:  # the extension was not built
        _load_errors[name] = str(exc)
        return None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    device = torch.device(device)
    names = ["torch"]
    if device.type == "cpu" and _load("cpu") is not None:
        names.append("cpu")
    return names


def resolve(backend: str, device: torch.device):
    """The backend module for `backend` on `device`; ValueError if it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cpu" if device.type == "cpu" and _load("cpu") is not None else "torch"
    if backend in ("triton", "cuda"):
        raise ValueError(f"backend={backend!r} is not available in this build (available: 'torch', 'cpu')")
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}")
        if _load("cpu") is None:
            raise ValueError(f"backend='cpu' is not available: the C++ extension failed to load ({_load_errors['cpu']})")
    return _load(backend)
