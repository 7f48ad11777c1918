"""The fused VCPO loss (docs/contract.md, "Loss") in Triton, forward and backward, with no host sync:

1. per-chunk sums of the tokens, combined per sequence: s_i, L_i, k3_i (sequence_stats.py);
2. one program over the B sequences: counts, ESS and lr scale, the aggregation weight a_i and the
   sequence-level IS coefficient c_i, as grad_scale_i = a_i c_i (fp64 inside);
3. the advantages (advantages.py);
4. where r or c vary within a sequence (a proximal policy, token-level weights, a trust region), one program per
   chunk sums the token terms (GSPO, GMPO: after a first pass for each sequence's ratio); a last program adds the
   chunks in order and writes the loss and the statistics;
5. backward: one program per chunk writes d loss / d logp for each of its tokens."""

import math

import torch
import triton
import triton.language as tl

from ..inputs import SequenceBatch, TokenBatch
from ..options import (ADVANTAGES, IS_CORRECTIONS, IS_LEVELS, LINEAR_IN_LOGP, LOSS_AGG_MODES, LR_RULES, SCALAR_FIELDS,
                       TRUST_REGIONS, PolicyLossOptions)
from .advantages import OPOB, advantages
from .codes import (AGG_SEQ_MEAN_TOKEN_MEAN, AGG_SEQ_MEAN_TOKEN_SUM, AGG_TOKEN_MEAN, CORRECTION_MASK,
                    CORRECTION_TRUNCATE, LEVEL_GEOMETRIC, LEVEL_TOKEN, SCALAR_ESS, SCALAR_ESS_RATIO,
                    SCALAR_IS_CLIP_FRACTION, SCALAR_KL_K3, SCALAR_LR_SCALE, SCALAR_MEAN_IS_COEF, SCALAR_NUM_NONFINITE,
                    SCALAR_NUM_SEQS, SCALAR_NUM_TOKENS, SCALAR_OPOB_MAX_SHARE, SCALAR_PPO_CLIP_FRACTION,
                    SCALAR_REJECTED_FRACTION, RULE_CISPO, RULE_DPPO_TV, RULE_GMPO, RULE_GSPO)
from .effective_sample_size import ess_of
from .rejection import sequence_rejection, token_criteria, token_rejected
from .segments import BLOCK, CHUNK, chunk_span, combine
from .sequence_stats import sequence_sums

BLOCK_SEQS = 1024


@triton.jit
def is_coef(lw, log_hi, log_lo, CORRECTION: tl.constexpr):
    """The IS coefficient of a unit with log weight lw: exp(min(lw, log C)), 1[log C_low <= lw <= log C] or 1."""
    if CORRECTION == CORRECTION_TRUNCATE:
        return tl.exp(tl.where(lw > log_hi, log_hi, lw))
    if CORRECTION == CORRECTION_MASK:
        return tl.where((lw >= log_lo) & (lw <= log_hi), 1.0, 0.0)
    return tl.where(lw == lw, 1.0, 1.0)  # a block of ones shaped like lw, also where lw is not finite


@triton.jit
def is_changed(lw, log_hi, log_lo, CORRECTION: tl.constexpr):
    if CORRECTION == CORRECTION_TRUNCATE:
        return tl.where(lw > log_hi, 1.0, 0.0)
    if CORRECTION == CORRECTION_MASK:
        return tl.where((lw >= log_lo) & (lw <= log_hi), 0.0, 1.0)
    return tl.where(lw == lw, 0.0, 0.0)


PARTS = tl.constexpr(5)  # the token pass's partial sums per chunk: loss, changed units, c, acted on, rejected

# The slots of the float64 work vector the batch program hands to the last one: ESS, ESS ratio, lr scale,
# sequence-level changed units and coefficient sum, K3 sum, counted tokens, valid sequences, non-finite log weights.
NUM_WORK = 9
WORK_ESS, WORK_RATIO, WORK_LR, WORK_CHANGED, WORK_COEF, WORK_KL, WORK_TOKENS, WORK_SEQS, WORK_NONFINITE = (
    tl.constexpr(i) for i in range(NUM_WORK))


