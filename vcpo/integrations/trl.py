"""VCPO in TRL: `VCPOGRPOTrainer`, a `trl.GRPOTrainer` whose loss is the VCPO loss (docs/integrations.md).

Per generation batch (once, before TRL shuffles it and splits it into `steps_per_generation` chunks): the
rewards and prompt groups, the current policy's log-probs and per-sequence squared gradient norms G_i, and
`vcpo.policy_loss` over the whole batch give the OPOB advantages, the ESS and the lr scale. Each chunk's loss
is then `vcpo.policy_loss` with those advantages; each optimizer step of the batch runs at the scaled lr.
`VCPOAsyncGRPOTrainer`: the same loss per tree-packed micro-batch of `trl.experimental.async_grpo.AsyncGRPOTrainer`,
and the lr scale of each optimizer step's sequences."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

import vcpo_kernels

from ..config import VCPOConfig
from ..distributed import agg_count, largest_abs
from ..grad_norms import UnsupportedModuleError, recorder
from ..loss import policy_loss
from ..lr import scale_lr, smoothed_lr_scale
from ..step import skip_names, skip_reason, token_logp

__all__ = ["VCPOAsyncGRPOConfig", "VCPOAsyncGRPOTrainer", "VCPOGRPOConfig", "VCPOGRPOTrainer", "trl_trust_region"]


@dataclass
class VCPOGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` plus `vcpo_config`, every VCPO option in one `vcpo.VCPOConfig` (written once there; of TRL's
    own loss options only those naming a trust region are read, trl_trust_region: docs/integrations.md maps the
    others). Build it in Python: `HfArgumentParser` cannot parse the nested config."""

    vcpo_config: VCPOConfig = field(default_factory=VCPOConfig)

    def to_dict(self):
        d = super().to_dict()
        d["vcpo_config"] = dataclasses.asdict(self.vcpo_config)  # JSON-serialisable for the loggers
        return d


def trl_trust_region(args) -> dict:
    """VCPOConfig's trust region of TRL's own loss settings (a GRPOConfig): `loss_type="cispo"` (TRL caps the ratio
    at `epsilon_high` itself, not at 1 + it, with no floor: `clip_ratio=(1, epsilon_high - 1)`), `"sapo"`
    (`sapo_temperature_pos/neg`), and `importance_sampling_level="sequence"` with a clipped loss type (GSPO:
    `clip_ratio=(epsilon, epsilon_high)`); {} for TRL's token-level clipped loss types, whose PPO clip the VCPO loss
    does not take over (set VCPOConfig.clip_ratio for it)."""
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    loss_type = getattr(args, "loss_type", None)  # AsyncGRPOConfig has neither
    sequence = getattr(args, "importance_sampling_level", "token") == "sequence"
    if loss_type in ("cispo", "sapo") and sequence:
        raise ValueError(f"loss_type={loss_type!r} with importance_sampling_level='sequence': the VCPO loss has "
                         f"{loss_type} per token only")
    if loss_type == "cispo":
        if high < 1:
            raise ValueError(f"loss_type='cispo': TRL caps the ratio at epsilon_high={high} itself (not at 1 + it), "
                             "so every token would weigh less than on-policy: set epsilon_high >= 1 (ScaleRL: 5.0)")
        return dict(trust_region="cispo", clip_ratio=(1.0, high - 1.0))
    if loss_type == "sapo":
        return dict(trust_region="sapo", sapo_tau=(args.sapo_temperature_pos, args.sapo_temperature_neg))
    if sequence:
        return dict(trust_region="gspo", clip_ratio=(args.epsilon, high))
    return {}


