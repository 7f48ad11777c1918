import torch

from .. import _C  # noqa: F401


@torch.library.register_fake("vcpo::opob_baseline")
def _fake(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, norm_by_std):
    return log_weight.new_empty((num_groups,)), log_weight.new_empty(log_weight.shape)


def opob_baseline(rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, norm_by_std):
    return torch.ops.vcpo.opob_baseline(
        rewards, log_weight, grad_sq_norm, group_index, seq_length, num_groups, length_norm, norm_by_std
    )
