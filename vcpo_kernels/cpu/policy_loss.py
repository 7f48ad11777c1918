import torch

from .. import _C  # noqa: F401
from ..inputs import SequenceBatch, TokenBatch, acc_dtype
from ..options import SCALAR_FIELDS, PolicyLossOptions


@torch.library.register_fake("vcpo::policy_loss")
def _fake(logp, behavior_logp, old_logp, mask, cu_seqlens, rewards, advantages, group_index, num_groups,
          grad_sq_norm, codes, values):
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
    loss, scalars, baseline, adv, s, _ = torch.ops.vcpo.policy_loss(
        t.logp, t.behavior_logp.detach(), None if t.old_logp is None else t.old_logp.detach(), t.mask, t.cu_seqlens,
        seq.rewards, seq.advantages, seq.group_index, seq.num_groups, seq.grad_sq_norm, *opts.packed(norm_length))
    return loss, scalars, baseline, adv, s
