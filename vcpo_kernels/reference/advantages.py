"""Reference advantages of every estimator (docs/contract.md, "Advantages")."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..inputs import SequenceBatch
from ..options import PolicyLossOptions
from .opob_baseline import opob_terms
from .segments import group_moments, group_of


def classic_advantages(kind: str, rewards: Tensor, valid: Tensor, group_index, num_groups: int, norm_by_std: bool):
    """GRPO, RLOO, REINFORCE and "none": (b_g, A_i)."""
    group = group_of(group_index, rewards.numel(), rewards.device)
    count, mean, var = group_moments(rewards, valid, group, num_groups)
    n = count[group]
    if kind == "grpo":
        adv = rewards - mean[group]
        if norm_by_std:
            std = torch.where(n > 1, (var[group] * n / (n - 1).clamp(min=1)).sqrt(), 0)
            adv = adv / (std + 1e-6)
        baseline = mean
    elif kind == "rloo":
        adv = torch.where(n > 1, (rewards - mean[group]) * n / (n - 1).clamp(min=1), 0)
        baseline = mean
    elif kind == "reinforce":
        total = (count * mean).sum() / count.sum().clamp(min=1)
        adv = rewards - total
        baseline = total.expand(num_groups).clone()
    else:
        adv = rewards
        baseline = torch.zeros_like(mean)
    return baseline, torch.where(valid, adv, 0)


def advantage_terms(seq: SequenceBatch, s: Tensor, length: Tensor, opts: PolicyLossOptions):
    """(b_g, A_i, the largest OPOB weight share of a group: 0 for another estimator or given advantages)."""
    valid = length > 0
    none = s.new_zeros(())
    if seq.advantages is not None:
        return seq.advantages.new_zeros(seq.num_groups), torch.where(valid, seq.advantages, 0), none
    if opts.advantage != "opob":
        return *classic_advantages(opts.advantage, seq.rewards, valid, seq.group_index, seq.num_groups,
                                   opts.norm_by_std), none
    s_trunc = torch.clamp(s, max=math.log(opts.is_threshold))
    log_weight = {0: s, 1: s_trunc, 2: s + s_trunc}[opts.opob_weight_code]
    return opob_terms(seq.rewards, log_weight, seq.grad_sq_norm, seq.group_index, length, seq.num_groups,
                      opts.opob_length_norm, opts.norm_by_std, opts.opob_aggregation, opts.opob_winsorize_quantiles,
                      opts.opob_leave_one_out)
