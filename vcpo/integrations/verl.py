"""VCPO in verl 0.9.1 (docs/integrations.md): the policy loss `vcpo` and the ESS-scaling optimizer `VCPOAdamW`.

verl imports this module on `import verl` through the `verl.plugins` entry point of this package, so every Ray
worker has the loss registered. verl calls the loss once per micro-batch, with the behaviour log-probs as
`old_log_prob` in its bypass mode; each call adds its sequences' log importance weights to this process's sums
(log space), and `VCPOAdamW.step` gathers the sums of every rank, forms the mini-batch's ESS ratio and lr scale and
takes the AdamW step at the scaled lr, or skips it when the gradient or the lr scale is not finite (as vcpo.step).
`zero_grad` (verl calls it before each mini-batch) starts new sums."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import Tensor
from verl.trainer.ppo.core_algos import register_policy_loss

from vcpo_kernels.ops import batch_normalizer
from vcpo_kernels.options import DEFAULT_LR_RULE

from ..config import VCPOConfig
from ..distributed import global_share
from ..loss import policy_loss
from ..lr import ess_lr_scale, scale_lr, smoothed_lr_scale
from ..step import skip_names, skip_reason

__all__ = ["LOSS_MODE", "TRUST_REGION_MODES", "TRUST_REGION_LOSSES", "vcpo_policy_loss", "loss_options", "rejection_entries", "VCPOAdamW"]

LOSS_MODE = "vcpo"  # actor.policy_loss.loss_mode
# verl's own trust-region losses and vcpo's trust_region of the same rule: registered as loss_mode vcpo_<verl's name>,
# the rule on the vcpo loss (its rollout correction, VCPOAdamW's ESS-scaled step), its bounds from verl's actor fields
TRUST_REGION_MODES = {"vanilla": "ppo", "gspo": "gspo", "geo_mean": "gmpo", "cispo": "cispo", "dppo_tv": "dppo_tv",
                      "sapo": "sapo"}

# This process's log-space weight sums since the last zero_grad: one [5] float64 row per loss call (_log_sums).
_SUMS: list[Tensor] = []


def loss_options(config, loss_agg_mode: str, verl_rule: str | None = None) -> VCPOConfig:
    """The VCPOConfig of verl's actor config: the IS level and threshold C from
    `policy_loss.rollout_correction` (`rollout_is`, `rollout_is_threshold`), its rejection criteria (`rollout_rs`,
    `rollout_rs_threshold`) and batch normalisation (`rollout_is_batch_normalize`), the aggregation from
    `loss_agg_mode`, `norm_length` from `loss_scale_factor`; with `verl_rule` (a TRUST_REGION_MODES key) its trust
    region from verl's actor fields (`trust_region_options`). What VCPO cannot reproduce raises ValueError naming
    verl's option."""
    rc = config.policy_loss.get("rollout_correction", None) if config is not None else None
    if rc is None and verl_rule is None:
        raise ValueError("loss_mode='vcpo' needs actor.policy_loss.rollout_correction (its rollout_is and "
                         "rollout_is_threshold are VCPO's IS level and C)")
    rc = {} if rc is None else rc
    if verl_rule is not None and rc.get("rollout_is", None) is not None:
        raise ValueError(f"loss_mode='vcpo_{verl_rule}' reads the ratio pi / mu (bypass mode), which is the importance "
                         f"weight itself: set rollout_correction.rollout_is=null (got {rc.get('rollout_is')!r})")
    level, threshold = rc.get("rollout_is", None), rc.get("rollout_is_threshold", 2.0)
    rejection = ()
    if rc.get("rollout_rs", None) is not None:
        rejection = rejection_entries(rc.get("rollout_rs"), rc.get("rollout_rs_threshold", None))
        if loss_agg_mode == "seq-mean-token-mean" and any(name.startswith("token_") for name, _, _ in rejection):
            # verl divides each sequence by its kept tokens; a rejected token keeps its place in L_i here
            raise ValueError(f"loss_mode='vcpo' does not support a token-level rollout_correction.rollout_rs "
                             f"({rc.get('rollout_rs')!r}) with loss_agg_mode='seq-mean-token-mean'")
    if level not in (None, "token", "sequence"):
        raise ValueError(f"rollout_correction.rollout_is must be None, 'token' or 'sequence', got {level!r}")
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        # verl's "lower_upper" (IcePop) keeps w inside the bounds; VCPO's mask gives those units coefficient 1.
        raise ValueError(f"loss_mode='vcpo' needs a single rollout_correction.rollout_is_threshold (truncation at "
                         f"C), got {threshold!r}") from None
    factor = config.get("loss_scale_factor", None)
    return VCPOConfig(is_level=level or "sequence", is_correction="truncate" if level else "none",
                      is_threshold=threshold, loss_agg_mode=loss_agg_mode, norm_length=factor, rejection=rejection,
                      is_batch_normalize=bool(level) and bool(rc.get("rollout_is_batch_normalize", False)),
                      **({} if verl_rule is None else trust_region_options(config, verl_rule)))