@triton.jit
def _batch_step(s_ptr, len_ptr, kl_ptr, gs_ptr, work_ptr, n, log_hi, log_lo, base, norm_length,
                ESS_TRUNC: tl.constexpr, RULE: tl.constexpr, LEVEL: tl.constexpr, CORRECTION: tl.constexpr,
                AGG: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.zeros((), tl.float64)
    seqs = tl.zeros((), tl.float64)
    kl = tl.zeros((), tl.float64)
    nonfinite = tl.zeros((), tl.float64)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        length = tl.load(len_ptr + i, mask=i < n, other=0.0).to(tl.float64)
        valid = length > 0
        s = tl.load(s_ptr + i, mask=valid, other=0.0).to(tl.float64)
        tokens += tl.sum(tl.where(valid, length, 0.0), 0)
        seqs += tl.sum(valid.to(tl.float64), 0)
        kl += tl.sum(tl.where(valid, tl.load(kl_ptr + i, mask=valid, other=0.0).to(tl.float64), 0.0), 0)
        finite = (s == s) & (tl.abs(s) < float("inf"))
        nonfinite += tl.sum(tl.where(valid & ~finite, 1.0, 0.0), 0)
    ess, ratio, lr = ess_of(s_ptr, len_ptr, n, log_hi, base, True, ESS_TRUNC, RULE, BLOCK)
    changed = tl.zeros((), tl.float64)
    coef_sum = tl.zeros((), tl.float64)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        length = tl.load(len_ptr + i, mask=i < n, other=0.0).to(tl.float64)
        valid = length > 0
        if AGG == AGG_TOKEN_MEAN:
            a = 1.0 / tl.maximum(tokens, 1.0) + length * 0.0
        elif AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
            a = 1.0 / (tl.maximum(seqs, 1.0) * tl.maximum(length, 1.0))
        elif AGG == AGG_SEQ_MEAN_TOKEN_SUM:
            a = 1.0 / tl.maximum(seqs, 1.0) + length * 0.0
        else:  # seq-mean-token-sum-norm
            a = 1.0 / (tl.maximum(seqs, 1.0) * norm_length) + length * 0.0
        c = length * 0.0 + 1.0
        if LEVEL != LEVEL_TOKEN:  # sequence or geometric: one coefficient per sequence
            s = tl.load(s_ptr + i, mask=valid, other=0.0).to(tl.float64)
            lw = s / tl.maximum(length, 1.0) if LEVEL == LEVEL_GEOMETRIC else s
            c = is_coef(lw, log_hi, log_lo, CORRECTION)
            changed += tl.sum(tl.where(valid, is_changed(lw, log_hi, log_lo, CORRECTION), 0.0), 0)
            coef_sum += tl.sum(tl.where(valid, c, 0.0), 0)
        tl.store(gs_ptr + i, tl.where(valid, a * c, 0.0).to(gs_ptr.dtype.element_ty), mask=i < n)
    tl.store(work_ptr + WORK_ESS, ess)
    tl.store(work_ptr + WORK_RATIO, ratio)
    tl.store(work_ptr + WORK_LR, lr)
    tl.store(work_ptr + WORK_CHANGED, changed)
    tl.store(work_ptr + WORK_COEF, coef_sum)
    tl.store(work_ptr + WORK_KL, kl)
    tl.store(work_ptr + WORK_TOKENS, tokens)
    tl.store(work_ptr + WORK_SEQS, seqs)
    tl.store(work_ptr + WORK_NONFINITE, nonfinite)


@triton.jit
def _rule_terms(cur, anchor, d, rho_seq, adv, ratio_lo, ratio_hi, eps_lo, eps_hi, dual_c, tau_pos, tau_neg,
                RULE: tl.constexpr, DUAL: tl.constexpr):
    """(p, d p / d lp, acted) of the rules beyond PPO's clip of r (docs/contract.md, "Trust regions"); `d` is
    lp - lp_anchor and `rho_seq` the sequence's ratio of GSPO and GMPO."""
    if RULE == RULE_GMPO:
        inside = tl.where(adv > 0, d <= eps_hi, tl.where(adv < 0, d >= -eps_lo, d == d))
        return -adv * rho_seq, tl.where(inside, -adv * rho_seq, 0.0), ~inside
    rho = tl.exp(d)
    if RULE == RULE_CISPO:
        w = tl.where(rho < ratio_lo, ratio_lo, tl.where(rho > ratio_hi, ratio_hi, rho))
        return -adv * w * cur, -adv * w, w != rho
    if RULE == RULE_DPPO_TV:
        moved = tl.exp(cur) - tl.exp(anchor)
        inside = tl.where(adv > 0, moved <= eps_hi, moved >= -eps_lo)
        w = rho
        if DUAL:
            w = tl.where(rho > dual_c, dual_c, rho)
        w = tl.where(inside, w, 0.0)
        return -adv * w * cur, -adv * w, ~inside
    # SAPO: the gate (4 / tau) sigmoid(tau (rho - 1)); its slope 4 s (1 - s) rho from e = exp(-|x|), 0 where rho
    # overflows (not 0 * inf)
    zero = tl.zeros_like(d)  # blocks in d's dtype: a float argument alone would stay fp32
    tau = tl.where(adv > 0, zero + tau_pos, zero + tau_neg)
    x = tau * (rho - 1.0)
    e = tl.exp(-tl.abs(x))
    sig = tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    slope = tl.where(rho == float("inf"), 0.0, 4.0 * e / ((1.0 + e) * (1.0 + e)) * rho)
    return -adv * 4.0 / tau * sig, -adv * slope, (d != d) & (d == d)  # acts on no token


@triton.jit
def _token_pass(lp_ptr, mu_ptr, old_ptr, mask_ptr, cu_ptr, chunk_end_ptr, adv_ptr, gs_ptr, rho_ptr, m2_ptr,
                seq_rejected_ptr, grad_loss_ptr, part_ptr, grad_ptr, num_seqs, num_tokens, search_steps, log_hi, log_lo,
                ratio_lo, ratio_hi, dual_c, eps_lo, eps_hi, tau_pos, tau_neg, k1_lo, k1_hi, k2_hi, k3_hi,
                REJECT_K1: tl.constexpr, REJECT_K2: tl.constexpr, REJECT_K3: tl.constexpr, REJECT_M2: tl.constexpr,
                HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr, TOKEN_LEVEL: tl.constexpr,
                CORRECTION: tl.constexpr, RULE: tl.constexpr, PPO_FORM: tl.constexpr, LINEAR_IN_LP: tl.constexpr,
                MU_ANCHOR: tl.constexpr, CLIP: tl.constexpr, DUAL: tl.constexpr, SEQ_PASS: tl.constexpr, WRITE_GRAD: tl.constexpr, ACC64: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    # Forward (WRITE_GRAD False): the chunk's sums of c p, changed units, c and the tokens the trust region acted
    # on, the first times grad_scale. Backward: grad[t] = g grad_scale c (d p / d lp), 0 where the token does not
    # count. SEQ_PASS (GSPO, GMPO): the chunk's sum of the kept tokens' log ratios (GMPO: clipped) and their count.
    acc_t = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0)
    seq, first, last = chunk_span(pid, chunk_end_ptr, cu_ptr, num_seqs, num_tokens, search_steps, CHUNK)
    if seq < num_seqs:
        adv = tl.load(adv_ptr + seq).to(acc_t)
        gs = tl.load(gs_ptr + seq).to(acc_t)
        rho_seq = tl.load(rho_ptr + seq).to(acc_t)
        m2_threshold = tl.load(m2_ptr)  # float64: compared with Delta^2 in float64
        seq_rejected = tl.load(seq_rejected_ptr + seq) != 0  # its token rejections are not counted again
        if WRITE_GRAD:
            gs = gs * tl.load(grad_loss_ptr).to(acc_t)
        gs_block = tl.zeros((BLOCK,), acc_t) + gs  # a block: the interpreter cannot OR a scalar into one
        loss = tl.zeros((BLOCK,), acc_t)
        changed = tl.zeros((BLOCK,), acc_t)
        coef_sum = tl.zeros((BLOCK,), acc_t)
        clipped = tl.zeros((BLOCK,), acc_t)
        rejected = tl.zeros((BLOCK,), acc_t)
        kept = tl.zeros((BLOCK,), acc_t)
        for start in range(first, last, BLOCK):
            t = start + tl.arange(0, BLOCK)
            inside = t < last
            counted = inside
            if HAS_MASK:
                counted = counted & (tl.load(mask_ptr + t, mask=inside, other=0) != 0)
            cur = tl.where(counted, tl.load(lp_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)
            prox = cur
            if HAS_OLD:
                prox = tl.where(counted, tl.load(old_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)
            c = tl.where(counted, 1.0, 1.0).to(acc_t)  # not cur * 0 + 1: lp may be -inf
            if TOKEN_LEVEL:
                d = tl.where(counted, prox - tl.load(mu_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)
                c = is_coef(d, log_hi, log_lo, CORRECTION).to(acc_t)
                changed += tl.where(counted, is_changed(d, log_hi, log_lo, CORRECTION), 0.0).to(acc_t)
                coef_sum += tl.where(counted, c, 0.0)
            if REJECT_K1 or REJECT_K2 or REJECT_K3 or REJECT_M2:  # after the IS statistics: those without rejection
                d_mu = tl.where(counted, prox - tl.load(mu_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)
                out = token_rejected(d_mu, k1_lo, k1_hi, k2_hi, k3_hi, m2_threshold, REJECT_K1, REJECT_K2, REJECT_K3,
                                     REJECT_M2)
                rejected += tl.where(counted & out & ~seq_rejected, 1.0, 0.0).to(acc_t)
                c = tl.where(out, 0.0, c)
            # a unit the correction removed (c = 0) contributes exactly 0, even where r or A are not finite; so does
            # a token outside the sampling support (lp = -inf) under a rule linear in lp
            dropped = (c == 0.0) | (gs_block == 0.0)
            if LINEAR_IN_LP:
                dropped = dropped | (cur == -float("inf"))
            # the ratio's anchor: old_logp; in bypass mode the behaviour policy under a trust region, else r = 1
            anchor = prox
            if MU_ANCHOR:
                anchor = tl.where(counted, tl.load(mu_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)
            log_ratio = tl.where(dropped, 0.0, cur - anchor)
            if SEQ_PASS:
                if RULE == RULE_GMPO:  # where, not tl.minimum: a NaN must stay NaN
                    log_ratio = tl.where(adv > 0, tl.where(log_ratio > eps_hi, eps_hi, log_ratio),
                                         tl.where(adv < 0, tl.where(log_ratio < -eps_lo, -eps_lo, log_ratio),
                                                  log_ratio))
                loss += tl.where(counted & ~dropped, log_ratio, 0.0)
                kept += tl.where(counted & ~dropped, 1.0, 0.0).to(acc_t)
            else:
                if PPO_FORM:
                    r = tl.where(counted, 1.0, 1.0).to(acc_t)
                    if RULE == RULE_GSPO:
                        r = r * rho_seq
                    elif HAS_OLD or MU_ANCHOR:
                        r = tl.exp(log_ratio)
                    p1 = -adv * r
                    val = p1
                    dval = tl.where(counted, 0.0, 0.0).to(acc_t) - adv
                    on_clip = t < 0  # all False
                    if CLIP:
                        rc = tl.where(r < ratio_lo, ratio_lo, tl.where(r > ratio_hi, ratio_hi, r))
                        p2 = -adv * rc
                        take_unclipped = p1 >= p2  # ties go to the unclipped branch
                        val = tl.where(take_unclipped, p1, p2)
                        dval = tl.where(take_unclipped, dval, 0.0)
                        on_clip = ~take_unclipped
                        if DUAL:
                            limit = -adv * dual_c
                            take_dual = (gs_block * 0.0 + adv < 0) & ~(val <= limit)
                            val = tl.where(take_dual, limit, val)
                            dval = tl.where(take_dual, 0.0, dval)
                            on_clip = on_clip | take_dual
                    dlp = dval * r
                else:
                    val, dlp, on_clip = _rule_terms(cur, anchor, log_ratio, rho_seq, adv, ratio_lo, ratio_hi, eps_lo,
                                                    eps_hi, dual_c, tau_pos, tau_neg, RULE, DUAL)
                if WRITE_GRAD:
                    g = tl.where(counted & ~dropped, gs * c * dlp, 0.0)
                    tl.store(grad_ptr + t, g.to(grad_ptr.dtype.element_ty), mask=inside)
                else:
                    loss += tl.where(counted & ~dropped, c * val, 0.0)
                    clipped += tl.where(counted & ~dropped & on_clip, 1.0, 0.0).to(acc_t)
        if SEQ_PASS:
            tl.store(part_ptr + pid * 2, tl.sum(loss, 0))
            tl.store(part_ptr + pid * 2 + 1, tl.sum(kept, 0))
        elif not WRITE_GRAD:
            chunk_loss = tl.sum(loss, 0)
            tl.store(part_ptr + pid * PARTS, tl.where(gs != 0.0, gs * chunk_loss, 0.0))
            tl.store(part_ptr + pid * PARTS + 1, tl.sum(changed, 0))
            tl.store(part_ptr + pid * PARTS + 2, tl.sum(coef_sum, 0))
            tl.store(part_ptr + pid * PARTS + 3, tl.sum(clipped, 0))
            tl.store(part_ptr + pid * PARTS + 4, tl.sum(rejected, 0))


@triton.jit
def _finish(part_ptr, num_parts, work_ptr, gs_ptr, adv_ptr, len_ptr, n, loss_ptr, scalars_ptr, share_ptr,
            seq_rejected_ptr, TOKEN_PASS: tl.constexpr, TOKEN_LEVEL: tl.constexpr, BLOCK: tl.constexpr):
    # The loss and the statistics of contract.md, "Statistics", from the chunk partials (in order) or, when
    # the token terms are constant within each sequence, from -sum_i grad_scale_i A_i L_i.
    loss = tl.zeros((), tl.float64)
    tok_changed = tl.zeros((), tl.float64)
    tok_coef = tl.zeros((), tl.float64)
    clipped = tl.zeros((), tl.float64)
    rejected = tl.zeros((), tl.float64)
    for start in range(0, n, BLOCK):  # the tokens of the sequences a sequence criterion rejected
        i = start + tl.arange(0, BLOCK)
        length = tl.load(len_ptr + i, mask=i < n, other=0.0).to(tl.float64)
        rejected += tl.sum(tl.where(tl.load(seq_rejected_ptr + i, mask=i < n, other=0) != 0, length, 0.0), 0)
    if TOKEN_PASS:
        for start in range(0, num_parts, BLOCK):
            j = start + tl.arange(0, BLOCK)
            inside = j < num_parts
            loss += tl.sum(tl.load(part_ptr + j * PARTS, mask=inside, other=0.0).to(tl.float64), 0)
            tok_changed += tl.sum(tl.load(part_ptr + j * PARTS + 1, mask=inside, other=0.0).to(tl.float64), 0)
            tok_coef += tl.sum(tl.load(part_ptr + j * PARTS + 2, mask=inside, other=0.0).to(tl.float64), 0)
            clipped += tl.sum(tl.load(part_ptr + j * PARTS + 3, mask=inside, other=0.0).to(tl.float64), 0)
            rejected += tl.sum(tl.load(part_ptr + j * PARTS + 4, mask=inside, other=0.0).to(tl.float64), 0)
    else:
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            length = tl.load(len_ptr + i, mask=i < n, other=0.0).to(tl.float64)
            gs = tl.load(gs_ptr + i, mask=i < n, other=0.0).to(tl.float64)
            adv = tl.load(adv_ptr + i, mask=i < n, other=0.0).to(tl.float64)
            loss -= tl.sum(tl.where((length > 0) & (gs != 0.0), gs * adv * length, 0.0), 0)
    tokens = tl.load(work_ptr + WORK_TOKENS)
    seqs = tl.load(work_ptr + WORK_SEQS)
    if TOKEN_LEVEL:
        unit_changed = tok_changed
        unit_coef = tok_coef
        units = tokens
    else:
        unit_changed = tl.load(work_ptr + WORK_CHANGED)
        unit_coef = tl.load(work_ptr + WORK_COEF)
        units = seqs
    dt = scalars_ptr.dtype.element_ty
    tl.store(loss_ptr, loss.to(dt))
    tl.store(scalars_ptr + SCALAR_ESS, tl.load(work_ptr + WORK_ESS).to(dt))
    tl.store(scalars_ptr + SCALAR_ESS_RATIO, tl.load(work_ptr + WORK_RATIO).to(dt))
    tl.store(scalars_ptr + SCALAR_LR_SCALE, tl.load(work_ptr + WORK_LR).to(dt))
    tl.store(scalars_ptr + SCALAR_IS_CLIP_FRACTION,
             tl.where(units > 0, unit_changed / tl.maximum(units, 1.0), 0.0).to(dt))
    tl.store(scalars_ptr + SCALAR_MEAN_IS_COEF, tl.where(units > 0, unit_coef / tl.maximum(units, 1.0), 0.0).to(dt))
    tl.store(scalars_ptr + SCALAR_KL_K3,
             tl.where(tokens > 0, tl.load(work_ptr + WORK_KL) / tl.maximum(tokens, 1.0), 0.0).to(dt))
    tl.store(scalars_ptr + SCALAR_NUM_TOKENS, tokens.to(dt))
    tl.store(scalars_ptr + SCALAR_NUM_SEQS, seqs.to(dt))
    tl.store(scalars_ptr + SCALAR_NUM_NONFINITE, tl.load(work_ptr + WORK_NONFINITE).to(dt))
    tl.store(scalars_ptr + SCALAR_PPO_CLIP_FRACTION,
             tl.where(tokens > 0, clipped / tl.maximum(tokens, 1.0), 0.0).to(dt))
    tl.store(scalars_ptr + SCALAR_REJECTED_FRACTION,
             tl.where(tokens > 0, rejected / tl.maximum(tokens, 1.0), 0.0).to(dt))
    tl.store(scalars_ptr + SCALAR_OPOB_MAX_SHARE, tl.load(share_ptr).to(dt))


def _token_args(t: TokenBatch, plan, adv, gs, rho_seq, rejection, opts: PolicyLossOptions):
    """(grid, the pointer arguments, the scalars, the flags) of _token_pass; `rejection` is (token_criteria's dict,
    the [B] uint8 flags of the sequences a sequence criterion rejected)."""
    chunk_end, grid, steps = plan
    dummy = t.logp
    eps_low, eps_high = opts.clip_ratio if opts.clip_ratio is not None else (0.0, 0.0)
    tau_pos, tau_neg = opts.sapo_tau
    criteria, seq_rejected = rejection
    args = (t.logp.detach(), t.behavior_logp.detach(), dummy if t.old_logp is None else t.old_logp.detach(),
            dummy if t.mask is None else t.mask.view(torch.uint8), t.cu_seqlens, chunk_end, adv, gs, rho_seq,
            criteria["threshold"], seq_rejected)
    scalars = (t.num_seqs, t.logp.numel(), steps, math.log(opts.is_threshold), math.log(opts.threshold_low),
               1.0 - eps_low, 1.0 + eps_high, float(opts.clip_ratio_c or 0.0), eps_low, eps_high, tau_pos, tau_neg,
               *criteria["bounds"])
    rule = opts.trust_rule
    flags = dict(**criteria["flags"], HAS_OLD=t.old_logp is not None, HAS_MASK=t.mask is not None,
                 TOKEN_LEVEL=opts.is_level == "token", CORRECTION=IS_CORRECTIONS[opts.is_correction],
                 RULE=TRUST_REGIONS[rule], PPO_FORM=rule in ("none", "ppo", "gspo"), LINEAR_IN_LP=rule in LINEAR_IN_LOGP,
                 MU_ANCHOR=t.old_logp is None and rule != "none", CLIP=rule in ("ppo", "gspo"),
                 DUAL=opts.clip_ratio_c is not None,
                 ACC64=t.acc_dtype == torch.float64, CHUNK=CHUNK, BLOCK=BLOCK)
    return grid, args, scalars, flags


def _sequence_ratios(t: TokenBatch, plan, adv, gs, rejection, opts: PolicyLossOptions) -> torch.Tensor:
    """[B]: GSPO's and GMPO's ratio of each sequence, exp of the mean log ratio over its kept tokens (GMPO: each
    clipped on the advantage's side); ones for the other rules (not read)."""
    if opts.trust_rule not in ("gspo", "gmpo"):
        return torch.ones_like(gs)
    grid, args, scalars, flags = _token_args(t, plan, adv, gs, torch.ones_like(gs), rejection, opts)
    partials = torch.zeros((max(grid, 1), 2), dtype=gs.dtype, device=gs.device)
    if grid and t.num_seqs:
        _token_pass[(grid,)](*args, gs, partials, t.logp, *scalars, SEQ_PASS=True, WRITE_GRAD=False, **flags)
    total, count = combine(partials, plan[0], t.num_seqs)
    return torch.exp(total / count.clamp(min=1))


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, tokens: TokenBatch, seq: SequenceBatch, opts: PolicyLossOptions, norm_length):
        t = tokens
        b, acc, device = t.num_seqs, t.acc_dtype, t.logp.device
        sums, plan = sequence_sums(t)
        s, length, kl = sums[0], sums[1], sums[2]
        gs = torch.empty(b, dtype=acc, device=device)
        work = torch.empty(NUM_WORK, dtype=torch.float64, device=device)
        log_hi, log_lo = math.log(opts.is_threshold), math.log(opts.threshold_low)
        _batch_step[(1,)](s, length, kl, gs, work, b, log_hi, log_lo, opts.ess_base_ratio,
                          float(norm_length or 1.0), ESS_TRUNC=opts.ess_on_corrected, RULE=LR_RULES[opts.lr_rule],
                          LEVEL=IS_LEVELS[opts.is_level], CORRECTION=IS_CORRECTIONS[opts.is_correction],
                          AGG=LOSS_AGG_MODES[opts.loss_agg_mode], BLOCK=BLOCK_SEQS)
        if seq.advantages is not None:
            baseline = torch.zeros(seq.num_groups, dtype=acc, device=device)
            adv = torch.where(length > 0, seq.advantages, 0)
            share = work.new_zeros(())
        else:
            kind = ADVANTAGES[opts.advantage]
            baseline, adv, share = advantages(
                kind, seq.rewards, length, seq.group_index, seq.num_groups, opts.norm_by_std,
                log_weight=s if kind == OPOB else None, grad_sq_norm=seq.grad_sq_norm,
                length_norm=opts.opob_length_norm, weight=opts.opob_weight_code, log_hi=log_hi,
                aggregation=opts.opob_aggregation, quantiles=opts.opob_winsorize_quantiles,
                leave_one_out=opts.opob_leave_one_out)
        token_pass = (t.old_logp is not None or opts.is_level == "token" or opts.trust_rule != "none" or
                      opts.token_rejection)
        seq_rejected = sequence_rejection(t, plan, length, opts)
        gs = torch.where(seq_rejected, 0, gs)  # after the IS statistics: those without rejection
        rejection = (token_criteria(t, opts), seq_rejected.to(torch.uint8))
        rho_seq = _sequence_ratios(t, plan, adv, gs, rejection, opts)
        grid, args, scalars, flags = _token_args(t, plan, adv, gs, rho_seq, rejection, opts)
        partials = torch.zeros((max(grid, 1), PARTS), dtype=acc, device=device)
        if token_pass and grid and b:
            _token_pass[(grid,)](*args, work, partials, t.logp, *scalars, SEQ_PASS=False, WRITE_GRAD=False, **flags)
        loss = torch.empty((), dtype=acc, device=device)
        stats = torch.empty(len(SCALAR_FIELDS), dtype=acc, device=device)
        _finish[(1,)](partials, grid if token_pass else 0, work, gs, adv, length, b, loss, stats, share,
                      rejection[1], TOKEN_PASS=token_pass, TOKEN_LEVEL=opts.is_level == "token", BLOCK=BLOCK_SEQS)
        ctx.tokens, ctx.plan, ctx.opts, ctx.criteria = t, plan, opts, rejection[0]
        ctx.save_for_backward(adv, gs, rho_seq, rejection[1])
        ctx.mark_non_differentiable(stats, baseline, adv, s)
        return loss, stats, baseline, adv, s

    @staticmethod
    def backward(ctx, grad_loss, *_):
        t = ctx.tokens
        adv, gs, rho_seq, seq_rejected = ctx.saved_tensors
        grad = torch.empty_like(t.logp)
        grid, args, scalars, flags = _token_args(t, ctx.plan, adv, gs, rho_seq, (ctx.criteria, seq_rejected), ctx.opts)
        if grid and t.num_seqs:
            _token_pass[(grid,)](*args, grad_loss.to(gs.dtype).contiguous(), gs, grad, *scalars, SEQ_PASS=False,
                                 WRITE_GRAD=True, **flags)
        else:
            grad.zero_()
        return grad, None, None, None, None


def policy_loss(tokens: TokenBatch, seq: SequenceBatch, opts: PolicyLossOptions, norm_length):
    """(loss, scalars, baseline, advantages, seq_log_weight); autograd to tokens.logp."""
    return _PolicyLoss.apply(tokens.logp, tokens, seq, opts, norm_length)
