"""The VCPO loss as a function and as an nn.Module."""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from torch import Tensor, nn

import vcpo_kernels
from vcpo_kernels import PolicyLossResult

from . import distributed
from .config import VCPOConfig

_OPTION_NAMES = {f.name for f in fields(VCPOConfig)}


def policy_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    *,
    config: Optional[VCPOConfig] = None,
    validate: bool = True,
    process_group=None,
    **kwargs,
) -> PolicyLossResult:
    """VCPO policy loss. `kwargs` are the batch tensors of vcpo_kernels.policy_loss (mask or cu_seqlens,
    old_logp, rewards or advantages, group_index, num_groups, grad_sq_norm) and option overrides.
    Returns `.loss` (autograd to logp) and the statistics (`.ess_ratio`, `.lr_scale`, ...).
    `process_group`: a torch.distributed data-parallel group whose ranks hold different sequences; the ESS, lr
    scale and baselines are then computed over all of them, identically on every rank (vcpo/distributed.py)."""
    config = config if config is not None else VCPOConfig()
    if not isinstance(config, VCPOConfig):
        raise ValueError(f"config must be a vcpo.VCPOConfig, got {type(config).__name__}")
    if process_group is not None:
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTION_NAMES}
        options = config.replace(**overrides) if overrides else config
        return distributed.policy_loss(logp, behavior_logp, process_group=process_group, options=options,
                                       validate=validate, backend=options.backend, **kwargs)
    return vcpo_kernels.policy_loss(
        logp, behavior_logp, options=config, validate=validate, backend=config.backend, **kwargs
    )


class VCPOLoss(nn.Module):
    """nn.Module form of `policy_loss`: `VCPOLoss(config)(logp, behavior_logp, mask=..., rewards=...)`."""

    def __init__(self, config: Optional[VCPOConfig] = None, **overrides) -> None:
        super().__init__()
        config = config if config is not None else VCPOConfig()
        self.config = config.replace(**overrides) if overrides else config

    def forward(self, logp: Tensor, behavior_logp: Tensor, **kwargs) -> PolicyLossResult:
        return policy_loss(logp, behavior_logp, config=self.config, **kwargs)

    def extra_repr(self) -> str:
        return repr(self.config)
