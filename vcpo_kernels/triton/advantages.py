"""Group baselines and advantages of every estimator (docs/contract.md, "Advantages") in Triton, fp64:
one program per group reads its members from the sequences sorted by group (no float atomics: deterministic),
then one program per block of sequences writes the advantages."""

import torch
import triton
import triton.language as tl

from ..options import ADVANTAGES
from .codes import (ADVANTAGE_GRPO, ADVANTAGE_OPOB, ADVANTAGE_REINFORCE, ADVANTAGE_RLOO, WEIGHT_REFERENCE_COMPAT,
                    WEIGHT_TRUNCATED)

BLOCK_SEQS = 1024
BLOCK_PAIRS = 64  # members per side of a block of pairs in the weighted quantiles
OPOB, REINFORCE, NONE = ADVANTAGES["opob"], ADVANTAGES["reinforce"], ADVANTAGES["none"]


@triton.jit
def opob_log_weight(s, log_hi, WEIGHT: tl.constexpr):
    """The log weight OPOB squares: s (raw), min(s, log C) (truncated), or s + min(s, log C) (reference)."""
    trunc = tl.where(s > log_hi, log_hi, s)
    if WEIGHT == WEIGHT_TRUNCATED:
        return trunc
    if WEIGHT == WEIGHT_REFERENCE_COMPAT:
        return s + trunc
    return s


@triton.jit
def group_range(start_ptr, g, n, HAS_GROUP: tl.constexpr):
    """[begin, end) of group g's run in the sorted order (the whole batch without groups)."""
    begin = tl.zeros((), tl.int64)
    end = tl.zeros((), tl.int64) + n
    if HAS_GROUP:
        begin = tl.load(start_ptr + g)
        end = tl.load(start_ptr + g + 1)
    return begin, end


@triton.jit
def group_members(k, end, order_ptr, len_ptr, HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr):
    """(sequence index, whether it is a valid member) of positions k < end of a group's run in the sorted order."""
    inside = k < end
    i = k
    if HAS_GROUP:
        i = tl.load(order_ptr + k, mask=inside, other=0)
    member = inside
    if HAS_LEN:
        member = member & (tl.load(len_ptr + i, mask=inside, other=0.0) > 0)
    return i, member


@triton.jit
def opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ: tl.constexpr, LENGTH_NORM: tl.constexpr,
               WEIGHT: tl.constexpr):
    """log W_i = 2 lw_i + log G_i (- 2 log L_i), fp64."""
    log_w = 2.0 * opob_log_weight(tl.load(lw_ptr + i, mask=member, other=0.0).to(tl.float64), log_hi, WEIGHT)
    if HAS_GSQ:
        log_w += tl.log(tl.load(gsq_ptr + i, mask=member, other=1.0).to(tl.float64))
    if LENGTH_NORM:
        log_w -= 2.0 * tl.log(tl.load(len_ptr + i, mask=member, other=1.0).to(tl.float64))
    return log_w


# Rows of the per-group stats: count, mean, population variance, baseline, the largest OPOB weight share; with
# leave_one_out, the sums over the members shifted by their max (shift, sum_w, sum_wd) and over the members but
# the first argmax shifted by theirs (first, shift2, sum_w2, sum_wd2).
COUNT, MEAN, VAR, BASELINE, SHARE, SHIFT, SUM_W, SUM_WD, FIRST, SHIFT2, SUM_W2, SUM_WD2 = range(12)
STAT_ROWS = 12


@triton.jit
def _shifted_sums(begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr, log_hi, mean, shift, skip,
                  HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, HAS_GSQ: tl.constexpr, LENGTH_NORM: tl.constexpr,
                  WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """(sum W, sum W (R - mean)) over a group's members but sequence `skip`, W = exp(log W - shift) (shift 0 where
    it is not finite: NaN/+inf propagate)."""
    safe = tl.where((shift == shift) & (tl.abs(shift) < float("inf")), shift, 0.0)
    sum_w = tl.zeros((), tl.float64)
    sum_wd = tl.zeros((), tl.float64)
    for first in range(begin, end, BLOCK):
        i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        member = member & (i != skip)
        log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
        w = tl.where(member, tl.exp(log_w - safe), 0.0)
        r = tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64)
        sum_w += tl.sum(w, 0)
        sum_wd += tl.sum(tl.where(member, w * (r - mean), 0.0), 0)
    return sum_w, sum_wd


