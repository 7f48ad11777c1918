"""Reference ESS in log space and the learning-rate scale (docs/contract.md, "Effective sample size")."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..options import DEFAULT_LR_RULE, LR_RULES, _choice, _positive


def ess_lr_scale(ess_ratio, rule: Optional[str] = DEFAULT_LR_RULE, base: float = 1.0):
    """lr multiplier min(1, ess_ratio / base) ** (1/2 | 1 | 0); a NaN ratio gives 0 (skip the step).
    Tensors stay tensors (no host sync); a float gives a float."""
    _choice("rule", rule, LR_RULES)
    base = _positive("base", base)
    if not isinstance(ess_ratio, Tensor):
        if not (ess_ratio >= 0 or ess_ratio != ess_ratio):
            raise ValueError(f"ess_ratio must be >= 0 (or NaN), got {ess_ratio!r}")
        return float(ess_lr_scale(torch.tensor(float(ess_ratio), dtype=torch.float64), rule, base))
    x = torch.clamp(ess_ratio / base, max=1.0)
    if rule == "sqrt":
        x = x.sqrt()
    elif rule is None:
        x = torch.ones_like(x)
    return torch.where(torch.isnan(ess_ratio), 0, x)


def effective_sample_size(log_weight: Tensor, seq_length: Optional[Tensor], base: float, rule: Optional[str]):
    """(ess, ess_ratio, lr_scale) over the sequences with seq_length > 0 (all when seq_length is None)."""
    valid = seq_length > 0 if seq_length is not None else torch.ones_like(log_weight, dtype=torch.bool)
    lw = torch.where(valid, log_weight, -torch.inf)
    m = torch.cat([lw, lw.new_full((1,), -torch.inf)]).max()
    shift = torch.where(torch.isfinite(m), m, 0)  # +inf/NaN propagate; all -inf gives 0/0
    e = torch.exp(lw - shift)
    s1, s2 = e.sum(), (e * e).sum()
    n = valid.sum().to(log_weight.dtype)
    ess = torch.where(n > 0, s1 * s1 / s2, 0)
    ratio = torch.where(n > 0, ess / n.clamp(min=1), 0)
    return ess, ratio, ess_lr_scale(ratio, rule, base)