def with_trl_trust_region(config: VCPOConfig, args) -> VCPOConfig:
    """`config` with the trust region TRL's settings name (trl_trust_region), which vcpo_config must not set too;
    refused where the trainer's bypass mode would weight twice (docs/contract.md, "Trust regions")."""
    if not isinstance(config, VCPOConfig):
        raise ValueError(f"vcpo_config must be a vcpo.VCPOConfig, got {type(config).__name__}")
    rule = trl_trust_region(args)
    if rule:
        if config.trust_region is not None or config.clip_ratio is not None:
            raise ValueError(f"TRL's loss_type={args.loss_type!r} / importance_sampling_level="
                             f"{args.importance_sampling_level!r} name the trust region {rule['trust_region']!r}, and "
                             "vcpo_config sets one too (trust_region or clip_ratio): set it in one place")
        config = config.replace(**rule)
    if config.trust_rule != "none" and config.is_correction == "truncate":
        raise ValueError(f"the trust region {config.trust_rule!r} reads the ratio pi / mu (VCPOGRPOTrainer takes its "
                         "steps in bypass mode), which is the importance weight itself: vcpo_config's "
                         "is_correction='truncate' would weight each unit a second time; use is_correction='none' (or "
                         "'mask')")
    return config


def _loss_mask(batch) -> torch.Tensor:
    """The tokens TRL's loss counts: the completion's, less tool output in multi-turn rollouts (bool [B, C])."""
    mask = batch["completion_mask"] != 0
    return mask if "tool_mask" not in batch else mask & (batch["tool_mask"] != 0)


def _grad_max(model) -> torch.Tensor:
    """The largest |entry| of the model's gradients (vcpo.distributed.largest_abs): under DDP the same on every
    process (the all-reduced gradient); FSDP2's shards: reduced over the ranks."""
    return largest_abs([p.grad for p in model.parameters() if p.grad is not None])


def _no_step(*args, **kwargs) -> None:
    return None


class _OptimizerStep:
    """One optimizer step of HF's Trainer, from on_pre_optimizer_step to on_optimizer_step: every param group's lr
    times the lr scale, restored after; or, as vcpo.step does, no step at all when the gradient or the lr scale is
    not finite (vcpo.step.skip_reason): the optimizer's `step` is a no-op until on_optimizer_step, so the weights and
    the optimizer's state stay as they were (Trainer clears the gradients after it). The decision reads values every
    process shares, so the processes skip together. Logged: `vcpo/skipped` per step, and a warning naming why."""

    def __init__(self, metrics, lr_scale_ema: float) -> None:
        self.metrics, self.lr_scale_ema, self._undo = metrics, lr_scale_ema, None

    def begin(self, optimizer, state, lr_scale: float, ess_ratio: float, grad_max: float) -> None:
        reason = skip_reason(grad_norm=grad_max, lr_scale=lr_scale, ess_ratio=ess_ratio)
        self.metrics["vcpo/skipped"].append(float(reason > 0))
        self._undo = ExitStack()
        if not reason:
            if self.lr_scale_ema:
                lr_scale = smoothed_lr_scale(optimizer, lr_scale, self.lr_scale_ema)
            self._undo.enter_context(scale_lr(optimizer, lr_scale))
            return
        logging.getLogger(__name__).warning("vcpo: optimizer step %d skipped: not finite: %s", state.global_step + 1,
                                            skip_names(reason))
        own = vars(optimizer).get("step")  # an instance attribute `step` (accelerate's own patch), if any
        optimizer.step = _no_step
        self._undo.callback(lambda: setattr(optimizer, "step", own) if own is not None else delattr(optimizer, "step"))

    def end(self) -> None:
        if self._undo is not None:
            self._undo.close()
            self._undo = None


class _ESSLearningRate(TrainerCallback):
    """Each optimizer step at the generation batch's lr scale, or skipped (_OptimizerStep)."""

    def __init__(self, metrics, lr_scale_ema: float) -> None:
        self.lr_scale, self.ess_ratio = 1.0, 1.0  # the generation batch's
        self.step = _OptimizerStep(metrics, lr_scale_ema)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.step.begin(optimizer, state, self.lr_scale, self.ess_ratio, float(_grad_max(model)))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.step.end()


class VCPOGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with the VCPO loss: the switch is this class name and `VCPOGRPOConfig(vcpo_config=...)`
    (a plain `GRPOConfig` gets `VCPOConfig()`'s defaults). The behaviour policy is vLLM's sampling log-probs when
    TRL has them, else TRL's `old_per_token_logps`, else the current policy's (on-policy: every weight is 1). Under
    several processes (`accelerate launch`) the ESS, lr scale and baselines are the whole generation batch's, the
    same on every process (`vcpo.policy_loss`'s `process_group`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vcpo_config = with_trl_trust_region(getattr(self.args, "vcpo_config", None) or VCPOConfig(), self.args)
        self._refuse_unsupported()
        self._lr = _ESSLearningRate(self._metrics["train"], self.vcpo_config.lr_scale_ema)
        self.add_callback(self._lr)
        self._rewards_per_func = None
        self._head_only = False  # grad_norms="auto" fell back to the LM head's norm

    def _refuse_unsupported(self) -> None:
        a = self.args
        why = []
        if (self.accelerator.num_processes > 1 and self.vcpo_config.loss_agg_mode == "seq-mean-token-sum-norm"
                and self.vcpo_config.norm_length is None):
            why.append(f"{self.accelerator.num_processes} processes with loss_agg_mode='seq-mean-token-sum-norm' and "
                       "norm_length=None (each process pads its completions to its own length: set norm_length, "
                       "e.g. to max_completion_length)")
        if a.steps_per_generation % a.gradient_accumulation_steps != 0:
            why.append(f"steps_per_generation={a.steps_per_generation} is not a multiple of "
                       f"gradient_accumulation_steps={a.gradient_accumulation_steps} (an optimizer step must lie "
                       "within one generation batch, whose lr scale it takes)")
        if self.beta != 0.0:
            why.append(f"beta={self.beta} (the VCPO loss has no KL term to a reference model)")
        if self.top_entropy_quantile < 1.0:
            why.append(f"top_entropy_quantile={self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None:
            why.append(f"off_policy_mask_threshold={self.off_policy_mask_threshold}")
        if self._entropy_bonus_enabled:
            why.append("an entropy bonus (entropy_coef / use_adaptive_entropy)")
        if self.aux_loss_enabled:
            why.append("the MoE router auxiliary loss")
        if why:
            raise ValueError("VCPOGRPOTrainer does not support " + "; ".join(why))

    # -- the generation batch ------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL's output dict drops the rewards: keep them ([B, num reward functions], gathered over processes).
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out  # evaluation keeps TRL's advantages and loss
        per_func = self._rewards_per_func
        unscorable = torch.isnan(per_func).all(1)
        if unscorable.any():
            raise ValueError(f"{int(unscorable.sum())} completions have no reward (every reward function returned "
                             "None): the VCPO baselines need a reward for every sequence")
        # per_func is gathered over the processes, in process order; this process's rows are its slice.
        b = out["completion_ids"].shape[0]
        first = self.accelerator.process_index * b
        rewards = (per_func[first:first + b] * self.reward_weights.to(per_func.device)).nansum(1)
        # TRL's sampler repeats each prompt num_generations times in a row over the whole generation batch: a group
        # is a run of that many rows of it (on several processes, it may span two).
        group_index = (first + torch.arange(b, device=rewards.device)) // self.num_generations
        world = self.accelerator.num_processes
        mask = _loss_mask(out)
        logp, grad_sq_norm = self._logps_and_norms(out, mask)
        behavior = out.get("sampling_per_token_logps")
        if behavior is not None:  # tokens vLLM could not score: weight 1, as TRL does
            behavior = torch.where(torch.isnan(behavior), logp, behavior)
        elif out.get("old_per_token_logps") is not None:
            behavior = out["old_per_token_logps"]
        else:
            behavior = logp
        result = policy_loss(logp, behavior, config=self.vcpo_config, mask=mask, rewards=rewards,
                             group_index=group_index, num_groups=world * b // self.num_generations,
                             grad_sq_norm=grad_sq_norm, process_group=dist.group.WORLD if world > 1 else None)
        out["advantages"] = result.advantages.to(logp.dtype)
        logged = self._logs["advantages"]  # the completions table shows the advantages trained on (all processes')
        every = self.accelerator.gather(out["advantages"]) if world > 1 else out["advantages"]
        for _ in range(min(len(every), len(logged))):
            logged.pop()
        logged.extend(every.tolist())
        out["vcpo_behavior_logps"] = behavior
        stats = torch.stack([result.ess_ratio, result.lr_scale, result.ess, result.baseline.mean(),
                             result.is_clip_fraction, grad_sq_norm.mean() if grad_sq_norm is not None
                             else result.ess.new_ones(())]).double()
        if world > 1:  # the first four are the whole batch's already; the last two: the mean of the processes'
            stats = self.accelerator.gather(stats[None]).mean(0)
        stats = stats.tolist()  # one host read per batch
        ess_ratio, lr_scale, ess, baseline_mean, clip_fraction, g_mean = stats
        self._lr.lr_scale, self._lr.ess_ratio = lr_scale, ess_ratio
        for name, value in (("ess_ratio", ess_ratio), ("lr_scale", lr_scale if math.isfinite(lr_scale) else 0.0),
                            ("ess", ess),
                            ("baseline_mean", baseline_mean), ("is_clip_fraction", clip_fraction),
                            ("grad_sq_norm_mean", g_mean)):
            self._metrics["train"][f"vcpo/{name}"].append(value)
        return out

    def _logps_and_norms(self, out, mask):
        """The current policy's log-probs of the completion tokens [B, C] and the G_i [B] (or None: uniform) of
        VCPOConfig.grad_norms, in chunks of per_device_train_batch_size sequences. The model's own forward (not
        TRL's fused head, which the norm recorder cannot see), at TRL's sampling temperature."""
        how = self.vcpo_config.grad_norms
        if how == "auto":
            how = "lm_head" if self._head_only else "exact"
        model = self.accelerator.unwrap_model(self.model)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        c = out["completion_ids"].shape[1]
        chunk = self.args.per_device_train_batch_size
        logps, norms = [], []
        for start in range(0, ids.shape[0], chunk):
            rows = slice(start, start + chunk)
            try:
                logp, g = self._chunk_norms(model, ids[rows], attention[rows], mask[rows], c, how)
            except UnsupportedModuleError as err:
                if self.vcpo_config.grad_norms != "auto":
                    raise
                warnings.warn(f"grad_norms='auto' uses the LM head's norm for {type(model).__name__}: {err}")
                self._head_only = True
                return self._logps_and_norms(out, mask)
            logps.append(logp)
            norms.append(g)
        logp = torch.cat(logps)
        if how == "length":
            return logp, mask.sum(1).to(logp.dtype)
        return logp, None if how == "uniform" else torch.cat(norms).to(logp.dtype)

    def _chunk_norms(self, model, ids, attention, mask, c, how):
        psg = recorder(model, how, num_seqs=ids.shape[0], seq_len=ids.shape[1], freeze_parameters=True)
        record = psg is not None
        with psg if psg is not None else nullcontext(), torch.set_grad_enabled(record):
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, -c - 1:-1]
            logp = token_logp(logits / self.temperature, ids[:, -c:])
            del logits
            if record:
                psg.backward(torch.where(mask, logp, 0).sum())
        g = None
        if record:
            g = psg.sq_norms()
            psg.release()
        return logp.detach(), g

    def _prepare_inputs(self, generation_batch):
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not before:
            self._set_shares(self._buffered_inputs)
        return inputs

    def _set_shares(self, chunks) -> None:
        """Each chunk's share of its optimizer step's loss: its count (tokens or sequences, by loss_agg_mode)
        over the count of the gradient_accumulation_steps chunks that step accumulates on every process, times
        the number of processes (DDP averages their gradients), so the step's loss is the aggregation over all
        of them."""
        mode = self.vcpo_config.loss_agg_mode
        counts = torch.stack([agg_count(_loss_mask(x).sum(1), mode) for x in chunks]).double()
        world = self.accelerator.num_processes
        every = self.accelerator.gather(counts[None]).sum(0) if world > 1 else counts  # one collective per batch
        counts, every = counts.tolist(), every.tolist()
        k = self.args.gradient_accumulation_steps
        for j, x in enumerate(chunks):
            window = sum(every[j - j % k: j - j % k + k])
            x["vcpo_share"] = world * counts[j] / max(window, 1.0)

    # -- the loss of one chunk -----------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logp, _, _ = self._get_per_token_logps_and_entropies(model, ids, attention, inputs["completion_ids"].shape[1])
        # Bypass mode: the behaviour policy is the proximal one; the advantages are the generation batch's. Not
        # validated: a non-finite one (a NaN ESS) makes a non-finite gradient, and the optimizer step is skipped.
        out = policy_loss(logp, inputs["vcpo_behavior_logps"], config=self.vcpo_config, mask=_loss_mask(inputs),
                          advantages=inputs["advantages"].to(logp.dtype), validate=False)
        self._metrics["train"]["policy_loss"].append(out.loss.item())
        return out.loss * inputs["vcpo_share"]


# -- trl.experimental.async_grpo ---------------------------------------------------------------------------------------


def _async_defaults() -> VCPOConfig:
    return VCPOConfig(grad_norms="length")  # no norm pass over packed tree rows


@dataclass
class VCPOAsyncGRPOConfig(AsyncGRPOConfig):
    """`AsyncGRPOConfig` plus `vcpo_config` (as `VCPOGRPOConfig`; `grad_norms` must be "length" or "uniform")."""

    vcpo_config: VCPOConfig = field(default_factory=_async_defaults)

    def to_dict(self):
        d = super().to_dict()
        d["vcpo_config"] = dataclasses.asdict(self.vcpo_config)
        return d


class _StepESS(TrainerCallback):
    """The ESS of one optimizer step's sequences (all its micro-batches): `compute_loss` adds each micro-batch's
    log weights and lengths; the step runs with every param group's lr times the resulting scale, restored after,
    or is skipped (_OptimizerStep)."""

    def __init__(self, trainer: "VCPOAsyncGRPOTrainer") -> None:
        self.trainer = trainer
        self.log_weights, self.lengths = [], []
        self.step = _OptimizerStep(trainer._metrics["train"], trainer.vcpo_config.lr_scale_ema)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        config = self.trainer.vcpo_config
        ess = vcpo_kernels.effective_sample_size(
            torch.cat(self.log_weights), seq_length=torch.cat(self.lengths), ess_base_ratio=config.ess_base_ratio,
            lr_rule=config.lr_rule, is_threshold=config.is_threshold if config.ess_on_corrected else None)
        self.log_weights, self.lengths = [], []
        grad_max = _grad_max(model).to(ess.ess.device)
        ess_value, ratio, scale, grad_max = torch.stack([ess.ess, ess.ess_ratio, ess.lr_scale, grad_max]) \
            .double().tolist()  # one host read
        metrics = self.trainer._metrics["train"]
        for name, value in (("ess", ess_value), ("ess_ratio", ratio), ("lr_scale", scale if math.isfinite(scale)
                                                                         else 0.0)):
            metrics[f"vcpo/{name}"].append(value)
        self.step.begin(optimizer, state, scale, ratio, grad_max)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.step.end()


class _WithGroups:
    """TRL's rollout collator, plus each packed sample's reward and prompt group (the loss's OPOB inputs), per row:
    `vcpo_rewards` and `vcpo_group_id`, [rows, most samples in a row], padded with NaN and -1."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        (rows,) = examples
        width = max(len(row.samples) for row in rows)
        rewards = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
        groups = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            for i, sample in enumerate(row.samples):
                rewards[r, i] = sample["metrics"]["reward"]
                groups[r, i] = sample["group_id"]
        batch["vcpo_rewards"], batch["vcpo_group_id"] = rewards, groups
        return batch


class VCPOAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`trl.experimental.async_grpo.AsyncGRPOTrainer` with the VCPO loss: the switch is this class name and
    `VCPOAsyncGRPOConfig(vcpo_config=...)`. Each micro-batch's loss is `vcpo.policy_loss` in bypass mode (the
    behaviour policy is the sample's `old_log_probs`, the generator's), with OPOB (or GRPO) advantages over the prompt
    groups of the micro-batch, which must hold its groups whole; each optimizer step runs at the lr scale of the ESS
    of all its micro-batches' sequences. One process; G_i is the length or 1 (no norm pass over packed tree rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vcpo_config = with_trl_trust_region(getattr(self.args, "vcpo_config", None) or _async_defaults(),
                                                 self.args)
        why = []
        if self.accelerator.num_processes > 1:
            why.append(f"{self.accelerator.num_processes} processes (each rank's packed row holds a different number "
                       "of sequences, which the ESS and baselines over all ranks do not take)")
        if self.vcpo_config.grad_norms not in ("length", "uniform"):
            why.append(f"grad_norms={self.vcpo_config.grad_norms!r} (no per-sequence norm pass over packed tree "
                       "rows: use 'length' or 'uniform')")
        if self.vcpo_config.batch_baseline:
            why.append("opob_scope='batch' (a micro-batch is not the batch)")
        if self.aux_loss_enabled:
            why.append("the MoE router auxiliary loss")
        if why:
            raise ValueError("VCPOAsyncGRPOTrainer does not support " + "; ".join(why))
        self._ess = _StepESS(self)
        self.add_callback(self._ess)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        inner = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates the DataLoader it wraps
        inner.collate_fn = _WithGroups(inner.collate_fn)
        return loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp, behavior, mask, rewards, groups = self._packed_sequences(model, inputs)
        if torch.isnan(rewards).any():
            raise ValueError(f"{int(torch.isnan(rewards).sum())} samples have no reward (every reward function "
                             "returned None): the VCPO baselines need a reward for every sequence")
        # Prompt groups: the micro-batch's own (renumbered), each with every one of its samples.
        ids, group_index, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
        split = sizes < self.args.num_generations
        if self.vcpo_config.advantage in ("opob", "grpo", "rloo") and split.any():  # group baselines
            raise ValueError(f"prompt groups {ids[split].tolist()} have only {sizes[split].tolist()} of their "
                             f"{self.args.num_generations} samples in this micro-batch: their baselines would be "
                             "formed over part of the group (set token_budget=0 and per_device_train_batch_size to a "
                             "multiple of num_generations)")
        lengths = mask.sum(1)
        result = policy_loss(logp, behavior, config=self.vcpo_config, mask=mask, rewards=rewards.to(logp.dtype),
                             group_index=group_index, num_groups=len(ids),
                             grad_sq_norm=lengths.to(logp.dtype) if self.vcpo_config.grad_norms == "length" else None)
        stats = vcpo_kernels.sequence_stats(logp.detach(), behavior, mask=mask)
        self._ess.log_weights.append(stats.seq_log_weight.detach().double())
        self._ess.lengths.append(stats.seq_length.double())
        metrics = self._metrics["train"]
        for name, value in (("policy_loss", result.loss), ("vcpo/micro_batch_ess_ratio", result.ess_ratio),
                            ("vcpo/baseline_mean", result.baseline.mean()),
                            ("vcpo/is_clip_fraction", result.is_clip_fraction)):
            metrics[name].append(float(value))
        # Each micro-batch's aggregate, averaged over the step's micro-batches (TRL's own accumulation).
        return result.loss / self.current_gradient_accumulation_steps

    def _packed_sequences(self, model, inputs):
        """The tree-packed row's forward (TRL's fused head: log-probs at the sampling temperature) laid out as
        [samples, longest trained length]: current and behaviour log-probs, the mask, each sample's reward and group."""
        row = inputs["attention_mask"].bool()
        trained = inputs["token_index"] >= 0
        tree = {key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q",
                                                               "tree_cu_seqlens_k")}
        tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        outputs = model(input_ids=inputs["input_ids"][row][None], position_ids=inputs["position_ids"][row][None],
                        shift_labels=inputs["shift_labels"][row][None], fused_lm_head=True, **tree)
        token_logp = outputs.log_probs.flatten()[inputs["token_index"][trained]]
        segment = inputs["segment_id"][trained]  # the sample of each trained token, non-decreasing
        rewards, groups = inputs["vcpo_rewards"][0], inputs["vcpo_group_id"][0]
        num_samples = int((groups >= 0).sum())
        counts = torch.bincount(segment, minlength=num_samples)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(len(segment), device=segment.device) - starts[segment]
        width = max(int(counts.max()), 1)
        shape = (num_samples, width)
        logp = token_logp.new_zeros(shape).index_put((segment, position), token_logp)
        behavior = token_logp.new_zeros(shape).index_put((segment, position),
                                                          inputs["old_log_probs"][trained].to(token_logp.dtype))
        mask = torch.zeros(shape, dtype=torch.bool, device=segment.device).index_put(
            (segment, position), torch.ones_like(segment, dtype=torch.bool))
        return logp, behavior, mask, rewards[:num_samples], groups[:num_samples]
