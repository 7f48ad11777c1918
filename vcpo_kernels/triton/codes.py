"""The option codes and the packed statistics' positions of vcpo_kernels/options.py as Triton constants, so that
the kernels use names, not numbers (each a tl.constexpr: a jitted function may read it as a global)."""

import triton.language as tl

from ..options import (ADVANTAGES, IS_CORRECTIONS, IS_LEVELS, LOSS_AGG_MODES, LR_RULES, OPOB_WEIGHTS, SCALAR_FIELDS,
                       TRUST_REGIONS)

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
RULE_GSPO = tl.constexpr(TRUST_REGIONS["gspo"])
RULE_GMPO = tl.constexpr(TRUST_REGIONS["gmpo"])
RULE_CISPO = tl.constexpr(TRUST_REGIONS["cispo"])
RULE_DPPO_TV = tl.constexpr(TRUST_REGIONS["dppo_tv"])

# Positions in the fused loss's `scalars` output (SCALAR_FIELDS; a name not there fails at import).
SCALAR_ESS = tl.constexpr(SCALAR_FIELDS.index("ess"))
SCALAR_ESS_RATIO = tl.constexpr(SCALAR_FIELDS.index("ess_ratio"))
SCALAR_LR_SCALE = tl.constexpr(SCALAR_FIELDS.index("lr_scale"))
SCALAR_IS_CLIP_FRACTION = tl.constexpr(SCALAR_FIELDS.index("is_clip_fraction"))
SCALAR_MEAN_IS_COEF = tl.constexpr(SCALAR_FIELDS.index("mean_is_coef"))
SCALAR_KL_K3 = tl.constexpr(SCALAR_FIELDS.index("kl_k3"))
SCALAR_NUM_TOKENS = tl.constexpr(SCALAR_FIELDS.index("num_tokens"))
SCALAR_NUM_SEQS = tl.constexpr(SCALAR_FIELDS.index("num_seqs"))
SCALAR_NUM_NONFINITE = tl.constexpr(SCALAR_FIELDS.index("num_nonfinite"))
SCALAR_PPO_CLIP_FRACTION = tl.constexpr(SCALAR_FIELDS.index("ppo_clip_fraction"))
SCALAR_REJECTED_FRACTION = tl.constexpr(SCALAR_FIELDS.index("rejected_fraction"))
SCALAR_OPOB_MAX_SHARE = tl.constexpr(SCALAR_FIELDS.index("opob_max_share"))
