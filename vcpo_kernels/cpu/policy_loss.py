import math

import torch

from .. import _C  # noqa: F401
from ..inputs import SequenceBatch, TokenBatch, acc_dtype
from ..options import ADVANTAGES, IS_CORRECTIONS, IS_LEVELS, LOSS_AGG_MODES, LR_RULES, SCALAR_FIELDS, PolicyLossOptions


@torch.library.register_fake("vcpo::policy_loss")
def _fake(logp, behavior_logp, old_logp, mask, cu_seqlens, rewards, advantages, group_index, num_groups,
          grad_sq_norm, *options):
    b = cu_seqlens.shape[0] - 1
    dtype = acc_dtype(logp.dtype)
    seq = lambda n: logp.new_empty((n,), dtype=dtype)  # noqa: E731
    return logp.new_empty((), dtype=dtype), seq(len(SCALAR_FIELDS)), seq(num_groups), seq(b), seq(b), seq(b)


@torch.library.register_fake("vcpo::policy_loss_backward")
def _fake_backward(grad_loss, logp, *rest):
    return torch.empty_like(logp)


def policy_loss(tokens: TokenBatch, seq: SequenceBatch, opts: PolicyLossOptions, norm_length):
    """(loss, scalars, baseline, advantages, seq_log_weight); autograd is registered in C++ (csrc/autograd.cpp)."""
    t = tokens
    clip_low, clip_high = opts.clip_ratio if opts.clip_ratio is not None else (None, None)
    loss, scalars, baseline, adv, s, _ = torch.ops.vcpo.policy_loss(
        t.logp, t.behavior_logp.detach(), None if t.old_logp is None else t.old_logp.detach(), t.mask, t.cu_seqlens,
        seq.rewards, seq.advantages, seq.group_index, seq.num_groups, seq.grad_sq_norm,
        IS_LEVELS[opts.is_level], IS_CORRECTIONS[opts.is_correction],
        math.log(opts.is_threshold), math.log(opts.threshold_low),
        opts.ess_on_corrected, opts.ess_base_ratio, LR_RULES[opts.lr_rule], ADVANTAGES[opts.advantage],
        opts.norm_by_std, opts.opob_length_norm, opts.opob_weight_code,
        clip_low, clip_high, opts.clip_ratio_c,
        LOSS_AGG_MODES[opts.loss_agg_mode], float(norm_length) if norm_length is not None else 0.0,
    )
    return loss, scalars, baseline, adv, s
