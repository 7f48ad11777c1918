"""The learning rate over a run (`lr_schedule`, docs/trainer.md "Settings"): a factor of the base lr for each optimizer
step, a function of the step's number alone, so a resumed run and every trainer rank compute the same lr without
state to save. The ESS scale of VCPO multiplies the scheduled lr of each step (vcpo.scale_lr)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, steps: int, schedule: str, warmup_steps: int, min_ratio: float) -> float:
    """The base lr's factor at optimizer step `step` (1-based) of `steps`: a linear warm-up over the first
    `warmup_steps` (step / warmup_steps), then 1 (constant) or a cosine or linear decay from 1 at the first step after
    the warm-up to `min_ratio` at step `steps` (and after it, for a run extended on resume)."""
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps - 1) / max(steps - warmup_steps - 1, 1))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay
