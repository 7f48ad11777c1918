"""The off-policy optimal baseline (docs/contract.md, "Advantages", "opob") in Triton: the per-group kernel
of advantages.py with the caller's log weights."""

from .advantages import OPOB, advantages


def opob_baseline(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, norm_by_std):
    return advantages(OPOB, rewards, seq_length, group_index, num_groups, norm_by_std, log_weight=log_weight,
                      grad_sq_norm=grad_sq_norm, length_norm=length_norm)[:2]
