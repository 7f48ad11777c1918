"""Options of the VCPO loss (defaults and meaning: docs/contract.md) and their integer codes for the
compiled ops. This file is the one place the codes are written: csrc/options.h is generated from it
(`python tools/options_header.py > csrc/options.h`; a test checks that the two agree), and the Triton kernels
read them as constants (vcpo_kernels/triton/codes.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

IS_LEVELS = {"sequence": 0, "token": 1, "geometric": 2}
IS_CORRECTIONS = {"truncate": 0, "mask": 1, "none": 2}
LR_RULES = {None: 0, "sqrt": 1, "linear": 2}
DEFAULT_LR_RULE = "linear"  # the ESS-scaled step's rule wherever one is not named (README, "Which update rule")
ADVANTAGES = {"opob": 0, "grpo": 1, "rloo": 2, "reinforce": 3, "none": 4}
GIVEN_ADVANTAGES = 5  # the kernels' code for advantages passed in by the caller
OPOB_SCOPES = ("group", "batch")
# Which log weight OPOB squares: s, min(s, log C) (opob_truncated_weights) or s + min(s, log C) (reference_compat).
OPOB_WEIGHTS = {"raw": 0, "truncated": 1, "reference-compat": 2}
# How OPOB forms b_g from the group's rewards and weights W_j (docs/contract.md, "Advantages").
OPOB_AGGREGATIONS = {"mean": 0, "median": 1, "winsorized_mean": 2}
# The trust region: what the per-token surrogate does with the ratio pi / pi_anchor (docs/contract.md, "Trust
# regions"). The rules that read clip_ratio, and those whose value is linear in log pi (REINFORCE-style).
TRUST_REGIONS = {"none": 0, "ppo": 1, "gspo": 2, "gmpo": 3, "cispo": 4, "dppo_tv": 5, "sapo": 6}
CLIPPED_RULES = ("ppo", "gspo", "gmpo", "cispo", "dppo_tv")
LINEAR_IN_LOGP = ("cispo", "dppo_tv")
# verl's rejection criteria (rollout_rs): the per-token divergence k1 = Delta, k2 = Delta^2 / 2,
# k3 = exp(Delta) - 1 - Delta, taken per token or summed, averaged or maximised over the sequence; and M2PO's mask
# (batch_m2): the tokens of largest Delta^2 until the mean Delta^2 of the others is at most its bound.
REJECTION_CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "batch_m2")
LOSS_AGG_MODES = {
    "token-mean": 0,
    "seq-mean-token-mean": 1,
    "seq-mean-token-sum": 2,
    "seq-mean-token-sum-norm": 3,
}
# Order of PolicyLossStats' scalar fields in the packed `scalars` tensor of the fused op.
SCALAR_FIELDS = (
    "ess",
    "ess_ratio",
    "lr_scale",
    "is_clip_fraction",
    "mean_is_coef",
    "kl_k3",
    "num_tokens",
    "num_seqs",
    "num_nonfinite",
    "ppo_clip_fraction",
    "rejected_fraction",
    "opob_max_share",
)
# The fused op's scalar options, packed by position into `int[] codes` and `float[] values` (an absent clip
# bound is NaN); PolicyLossOptions.packed() fills them, csrc/loss_options.h unpacks them.
LOSS_CODES = ("is_level", "is_correction", "ess_on_corrected", "lr_rule", "advantage", "norm_by_std",
              "opob_length_norm", "opob_weight", "loss_agg", "opob_aggregation", "rejection", "opob_leave_one_out", "trust_region")
# The rejection criteria in use are the bits of code "rejection" (bit j: REJECTION_CRITERIA[j]); each has a low and
# a high bound value, in that order and criterion order: log r bounds for k1 (the entries' intersection), the
# least upper bound for k2 and k3 (low unused).
LOSS_VALUES = ("log_threshold", "log_threshold_low", "ess_base_ratio", "clip_low", "clip_high", "clip_c",
               "norm_length", "winsorize_low", "winsorize_high", "sapo_tau_pos", "sapo_tau_neg", "m2_threshold") + tuple(
                   f"{name}_{side}" for name in REJECTION_CRITERIA for side in ("low", "high"))
# C++ enum -> codes, for csrc/options.h.
_ENUMS = {
    "IsLevel": IS_LEVELS,
    "IsCorrection": IS_CORRECTIONS,
    "LrRule": LR_RULES,
    "Advantage": {**ADVANTAGES, "given": GIVEN_ADVANTAGES},
    "OpobWeight": OPOB_WEIGHTS,
    "LossAgg": LOSS_AGG_MODES,
    "OpobAggregation": OPOB_AGGREGATIONS,
    "Rejection": {name: j for j, name in enumerate(REJECTION_CRITERIA)},
    "TrustRegion": TRUST_REGIONS,
}


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PolicyLossOptions:
    """Every option of the fused VCPO loss; invalid values raise ValueError naming the field."""

    is_level: str = "sequence"
    is_correction: str = "truncate"
    is_threshold: float = 8.0
    is_threshold_low: Optional[float] = None  # default 1 / is_threshold
    ess_on_corrected: bool = False
    ess_base_ratio: float = 1.0
    lr_rule: Optional[str] = DEFAULT_LR_RULE
    advantage: str = "opob"
    norm_by_std: bool = True
    opob_scope: str = "group"
    opob_length_norm: bool = False
    opob_truncated_weights: bool = False
    reference_compat: bool = False
    clip_ratio: Optional[Tuple[float, float]] = None
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "seq-mean-token-mean"
    norm_length: Optional[float] = None
    opob_aggregation: str = "mean"
    opob_winsorize_quantiles: Tuple[float, float] = (0.05, 0.95)
    # (criterion, low, high) entries, all applied: k1 criteria keep low <= r <= high (r the token's, the
    # sequence's or the geometric-mean ratio), the others keep statistic <= high (low None).
    rejection: Tuple[Tuple[str, Optional[float], Optional[float]], ...] = ()
    is_batch_normalize: bool = False
    # OPOB's baseline of sequence i over the other members of its group (or batch) only: b_-i.
    opob_leave_one_out: bool = False
    # The trust region (TRUST_REGIONS); None: "ppo" when clip_ratio is given, else "none" (trust_rule).
    trust_region: Optional[str] = None
    # SAPO's gate temperatures (tau_pos, tau_neg): for tokens with A > 0, and the others.
    sapo_tau: Tuple[float, float] = (1.0, 1.05)
    # batch_m2: the threshold of Delta^2 formed over a larger batch than the call's (the ranks of a data-parallel
    # group: vcpo.distributed), used as it is; None: from the call's own tokens.
    second_moment_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        _choice("is_level", self.is_level, IS_LEVELS)
        _choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _positive("is_threshold", self.is_threshold)
        if self.is_threshold_low is not None:
            _positive("is_threshold_low", self.is_threshold_low)
            if self.is_threshold_low > self.is_threshold:
                raise ValueError(
                    f"is_threshold_low ({self.is_threshold_low}) must be <= is_threshold ({self.is_threshold})"
                )
        _positive("ess_base_ratio", self.ess_base_ratio)
        _choice("lr_rule", self.lr_rule, LR_RULES)
        _choice("advantage", self.advantage, ADVANTAGES)
        _choice("opob_scope", self.opob_scope, OPOB_SCOPES)
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        for name in ("ess_on_corrected", "norm_by_std", "opob_length_norm", "opob_truncated_weights",
                     "reference_compat", "opob_leave_one_out"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.opob_truncated_weights and self.reference_compat:
            raise ValueError("opob_truncated_weights and reference_compat are exclusive: choose one OPOB weight")
        self._check_trust_region()
        if self.norm_length is not None:
            _positive("norm_length", self.norm_length)
        _choice("opob_aggregation", self.opob_aggregation, OPOB_AGGREGATIONS)
        q = self.opob_winsorize_quantiles
        if not isinstance(q, (tuple, list)) or len(q) != 2 or not all(
                not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x <= 1 for x in q) or q[0] > q[1]:
            raise ValueError(f"opob_winsorize_quantiles must be a pair (low, high), 0 <= low <= high <= 1, got "
                             f"{q!r}")
        object.__setattr__(self, "opob_winsorize_quantiles", (float(q[0]), float(q[1])))
        if self.opob_leave_one_out and self.opob_aggregation != "mean":
            raise ValueError(f"opob_leave_one_out=True is not available with opob_aggregation="
                             f"{self.opob_aggregation!r}: the leave-one-out baseline is the weighted mean only "
                             f"(opob_aggregation='mean')")
        object.__setattr__(self, "rejection", _rejection(self.rejection))
        if self.second_moment_threshold is not None:
            x = self.second_moment_threshold
            if self.second_moment_bound is None:
                raise ValueError("second_moment_threshold is the threshold of rejection 'batch_m2', which is not in "
                                 "rejection")
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0:
                raise ValueError(f"second_moment_threshold must be a number >= 0 (inf: no token rejected), got {x!r}")
            object.__setattr__(self, "second_moment_threshold", float(x))
        if not isinstance(self.is_batch_normalize, bool):
            raise ValueError(f"is_batch_normalize must be a bool, got {self.is_batch_normalize!r}")

    def _check_trust_region(self) -> None:
        if self.trust_region is not None:
            _choice("trust_region", self.trust_region, TRUST_REGIONS)
        rule = self.trust_rule
        if self.clip_ratio is not None:
            if rule not in CLIPPED_RULES:
                raise ValueError(f"clip_ratio is not read by trust_region={rule!r}: the bounds belong to one of "
                                 f"{list(CLIPPED_RULES)}")
            if not isinstance(self.clip_ratio, (tuple, list)) or len(self.clip_ratio) != 2:
                raise ValueError(f"clip_ratio must be a pair (eps_low, eps_high) or None, got {self.clip_ratio!r}")
            low, high = self.clip_ratio
            for side, eps in (("eps_low", low), ("eps_high", high)):
                if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
                    raise ValueError(f"clip_ratio {side} must be a finite number >= 0, got {eps!r}")
            if low >= 1 and rule in ("ppo", "gspo"):
                raise ValueError(f"clip_ratio eps_low must be < 1 for trust_region={rule!r}, got {low!r}")
            object.__setattr__(self, "clip_ratio", (float(low), float(high)))
        elif rule in CLIPPED_RULES:
            raise ValueError(f"trust_region={rule!r} needs clip_ratio=(eps_low, eps_high)")
        if self.clip_ratio_c is not None:
            if rule not in ("ppo", "gspo", "dppo_tv"):
                raise ValueError(f"clip_ratio_c is the dual clip of 'ppo' and 'gspo' and the ratio cap of 'dppo_tv', "
                                 f"not an option of trust_region={rule!r}")
            if _positive("clip_ratio_c", self.clip_ratio_c) <= 1:
                raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c!r}")
        tau = self.sapo_tau
        if not isinstance(tau, (tuple, list)) or len(tau) != 2:
            raise ValueError(f"sapo_tau must be a pair (tau_pos, tau_neg), got {tau!r}")
        object.__setattr__(self, "sapo_tau", (_positive("sapo_tau tau_pos", tau[0]),
                                              _positive("sapo_tau tau_neg", tau[1])))
        if self.sapo_tau != PolicyLossOptions.sapo_tau and rule != "sapo":
            raise ValueError(f"sapo_tau is read by trust_region='sapo' only, not {rule!r}")

    @property
    def trust_rule(self) -> str:
        """The trust region in use: trust_region, or for None "ppo" when clip_ratio is given, else "none"."""
        if self.trust_region is not None:
            return self.trust_region
        return "ppo" if self.clip_ratio is not None else "none"

    @property
    def threshold_low(self) -> float:
        return 1.0 / self.is_threshold if self.is_threshold_low is None else float(self.is_threshold_low)

    @property
    def opob_weight_code(self) -> int:
        return OPOB_WEIGHTS["reference-compat" if self.reference_compat else
                            "truncated" if self.opob_truncated_weights else "raw"]

    def packed(self, norm_length: Optional[float]) -> Tuple[list, list]:
        """(codes, values) of the fused op, in LOSS_CODES and LOSS_VALUES order."""
        clip_low, clip_high = self.clip_ratio if self.clip_ratio is not None else (math.nan, math.nan)
        codes = dict(is_level=IS_LEVELS[self.is_level], is_correction=IS_CORRECTIONS[self.is_correction],
                     ess_on_corrected=int(self.ess_on_corrected), lr_rule=LR_RULES[self.lr_rule],
                     advantage=ADVANTAGES[self.advantage], norm_by_std=int(self.norm_by_std),
                     opob_length_norm=int(self.opob_length_norm), opob_weight=self.opob_weight_code,
                     loss_agg=LOSS_AGG_MODES[self.loss_agg_mode],
                     opob_aggregation=OPOB_AGGREGATIONS[self.opob_aggregation],
                     rejection=0, opob_leave_one_out=int(self.opob_leave_one_out),
                     trust_region=TRUST_REGIONS[self.trust_rule])
        for name, _, _ in self.rejection:
            codes["rejection"] |= 1 << REJECTION_CRITERIA.index(name)
        values = dict(log_threshold=math.log(self.is_threshold), log_threshold_low=math.log(self.threshold_low),
                      ess_base_ratio=self.ess_base_ratio, clip_low=clip_low, clip_high=clip_high,
                      clip_c=math.nan if self.clip_ratio_c is None else float(self.clip_ratio_c),
                      norm_length=0.0 if norm_length is None else float(norm_length),
                      winsorize_low=self.opob_winsorize_quantiles[0], winsorize_high=self.opob_winsorize_quantiles[1],
                      sapo_tau_pos=self.sapo_tau[0], sapo_tau_neg=self.sapo_tau[1],
                      m2_threshold=math.nan if self.second_moment_threshold is None else self.second_moment_threshold)
        for name in REJECTION_CRITERIA:  # plain loops: torch.compile traces this
            k1 = name.endswith("k1")
            low, high = (-math.inf if k1 else 0.0), math.inf
            for entry, lo, hi in self.rejection:
                if entry == name:
                    low = max(low, math.log(lo)) if k1 else low
                    high = min(high, math.log(hi) if k1 else hi)
            values[f"{name}_low"], values[f"{name}_high"] = low, high
        return [codes[k] for k in LOSS_CODES], [values[k] for k in LOSS_VALUES]

    def replace(self, **changes) -> "PolicyLossOptions":
        return dataclasses.replace(self, **changes)

    @property
    def batch_baseline(self) -> bool:
        """Whether one OPOB baseline spans the whole batch (opob_scope="batch") instead of one per prompt group."""
        return self.advantage == "opob" and self.opob_scope == "batch"

    @property
    def token_rejection(self) -> bool:
        """Whether a rejection criterion acts per token (the coefficient then varies within a sequence)."""
        return any(name.startswith(("token_", "batch_")) for name, _, _ in self.rejection)

    @property
    def second_moment_bound(self) -> Optional[float]:
        """M2PO's bound on the mean Delta^2 of the kept tokens (rejection "batch_m2"), or None."""
        return min((high for name, _, high in self.rejection if name == "batch_m2"), default=None)