@triton.jit
def _group_stats(r_ptr, len_ptr, order_ptr, start_ptr, lw_ptr, gsq_ptr, stats_ptr, n, num_groups, log_hi,
                 HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, IS_OPOB: tl.constexpr, HAS_GSQ: tl.constexpr,
                 LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr, LEAVE_ONE_OUT: tl.constexpr, BLOCK: tl.constexpr):
    # stats[:, g] (the rows above) of group g's valid members, read from its run order[start[g]:start[g + 1]] of the
    # sorted order (the whole batch without groups)
    g = tl.program_id(0)
    begin, end = group_range(start_ptr, g, n, HAS_GROUP)
    count = tl.zeros((), tl.float64)
    total = tl.zeros((), tl.float64)
    for first in range(begin, end, BLOCK):
        i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        count += tl.sum(member.to(tl.float64), 0)
        total += tl.sum(tl.where(member, tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64), 0.0), 0)
    mean = tl.where(count > 0, total / tl.maximum(count, 1.0), 0.0)
    sq = tl.zeros((), tl.float64)
    shift = tl.full((), float("-inf"), tl.float64)
    for first in range(begin, end, BLOCK):
        i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        d = tl.where(member, tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64) - mean, 0.0)
        sq += tl.sum(d * d, 0)
        if IS_OPOB:
            log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
            shift = tl.maximum(shift, tl.max(tl.where(member, log_w, float("-inf")), 0))
    var = tl.where(count > 0, sq / tl.maximum(count, 1.0), 0.0)
    baseline = mean
    share = tl.zeros((), tl.float64)
    if IS_OPOB:
        # b = mean + sum W (R - mean) / sum W, W = exp(log W - max): exact for one member or equal rewards
        sum_w, sum_wd = _shifted_sums(begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr, log_hi, mean, shift, -1,
                                      HAS_GROUP, HAS_LEN, HAS_GSQ, LENGTH_NORM, WEIGHT, BLOCK)
        baseline = tl.where(shift == float("-inf"), mean, mean + sum_wd / sum_w)  # every W = 0: plain mean
        # max W / sum W = 1 / sum exp(log W - max); every W = 0: 1 / n_g; a NaN or +inf W: NaN; no member: 0
        share = tl.where(shift == float("-inf"), 1.0 / tl.maximum(count, 1.0), 1.0 / sum_w)
        share = tl.where((shift != shift) | (shift == float("inf")), float("nan"), share)
        share = tl.where(count > 0, share, 0.0)
        if LEAVE_ONE_OUT:
            top = tl.full((), n, tl.int64)  # the group's first argmax (members keep their order in the run)
            for first in range(begin, end, BLOCK):
                i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
                log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
                top = tl.minimum(top, tl.min(tl.where(member & (log_w == shift), i.to(tl.int64), n), 0))
            shift2 = tl.full((), float("-inf"), tl.float64)
            for first in range(begin, end, BLOCK):
                i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
                member = member & (i != top)
                log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
                shift2 = tl.maximum(shift2, tl.max(tl.where(member, log_w, float("-inf")), 0))
            sum_w2, sum_wd2 = _shifted_sums(begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr, log_hi, mean,
                                            shift2, top, HAS_GROUP, HAS_LEN, HAS_GSQ, LENGTH_NORM, WEIGHT, BLOCK)
            tl.store(stats_ptr + SHIFT * num_groups + g, shift)
            tl.store(stats_ptr + SUM_W * num_groups + g, sum_w)
            tl.store(stats_ptr + SUM_WD * num_groups + g, sum_wd)
            tl.store(stats_ptr + FIRST * num_groups + g, top.to(tl.float64))
            tl.store(stats_ptr + SHIFT2 * num_groups + g, shift2)
            tl.store(stats_ptr + SUM_W2 * num_groups + g, sum_w2)
            tl.store(stats_ptr + SUM_WD2 * num_groups + g, sum_wd2)
    tl.store(stats_ptr + COUNT * num_groups + g, count)
    tl.store(stats_ptr + MEAN * num_groups + g, mean)
    tl.store(stats_ptr + VAR * num_groups + g, var)
    tl.store(stats_ptr + BASELINE * num_groups + g, baseline)
    tl.store(stats_ptr + SHARE * num_groups + g, share)


