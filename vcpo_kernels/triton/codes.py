"""The option codes of vcpo_kernels/options.py as Triton constants, so that the kernels compare names, not
numbers (each a tl.constexpr: a jitted function may read it as a global)."""

import triton.language as tl

from ..options import ADVANTAGES, IS_CORRECTIONS, IS_LEVELS, LOSS_AGG_MODES, LR_RULES, OPOB_WEIGHTS

LEVEL_TOKEN = tl.constexpr(IS_LEVELS["token"])
LEVEL_GEOMETRIC = tl.constexpr(IS_LEVELS["geometric"])
CORRECTION_TRUNCATE = tl.constexpr(IS_CORRECTIONS["truncate"])
CORRECTION_MASK = tl.constexpr(IS_CORRECTIONS["mask"])
RULE_NONE = tl.constexpr(LR_RULES[None])
RULE_SQRT = tl.constexpr(LR_RULES["sqrt"])
ADVANTAGE_OPOB = tl.constexpr(ADVANTAGES["opob"])
ADVANTAGE_GRPO = tl.constexpr(ADVANTAGES["grpo"])
ADVANTAGE_RLOO = tl.constexpr(ADVANTAGES["rloo"])
ADVANTAGE_REINFORCE = tl.constexpr(ADVANTAGES["reinforce"])
WEIGHT_TRUNCATED = tl.constexpr(OPOB_WEIGHTS["truncated"])
WEIGHT_REFERENCE_COMPAT = tl.constexpr(OPOB_WEIGHTS["reference-compat"])
AGG_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES["token-mean"])
AGG_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES["seq-mean-token-mean"])
AGG_SEQ_MEAN_TOKEN_SUM = tl.constexpr(LOSS_AGG_MODES["seq-mean-token-sum"])
