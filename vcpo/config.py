"""VCPOConfig: the options of the VCPO loss (docs/contract.md) plus the backend choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vcpo_kernels.backends import BACKENDS
from vcpo_kernels.options import PolicyLossOptions
from vcpo_kernels.truncation import check_sampling


@dataclass(frozen=True)
class VCPOConfig(PolicyLossOptions):
    """Defaults follow the paper's released runs (sequence-level truncated IS with C = 8, OPOB advantages normalised
    by the group std with exact per-sequence gradient norms, ESS-scaled lr with rho_base = 1, seq-mean-token-mean,
    PPO clipping off, gradient clipping at 1.0) but for the lr rule: linear, the paper's option, where its runs used
    the square root (`lr_rule="sqrt"`; README, "Which update rule at a long lag"). The loss options are documented
    in docs/contract.md; the step options below."""

    backend: str = "auto"
    # The update step (vcpo.step): what G_i in the OPOB weights is, how the gradient is formed, clipping.
    grad_norms: str = "exact"  # "exact" | "auto" | "lm_head" | "length" | "uniform"
    assembly: str = "auto"  # "auto" | "bookkeeping" | "two_pass"
    grad_clip: Optional[float] = 1.0
    # Log-probs through vcpo_kernels.linear_logprobs from the last hidden states and the LM head's weight,
    # never the [B, T, V] logits (Hugging Face causal LMs; tied embeddings handled; docs/grad_norms.md).
    fused_lm_head: bool = False
    # At most this many sequences per forward, made of whole prompt groups (group_index), each micro-batch cut to
    # its own longest sequence; the step is the whole batch's (docs/grad_norms.md, "Micro-batches"). None: one
    # forward of the whole batch.
    micro_batch_size: Optional[int] = None
    # The sampling temperature of the rollouts: the step's log-probs are those of softmax(logits / temperature),
    # the distribution the behaviour log-probs are of (vLLM's processed log-probs; docs/trainer.md, "Sampling").
    temperature: float = 1.0
    # The rollouts' top-k and top-p (vLLM's; off: -1 or 0, and 1): the step's log-probs are those of the
    # distribution truncated to the sampling support, decided from the trainer's own logits (docs/contract.md,
    # "Truncated sampling"); a sampled token outside it has log-prob -inf, an importance weight of 0.
    top_k: int = -1
    top_p: float = 1.0
    # Mixed precision: the model's forward under torch.autocast in this dtype ("bfloat16" or "float16") over its
    # own (fp32) parameters; None: the parameters' dtype. The log-probs, exact norms and loss accumulate in fp32.
    autocast: Optional[str] = None
    # The lr scale of each step taken: 0 (the paper's), the batch's own; beta in (0, 1), the moving average, weight
    # beta, of the batch scales of the steps taken so far, bias-corrected (vcpo.lr.smoothed_lr_scale).
    lr_scale_ema: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.grad_norms not in GRAD_NORMS:
            raise ValueError(f"grad_norms must be one of {list(GRAD_NORMS)}, got {self.grad_norms!r}")
        if self.assembly not in ASSEMBLY:
            raise ValueError(f"assembly must be one of {list(ASSEMBLY)}, got {self.assembly!r}")
        if not isinstance(self.fused_lm_head, bool):
            raise ValueError(f"fused_lm_head must be True or False, got {self.fused_lm_head!r}")
        if self.micro_batch_size is not None and (isinstance(self.micro_batch_size, bool) or
                                                  not isinstance(self.micro_batch_size, int) or
                                                  self.micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be an integer >= 1 or None, got {self.micro_batch_size!r}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0):
            raise ValueError(f"grad_clip must be a number > 0 or None, got {self.grad_clip!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        check_sampling(self.top_k, self.top_p)
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {list(AUTOCAST_DTYPES)}, got {self.autocast!r}")
        if isinstance(self.lr_scale_ema, bool) or not isinstance(self.lr_scale_ema, (int, float)) or \
                not 0 <= self.lr_scale_ema < 1:
            raise ValueError(f"lr_scale_ema must be a number in [0, 1), got {self.lr_scale_ema!r}")


AUTOCAST_DTYPES = (None, "bfloat16", "float16")  # VCPOConfig.autocast
# exact: ||grad_theta sum_t log pi(y_it)||^2 over all trainable parameters, from one batched backward (a model
# with a module it cannot handle exactly is refused: vcpo.grad_norms.UnsupportedModuleError); auto: exact where the model
# is supported, else lm_head with one warning naming the module; lm_head: the same over the output layer's
# parameters only; length: G_i = L_i (OPO's length weighting); uniform: G_i = 1 (the baseline then weights
# sequences by w_i^2 alone).
GRAD_NORMS = ("exact", "auto", "lm_head", "length", "uniform")
# bookkeeping: the gradient sum_i k_i g_i is formed from the norm pass's stored layer inputs and output
# gradients (one backward in all; exact when d loss / d log pi is constant within a sequence: bypass mode and
# sequence-level weights; needs grad_norms="exact"); two_pass: a second backward of the loss (any options;
# the graph is kept meanwhile); auto: bookkeeping where it is exact, else two_pass.
ASSEMBLY = ("auto", "bookkeeping", "two_pass")