@triton.jit
def _member_w(i, member, none, safe, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ: tl.constexpr,
              LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr):
    """w_i = W_i / max W of the group (1 when every W is 0), 0 for non-members."""
    log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
    return tl.where(member, tl.where(none, 1.0, tl.exp(log_w - safe)), 0.0)


@triton.jit
def _quantile(q, total, top, begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr, none, safe, log_hi,
              HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, HAS_GSQ: tl.constexpr, LENGTH_NORM: tl.constexpr,
              WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest R_k whose running weight sum_j w_j [R_j <= R_k] reaches q total (top if none): blocks of
    [BLOCK, BLOCK] pairs, O(n_g^2)."""
    low = tl.full((), float("inf"), tl.float64)
    for k0 in range(begin, end, BLOCK):
        ik, mk = group_members(k0 + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        rk = tl.load(r_ptr + ik, mask=mk, other=0.0).to(tl.float64)
        cum = tl.zeros((BLOCK,), tl.float64)
        for j0 in range(begin, end, BLOCK):
            ij, mj = group_members(j0 + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
            rj = tl.load(r_ptr + ij, mask=mj, other=0.0).to(tl.float64)
            wj = _member_w(ij, mj, none, safe, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
            cum += tl.sum(tl.where(rj[None, :] <= rk[:, None], wj[None, :], 0.0), 1)
        low = tl.minimum(low, tl.min(tl.where(mk & (cum >= q * total), rk, float("inf")), 0))
    return tl.where(low == float("inf"), top, low)


@triton.jit
def _robust_baseline(r_ptr, len_ptr, order_ptr, start_ptr, lw_ptr, gsq_ptr, stats_ptr, n, num_groups, log_hi,
                     q_lo, q_hi, HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, HAS_GSQ: tl.constexpr,
                     LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr, MEDIAN: tl.constexpr, BLOCK: tl.constexpr):
    # stats[BASELINE, g] = the weighted median or winsorized mean of group g (docs/contract.md, opob_aggregation)
    g = tl.program_id(0)
    begin, end = group_range(start_ptr, g, n, HAS_GROUP)
    shift = tl.full((), float("-inf"), tl.float64)
    top = tl.full((), float("-inf"), tl.float64)
    for first in range(begin, end, BLOCK):
        i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
        shift = tl.maximum(shift, tl.max(tl.where(member, log_w, float("-inf")), 0))
        r = tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64)
        top = tl.maximum(top, tl.max(tl.where(member, r, float("-inf")), 0))
    none = shift == float("-inf")
    bad = (shift != shift) | (shift == float("inf"))  # a NaN or +inf W
    safe = tl.where(none | bad, 0.0, shift)
    total = tl.zeros((), tl.float64)
    for first in range(begin, end, BLOCK):
        i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
        total += tl.sum(_member_w(i, member, none, safe, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM,
                                  WEIGHT), 0)
    lo = _quantile(tl.where(MEDIAN, 0.5, q_lo), total, top, begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr,
                   none, safe, log_hi, HAS_GROUP, HAS_LEN, HAS_GSQ, LENGTH_NORM, WEIGHT, BLOCK)
    b = lo
    if not MEDIAN:  # lo + sum w (clip(R, lo, hi) - lo) / sum w: exact for one member or equal rewards
        hi = _quantile(q_hi, total, top, begin, end, r_ptr, order_ptr, len_ptr, lw_ptr, gsq_ptr, none, safe, log_hi,
                       HAS_GROUP, HAS_LEN, HAS_GSQ, LENGTH_NORM, WEIGHT, BLOCK)
        acc = tl.zeros((), tl.float64)
        for first in range(begin, end, BLOCK):
            i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
            w = _member_w(i, member, none, safe, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
            r = tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64)
            acc += tl.sum(w * (tl.minimum(tl.maximum(r, lo), hi) - lo), 0)
        b = lo + acc / total
    b = tl.where(top == float("-inf"), 0.0, tl.where(bad, float("nan"), b))  # no member: 0
    tl.store(stats_ptr + BASELINE * num_groups + g, b)


@triton.jit
def _leave_one_out_deviation(i, valid, g, r, count, mean, stats_ptr, num_groups, lw_ptr, gsq_ptr, len_ptr, log_hi,
                             HAS_GSQ: tl.constexpr, LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr):
    """R_i - b_-i (docs/contract.md): for i not its group's first argmax, the group's sums minus i's term (w_i <= 1
    while the argmax's 1 stays: no cancellation); for the argmax, the sums over the others shifted by their own max.
    No other member, or every other W = 0: the RLOO deviation (0 for one member); a NaN or +inf W: NaN."""
    shift = tl.load(stats_ptr + SHIFT * num_groups + g, mask=valid, other=0.0)
    is_first = i == tl.load(stats_ptr + FIRST * num_groups + g, mask=valid, other=-1.0).to(tl.int64)
    shift2 = tl.load(stats_ptr + SHIFT2 * num_groups + g, mask=valid, other=0.0)
    safe = tl.where((shift == shift) & (tl.abs(shift) < float("inf")), shift, 0.0)
    log_w = opob_log_w(i, valid, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
    w = tl.exp(log_w - safe)
    d = r - mean
    den = tl.where(is_first, tl.load(stats_ptr + SUM_W2 * num_groups + g, mask=valid, other=1.0),
                   tl.load(stats_ptr + SUM_W * num_groups + g, mask=valid, other=1.0) - w)
    num = tl.where(is_first, tl.load(stats_ptr + SUM_WD2 * num_groups + g, mask=valid, other=0.0),
                   tl.load(stats_ptr + SUM_WD * num_groups + g, mask=valid, other=0.0) - w * d)
    none = tl.where(is_first, shift2, shift) == float("-inf")
    unweighted = tl.where(count > 1, d * count / tl.maximum(count - 1, 1.0), 0.0)
    dev = tl.where(none, unweighted, d - num / tl.where(none, 1.0, den))
    return tl.where((shift != shift) | (shift == float("inf")), float("nan"), dev)


@triton.jit
def _advantages(r_ptr, len_ptr, g_ptr, stats_ptr, adv_ptr, lw_ptr, gsq_ptr, n, num_groups, log_hi,
                KIND: tl.constexpr, NORM_BY_STD: tl.constexpr, HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr,
                HAS_GSQ: tl.constexpr, LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr, LEAVE_ONE_OUT: tl.constexpr,
                BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    valid = inside
    if HAS_LEN:
        valid = valid & (tl.load(len_ptr + i, mask=inside, other=0.0) > 0)
    g = tl.zeros((BLOCK,), tl.int64)
    if HAS_GROUP:
        g = tl.load(g_ptr + i, mask=inside, other=0)
        g = tl.where((g >= 0) & (g < num_groups), g, 0)  # an unvalidated bad index must not read out of bounds
    count = tl.load(stats_ptr + COUNT * num_groups + g, mask=inside, other=0.0)
    mean = tl.load(stats_ptr + MEAN * num_groups + g, mask=inside, other=0.0)
    var = tl.load(stats_ptr + VAR * num_groups + g, mask=inside, other=0.0)
    baseline = tl.load(stats_ptr + BASELINE * num_groups + g, mask=inside, other=0.0)
    r = tl.load(r_ptr + i, mask=inside, other=0.0).to(tl.float64)
    if KIND == ADVANTAGE_OPOB:
        if LEAVE_ONE_OUT:
            a = _leave_one_out_deviation(i, valid, g, r, count, mean, stats_ptr, num_groups, lw_ptr, gsq_ptr, len_ptr,
                                         log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
        else:
            a = r - baseline
        if NORM_BY_STD:
            sigma = tl.sqrt(var)
            a = tl.where(sigma > 1e-8, a / sigma, a)
    elif KIND == ADVANTAGE_GRPO:
        a = r - mean
        if NORM_BY_STD:
            std = tl.where(count > 1, tl.sqrt(var * count / tl.maximum(count - 1, 1.0)), 0.0)
            a = a / (std + 1e-6)
    elif KIND == ADVANTAGE_RLOO:
        a = tl.where(count > 1, (r - mean) * count / tl.maximum(count - 1, 1.0), 0.0)
    elif KIND == ADVANTAGE_REINFORCE:  # the stats are of the whole batch, one group
        a = r - mean
    else:
        a = r
    tl.store(adv_ptr + i, tl.where(valid, a, 0.0).to(adv_ptr.dtype.element_ty), mask=inside)


def members_by_group(group_index, num_groups: int):
    """(order, start): the sequences sorted by group, stably, and where each group's run starts, so that each
    group's program reads its own members only (O(B) in all, not O(groups x B)); no host sync, deterministic.
    Out-of-range (unvalidated) indices sort outside every run."""
    sorted_groups, order = torch.sort(group_index, stable=True)
    start = torch.searchsorted(sorted_groups, torch.arange(num_groups + 1, device=group_index.device))
    return order, start


def advantages(kind: int, rewards, seq_length, group_index, num_groups: int, norm_by_std: bool, *,
               log_weight=None, grad_sq_norm=None, length_norm=False, weight=0, log_hi=0.0, aggregation="mean",
               quantiles=(0.05, 0.95), leave_one_out=False):
    """(b_g [num_groups], A_i [B]) in rewards' dtype and the largest OPOB weight share of a group (a 0-d fp64
    tensor, 0 for another estimator); `log_weight` (and the OPOB options) for kind OPOB."""
    n = rewards.numel()
    device, dtype = rewards.device, rewards.dtype
    groups = 1 if kind == REINFORCE else num_groups  # REINFORCE: one batch-wide baseline
    group = None if kind == REINFORCE else group_index
    stats = torch.empty((STAT_ROWS, groups), dtype=torch.float64, device=device)
    dummy = rewards
    order, start = (dummy, dummy) if group is None else members_by_group(group, groups)
    length = dummy if seq_length is None else seq_length
    lw = dummy if log_weight is None else log_weight
    gsq = dummy if grad_sq_norm is None else grad_sq_norm
    loo = kind == OPOB and leave_one_out
    opob = dict(HAS_GSQ=grad_sq_norm is not None, LENGTH_NORM=bool(length_norm), WEIGHT=weight)
    _group_stats[(groups,)](rewards, length, order, start, lw, gsq, stats, n, groups, float(log_hi),
                            HAS_GROUP=group is not None, HAS_LEN=seq_length is not None, IS_OPOB=kind == OPOB,
                            LEAVE_ONE_OUT=loo, BLOCK=BLOCK_SEQS, **opob)
    if kind == OPOB and aggregation != "mean":
        _robust_baseline[(groups,)](rewards, length, order, start, log_weight, gsq, stats, n, groups, float(log_hi),
                                    float(quantiles[0]), float(quantiles[1]), HAS_GROUP=group is not None,
                                    HAS_LEN=seq_length is not None, MEDIAN=aggregation == "median", BLOCK=BLOCK_PAIRS,
                                    **opob)
    adv = torch.empty(n, dtype=dtype, device=device)
    if n:
        _advantages[(triton.cdiv(n, BLOCK_SEQS),)](
            rewards, length, dummy if group is None else group, stats, adv, lw, gsq, n, groups, float(log_hi),
            KIND=kind, NORM_BY_STD=bool(norm_by_std), HAS_GROUP=group is not None, HAS_LEN=seq_length is not None,
            LEAVE_ONE_OUT=loo, BLOCK=BLOCK_SEQS, **opob)
    if kind == REINFORCE:
        baseline = stats[BASELINE].expand(num_groups)
    elif kind == NONE:
        baseline = torch.zeros(num_groups, dtype=torch.float64, device=device)
    else:
        baseline = stats[BASELINE]
    share = torch.cat([stats[SHARE], stats.new_zeros(1)]).amax() if kind == OPOB else stats.new_zeros(())
    return baseline.to(dtype), adv, share
