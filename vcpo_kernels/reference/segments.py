"""Segment and group reductions with plain tensor ops (no host sync), used by the reference ops."""

from __future__ import annotations

import torch
from torch import Tensor


def segment_ids(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """Sequence index of every token of the packed layout."""
    num_seqs = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seqs = torch.arange(num_seqs, device=cu_seqlens.device)
    return torch.repeat_interleave(seqs, lengths, output_size=num_tokens)


def segment_sum(values: Tensor, index: Tensor, size: int) -> Tensor:
    return values.new_zeros(size).index_add_(0, index, values)


def segment_max(values: Tensor, index: Tensor, size: int) -> Tensor:
    """Max per segment (-inf for an empty one); NaN propagates."""
    init = values.new_full((size,), -torch.inf)
    return init.scatter_reduce(0, index, values, reduce="amax", include_self=True)


def group_moments(rewards: Tensor, valid: Tensor, group: Tensor, num_groups: int):
    """Count, mean and population variance of the valid members' rewards, per group."""
    count = segment_sum(valid.to(rewards.dtype), group, num_groups)
    denom = count.clamp(min=1)
    mean = segment_sum(torch.where(valid, rewards, 0), group, num_groups) / denom
    dev = torch.where(valid, rewards - mean[group], 0)
    var = segment_sum(dev * dev, group, num_groups) / denom
    return count, mean, var


def group_of(group_index, num_seqs: int, device) -> Tensor:
    return group_index if group_index is not None else torch.zeros(num_seqs, dtype=torch.int64, device=device)
