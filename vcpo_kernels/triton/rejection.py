"""The rejection criteria of the fused loss in Triton (docs/contract.md, "Rejection"): the sequence criteria from
per-chunk sums and maxima of the token divergences, combined per sequence; the token criteria and M2PO's mask in
the token pass (token_rejected), M2PO's threshold from a sort of the batch's Delta^2 on the device."""

import math

import torch
import triton
import triton.language as tl

from ..inputs import TokenBatch
from ..options import LOSS_VALUES, PolicyLossOptions
from ..reference.policy_loss import second_moment_threshold
from .segments import BLOCK, CHUNK, chunk_span, combine, counted_deltas, k3_term

SEQUENCE_STATISTICS = 5  # per sequence: the sums of k1, k2, k3 and the maxima of k2, k3 over its counted tokens


@triton.jit
def token_rejected(d, k1_lo, k1_hi, k2_hi, k3_hi, m2_threshold, REJECT_K1: tl.constexpr, REJECT_K2: tl.constexpr,
                   REJECT_K3: tl.constexpr, REJECT_M2: tl.constexpr):
    """Whether a token criterion rejects the tokens of log ratio d (Delta): a NaN statistic fails."""
    out = (d != d) & (d == d)  # False, shaped like d
    if REJECT_K1:
        out = out | ~((d >= k1_lo) & (d <= k1_hi))
    if REJECT_K2:
        out = out | ~(0.5 * d * d <= k2_hi)
    if REJECT_K3:
        out = out | ~(k3_term(d) <= k3_hi)
    if REJECT_M2:  # Delta^2 in float64, as the threshold's order statistic
        d64 = d.to(tl.float64)
        out = out | ~(d64 * d64 < m2_threshold)
    return out


@triton.jit
def _sequence_partials(lp_ptr, mu_ptr, old_ptr, mask_ptr, cu_ptr, chunk_end_ptr, sum_ptr, max_ptr, num_seqs,
                       num_tokens, search_steps, HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr, ACC64: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # The chunk's sums of k1, k2, k3 and maxima of k2, k3 over its counted tokens (a NaN stays NaN in both).
    acc_t = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0)
    seq, first, last = chunk_span(pid, chunk_end_ptr, cu_ptr, num_seqs, num_tokens, search_steps, CHUNK)
    if seq < num_seqs:
        k1 = tl.zeros((BLOCK,), acc_t)
        k2 = tl.zeros((BLOCK,), acc_t)
        k3 = tl.zeros((BLOCK,), acc_t)
        top2 = tl.full((BLOCK,), -float("inf"), acc_t)
        top3 = tl.full((BLOCK,), -float("inf"), acc_t)
        for start in range(first, last, BLOCK):
            t = start + tl.arange(0, BLOCK)
            counted, d = counted_deltas(t, last, lp_ptr, mu_ptr, old_ptr, mask_ptr, HAS_OLD, HAS_MASK, ACC64)
            half_square = 0.5 * d * d
            k3_d = k3_term(d)
            k1 += d
            k2 += half_square
            k3 += k3_d
            # a NaN wins the maximum, as it fails the criterion
            top2 = tl.where(counted & ((half_square > top2) | (half_square != half_square)), half_square, top2)
            top3 = tl.where(counted & ((k3_d > top3) | (k3_d != k3_d)), k3_d, top3)
        tl.store(sum_ptr + pid * 3, tl.sum(k1, 0))
        tl.store(sum_ptr + pid * 3 + 1, tl.sum(k2, 0))
        tl.store(sum_ptr + pid * 3 + 2, tl.sum(k3, 0))
        nan2 = tl.max(tl.where(top2 != top2, 1, 0), 0)
        nan3 = tl.max(tl.where(top3 != top3, 1, 0), 0)
        tl.store(max_ptr + pid * 2, tl.where(nan2 > 0, float("nan"), tl.max(tl.where(top2 != top2, 0.0, top2), 0)))
        tl.store(max_ptr + pid * 2 + 1, tl.where(nan3 > 0, float("nan"), tl.max(tl.where(top3 != top3, 0.0, top3), 0)))


