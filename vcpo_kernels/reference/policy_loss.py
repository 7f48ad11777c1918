"""Reference fused VCPO loss, differentiable w.r.t. logp by autograd (docs/contract.md, "Loss")."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..inputs import SequenceBatch, TokenBatch
from ..options import LINEAR_IN_LOGP, PolicyLossOptions
from .advantages import advantage_terms
from .effective_sample_size import effective_sample_size
from .segments import segment_ids, segment_max, segment_sum
from .sequence_stats import sequence_stats, token_deltas
from .trust_region import surrogate


def is_coefficient(log_weight: Tensor, opts: PolicyLossOptions):
    """(c, changed): the IS coefficient of each unit and whether the correction changed its weight."""
    log_hi, log_lo = math.log(opts.is_threshold), math.log(opts.threshold_low)
    if opts.is_correction == "truncate":
        return torch.exp(torch.clamp(log_weight, max=log_hi)), log_weight > log_hi
    if opts.is_correction == "mask":
        kept = (log_weight >= log_lo) & (log_weight <= log_hi)
        return kept.to(log_weight.dtype), ~kept
    return torch.ones_like(log_weight), torch.zeros_like(log_weight, dtype=torch.bool)


def rejected_tokens(delta: Tensor, counted: Tensor, ids: Tensor, length: Tensor, opts: PolicyLossOptions):
    """Counted tokens that a rejection criterion removes (its own statistic, or its sequence's, fails the bounds;
    a NaN statistic fails)."""
    rejected = torch.zeros_like(counted)
    b = length.numel()
    for name, low, high in opts.rejection:
        scope, kind = name.rsplit("_", 1)
        if scope == "batch":  # M2PO: Delta^2 (in float64) at or above the batch's threshold (a NaN fails)
            square = delta.double() * delta.double()
            threshold = (second_moment_threshold(square, counted, opts.second_moment_bound)
                         if opts.second_moment_threshold is None else opts.second_moment_threshold)
            rejected |= counted & ~(square < threshold)
            continue
        token = {"k1": delta, "k2": 0.5 * delta * delta, "k3": torch.expm1(delta) - delta}[kind]
        if scope == "token":
            stat = token
        elif scope == "seq_max":
            stat = segment_max(torch.where(counted, token, -torch.inf), ids, b)[ids]
        else:
            total = segment_sum(torch.where(counted, token, 0), ids, b)
            stat = (total if scope == "seq_sum" else total / length.clamp(min=1))[ids]
        keep = (stat >= math.log(low)) & (stat <= math.log(high)) if kind == "k1" else stat <= high
        rejected |= counted & ~keep
    return rejected


def second_moment_threshold(square: Tensor, counted: Tensor, bound: float) -> Tensor:
    """M2PO's threshold: with v_1 >= v_2 >= ... the counted tokens' finite-or-infinite Delta^2 (`square`, float64;
    NaN left out), the smallest k whose rest v_{k+1..n} has a mean <= bound (an empty rest: 0), and v_k (+inf for
    k = 0): the tokens at or above it are masked. Suffix sums from the smallest value up; no host sync."""
    values = torch.where(counted & ~torch.isnan(square), square, -torch.inf)
    v = torch.sort(values.flatten(), descending=True).values
    n = (v > -torch.inf).sum()
    index = torch.arange(v.numel(), device=v.device)
    inside = index < n
    suffix = torch.flip(torch.cumsum(torch.flip(torch.where(inside, v, 0), [0]), 0), [0])  # sum of v[k:]
    rest_mean = suffix / (n - index).clamp(min=1)
    first_ok = torch.where(inside & (rest_mean <= bound), index, n).min() if v.numel() else n
    padded = torch.cat([v.new_full((1,), torch.inf), v])  # padded[k] = v_k, the k-th largest (1-based)
    return padded.index_select(0, first_ok.clamp(max=v.numel()).reshape(1)).squeeze(0)  # a tensor index: no sync


def ratio_anchor(tokens: TokenBatch, prox: Tensor, opts: PolicyLossOptions) -> Optional[Tensor]:
    """log pi_anchor of the ratio rho = pi / pi_anchor: old_logp; in bypass mode the behaviour policy's under a
    trust region, else None (r = 1)."""
    if tokens.old_logp is not None:
        return prox
    return None if opts.trust_rule == "none" else tokens.behavior_logp.to(prox.dtype)


def aggregation_weights(length: Tensor, opts: PolicyLossOptions, norm_length: Optional[float]) -> Tensor:
    """a_i, the weight of sequence i's token sum in the loss (0 for invalid sequences)."""
    valid = length > 0
    num_seqs = valid.sum().to(length.dtype).clamp(min=1)
    mode = opts.loss_agg_mode
    if mode == "token-mean":
        a = 1 / length.sum().clamp(min=1) * torch.ones_like(length)
    elif mode == "seq-mean-token-mean":
        a = 1 / (num_seqs * length.clamp(min=1))
    elif mode == "seq-mean-token-sum":
        a = 1 / num_seqs * torch.ones_like(length)
    else:
        a = 1 / (num_seqs * norm_length) * torch.ones_like(length)
    return torch.where(valid, a, 0)


