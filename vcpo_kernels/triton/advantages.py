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


@triton.jit
def _group_stats(r_ptr, len_ptr, order_ptr, start_ptr, lw_ptr, gsq_ptr, stats_ptr, n, num_groups, log_hi,
                 HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, IS_OPOB: tl.constexpr, HAS_GSQ: tl.constexpr,
                 LENGTH_NORM: tl.constexpr, WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    # stats[:, g] = (count, mean, population variance, baseline) of group g's valid members, read from its run
    # order[start[g]:start[g + 1]] of the sorted order (the whole batch without groups)
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
    if IS_OPOB:
        # b = mean + sum W (R - mean) / sum W, W = exp(log W - max): exact for one member or equal rewards
        safe = tl.where((shift == shift) & (tl.abs(shift) < float("inf")), shift, 0.0)  # NaN/+inf propagate
        sum_w = tl.zeros((), tl.float64)
        sum_wd = tl.zeros((), tl.float64)
        for first in range(begin, end, BLOCK):
            i, member = group_members(first + tl.arange(0, BLOCK), end, order_ptr, len_ptr, HAS_GROUP, HAS_LEN)
            log_w = opob_log_w(i, member, lw_ptr, gsq_ptr, len_ptr, log_hi, HAS_GSQ, LENGTH_NORM, WEIGHT)
            w = tl.where(member, tl.exp(log_w - safe), 0.0)
            r = tl.load(r_ptr + i, mask=member, other=0.0).to(tl.float64)
            sum_w += tl.sum(w, 0)
            sum_wd += tl.sum(tl.where(member, w * (r - mean), 0.0), 0)
        baseline = tl.where(shift == float("-inf"), mean, mean + sum_wd / sum_w)  # every W = 0: plain mean
    tl.store(stats_ptr + g, count)
    tl.store(stats_ptr + num_groups + g, mean)
    tl.store(stats_ptr + 2 * num_groups + g, var)
    tl.store(stats_ptr + 3 * num_groups + g, baseline)


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
    # stats[3, g] = the weighted median or winsorized mean of group g (docs/contract.md, opob_aggregation)
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
    tl.store(stats_ptr + 3 * num_groups + g, b)


@triton.jit
def _advantages(r_ptr, len_ptr, g_ptr, stats_ptr, adv_ptr, n, num_groups, KIND: tl.constexpr,
                NORM_BY_STD: tl.constexpr, HAS_GROUP: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    valid = inside
    if HAS_LEN:
        valid = valid & (tl.load(len_ptr + i, mask=inside, other=0.0) > 0)
    g = tl.zeros((BLOCK,), tl.int64)
    if HAS_GROUP:
        g = tl.load(g_ptr + i, mask=inside, other=0)
        g = tl.where((g >= 0) & (g < num_groups), g, 0)  # an unvalidated bad index must not read out of bounds
    count = tl.load(stats_ptr + g, mask=inside, other=0.0)
    mean = tl.load(stats_ptr + num_groups + g, mask=inside, other=0.0)
    var = tl.load(stats_ptr + 2 * num_groups + g, mask=inside, other=0.0)
    baseline = tl.load(stats_ptr + 3 * num_groups + g, mask=inside, other=0.0)
    r = tl.load(r_ptr + i, mask=inside, other=0.0).to(tl.float64)
    if KIND == ADVANTAGE_OPOB:
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
               quantiles=(0.05, 0.95)):
    """(b_g [num_groups], A_i [B]) in rewards' dtype; `log_weight` (and the OPOB options) for kind OPOB."""
    n = rewards.numel()
    device, dtype = rewards.device, rewards.dtype
    groups = 1 if kind == REINFORCE else num_groups  # REINFORCE: one batch-wide baseline
    group = None if kind == REINFORCE else group_index
    stats = torch.empty((4, groups), dtype=torch.float64, device=device)
    dummy = rewards
    order, start = (dummy, dummy) if group is None else members_by_group(group, groups)
    _group_stats[(groups,)](rewards, dummy if seq_length is None else seq_length, order, start,
                            dummy if log_weight is None else log_weight,
                            dummy if grad_sq_norm is None else grad_sq_norm, stats, n, groups, float(log_hi),
                            HAS_GROUP=group is not None, HAS_LEN=seq_length is not None, IS_OPOB=kind == OPOB,
                            HAS_GSQ=grad_sq_norm is not None, LENGTH_NORM=bool(length_norm), WEIGHT=weight,
                            BLOCK=BLOCK_SEQS)
    if kind == OPOB and aggregation != "mean":
        _robust_baseline[(groups,)](rewards, dummy if seq_length is None else seq_length, order, start, log_weight,
                                    dummy if grad_sq_norm is None else grad_sq_norm, stats, n, groups, float(log_hi),
                                    float(quantiles[0]), float(quantiles[1]), HAS_GROUP=group is not None,
                                    HAS_LEN=seq_length is not None, HAS_GSQ=grad_sq_norm is not None,
                                    LENGTH_NORM=bool(length_norm), WEIGHT=weight, MEDIAN=aggregation == "median",
                                    BLOCK=BLOCK_PAIRS)
    adv = torch.empty(n, dtype=dtype, device=device)
    if n:
        _advantages[(triton.cdiv(n, BLOCK_SEQS),)](
            rewards, dummy if seq_length is None else seq_length, dummy if group is None else group, stats, adv, n,
            groups, KIND=kind, NORM_BY_STD=bool(norm_by_std), HAS_GROUP=group is not None,
            HAS_LEN=seq_length is not None, BLOCK=BLOCK_SEQS)
    if kind == REINFORCE:
        baseline = stats[3].expand(num_groups)
    elif kind == NONE:
        baseline = torch.zeros(num_groups, dtype=torch.float64, device=device)
    else:
        baseline = stats[3]
    return baseline.to(dtype), adv