def trust_region_options(config, verl_rule: str) -> dict:
    """VCPOConfig's trust region of verl's loss `verl_rule` and its actor fields: `clip_ratio_low/high` (each
    `clip_ratio` where None, as verl), `clip_ratio_c` (vanilla's dual clip, always on in verl; dppo_tv's ratio cap),
    `tau_pos`, `tau_neg` (sapo)."""
    rule = TRUST_REGION_MODES[verl_rule]
    if rule == "sapo":
        return dict(trust_region=rule, sapo_tau=(config.get("tau_pos", 1.0), config.get("tau_neg", 1.05)))
    both = config.get("clip_ratio", 0.2)
    low, high = config.get("clip_ratio_low", None), config.get("clip_ratio_high", None)
    options = dict(trust_region=rule, clip_ratio=(both if low is None else low, both if high is None else high))
    if rule in ("ppo", "dppo_tv"):
        options["clip_ratio_c"] = config.get("clip_ratio_c", 3.0)
    return options


def rejection_entries(rollout_rs: str, rollout_rs_threshold) -> tuple:
    """PolicyLossOptions.rejection of verl's `rollout_rs` (comma-separated criteria, repeats dropped) and
    `rollout_rs_threshold` (one spec for all, or one per criterion). verl's k1 spec "lo_hi" (or "x": 1/x and x)
    bounds -log r, so it keeps 1/hi <= r <= 1/lo: vcpo's bounds on r are (1/hi, 1/lo)."""
    names = list(dict.fromkeys(n.strip() for n in str(rollout_rs).split(",") if n.strip()))
    specs = [p.strip() for p in str(rollout_rs_threshold).split(",") if p.strip()]
    if rollout_rs_threshold is None or not names or len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs={rollout_rs!r} needs one rollout_rs_threshold or one per criterion, got "
                         f"{rollout_rs_threshold!r}")
    entries = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        try:
            if name.endswith("k1"):
                lo, _, hi = spec.rpartition("_")
                hi = float(hi)
                lo = float(lo) if lo else 1 / hi
                entries.append((name, 1 / hi, 1 / lo))
            else:
                entries.append((name, None, float(spec)))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_rs_threshold {spec!r} of {name!r} is not a bound verl accepts") from None
    return entries


def _log_sums(s: Tensor, valid: Tensor) -> Tensor:
    """[m, sum exp(s - m), sum exp(2 (s - m)), n, 1] over the valid s (float64): the ESS's sums shifted by their
    maximum m, the count, one loss call. No valid weight, or every weight 0 (m = -inf): sums 0."""
    s = torch.where(valid, s.double(), -math.inf)
    m = s.max() if s.numel() else s.new_tensor(-math.inf)
    e = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m))
    return torch.stack([m, e.sum(), (e * e).sum(), valid.sum().double(), torch.ones_like(m)])


def _merge(rows: Tensor) -> Tensor:
    """One row of _log_sums from rows of them (micro-batches, ranks), in row order; columns after the fifth (the
    ranks' gradient maxima) are taken as their maximum."""
    m = rows[:, 0].max()
    f = torch.where(torch.isneginf(rows[:, 0]), 0.0, torch.exp(rows[:, 0] - torch.where(torch.isneginf(m), 0.0, m)))
    return torch.cat([torch.stack([m, (rows[:, 1] * f).sum(), (rows[:, 2] * f * f).sum(), rows[:, 3].sum(),
                                   rows[:, 4].sum()]), rows[:, 5:].amax(0)])