def policy_loss(tokens: TokenBatch, seq: SequenceBatch, opts: PolicyLossOptions, norm_length: Optional[float]):
    """(loss, scalars, baseline, advantages, seq_log_weight); scalars in options.SCALAR_FIELDS order."""
    cd = tokens.acc_dtype
    s, length, k3 = sequence_stats(tokens)
    valid = length > 0
    num_seqs = valid.sum().to(cd)
    num_tokens = length.sum()
    s_trunc = torch.clamp(s, max=math.log(opts.is_threshold))
    ess, ess_ratio, lr_scale = effective_sample_size(
        s_trunc if opts.ess_on_corrected else s, length, opts.ess_base_ratio, opts.lr_rule
    )
    baseline, adv, max_share = advantage_terms(seq, s, length, opts)

    counted, prox, delta = token_deltas(tokens)
    ids = segment_ids(tokens.cu_seqlens, tokens.logp.numel())
    if opts.is_level == "token":
        coef, changed = is_coefficient(delta, opts)
        unit_coef, unit_valid, unit_count = coef, counted, num_tokens
    else:
        seq_lw = s / length.clamp(min=1) if opts.is_level == "geometric" else s
        unit_coef, changed = is_coefficient(seq_lw, opts)
        coef = unit_coef[ids]
        unit_valid, unit_count = valid, num_seqs
    rejected = rejected_tokens(delta, counted, ids, length, opts)
    coef = torch.where(rejected, 0, coef)
    lp = torch.where(counted, tokens.logp.to(cd), 0)  # masked tokens get an exact zero gradient
    # A unit the correction removed (c = 0) contributes exactly 0, even where r or A are not finite; so does a
    # token outside the sampling support (lp = -inf) under a rule whose value is linear in lp. Its advantage is
    # zeroed before autograd sees it: a NaN one would otherwise give a gradient of 0 * NaN.
    kept = counted & (coef != 0)
    if opts.trust_rule in LINEAR_IN_LOGP:
        kept &= lp != -torch.inf
    token_adv = torch.where(kept, adv[ids], 0)
    p, on_clip = surrogate(lp, ratio_anchor(tokens, prox, opts), token_adv, kept, ids, tokens.num_seqs, opts)
    token_loss = torch.where(kept, coef * p, 0)
    a = aggregation_weights(length, opts, norm_length)
    loss = (a * segment_sum(token_loss, ids, tokens.num_seqs)).sum()

    denom_units = unit_count.clamp(min=1)
    denom_tokens = num_tokens.clamp(min=1)
    scalars = torch.stack([
        ess,
        ess_ratio,
        lr_scale,
        (changed & unit_valid).sum().to(cd) / denom_units,
        torch.where(unit_valid, unit_coef, 0).sum() / denom_units,
        k3.sum() / denom_tokens,
        num_tokens,
        num_seqs,
        (valid & ~torch.isfinite(s)).sum().to(cd),
        (on_clip & kept).sum().to(cd) / denom_tokens,
        rejected.sum().to(cd) / denom_tokens,
        max_share.to(cd),
    ]).to(cd)
    return loss, scalars, baseline, adv, s
