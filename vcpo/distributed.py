"""The VCPO loss over a data-parallel group: every rank gets the same ESS, lr scale and baselines.

Each rank holds different sequences. The ESS ratio and the group baselines are functions of all of them, so
the per-sequence quantities they need (log weight s_i, counted length L_i, reward R_i, G_i, prompt group) are
exchanged in one all_gather of a [B, 5] tensor; every rank then computes the same ESS and baselines (with the
reference ops: [world * B] elements, microseconds) and its own loss with its slice of the advantages. Unlike the
public reference code, which computes the ESS on tensor-parallel rank 0 only (every other rank steps with
lr = 0), no rank is special. `is_batch_normalize` divides by the mean IS coefficient of every rank's units.

Pass the data-parallel group: ranks that hold the same sequences (tensor or pipeline parallel peers) already
agree without communication and must not be in it. Every rank must pass the same number of sequences, and
group indices are global (a prompt's responses may sit on several ranks). Each rank's loss is its own sequences'
part of the whole batch's loss times the world size, with the counts `loss_agg_mode` divides by (the tokens
sum_j L_j, the valid sequences B') taken over all ranks, and `norm_length` defaulting to the longest padded
length of any rank: averaging the ranks' gradients, as data parallelism does, gives the whole batch's gradient
however unevenly tokens, valid sequences and padding fall on the ranks. The loss's other statistics (KL, clip
fractions, counts) are the rank's own; vcpo.step sums them over the ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

import vcpo_kernels
from vcpo_kernels.inputs import sequence_batch, token_batch
from vcpo_kernels.ops import batch_normalizer
from vcpo_kernels.reference.policy_loss import second_moment_threshold as reference_threshold
from vcpo_kernels.reference.sequence_stats import token_deltas

__all__ = ["init_process_group", "policy_loss", "agg_count", "global_share", "second_moment_threshold"]


def init_process_group(**kwargs) -> None:
    """torch.distributed.init_process_group(**kwargs), after importing torch.distributed.nn.functional: that module's
    functions take `group.WORLD` as a default argument, read at import, and a Hugging Face model class imports it,
    so a model built after the group would keep the group alive past destroy_process_group, to the interpreter's
    exit, where freeing a gloo group aborts the process now and then ("terminate called without an active
    exception")."""
    import torch.distributed.nn.functional  # noqa: F401

    dist.init_process_group(**kwargs)


def largest_abs(tensors: list) -> Tensor:
    """The largest |entry| of `tensors` (0 for none), on their device with no host read: NaN or inf when an entry is
    not finite. DTensor shards are reduced over their mesh, so every rank gets the same value."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    largest = torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)
    return largest.full_tensor() if hasattr(largest, "full_tensor") else largest


def agg_count(length: Tensor, loss_agg_mode: str) -> Tensor:
    """What `loss_agg_mode` divides by, from the counted lengths L_i: the counted tokens for "token-mean", the
    valid sequences (L_i > 0) otherwise."""
    return length.sum() if loss_agg_mode == "token-mean" else (length > 0).sum()


def global_share(part_length: Tensor, whole_count, loss_agg_mode: str) -> Tensor:
    """agg_count(part) / whole_count, float64: a loss aggregated over the sequences of `part` alone, times this,
    is their share of the loss aggregated over a batch whose agg_count is `whole_count` (a number or a tensor;
    0 when `part` counts nothing). Ranks here, and the micro-batches of vcpo.step."""
    part = agg_count(part_length, loss_agg_mode).double()
    return part / torch.as_tensor(whole_count, dtype=part.dtype, device=part.device).clamp(min=1)


def second_moment_threshold(tokens, options, process_group=None) -> float:
    """M2PO's threshold (rejection batch_m2) over the counted tokens of every rank of `process_group` (None: this
    process's), as one process holding them all would form it (docs/contract.md, "Rejection"): each rank's Delta^2
    (float64; NaN left out) in one all_gather, padded with NaN to the largest rank's count. Two host reads: the
    counts, and the threshold."""
    counted, _, delta = token_deltas(tokens)
    square = delta.double() * delta.double()
    if process_group is None:
        return float(reference_threshold(square, counted, options.second_moment_bound))
    local = square[counted & ~torch.isnan(square)]  # the counted values only: what the gather carries
    world = dist.get_world_size(process_group)
    counts = [torch.zeros(1, dtype=torch.int64, device=local.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([local.numel()], device=local.device), group=process_group)
    most = max(int(c) for c in counts)
    padded = torch.cat([local, local.new_full((most - local.numel(),), math.nan)])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=process_group)
    every = torch.cat(parts)
    return float(reference_threshold(every, torch.ones_like(every, dtype=torch.bool), options.second_moment_bound))


def policy_loss(logp: Tensor, behavior_logp: Tensor, *, process_group, options, validate: bool = True,
                backend: str = "auto", mask=None, cu_seqlens=None, old_logp=None, rewards=None, advantages=None,
                group_index=None, num_groups=None, grad_sq_norm=None) -> vcpo_kernels.PolicyLossResult:
    """vcpo_kernels.policy_loss with ESS, lr scale and baselines over all ranks of `process_group`."""
    if not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialised")
    if group_index is not None and num_groups is None:
        raise ValueError("num_groups is required with a process_group: group indices are global, and a rank "
                         "cannot infer the count from its own sequences")
    tokens = token_batch(logp, behavior_logp, old_logp, mask, cu_seqlens, validate)
    if options.second_moment_bound is not None and options.second_moment_threshold is None:
        options = options.replace(second_moment_threshold=second_moment_threshold(tokens, options, process_group))
    seq = sequence_batch(tokens, rewards, advantages, group_index, num_groups, grad_sq_norm, options.batch_baseline,
                         validate)
    stats = vcpo_kernels.sequence_stats(logp.detach(), behavior_logp, mask=mask, cu_seqlens=cu_seqlens,
                                        old_logp=old_logp, validate=False, backend=backend)
    b = tokens.num_seqs
    zeros = torch.zeros(b, dtype=torch.float64, device=logp.device)
    local = torch.stack([
        stats.seq_log_weight.double(),
        stats.seq_length.double(),
        seq.rewards.double() if seq.rewards is not None else zeros,
        seq.grad_sq_norm.double() if seq.grad_sq_norm is not None else zeros + 1,
        seq.group_index.double() if seq.group_index is not None else zeros,
        zeros + (tokens.padded_length or 0),  # packed: no padded length (norm_length must then be given)
    ], 1)
    world = dist.get_world_size(process_group)
    if validate:  # every rank must hold as many sequences (a second, tiny collective)
        sizes = [torch.zeros(1, dtype=torch.int64, device=logp.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([b], device=logp.device), group=process_group)
        if len({int(x) for x in sizes}) != 1:
            raise ValueError(f"every rank must pass the same number of sequences, got {[int(x) for x in sizes]}")
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=process_group)  # the one collective of the loss
    every = torch.cat(parts)
    s, length = every[:, 0], every[:, 1]
    first = dist.get_rank(process_group) * b

    ess = vcpo_kernels.effective_sample_size(
        s, seq_length=length, ess_base_ratio=options.ess_base_ratio, lr_rule=options.lr_rule, validate=False,
        is_threshold=options.is_threshold if options.ess_on_corrected else None, backend="torch")
    if seq.advantages is not None:
        baseline, adv_local, max_share = seq.advantages.new_zeros(seq.num_groups), seq.advantages, s.new_zeros(())
    else:
        everyone = vcpo_kernels.advantages(
            every[:, 2], s, seq_length=length, grad_sq_norm=every[:, 3],
            group_index=None if seq.group_index is None else every[:, 4].long(), num_groups=seq.num_groups,
            options=options, validate=False)
        baseline, adv_local = everyone.baseline, everyone.advantages[first:first + b]
        max_share = everyone.opob_max_share
    out = vcpo_kernels.policy_loss(logp, behavior_logp, mask=mask, cu_seqlens=cu_seqlens, old_logp=old_logp,
                                   advantages=adv_local.to(tokens.acc_dtype),
                                   options=options.replace(is_batch_normalize=False), validate=False, backend=backend)
    if options.is_batch_normalize:  # the mean coefficient of every rank's units (a second, tiny collective)
        units = (out.num_tokens if options.is_level == "token" else out.num_seqs).double()
        coef = torch.stack([out.mean_is_coef.double() * units, units])
        dist.all_reduce(coef, group=process_group)
        out.loss = out.loss / batch_normalizer(coef[0] / coef[1].clamp(min=1)).to(out.loss.dtype)
    share = world * global_share(stats.seq_length, agg_count(length, options.loss_agg_mode), options.loss_agg_mode)
    if options.loss_agg_mode == "seq-mean-token-sum-norm" and options.norm_length is None and tokens.padded_length:
        # the default norm_length, T, of one batch padded to the longest rank's T (the op used this rank's)
        share = share * max(tokens.padded_length, 1) / every[:, 5].max().clamp(min=1)
    out.loss = out.loss * share.to(out.loss.dtype)
    dtype = out.ess.dtype
    out.ess, out.ess_ratio, out.lr_scale = (t.to(dtype) for t in (ess.ess, ess.ess_ratio, ess.lr_scale))
    out.baseline, out.opob_max_share = baseline.to(dtype), max_share.to(dtype)  # the op saw given advantages
    return out
