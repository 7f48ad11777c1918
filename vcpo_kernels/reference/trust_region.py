"""The per-token surrogate of each trust region, differentiable w.r.t. logp by autograd (docs/contract.md,
"Trust regions")."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..options import PolicyLossOptions
from .segments import segment_sum


class UnitRatio(torch.autograd.Function):
    """exp(lp - stop_gradient(lp)): 1 with d / d lp = 1, also where lp is not finite."""

    @staticmethod
    def forward(ctx, lp):
        return torch.ones_like(lp)

    @staticmethod
    def backward(ctx, grad):
        return grad


class SapoGate(torch.autograd.Function):
    """SAPO's gate (4 / tau) sigmoid(tau (rho - 1)) of rho = exp(d), and its slope d / d d = 4 s (1 - s) rho formed
    from e = exp(-|x|), x = tau (rho - 1): 0 where rho overflows (autograd would give 0 * inf there)."""

    @staticmethod
    def forward(ctx, d, tau):
        rho = torch.exp(d)
        x = tau * (rho - 1)
        e = torch.exp(-torch.abs(x))
        ctx.save_for_backward(torch.where(torch.isinf(rho), 0, 4 * e / ((1 + e) * (1 + e)) * rho))
        return 4 / tau * torch.where(x >= 0, 1 / (1 + e), e / (1 + e))

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None


def ppo_surrogate(r: Tensor, adv: Tensor, opts: PolicyLossOptions):
    """(p, on_clip): p(r) = -A r, with PPO's clip (and dual clip) when clip_ratio is given."""
    p = -adv * r
    on_clip = torch.zeros_like(r, dtype=torch.bool)
    if opts.clip_ratio is None:
        return p, on_clip
    eps_low, eps_high = opts.clip_ratio
    p2 = -adv * torch.clamp(r, 1 - eps_low, 1 + eps_high)
    take_unclipped = p >= p2  # ties go to the unclipped branch
    p, on_clip = torch.where(take_unclipped, p, p2), ~take_unclipped
    if opts.clip_ratio_c is not None:
        limit = -adv * opts.clip_ratio_c
        take_dual = (adv < 0) & ~(p <= limit)
        p, on_clip = torch.where(take_dual, limit, p), on_clip | take_dual
    return p, on_clip


def _sequence_mean(x: Tensor, kept: Tensor, ids: Tensor, num_seqs: int) -> Tensor:
    """Each token's sequence mean of x over the sequence's kept tokens."""
    total = segment_sum(torch.where(kept, x, 0), ids, num_seqs)
    count = segment_sum(kept.to(x.dtype), ids, num_seqs)
    return (total / count.clamp(min=1))[ids]


def surrogate(lp: Tensor, anchor: Optional[Tensor], adv: Tensor, kept: Tensor, ids: Tensor, num_seqs: int,
              opts: PolicyLossOptions):
    """(p, acted): each token's surrogate p (autograd to lp; the loss is c * p) and whether the trust region
    acted on it. `anchor` is log pi_anchor, or None in bypass mode without a trust region (r = 1); `adv` is the
    token's sequence advantage; only `kept` tokens are read."""
    rule = opts.trust_rule
    if anchor is None:
        return ppo_surrogate(UnitRatio.apply(lp), adv, opts)
    delta = torch.where(kept, lp - anchor, 0)  # log rho, with its gradient
    if rule in ("none", "ppo"):
        return ppo_surrogate(torch.exp(delta), adv, opts)
    if rule == "gspo":  # the sequence's geometric-mean ratio, with the gradient of the token form
        rho_seq = torch.exp(_sequence_mean(delta.detach(), kept, ids, num_seqs))
        return ppo_surrogate(rho_seq * UnitRatio.apply(lp), adv, opts)
    if rule == "gmpo":  # the geometric mean of the token ratios, each clipped in log space on A's side
        eps_low, eps_high = opts.clip_ratio
        d = delta.detach()
        clipped = torch.where(adv > 0, torch.clamp(d, max=eps_high), torch.where(adv < 0, torch.clamp(d, min=-eps_low), d))
        inside = clipped == d
        rho_seq = torch.exp(_sequence_mean(clipped, kept, ids, num_seqs))
        unit = UnitRatio.apply(lp)
        return -adv * rho_seq * torch.where(inside, unit, unit.detach()), ~inside
    if rule == "sapo":  # a soft gate in place of the clip
        tau_pos, tau_neg = opts.sapo_tau
        tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
        return -adv * SapoGate.apply(delta, tau), torch.zeros_like(kept)
    eps_low, eps_high = opts.clip_ratio
    rho = torch.exp(delta.detach())
    if rule == "cispo":  # REINFORCE with the clipped ratio as a constant weight: clipped tokens keep a gradient
        weight = torch.clamp(rho, 1 - eps_low, 1 + eps_high)
        return -adv * weight * lp, weight != rho
    # dppo_tv: REINFORCE with the ratio (capped at clip_ratio_c) as a constant weight, on the tokens whose
    # probability moved less than the bound on A's side
    moved = torch.exp(lp.detach()) - torch.exp(anchor)
    inside = torch.where(adv > 0, moved <= eps_high, moved >= -eps_low)
    weight = rho if opts.clip_ratio_c is None else torch.clamp(rho, max=opts.clip_ratio_c)
    return -adv * torch.where(inside, weight, 0) * lp, ~inside
