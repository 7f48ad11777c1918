"""Reference per-sequence sums (docs/contract.md, "Per-sequence statistics")."""

from __future__ import annotations

import torch

from ..inputs import TokenBatch
from .segments import segment_ids, segment_sum


def token_deltas(tokens: TokenBatch):
    """(counted, lp_prox, Delta) per token in the accumulation dtype, detached; zero where not counted."""
    cd = tokens.acc_dtype
    counted = tokens.mask if tokens.mask is not None else torch.ones_like(tokens.logp, dtype=torch.bool)
    prox_src = tokens.old_logp if tokens.old_logp is not None else tokens.logp
    prox = torch.where(counted, prox_src.detach().to(cd), 0)
    delta = torch.where(counted, prox - tokens.behavior_logp.to(cd), 0)
    return counted, prox, delta


def sequence_stats(tokens: TokenBatch):
    """(s_i, L_i, k3_i) for every sequence."""
    counted, _, delta = token_deltas(tokens)
    ids = segment_ids(tokens.cu_seqlens, tokens.logp.numel())
    b = tokens.num_seqs
    s = segment_sum(delta, ids, b)
    length = segment_sum(counted.to(delta.dtype), ids, b)
    k3 = segment_sum(torch.where(delta == -torch.inf, 0, torch.expm1(delta) - delta), ids, b)  # -inf: weight 0
    return s, length, k3