def _sequence_statistics(t: TokenBatch, plan) -> dict:
    """Per sequence [B]: the sums of k1, k2, k3 and the maxima of k2, k3 over its counted tokens."""
    chunk_end, grid, steps = plan
    acc, device, b = t.acc_dtype, t.logp.device, t.num_seqs
    sums = torch.zeros((max(grid, 1), 3), dtype=acc, device=device)
    maxima = torch.full((max(grid, 1), 2), -math.inf, dtype=acc, device=device)
    if grid and b:
        dummy = t.logp
        _sequence_partials[(grid,)](t.logp.detach(), t.behavior_logp.detach(),
                                    dummy if t.old_logp is None else t.old_logp.detach(),
                                    dummy if t.mask is None else t.mask.view(torch.uint8), t.cu_seqlens, chunk_end,
                                    sums, maxima, b, t.logp.numel(), steps, HAS_OLD=t.old_logp is not None,
                                    HAS_MASK=t.mask is not None, ACC64=acc == torch.float64, CHUNK=CHUNK,
                                    BLOCK=BLOCK)
    k1, k2, k3 = combine(sums, chunk_end, b)
    # each chunk's maximum to its sequence: the sequence of chunk c is the first whose chunk_end exceeds c
    # (a chunk past the last sequence, or an unused one, goes to the spare slot b: no boolean indexing, no sync)
    chunk_seq = torch.searchsorted(chunk_end, torch.arange(maxima.shape[0], device=device), right=True).clamp(max=b)
    top = torch.full((2, b + 1), -math.inf, dtype=acc, device=device)
    for j in range(2):  # amax propagates NaN: a NaN maximum fails the criterion
        top[j].scatter_reduce_(0, chunk_seq, maxima[:, j], "amax")
    return {"sum_k1": k1, "sum_k2": k2, "sum_k3": k3, "max_k2": top[0, :b], "max_k3": top[1, :b]}


def sequence_rejection(t: TokenBatch, plan, length: torch.Tensor, opts: PolicyLossOptions) -> torch.Tensor:
    """[B] bool: the sequences a sequence criterion (seq_sum, seq_mean, seq_max) rejects; all False without one."""
    criteria = [entry for entry in opts.rejection if entry[0].startswith("seq_")]
    rejected = torch.zeros_like(length, dtype=torch.bool)
    if not criteria:
        return rejected
    stats = _sequence_statistics(t, plan)
    for name, low, high in criteria:
        scope, kind = name.rsplit("_", 1)
        if scope == "seq_max":
            stat = stats[f"max_{kind}"]
        else:
            stat = stats[f"sum_{kind}"] if scope == "seq_sum" else stats[f"sum_{kind}"] / length.clamp(min=1)
        keep = (stat >= math.log(low)) & (stat <= math.log(high)) if kind == "k1" else stat <= high
        rejected |= (length > 0) & ~keep
    return rejected


def token_criteria(t: TokenBatch, opts: PolicyLossOptions) -> dict:
    """The token pass's rejection arguments: the k1 bounds (log r, the entries' intersection) and the k2 and k3
    upper bounds (PolicyLossOptions.packed), M2PO's threshold ([1] float64 on the device, +inf without it: the
    given one, or from Delta in the accumulation dtype, as the token pass forms it, squared and ordered in float64)
    and the flags."""
    packed = dict(zip(LOSS_VALUES, opts.packed(None)[1]))
    bounds = tuple(packed[k] for k in ("token_k1_low", "token_k1_high", "token_k2_high", "token_k3_high"))
    names = {name for name, _, _ in opts.rejection}
    bound = opts.second_moment_bound
    given = opts.second_moment_threshold  # the caller's (a DP group's), else formed from these tokens
    threshold = torch.full((1,), math.inf if given is None else given, dtype=torch.float64, device=t.logp.device)
    if bound is not None and given is None:
        acc = t.acc_dtype
        counted = torch.ones_like(t.logp, dtype=torch.bool) if t.mask is None else t.mask != 0
        prox = t.logp.detach() if t.old_logp is None else t.old_logp
        delta = torch.where(counted, prox.to(acc) - t.behavior_logp.to(acc), 0)
        threshold = second_moment_threshold(delta.double() * delta.double(), counted, bound).reshape(1)
    return dict(bounds=bounds, threshold=threshold,
                flags=dict(REJECT_K1="token_k1" in names, REJECT_K2="token_k2" in names,
                           REJECT_K3="token_k3" in names, REJECT_M2=bound is not None))
