"""VCPOConfig: the options of the VCPO loss (docs/contract.md) plus the backend choice."""

from __future__ import annotations

from dataclasses import dataclass

from vcpo_kernels.backends import BACKENDS
from vcpo_kernels.options import PolicyLossOptions


@dataclass(frozen=True)
class VCPOConfig(PolicyLossOptions):
    """Defaults follow the paper's released runs: sequence-level truncated IS with C = 8, OPOB advantages
    normalised by the group std, ESS-scaled lr with the sqrt rule and rho_base = 1, seq-mean-token-mean,
    PPO clipping off. Every field is documented in docs/contract.md."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
