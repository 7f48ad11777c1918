"""Reference off-policy optimal baseline (docs/contract.md, "Advantages", "opob")."""

from __future__ import annotations

from typing import Optional, Tuple

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
    aggregation: str = "mean",
    quantiles: Tuple[float, float] = (0.05, 0.95),
):
    """(b_g [num_groups], A_i [B]) with W_j = exp(2 lw_j) G_j (/ L_j^2), max-shifted per group, and b_g their
    weighted mean, median or winsorized mean."""
    return opob_terms(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm,
                      norm_by_std, aggregation, quantiles)[:2]


def opob_terms(
    rewards: Tensor,
    log_weight: Tensor,
    grad_sq_norm: Optional[Tensor],
    group_index: Optional[Tensor],
    seq_length: Optional[Tensor],
    num_groups: int,
    length_norm: bool,
    norm_by_std: bool,
    aggregation: str = "mean",
    quantiles: Tuple[float, float] = (0.05, 0.95),
    leave_one_out: bool = False,
):
    """opob_baseline's (b_g, A_i) and the batch's largest weight share max_g max_j W_j / sum_g W; with
    `leave_one_out`, A_i against b_-i, the weighted mean of the other members of i's group."""
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
    if aggregation == "mean":
        baseline = torch.where(shift == -torch.inf, mean, mean + sum_wd / sum_w)  # all W = 0: plain mean
    else:
        baseline = _robust_baseline(rewards, w, valid, group, num_groups, shift, aggregation, quantiles)
    sigma = var.sqrt()[group]
    if leave_one_out:
        adv = _leave_one_out_deviation(rewards, log_w, w, valid, group, num_groups, mean, shift, sum_w, sum_wd)
    else:
        adv = rewards - baseline[group]
    if norm_by_std:
        adv = torch.where(sigma > 1e-8, adv / sigma, adv)
    return baseline, torch.where(valid, adv, 0), _max_share(shift, sum_w, num_groups, valid, group)


def _max_share(shift, sum_w, num_groups, valid, group):
    """max over the groups with members of max_j W_j / sum_j W_j = 1 / sum_j exp(log W_j - max): 1 / n_g where every
    W_j is 0 (the members then weigh equally), NaN where a W_j is NaN or +inf; 0 for an empty batch."""
    count = segment_sum(valid.to(sum_w.dtype), group, num_groups)
    share = torch.where(shift == -torch.inf, 1 / count.clamp(min=1), 1 / sum_w)
    share = torch.where(torch.isnan(shift) | (shift == torch.inf), torch.nan, share)
    return torch.cat([torch.where(count > 0, share, 0), share.new_zeros(1)]).amax()


def _leave_one_out_deviation(rewards, log_w, w, valid, group, num_groups, mean, shift, sum_w, sum_wd):
    """R_i - b_-i, b_-i = mean + sum_{j != i} W_j (R_j - mean) / sum_{j != i} W_j over i's group. The sums over the
    others are shifted by their own maximum: for i, not its group's (first) argmax a, the group's sums minus i's
    term, whose shifted weight is at most a's, 1, so the difference is at least half the sum (no cancellation);
    for a, sums over the others shifted by their maximum (the second largest W), formed without subtracting.
    No other member, or every other W_j = 0: the unweighted mean of the others (the RLOO deviation, 0 for a
    one-member group); a NaN or +inf W_j in the group: NaN."""
    b = rewards.numel()
    index = torch.arange(b, device=rewards.device)
    top = valid & (log_w == shift[group])
    first = index.new_full((num_groups,), b).scatter_reduce(0, group, torch.where(top, index, b), reduce="amin")
    is_first = index == first[group]
    others = torch.where(is_first, -torch.inf, log_w)
    shift2 = segment_max(others, group, num_groups)
    w2 = torch.exp(others - torch.where(torch.isfinite(shift2), shift2, 0)[group])
    d = torch.where(valid, rewards - mean[group], 0)
    sum_w2, sum_wd2 = segment_sum(w2, group, num_groups), segment_sum(w2 * d, group, num_groups)
    den = torch.where(is_first, sum_w2[group], sum_w[group] - w)
    num = torch.where(is_first, sum_wd2[group], sum_wd[group] - w * d)
    none = torch.where(is_first, shift2[group], shift[group]) == -torch.inf
    n = segment_sum(valid.to(rewards.dtype), group, num_groups)[group]
    unweighted = torch.where(n > 1, d * n / (n - 1).clamp(min=1), 0)
    dev = torch.where(none, unweighted, d - num / den)
    bad = (torch.isnan(shift) | (shift == torch.inf))[group]
    return torch.where(bad, torch.nan, dev)


def _robust_baseline(rewards, w, valid, group, num_groups, shift, aggregation, quantiles):
    """b_g by weighted quantiles, O(n_g^2) per group: F_k = sum of the W_j with R_j <= R_k in k's group, and the
    q-quantile the smallest R_k with F_k >= q sum_j W_j (the group's largest reward if rounding leaves none).
    A group whose every W_j is 0 weighs its members equally; a NaN or +inf W_j gives NaN."""
    w = torch.where(valid & (shift == -torch.inf)[group], 1.0, w)  # all W = 0: every member weighs 1
    same = (group[:, None] == group[None, :]) & valid[None, :] & valid[:, None]
    below = same & (rewards[None, :] <= rewards[:, None])  # [k, j]: R_j <= R_k in k's group
    cum = torch.where(below, w[None, :], 0).sum(1)
    total = segment_sum(w, group, num_groups)
    top = segment_max(torch.where(valid, rewards, -torch.inf), group, num_groups)

    def quantile(q):
        hit = valid & (cum >= q * total[group])
        low = rewards.new_full((num_groups,), torch.inf).scatter_reduce(
            0, group, torch.where(hit, rewards, torch.inf), reduce="amin", include_self=True)
        return torch.where(low == torch.inf, top, low)

    if aggregation == "median":
        b = quantile(0.5)
    else:  # b = lo + sum W (clip(R, lo, hi) - lo) / sum W: exact for one-member and constant-reward groups
        lo, hi = quantile(quantiles[0]), quantile(quantiles[1])
        clipped = torch.minimum(torch.maximum(rewards, lo[group]), hi[group])
        b = lo + segment_sum(torch.where(valid, w * (clipped - lo[group]), 0), group, num_groups) / total
    count = segment_sum(valid.to(rewards.dtype), group, num_groups)
    bad = torch.isnan(shift) | (shift == torch.inf)
    return torch.where(count == 0, 0, torch.where(bad, torch.nan, b))
