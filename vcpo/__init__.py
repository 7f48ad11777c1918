"""vcpo: variance-controlled off-policy policy gradients for LLM RL, as a drop-in PyTorch loss.

    result = vcpo.policy_loss(logp, behavior_logp, mask=mask, rewards=rewards, group_index=groups)
    result.loss.backward()
    with vcpo.scale_lr(optimizer, result.lr_scale):
        optimizer.step()

Math and options: docs/contract.md."""

from vcpo_kernels import PolicyLossResult

from .config import VCPOConfig
from .grad_norms import PerSequenceGradients
from .loss import VCPOLoss, policy_loss
from .lr import ess_lr_scale, scale_lr, smoothed_lr_scale
from .memory import MicroBatchFit
from .step import RolloutBatch, step

__version__ = "0.1.0"
__all__ = [
    "VCPOConfig",
    "VCPOLoss",
    "PolicyLossResult",
    "policy_loss",
    "ess_lr_scale",
    "scale_lr",
    "smoothed_lr_scale",
    "PerSequenceGradients",
    "RolloutBatch",
    "step",
    "MicroBatchFit",
]
