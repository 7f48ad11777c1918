"""ESS-guided learning-rate scaling of one optimizer step."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Union

import torch
from torch import Tensor

from vcpo_kernels import ess_lr_scale

__all__ = ["ess_lr_scale", "scale_lr", "smoothed_lr_scale"]

# Where smoothed_lr_scale keeps its state: a key of the optimizer's first param group ([average, steps]), as torch's
# lr schedulers keep `initial_lr`, so optimizer.state_dict() saves it and load_state_dict() restores it.
EMA_STATE = "vcpo_lr_scale_ema"


def smoothed_lr_scale(optimizer: torch.optim.Optimizer, lr_scale: float, beta: float) -> float:
    """The lr scale of a step taken with `optimizer` under VCPOConfig.lr_scale_ema = `beta`: the moving average of
    the batch scales of every step taken so far with it, this one's (`lr_scale`) included,
    (1 - beta) sum_j beta^(t-j) s_j / (1 - beta^t) (Adam's bias correction: the first step's is its own scale). Call
    it once per step taken; ranks that see the same scales keep the same average."""
    group = optimizer.param_groups[0]
    average, steps = group.get(EMA_STATE, (0.0, 0))
    average, steps = beta * average + (1.0 - beta) * float(lr_scale), steps + 1
    group[EMA_STATE] = [average, steps]
    return average / (1.0 - beta ** steps)


@contextmanager
def scale_lr(optimizer: torch.optim.Optimizer, lr_scale: Union[float, Tensor]) -> Iterator[None]:
    """Multiply every param group's lr by `lr_scale` for the steps inside the block, then restore it.

    Weight decay scales with it: AdamW decays by lr * weight_decay and L2-style decay (SGD, Adam) enters the
    gradient, so both follow the scaled lr. A tensor lr_scale stays on the device for param groups whose lr
    is a tensor; a float lr reads it once (one host sync per step)."""
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    host_scale = None
    if any(not isinstance(lr, Tensor) for lr in saved) or not isinstance(lr_scale, Tensor):
        host_scale = float(lr_scale)
        if not math.isfinite(host_scale) or host_scale < 0:
            raise ValueError(f"lr_scale must be finite and >= 0, got {host_scale}")
    try:
        for g, lr in zip(groups, saved):
            if isinstance(lr, Tensor):
                g["lr"] = lr * (lr_scale if isinstance(lr_scale, Tensor) else host_scale)
            else:
                g["lr"] = lr * host_scale
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr
