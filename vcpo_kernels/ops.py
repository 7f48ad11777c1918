"""The public ops. Each normalises and validates its inputs (inputs.py), picks a backend (backends.py) and
returns device tensors without a host sync. Math: docs/contract.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from . import backends, reference
from .inputs import (
    SequenceBatch,
    grad_sq_norm_tensor,
    group_index_tensor,
    linear_logprobs_inputs,
    per_sequence,
    require_tensor,
    sequence_batch,
    token_batch,
)
from .options import DEFAULT_LR_RULE, SCALAR_FIELDS, PolicyLossOptions
from .truncation import truncates


def _validating(validate: bool) -> bool:
    # Value checks read tensor contents; inside torch.compile that would break the graph, so they are skipped
    # there (shape, dtype and option checks still run while tracing).
    return validate and not torch.compiler.is_compiling()


@dataclass
class SequenceStats:
    seq_log_weight: Tensor  # s_i
    seq_length: Tensor  # L_i (counted tokens, as a float)
    seq_kl_k3: Tensor  # sum_t exp(Delta) - Delta - 1


@dataclass
class EffectiveSampleSize:
    ess: Tensor
    ess_ratio: Tensor
    lr_scale: Tensor


@dataclass
class Baseline:
    baseline: Tensor  # [num_groups]
    advantages: Tensor  # [B]
    opob_max_share: Optional[Tensor] = None  # advantages(): the largest OPOB weight share of a group (0: no OPOB)


@dataclass
class PolicyLossResult:
    """The loss (autograd to logp) and its statistics, all device tensors (docs/contract.md, "Statistics")."""

    loss: Tensor
    ess: Tensor
    ess_ratio: Tensor
    lr_scale: Tensor
    baseline: Tensor
    advantages: Tensor
    seq_log_weight: Tensor
    is_clip_fraction: Tensor
    mean_is_coef: Tensor
    kl_k3: Tensor
    num_tokens: Tensor
    num_seqs: Tensor
    num_nonfinite: Tensor
    ppo_clip_fraction: Tensor
    rejected_fraction: Tensor
    opob_max_share: Tensor

    def metrics(self, **extra: Tensor) -> dict[str, float]:
        """The loss, the scalar statistics and any `extra` scalar tensors as Python floats: one host sync for
        all of them, for logging."""
        names = ("loss",) + SCALAR_FIELDS
        tensors = [getattr(self, n) for n in names] + list(extra.values())
        values = torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist()
        return dict(zip(names + tuple(extra), values))


def sequence_stats(
    logp: Tensor,
    behavior_logp: Tensor,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    old_logp: Optional[Tensor] = None,
    validate: bool = True,
    backend: str = "auto",
) -> SequenceStats:
    """Per-sequence log IS weight s_i, counted length L_i and K3 sum, in one pass over the tokens."""
    tokens = token_batch(logp, behavior_logp, old_logp, mask, cu_seqlens, _validating(validate))
    kernel = backends.kernel("sequence_stats", backend, tokens.logp.device)
    return SequenceStats(*kernel(tokens))


def _log_weight_tensor(seq_log_weight) -> Tensor:
    lw = require_tensor("seq_log_weight", seq_log_weight)
    if lw.dim() != 1 or lw.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"seq_log_weight must be a 1-D float32/float64 tensor, got {lw.dtype} {tuple(lw.shape)}")
    return lw.detach().contiguous()


def _seq_length_tensor(seq_length, lw: Tensor, validate: bool) -> Optional[Tensor]:
    if seq_length is None:
        return None
    return per_sequence("seq_length", seq_length, lw.numel(), lw.device, lw.dtype, validate)


def effective_sample_size(
    seq_log_weight: Tensor,
    *,
    seq_length: Optional[Tensor] = None,
    ess_base_ratio: float = 1.0,
    lr_rule: Optional[str] = DEFAULT_LR_RULE,
    is_threshold: Optional[float] = None,
    validate: bool = True,
    backend: str = "auto",
) -> EffectiveSampleSize:
    """ESS = (sum w)^2 / sum w^2 of w = exp(seq_log_weight), in log space, over sequences with seq_length > 0;
    with `is_threshold` C, of the truncated weights min(w, C) (the loss's `ess_on_corrected`)."""
    opts = PolicyLossOptions(ess_base_ratio=ess_base_ratio, lr_rule=lr_rule,
                             **({} if is_threshold is None else dict(is_threshold=is_threshold)))
    lw = _log_weight_tensor(seq_log_weight)
    if is_threshold is not None:
        lw = torch.clamp(lw, max=math.log(opts.is_threshold))  # NaN stays NaN
    length = _seq_length_tensor(seq_length, lw, _validating(validate))
    kernel = backends.kernel("effective_sample_size", backend, lw.device)
    return EffectiveSampleSize(*kernel(lw, length, opts.ess_base_ratio, opts.lr_rule))


def opob_baseline(
    rewards: Tensor,
    seq_log_weight: Tensor,
    *,
    grad_sq_norm: Optional[Tensor] = None,
    group_index: Optional[Tensor] = None,
    num_groups: Optional[int] = None,
    seq_length: Optional[Tensor] = None,
    length_norm: bool = False,
    norm_by_std: bool = True,
    validate: bool = True,
    backend: str = "auto",
) -> Baseline:
    """Per-group b_g = sum w^2 G R / sum w^2 G (w = exp(seq_log_weight)) and advantages (R - b_g) / sigma_g."""
    check = _validating(validate)
    lw = _log_weight_tensor(seq_log_weight)
    b, device, dtype = lw.numel(), lw.device, lw.dtype
    r = per_sequence("rewards", rewards, b, device, dtype, check)
    g, ng = group_index_tensor(group_index, num_groups, b, device, check)
    gsq = grad_sq_norm_tensor(grad_sq_norm, b, device, dtype, check)
    length = _seq_length_tensor(seq_length, lw, check)
    if length_norm and length is None:
        raise ValueError("length_norm=True needs seq_length")
    kernel = backends.kernel("opob_baseline", backend, device)
    return Baseline(*kernel(r, lw, gsq, g, length, ng, bool(length_norm), bool(norm_by_std)))


_DEFAULT_OPTIONS = PolicyLossOptions()


def advantages(
    rewards: Tensor,
    seq_log_weight: Tensor,
    *,
    seq_length: Tensor,
    grad_sq_norm: Optional[Tensor] = None,
    group_index: Optional[Tensor] = None,
    num_groups: Optional[int] = None,
    options: Optional[PolicyLossOptions] = None,
    validate: bool = True,
) -> Baseline:
    """Baselines and advantages of the estimator in `options` (OPOB by default, with its weights, scope and
    normalisation), from per-sequence quantities exactly as the fused loss forms them: for a caller that holds
    the sequences of several ranks (vcpo/distributed.py). Torch ops on any device, no host sync."""
    opts = options if options is not None else _DEFAULT_OPTIONS
    check = _validating(validate)
    lw = _log_weight_tensor(seq_log_weight)
    b, device, dtype = lw.numel(), lw.device, lw.dtype
    g, ng = (None, 1) if opts.batch_baseline else group_index_tensor(group_index, num_groups, b, device, check)
    seq = SequenceBatch(per_sequence("rewards", rewards, b, device, dtype, check), None, g, ng,
                        grad_sq_norm_tensor(grad_sq_norm, b, device, dtype, check))
    return Baseline(*reference.advantage_terms(seq, lw, _seq_length_tensor(seq_length, lw, check), opts))


def policy_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    old_logp: Optional[Tensor] = None,
    rewards: Optional[Tensor] = None,
    advantages: Optional[Tensor] = None,
    group_index: Optional[Tensor] = None,
    num_groups: Optional[int] = None,
    grad_sq_norm: Optional[Tensor] = None,
    options: Optional[PolicyLossOptions] = None,
    validate: bool = True,
    backend: str = "auto",
    **option_overrides,
) -> PolicyLossResult:
    """The fused VCPO loss: IS weights, ESS, advantages (OPOB by default) and the aggregated surrogate.
    Options come from `options` (a PolicyLossOptions, or vcpo.VCPOConfig) with keyword overrides."""
    opts = options if options is not None else _DEFAULT_OPTIONS
    if not isinstance(opts, PolicyLossOptions):
        raise ValueError(f"options must be a PolicyLossOptions (or vcpo.VCPOConfig), got {type(opts).__name__}")
    if option_overrides:
        unknown = set(option_overrides) - {f.name for f in fields(PolicyLossOptions)}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; see PolicyLossOptions")
        opts = opts.replace(**option_overrides)
    check = _validating(validate)
    tokens = token_batch(logp, behavior_logp, old_logp, mask, cu_seqlens, check)
    if tokens.old_logp is None and opts.trust_rule != "none" and opts.is_correction == "truncate":
        raise ValueError(f"trust_region={opts.trust_rule!r} in bypass mode (no old_logp) reads the ratio pi / mu, "
                         "which is the importance weight itself: is_correction='truncate' would weight each unit a "
                         "second time; use is_correction='none' (or 'mask'), or pass old_logp")
    seq = sequence_batch(tokens, rewards, advantages, group_index, num_groups, grad_sq_norm, opts.batch_baseline,
                         check)
    norm_length = opts.norm_length
    if opts.loss_agg_mode == "seq-mean-token-sum-norm" and norm_length is None:
        if tokens.padded_length is None:
            raise ValueError("norm_length is required for loss_agg_mode='seq-mean-token-sum-norm' with packed input")
        norm_length = max(tokens.padded_length, 1)
    kernel = backends.kernel("policy_loss", backend, tokens.logp.device)
    loss, scalars, baseline, adv, s = kernel(tokens, seq, opts, norm_length)
    stats = dict(zip(SCALAR_FIELDS, scalars.unbind(0)))
    if opts.is_batch_normalize:
        # every coefficient divided by their mean M over the units: the loss is linear in them
        loss = loss / batch_normalizer(stats["mean_is_coef"]).to(loss.dtype)
    return PolicyLossResult(loss=loss, baseline=baseline, advantages=adv, seq_log_weight=s, **stats)


def batch_normalizer(mean_coef: Tensor) -> Tensor:
    """What is_batch_normalize divides the IS coefficients by: their mean over the units, detached; 1 where it
    is 0 (every coefficient 0: nothing to scale)."""
    mean_coef = mean_coef.detach()
    return torch.where(mean_coef == 0, 1, mean_coef)


@dataclass
class LinearLogprobs:
    logp: Tensor  # [N] log p(target), fp32 (fp64 for fp64 inputs); 0 where the target is ignored
    entropy: Optional[Tensor]  # [N] with return_entropy
    sum_p2: Optional[Tensor]  # [N] sum_v p_v^2, with return_sum_p2


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    top_k: int = -1,
    top_p: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_sum_p2: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    seq_grad_sq_norm: Optional[Tensor] = None,
    seq_grad_row_ids: Optional[Tensor] = None,
    seq_grad_rows: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    validate: bool = True,
    backend: str = "auto",
) -> LinearLogprobs:
    """log softmax((hidden @ weight.T + bias) / temperature)[targets] per token, without materialising the
    N x V logits (chunks of `chunk_size` tokens; default: 16M logits a chunk). `softcap`: the logits
    hidden @ weight.T + bias are first capped to softcap * tanh(logits / softcap) (Gemma 2/3's
    `final_logit_softcapping`), then divided by the temperature; every output, gradient and per-sequence
    norm is that of the capped logits. `top_k`, `top_p` (vLLM's, off: -1 or 0, and 1): every output is that of
    the distribution truncated to the sampling support and renormalised, a target outside it has log-prob -inf
    and no gradient (docs/contract.md, "Truncated sampling"). Autograd to hidden, weight and bias from any upstream gradient of
    every output. `seq_grad_sq_norm` ([B], with `cu_seqlens`): the backward adds each sequence's squared norm
    of the weight (and bias) gradient to it. `seq_grad_rows` ([B, K, H], with `seq_grad_row_ids` [B, K] and
    `cu_seqlens`): the backward adds row `seq_grad_row_ids[i, k]` of sequence i's weight gradient to
    `seq_grad_rows[i, k]` (the inner product with a tied embedding's per-sequence gradient needs the rows at its
    input ids). Only the first backward through a call adds to these two; a later one (the loss's, after a
    norm pass) gives the gradients alone."""
    chunk_size = linear_logprobs_inputs(hidden, weight, targets, bias, temperature, softcap, top_k, top_p,
                                        ignore_index, chunk_size, cu_seqlens, seq_grad_sq_norm, seq_grad_row_ids,
                                        seq_grad_rows, _validating(validate))
    kernel = backends.kernel("linear_logprobs", backend, hidden.device)
    truncation = (top_k, float(top_p)) if truncates(top_k, top_p, weight.shape[0]) else None
    logp, entropy, sum_p2 = kernel(hidden, weight, targets.long(), bias, float(temperature),
                                   None if softcap is None else float(softcap), truncation, ignore_index, chunk_size,
                                   return_entropy, return_sum_p2, cu_seqlens, seq_grad_sq_norm, seq_grad_row_ids,
                                   seq_grad_rows)
    return LinearLogprobs(logp, entropy, sum_p2)