def _sequence_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's advantage: its value at the first counted token (verl's outcome estimators write the same
    value on every response token)."""
    first = mask.to(torch.int8).argmax(1, keepdim=True)
    return advantages.gather(1, first).squeeze(1)


@register_policy_loss(LOSS_MODE)
def vcpo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                     rollout_is_weights=None):
    """verl's policy-loss signature. Bypass mode: `old_log_prob` is the behaviour policy's (verl's
    `algorithm.rollout_correction.bypass_mode=True`), the proximal policy is `log_prob` detached. The loss is this
    micro-batch's part of the mini-batch's: its count over verl's global counts (`global_batch_info`: tokens over
    all data-parallel ranks, or the mini-batch's sequences) times the data-parallel size, as verl's own losses."""
    return _vcpo_loss(None, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                      rollout_is_weights)


def _trust_region_loss(verl_rule: str):
    """The loss of loss_mode vcpo_<verl_rule>: vcpo_policy_loss with verl's rule as its trust region."""

    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
        return _vcpo_loss(verl_rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                          rollout_is_weights)

    loss.__name__ = f"vcpo_{verl_rule}_policy_loss"
    return register_policy_loss(f"vcpo_{verl_rule}")(loss)


TRUST_REGION_LOSSES = {verl_rule: _trust_region_loss(verl_rule) for verl_rule in TRUST_REGION_MODES}


def _vcpo_loss(verl_rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
               rollout_is_weights):
    mode = LOSS_MODE if verl_rule is None else f"vcpo_{verl_rule}"
    if rollout_is_weights is not None:
        raise ValueError(f"loss_mode='{mode}' got verl's rollout_is_weights (decoupled mode): set "
                         "algorithm.rollout_correction.bypass_mode=True so that old_log_prob is the behaviour policy "
                         "and VCPO forms the weights itself")
    options = loss_options(config, loss_agg_mode, verl_rule)
    mask = response_mask.bool()
    out = policy_loss(log_prob, old_log_prob.to(log_prob.dtype), config=options.replace(is_batch_normalize=False),
                      mask=mask, advantages=_sequence_advantages(advantages, mask).to(log_prob.dtype))
    loss = out.loss
    if options.is_batch_normalize:
        # verl's mean: over this call's units and, when torch.distributed is initialised, every process's
        units = (out.num_tokens if options.is_level == "token" else out.num_seqs).double()
        coef = torch.stack([out.mean_is_coef.double() * units, units])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(coef)
        loss = loss / batch_normalizer(coef[0] / coef[1].clamp(min=1)).to(loss.dtype)
    info = config.global_batch_info
    dp = info.get("dp_size", None) or 1
    whole = info.get("batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size", None)
    if whole is not None:
        loss = loss * (dp * global_share(mask.sum(1), whole, loss_agg_mode)).to(loss.dtype)
    elif dp > 1:
        raise ValueError(f"loss_mode='{mode}' with dp_size={dp} needs verl's global batch counts (global_batch_info)")
    _SUMS.append(_log_sums(out.seq_log_weight.detach(), mask.any(1)))
    stats = torch.stack([out.is_clip_fraction, out.mean_is_coef, out.kl_k3, out.ess_ratio,
                         out.rejected_fraction, out.ppo_clip_fraction]).double().tolist()
    return loss, {f"actor/vcpo_{k}": v for k, v in zip(("is_clip_fraction", "mean_is_coef", "kl_k3",
                                                         "micro_batch_ess_ratio", "rejected_fraction",
                                                         "trust_region_fraction"), stats)}


class VCPOAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose step runs at lr times the ESS lr scale of the sequences the `vcpo` loss saw since
    the last `zero_grad`, over every rank of `process_group` (default: all ranks, when torch.distributed is
    initialised; one all_gather of six numbers, so every rank takes the same scale). Ranks that hold the same
    sequences add each equally often, which leaves the ratio unchanged. A step whose gradient (the largest |entry|
    of every rank's, gathered with the sums) or lr scale is not finite is skipped as vcpo.step skips one: no AdamW
    step, the gradients cleared. verl's actor already skips the step (and clears the gradients) when its gradient
    norm is not finite; this adds the NaN ESS, whose lr scale of 0 would still move AdamW's moments. In verl:
    `actor.optim.optimizer_impl=vcpo.integrations.verl`, `optimizer=VCPOAdamW`, `lr_rule` and `ess_base_ratio` in
    `override_optimizer_config`, and `lr_scale_ema` (VCPOConfig's). The last step's `ess`, `ess_ratio`, `lr_scale` (the
    step's), `batch_lr_scale` (its sequences' own; the same without lr_scale_ema), `num_seqs`, `skipped` (1.0 or 0.0)
    and `skip_reason` are in `.vcpo_stats` (floats)."""

    def __init__(self, params, *, lr_rule=DEFAULT_LR_RULE, ess_base_ratio=1.0, lr_scale_ema=0.0, process_group=None,
                 **adamw_kwargs):
        VCPOConfig(lr_rule=lr_rule, ess_base_ratio=ess_base_ratio, lr_scale_ema=lr_scale_ema)  # names a bad value
        super().__init__(params, **adamw_kwargs)
        self.lr_rule, self.ess_base_ratio, self.process_group = lr_rule, float(ess_base_ratio), process_group
        self.lr_scale_ema = float(lr_scale_ema)
        self.vcpo_stats: dict[str, float] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        _SUMS.clear()  # a new mini-batch
        super().zero_grad(set_to_none)

    def lr_scale(self) -> float:
        """The ESS lr scale of the sums since the last zero_grad, over all ranks (collective: every rank calls it);
        `vcpo_stats` gets it, with whether the step is to be skipped."""
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        device = params[0].device
        # this rank's largest |gradient entry| (a local shard's with FSDP: the gather below covers the others)
        grad_max = torch.nn.utils.get_total_norm(grads, norm_type=math.inf) if grads else torch.zeros(())
        grad_max = (grad_max.to_local() if hasattr(grad_max, "to_local") else grad_max).double().reshape(1)
        empty = torch.tensor([-math.inf, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        sums = torch.cat([(_merge(torch.stack(_SUMS)) if _SUMS else empty).to(device), grad_max.to(device)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            parts = [torch.empty_like(sums) for _ in range(dist.get_world_size(self.process_group))]
            dist.all_gather(parts, sums, group=self.process_group)
            sums = _merge(torch.stack(parts))  # in rank order: the same bits on every rank
        _, s1, s2, n, calls, grad_max = sums
        ess = torch.where(n > 0, s1 * s1 / s2, 0.0)  # all weights 0: NaN, so the scale is 0 (docs/contract.md)
        ratio = torch.where(n > 0, ess / n, 0.0)
        scale = ess_lr_scale(ratio, self.lr_rule, self.ess_base_ratio)
        ess, ratio, scale, n, calls, grad_max = torch.stack([ess, ratio, scale, n, calls, grad_max]).tolist()
        if calls == 0:
            raise RuntimeError("VCPOAdamW stepped with no call of the 'vcpo' policy loss on any rank since zero_grad "
                               "(set actor.policy_loss.loss_mode=vcpo)")
        reason = skip_reason(grad_norm=grad_max, lr_scale=scale, ess_ratio=ratio)
        self.vcpo_stats = {"ess": ess, "ess_ratio": ratio, "lr_scale": scale, "batch_lr_scale": scale,
                           "num_seqs": n, "skipped": float(reason > 0), "skip_reason": float(reason)}
        return scale

    @torch.no_grad()
    def step(self, closure=None):
        scale = self.lr_scale()
        if self.vcpo_stats["skipped"]:
            warnings.warn(f"VCPOAdamW: step skipped, not finite: {skip_names(self.vcpo_stats['skip_reason'])}")
            self.zero_grad()  # as verl's actor does for a non-finite gradient norm
            return None
        if self.lr_scale_ema:
            scale = self.vcpo_stats["lr_scale"] = smoothed_lr_scale(self, scale, self.lr_scale_ema)
        with scale_lr(self, scale):
            return super().step(closure)
