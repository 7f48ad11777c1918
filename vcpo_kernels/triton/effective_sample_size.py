"""ESS of the sequence weights in log space and the lr scale (docs/contract.md, "Effective sample size") in
Triton: one program over the B log weights, in fp64, on the device (no host sync)."""

import torch
import triton
import triton.language as tl

from ..options import LR_RULES
from .codes import RULE_NONE, RULE_SQRT

BLOCK_SEQS = 1024


@triton.jit
def ess_lr_scale(ratio, base, RULE: tl.constexpr):
    """min(1, ratio / base) ** (1/2 | 1 | 0); 0 for a NaN ratio (skip the step, never a full lr)."""
    x = tl.minimum(ratio / base, 1.0)
    if RULE == RULE_SQRT:
        x = tl.sqrt(x)
    if RULE == RULE_NONE:
        x = x * 0.0 + 1.0
    return tl.where(ratio != ratio, 0.0, x)


@triton.jit
def valid_log_weights(i, n, lw_ptr, len_ptr, log_hi, HAS_LEN: tl.constexpr, TRUNCATE: tl.constexpr):
    """(valid, fp64 log weight) of sequences i; with TRUNCATE min(lw, log_hi), NaN kept."""
    valid = i < n
    if HAS_LEN:
        valid = valid & (tl.load(len_ptr + i, mask=i < n, other=0.0) > 0)
    lw = tl.load(lw_ptr + i, mask=valid, other=0.0).to(tl.float64)
    if TRUNCATE:
        lw = tl.where(lw > log_hi, log_hi, lw)
    return valid, lw


@triton.jit
def ess_of(lw_ptr, len_ptr, n, log_hi, base, HAS_LEN: tl.constexpr, TRUNCATE: tl.constexpr, RULE: tl.constexpr,
           BLOCK: tl.constexpr):
    """(ess, ess_ratio, lr_scale) in fp64 over the sequences with length > 0 (all without lengths); with
    TRUNCATE the log weights are min(lw, log_hi) first (NaN kept)."""
    m = tl.full((), float("-inf"), tl.float64)
    count = tl.zeros((), tl.float64)
    for start in range(0, n, BLOCK):
        valid, lw = valid_log_weights(start + tl.arange(0, BLOCK), n, lw_ptr, len_ptr, log_hi, HAS_LEN, TRUNCATE)
        m = tl.maximum(m, tl.max(tl.where(valid, lw, float("-inf")), 0))
        count += tl.sum(valid.to(tl.float64), 0)
    # +inf and NaN propagate through exp; all -inf gives 0 / 0
    shift = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
    s1 = tl.zeros((), tl.float64)
    s2 = tl.zeros((), tl.float64)
    for start in range(0, n, BLOCK):
        valid, lw = valid_log_weights(start + tl.arange(0, BLOCK), n, lw_ptr, len_ptr, log_hi, HAS_LEN, TRUNCATE)
        e = tl.where(valid, tl.exp(lw - shift), 0.0)
        s1 += tl.sum(e, 0)
        s2 += tl.sum(e * e, 0)
    ess = tl.where(count > 0, s1 * s1 / s2, 0.0)
    ratio = tl.where(count > 0, ess / tl.maximum(count, 1.0), 0.0)
    return ess, ratio, ess_lr_scale(ratio, base, RULE)


@triton.jit
def _ess(lw_ptr, len_ptr, out_ptr, n, base, HAS_LEN: tl.constexpr, RULE: tl.constexpr, BLOCK: tl.constexpr):
    ess, ratio, lr = ess_of(lw_ptr, len_ptr, n, 0.0, base, HAS_LEN, False, RULE, BLOCK)
    tl.store(out_ptr, ess)
    tl.store(out_ptr + 1, ratio)
    tl.store(out_ptr + 2, lr)


def effective_sample_size(log_weight, seq_length, base, rule):
    out = torch.empty(3, dtype=torch.float64, device=log_weight.device)
    _ess[(1,)](log_weight, log_weight if seq_length is None else seq_length, out, log_weight.numel(), float(base),
               HAS_LEN=seq_length is not None, RULE=LR_RULES[rule], BLOCK=BLOCK_SEQS)
    return tuple(out.to(log_weight.dtype).unbind())
