"""Reference off-policy optimal baseline (docs/contract.md, "Advantages", "opob")."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .segments import group_moments, group_of, segment_max, segment_sum


def opob_baseline(
    rewards: Tensor,
    log_weight: Tensor,
    grad_sq_norm: Optional[Tensor],
    group_index: Optional[Tensor],
    seq_length: Optional[Tensor],
    num_groups: int,
    length_norm: bool,
    norm_by_std: bool,
):
    """(b_g [num_groups], A_i [B]) with W_j = exp(2 lw_j) G_j (/ L_j^2), max-shifted per group."""
    b = rewards.numel()
    length = seq_length if seq_length is not None else torch.ones_like(rewards)
    valid = length > 0
    group = group_of(group_index, b, rewards.device)
    _, mean, var = group_moments(rewards, valid, group, num_groups)
    log_w = 2 * log_weight
    if grad_sq_norm is not None:
        log_w = log_w + torch.log(grad_sq_norm)
    if length_norm:
        log_w = log_w - 2 * torch.log(length)
    log_w = torch.where(valid, log_w, -torch.inf)
    shift = segment_max(log_w, group, num_groups)
    safe_shift = torch.where(torch.isfinite(shift), shift, 0)  # NaN/+inf propagate
    w = torch.exp(log_w - safe_shift[group])
    sum_w = segment_sum(w, group, num_groups)
    # b = mean + sum W (R - mean) / sum W: exact for one-member and constant-reward groups.
    sum_wd = segment_sum(torch.where(valid, w * (rewards - mean[group]), 0), group, num_groups)
    baseline = torch.where(shift == -torch.inf, mean, mean + sum_wd / sum_w)  # all W = 0: plain mean
    sigma = var.sqrt()[group]
    adv = rewards - baseline[group]
    if norm_by_std:
        adv = torch.where(sigma > 1e-8, adv / sigma, adv)
    return baseline, torch.where(valid, adv, 0)