def _bound(criterion: str, side: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf:
        raise ValueError(f"rejection {criterion!r}: {side} must be a finite number > 0, got {x!r}")
    return float(x)


def _rejection(entries) -> tuple:
    """The rejection entries as a tuple of (criterion, low, high), checked."""
    if not isinstance(entries, (tuple, list)):
        raise ValueError(f"rejection must be a sequence of (criterion, low, high) entries, got {entries!r}")
    out = []
    for entry in entries:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(f"rejection entries must be (criterion, low, high), got {entry!r}")
        name, low, high = entry
        _choice("rejection criterion", name, REJECTION_CRITERIA)
        high = _bound(name, "high", high)
        if name.endswith("k1"):
            low = _bound(name, "low", low)
            if low > high:
                raise ValueError(f"rejection {name!r}: low ({low}) must be <= high ({high})")
        elif low is not None:
            raise ValueError(f"rejection {name!r} bounds the divergence from above only: low must be None, "
                             f"got {low!r}")
        out.append((name, low, high))
    return tuple(out)


def _camel(name) -> str:
    return "None" if name is None else "".join(part.capitalize() for part in name.replace("-", "_").split("_"))


def cpp_header() -> str:
    """csrc/options.h: the codes above as C++ enums."""
    lines = ["// Generated from vcpo_kernels/options.py by `python tools/options_header.py > csrc/options.h`: edit",
             "// that file, not this one (tests/kernels/test_option_codes.py checks that they agree).", "#pragma once", "",
             "#include <cstdint>", "", "namespace vcpo {", ""]
    for enum, codes in _ENUMS.items():
        members = ", ".join(f"{_camel(k)} = {v}" for k, v in codes.items())
        lines.append(f"enum class {enum} : int64_t {{ {members} }};")
    lines.append("")
    lines.append(f"constexpr int64_t kNumRejection = {len(REJECTION_CRITERIA)};")
    lines.append("")
    for enum, names, count in (("Scalar", SCALAR_FIELDS, "kNumScalars"), ("LossCode", LOSS_CODES, "kNumLossCodes"),
                               ("LossValue", LOSS_VALUES, "kNumLossValues")):
        members = "".join(f"  k{_camel(name)} = {i},\n" for i, name in enumerate(names))
        lines.append(f"enum {enum} : int64_t {{\n{members}  {count} = {len(names)},\n}};")
    lines += ["", "// The LossValue of each Rejection criterion's low and high bound, in Rejection order."]
    for side in ("low", "high"):
        members = "".join(f"  k{_camel(name)}{side.capitalize()},\n" for name in REJECTION_CRITERIA)
        lines.append(f"constexpr LossValue kRejection{side.capitalize()}[kNumRejection] = {{\n{members}}};")
    lines += ["", "}  // namespace vcpo", ""]
    return "\n".join(lines)
