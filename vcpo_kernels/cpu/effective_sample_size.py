import torch

from .. import _C  # noqa: F401
from ..options import LR_RULES


@torch.library.register_fake("vcpo::effective_sample_size")
def _fake(log_weight, seq_length, ess_base_ratio, lr_rule):
    return tuple(log_weight.new_empty(()) for _ in range(3))


def effective_sample_size(log_weight, seq_length, base, rule):
    return torch.ops.vcpo.effective_sample_size(log_weight, seq_length, base, LR_RULES[rule])
