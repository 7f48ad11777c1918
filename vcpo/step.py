"""One VCPO update of a causal LM on a batch of rollouts: forward, exact per-sequence gradient norms, the fused
loss, the gradient (book-keeping or a second backward), clipping and the ESS-scaled optimizer step
(docs/grad_norms.md)."""

from __future__ import annotations

import math
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import vcpo_kernels as vk
from vcpo_kernels.inputs import token_batch

from .config import VCPOConfig
from .distributed import agg_count, global_share, second_moment_threshold
from .grad_norms import RECORDED, PerSequenceGradients, UnsupportedModuleError, recorder
from .loss import policy_loss
from .lr import scale_lr, smoothed_lr_scale

__all__ = ["RolloutBatch", "SKIP_REASONS", "skip_names", "skip_reason", "step", "token_logp"]

# Why a step was skipped: metrics["skip_reason"] is the sum of these bits (0: taken). A skipped step changes nothing
# of the model or the optimizer (docs/grad_norms.md, "Skipped steps").
SKIP_REASONS = {1: "loss", 2: "grad_norm", 4: "lr_scale"}


def skip_reason(*, loss: float = 0.0, grad_norm: float = 0.0, lr_scale: float = 1.0, ess_ratio: float = 1.0) -> int:
    """The SKIP_REASONS bits of a step's whole-batch values (floats; one not given is not checked), 0 for a step to
    take: a loss, gradient norm or lr scale that is not finite, or an lr scale of 0 from a NaN ESS (the loss's word
    for "skip the step", docs/contract.md: an optimizer step at lr 0 would still move AdamW's moments)."""
    bad = (not math.isfinite(loss), not math.isfinite(grad_norm),
           not math.isfinite(lr_scale) or (lr_scale == 0 and math.isnan(ess_ratio)))
    return sum(bit for bit, b in zip(SKIP_REASONS, bad) if b)


def skip_names(reason: int) -> str:
    """The SKIP_REASONS of `reason`, for a message: "loss, grad_norm"."""
    return ", ".join(name for bit, name in SKIP_REASONS.items() if int(reason) & bit)


@dataclass
class RolloutBatch:
    """Padded rollouts, [B, T] each, aligned with input_ids: position t holds token t (prompt and response)."""

    input_ids: Tensor
    attention_mask: Tensor  # 1 for real tokens, 0 for padding
    loss_mask: Tensor  # 1 for the tokens the policy generated (their log-probs count), else 0
    behavior_logp: Tensor  # the rollout engine's log-prob of token t (any value where loss_mask is 0)
    rewards: Tensor  # [B]
    group_index: Optional[Tensor] = None  # [B] prompt group of each sequence
    num_groups: Optional[int] = None
    old_logp: Optional[Tensor] = None  # a recomputed proximal policy; None = bypass mode

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(shape)}")
        for name in ("attention_mask", "loss_mask", "behavior_logp", "old_logp"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must have input_ids' shape {tuple(shape)}, got {tuple(t.shape)}")
        if self.rewards.shape != shape[:1]:
            raise ValueError(f"rewards must have shape [B] = [{shape[0]}], got {tuple(self.rewards.shape)}")


def token_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = -1,
               top_p: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target], in fp32 at least (materialises the logits over the vocabulary).
    With top_k / top_p (vLLM's; off: -1 or 0, and 1) the softmax is over the sampling support decided from these
    logits; a target outside it has log-prob -inf and no gradient (docs/contract.md, "Truncated sampling")."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1:
        logits = logits / temperature
    if not vk.truncates(top_k, top_p, logits.shape[-1]):
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = vk.sampling_support(logits, top_k, top_p)
    logp = torch.log_softmax(logits.masked_fill(~keep, -torch.inf), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    inside = keep.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(inside, logp, -torch.inf)


# Config fields of models whose logits are rescaled after the LM head (the fused op cannot follow them).
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_logits_scale")


def _fused_head_parts(model: nn.Module):
    """(body returning the last hidden states, LM head, input embedding, softcap of the logits or None) of a
    Hugging Face causal LM; the softcap (Gemma 2/3's final_logit_softcapping) is applied by the fused op."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or body is None or body is model:
        raise ValueError("fused_lm_head=True needs a Hugging Face causal LM whose get_output_embeddings() is an "
                         f"nn.Linear and whose base_model returns the last hidden states; got {type(model).__name__}")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_SCALES:
        for c in (config, text):
            if getattr(c, name, None) not in (None, 1, 1.0):
                raise ValueError(f"fused_lm_head=True: {type(model).__name__} rescales its logits ({name} = "
                                 f"{getattr(c, name)!r}); use fused_lm_head=False")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return body, head, embedding, getattr(text, "final_logit_softcapping", None)


def _autocast(config: VCPOConfig, device: torch.device):
    """The model's forward in config.autocast's precision over its own parameters (mixed precision), or as it is;
    the log-probs, the norms and the loss are formed in fp32 after it (docs/grad_norms.md, "Precision")."""
    if config.autocast is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, config.autocast))


def _bookkeeping_exact(config: VCPOConfig, batch: RolloutBatch) -> bool:
    """Book-keeping needs d loss / d log pi constant within each sequence: the ratio r must be 1 (bypass
    mode without a trust region) and the IS coefficient per sequence (not per token, nor a token-level rejection
    criterion)."""
    return batch.old_logp is None and config.is_level != "token" and not config.token_rejection and \
        config.trust_rule == "none"


def _average_gradients(params: list, group, sums: Tensor) -> None:
    """Mean of every parameter's gradient over the ranks of `group`, in one all_reduce of a flat buffer, and the
    sum of the float64 vector `sums` over the ranks, in place (a second, tiny all_reduce, issued first)."""
    pending = dist.all_reduce(sums, group=group, async_op=True)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
        offset += g.numel()
    pending.wait()


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
         config: Optional[VCPOConfig] = None, process_group=None) -> dict[str, float]:
    """One VCPO update of `model` (a causal LM returning `.logits`, e.g. any Hugging Face model; not wrapped
    in DDP). Returns the metrics of the whole batch; the only host sync is the one that reads them (and the lr
    scale with them), plus one before the first forward with `micro_batch_size` (the prompt groups and lengths
    that form the micro-batches), and the reads that form M2PO's threshold where the step forms it itself (over a
    `process_group`, or with `old_logp` and micro-batches): the batch's values are not validated here (vcpo.policy_loss does that, at the
    cost of host reads). With a data-parallel `process_group` (every rank calling with its own sequences, as many
    as the others, and a global `num_groups`), the ESS, lr scale, baselines, loss normalisation and metrics cover
    the sequences of all ranks and the gradients are averaged over the ranks before clipping, so every rank
    takes the step of one process on the whole batch (docs/grad_norms.md). A step whose loss, gradient norm or lr
    scale is not finite is skipped, on every rank alike: the weights and the optimizer's state stay as they were,
    the gradients are cleared, and the metrics say `skipped` (1.0, else 0.0) and why (`skip_reason`, SKIP_REASONS
    bits). `lr_scale` is the scale the step took (with `lr_scale_ema`, the moving average), `batch_lr_scale` the
    batch's own."""
    config = config if config is not None else VCPOConfig()
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"batch must be a vcpo.RolloutBatch, got {type(batch).__name__}")
    if config.grad_norms != "auto":
        return _step(model, optimizer, batch, config, process_group)
    if model not in _HEAD_ONLY:
        try:
            return _step(model, optimizer, batch, replace(config, grad_norms="exact"), process_group)
        except UnsupportedModuleError as err:  # raised before any gradient is kept: the step starts again
            _HEAD_ONLY[model] = err.module
            warnings.warn(f"grad_norms='auto' uses the LM head's norm for {type(model).__name__}: {err}", stacklevel=2)
    return _step(model, optimizer, batch, replace(config, grad_norms="lm_head"), process_group)


# grad_norms="auto": the models whose exact norms were refused, with the module that forced the head-only norm.
_HEAD_ONLY: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def _model_kwargs(model: nn.Module) -> dict:
    """No key/value cache: a training forward does not need one, and the modules replayed per sequence for the
    norms must not see (and update) it."""
    return {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}


@dataclass
class _Plan:
    """How the step runs the batch (docs/grad_norms.md, "Micro-batches")."""

    parts: list  # (rows, width) per micro-batch: its sequences (None: the whole batch as it is), columns kept
    per_micro_batch: bool = False  # several micro-batches, each one's coefficients known after its norm pass
    recompute: str = ""  # several micro-batches whose coefficients need the whole batch: why
    num_groups: Optional[int] = None
    count: float = 1.0  # what loss_agg_mode divides by, over the whole batch (all ranks)
    world: int = 1
    options: Optional[VCPOConfig] = None  # the config, with norm_length the whole batch's where it defaults


def _whole_batch_loss(config: VCPOConfig, batch: RolloutBatch) -> str:
    """Why a sequence's loss depends on sequences outside its prompt group, or "" when it does not (M2PO's mask
    with old_logp: its threshold is formed before the micro-batches, _old_policy_threshold)."""
    if config.second_moment_bound is not None and config.second_moment_threshold is None and batch.old_logp is None:
        return "rejection 'batch_m2' masks by an order statistic of the whole batch's tokens"
    if config.advantage == "reinforce":
        return "advantage='reinforce' subtracts the batch's mean reward"
    if config.batch_baseline:
        return "opob_scope='batch' forms one baseline over the whole batch"
    if config.is_batch_normalize:
        return "is_batch_normalize divides every IS coefficient by the whole batch's mean"
    return ""


def _plan(batch: RolloutBatch, config: VCPOConfig, process_group) -> _Plan:
    """The micro-batches: whole prompt groups, in order of first appearance, as many per micro-batch as fit in
    micro_batch_size sequences, each cut to its longest sequence (the last column with an attended or counted
    token); with a process_group, one all_gather of each rank's groups, count and padded length."""
    m = config.micro_batch_size
    b, t = batch.input_ids.shape
    if m is None:
        return _Plan([(None, t)])
    device = batch.input_ids.device
    groups = batch.group_index if batch.group_index is not None else torch.zeros(b, dtype=torch.long, device=device)
    used = (batch.attention_mask != 0) | (batch.loss_mask != 0)
    width = (used * torch.arange(1, t + 1, device=device)).amax(1) if t > 0 and b > 0 else groups * 0
    count = agg_count((batch.loss_mask[:, 1:] != 0).sum(1), config.loss_agg_mode).double()
    world, whole = 1, torch.stack([count.new_zeros(()), count, count.new_tensor(float(t))])
    if process_group is not None:
        if batch.group_index is not None and batch.num_groups is None:
            raise ValueError("num_groups is required with a process_group: group indices are global, and a rank "
                             "cannot infer the count from its own sequences")
        ng = batch.num_groups if batch.group_index is not None else 1
        present = count.new_zeros(ng).index_fill_(0, groups.long().clamp(0, max(ng - 1, 0)), 1.0)
        local = torch.cat([present, whole[1:]])
        world = dist.get_world_size(process_group)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=process_group)
        every = torch.stack(gathered)  # [world, groups present..., count, T]
        whole = torch.stack([(every[:, :ng].sum(0) > 1).any().double(), every[:, ng].sum(), every[:, ng + 1].max()])
    values = torch.cat([groups.double(), width.double(), whole]).tolist()  # the one host read of the plan
    group_of, widths, (spans, total, longest) = values[:b], values[b:2 * b], values[2 * b:]
    ng = batch.num_groups if batch.num_groups is not None else int(max(group_of, default=0)) + 1
    if batch.group_index is not None and not all(0 <= g < ng for g in group_of):
        raise ValueError(f"group_index must be in [0, num_groups) = [0, {ng}), got "
                         f"{sorted({int(g) for g in group_of})}")
    members: dict = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)
    chunks, current = [], []
    for g, rows in members.items():
        if len(rows) > m:
            what = ("the batch is one prompt group (group_index is None)" if batch.group_index is None
                    else f"prompt group {int(g)} has {len(rows)} sequences")
            raise ValueError(f"micro_batch_size={m} is smaller than a prompt group: {what}; micro-batches hold "
                             "whole groups, so micro_batch_size must be at least the largest group")
        if len(current) + len(rows) > m:
            chunks.append(current)
            current = []
        current = current + rows
    chunks.append(current)
    parts = [(torch.tensor(sorted(rows), device=device), min(t, max(2, int(max(widths[i] for i in rows)))))
             for rows in chunks if rows]
    if len(parts) <= 1 and (not parts or parts[0][1] == t):
        parts = [(None, t)]
    options = config
    if config.loss_agg_mode == "seq-mean-token-sum-norm" and config.norm_length is None:
        options = config.replace(norm_length=max(longest - 1, 1))  # the padded length T of the logp [B, T-1]
    why = ""
    if len(parts) > 1:
        why = _whole_batch_loss(config, batch) or ("prompt groups span ranks of the process_group" if spans else "")
    return _Plan(parts, per_micro_batch=len(parts) > 1 and not why, recompute=why, num_groups=ng,
                 count=max(total, 1.0), world=world, options=options)


def _select(batch: RolloutBatch, rows: Optional[Tensor], width: int) -> RolloutBatch:
    """The micro-batch of `rows`, its first `width` columns."""
    if rows is None:
        return batch
    cut = lambda x: None if x is None else x[rows, :width]  # noqa: E731
    return RolloutBatch(cut(batch.input_ids), cut(batch.attention_mask), cut(batch.loss_mask),
                        cut(batch.behavior_logp), batch.rewards[rows],
                        None if batch.group_index is None else batch.group_index[rows], batch.num_groups,
                        cut(batch.old_logp))


class _Pass:
    """One micro-batch's forward and, when G_i are recorded (`norms`), its norm pass: the backward of
    sum_i sum_t log pi(y_it) to the recorded layers. With `keep`, what backward(dlogp) needs stays: the records
    (book-keeping) or the graph; without, only the log-probs and the norms do."""

    def __init__(self, model: nn.Module, mb: RolloutBatch, config: VCPOConfig, *, norms: bool, keep: bool,
                 bookkeeping: bool):
        ids = mb.input_ids
        self.mask = mb.loss_mask[:, 1:] != 0
        self.bookkeeping = bookkeeping
        record = norms and config.grad_norms in RECORDED
        self.fused = _FusedHead(model, mb, self.mask, config, record) if config.fused_lm_head else None
        # The fused op adds the head's own norm; the recorder, every other layer's ("exact") or the head's. Frozen
        # parameters: the forward keeps only what activation gradients need (no backward to them follows).
        self.psg = recorder(model, config.grad_norms, num_seqs=ids.shape[0], seq_len=ids.shape[1],
                            freeze_parameters=bookkeeping or not keep, head_outside=self.fused is not None
                            ) if record else None
        with self.psg if self.psg is not None else nullcontext(), torch.set_grad_enabled(record or keep):
            if self.fused is not None:
                logp = self.fused.logp(self.psg, detach_body=record and not keep and self.psg is None)
            else:
                with _autocast(config, ids.device):
                    logits = model(input_ids=ids, attention_mask=mb.attention_mask, **_model_kwargs(model)).logits
                logp = token_logp(logits[:, :-1], ids[:, 1:], config.temperature, config.top_k, config.top_p)
                del logits
            if record:
                objective = torch.where(self.mask, logp, 0).sum()
                if self.psg is not None:
                    self.psg.backward(objective, retain_graph=keep and not bookkeeping)
                else:  # the fused head alone: its backward adds the per-sequence norms
                    torch.autograd.grad(objective, self.fused.hidden, retain_graph=keep)
        self.logp = logp
        self.grad_sq_norm = None
        if record:
            g = self.psg.sq_norms() if self.psg is not None else 0
            if self.fused is not None:
                g = g + self.fused.head_sq_norms(self.psg)
            self.grad_sq_norm = g.to(logp.dtype)
            if self.psg is not None and not (keep and bookkeeping):
                self.psg.release()
        elif norms and config.grad_norms == "length":
            self.grad_sq_norm = self.mask.sum(1).to(logp.dtype)

    def backward(self, dlogp: Tensor) -> None:
        """Accumulate the gradient of sum_it dlogp_it log pi(y_it) into the parameters' .grad."""
        if self.bookkeeping:
            # d loss / d log pi_it = k_i on every counted token of sequence i: the gradient is sum_i k_i g_i.
            k = (dlogp * self.mask).sum(1) / self.mask.sum(1).clamp(min=1)
            self.psg.assemble(k.double())
            self.psg.release()
            if self.fused is not None:
                self.fused.head_backward(dlogp)
        else:
            self.logp.backward(dlogp)


def _old_policy_threshold(batch: RolloutBatch, logp_dtype: torch.dtype, config: VCPOConfig, process_group) -> float:
    """M2PO's threshold with old_logp given: Delta = old_logp - behaviour (in the log-probs' accumulation dtype, as
    the loss forms it) needs no forward, so it is formed once over the whole batch (and every rank) and each
    micro-batch's loss takes it, instead of waiting for the whole batch's loss and a second forward."""
    old = batch.old_logp[:, 1:].to(logp_dtype)
    tokens = token_batch(old, batch.behavior_logp[:, 1:], old, batch.loss_mask[:, 1:] != 0, validate=False)
    return second_moment_threshold(tokens, config, process_group)


def _micro_batch_dlogp(part: _Pass, mb: RolloutBatch, plan: _Plan, config: VCPOConfig) -> Tensor:
    """d loss / d log pi on one micro-batch's tokens: the fused loss over its sequences (its prompt groups are
    whole, so their advantages are the whole batch's), times its share of the whole batch's normalisation."""
    leaf = part.logp.detach().requires_grad_()
    out = vk.policy_loss(leaf, mb.behavior_logp[:, 1:], mask=part.mask,
                         old_logp=None if mb.old_logp is None else mb.old_logp[:, 1:], rewards=mb.rewards,
                         group_index=mb.group_index, num_groups=plan.num_groups, grad_sq_norm=part.grad_sq_norm,
                         options=plan.options, validate=False, backend=config.backend)
    share = plan.world * global_share(part.mask.sum(1), plan.count, config.loss_agg_mode)
    (dlogp,) = torch.autograd.grad(out.loss * share.to(out.loss.dtype), leaf)
    return dlogp


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, config: VCPOConfig,
          process_group) -> dict[str, float]:
    exact_ok = _bookkeeping_exact(config, batch)
    if config.assembly == "bookkeeping" and not exact_ok:
        raise ValueError("assembly='bookkeeping' needs bypass mode (no old_logp), no trust region, is_level != "
                         "'token' and no token-level rejection criterion; use assembly='two_pass' or 'auto'")
    # Book-keeping rebuilds every parameter's gradient from the recorded layers: all of them must be recorded.
    if config.assembly == "bookkeeping" and config.grad_norms != "exact":
        raise ValueError("assembly='bookkeeping' needs grad_norms='exact' (every layer recorded)")
    plan = _plan(batch, config, process_group)
    if config.assembly == "bookkeeping" and plan.recompute:
        raise ValueError(f"assembly='bookkeeping' with micro_batch_size={config.micro_batch_size}: "
                         f"{plan.recompute}, so the coefficients are known only after every micro-batch's norm "
                         "pass and each micro-batch's gradient needs a second forward; use assembly='auto' or "
                         "'two_pass'")
    bookkeeping = config.grad_norms == "exact" and config.assembly != "two_pass" and exact_ok and not plan.recompute
    b, t = batch.input_ids.shape
    mask = batch.loss_mask[:, 1:] != 0
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = _check_sharded(params, config, process_group)

    optimizer.zero_grad(set_to_none=True)
    keep = len(plan.parts) == 1  # the one micro-batch's records or graph wait for the whole batch's loss
    logp = grad_sq_norm = kept = None
    for rows, width in plan.parts:
        mb = _select(batch, rows, width)
        part = _Pass(model, mb, config, norms=True, keep=keep or plan.per_micro_batch, bookkeeping=bookkeeping)
        if rows is None:
            logp, grad_sq_norm = part.logp.detach(), part.grad_sq_norm
        else:
            if logp is None:
                logp = part.logp.new_zeros(b, t - 1)
                grad_sq_norm = None if part.grad_sq_norm is None else part.grad_sq_norm.new_zeros(b)
            logp[rows, :width - 1] = part.logp.detach()
            if grad_sq_norm is not None:
                grad_sq_norm[rows] = part.grad_sq_norm
        if plan.per_micro_batch:
            if config.second_moment_bound is not None and config.second_moment_threshold is None:  # once, see above
                threshold = _old_policy_threshold(batch, part.logp.dtype, config, process_group)
                config = config.replace(second_moment_threshold=threshold)
                plan.options = plan.options.replace(second_moment_threshold=threshold)
            part.backward(_micro_batch_dlogp(part, mb, plan, config))
        elif keep:
            kept = part
        del part, mb

    # The whole batch's loss: its gradient to the log-probs (unless each micro-batch had its own) and statistics.
    leaf = logp.detach().requires_grad_(not plan.per_micro_batch)
    with torch.no_grad() if plan.per_micro_batch else nullcontext():
        out = policy_loss(
            leaf, batch.behavior_logp[:, 1:], mask=mask,
            old_logp=None if batch.old_logp is None else batch.old_logp[:, 1:],
            rewards=batch.rewards, group_index=batch.group_index, num_groups=batch.num_groups,
            grad_sq_norm=grad_sq_norm, config=config, process_group=process_group, validate=False,
        )
    if not plan.per_micro_batch:
        (dlogp,) = torch.autograd.grad(out.loss, leaf)
        if kept is not None:
            rows, width = plan.parts[0]
            kept.backward(dlogp if rows is None else dlogp[rows, :width - 1])
            del kept
        else:
            for rows, width in plan.parts:  # the second forward, and the backward, of each micro-batch
                _Pass(model, _select(batch, rows, width), config, norms=False, keep=True,
                      bookkeeping=False).backward(dlogp[rows, :width - 1])
    world = dist.get_world_size(process_group) if process_group is not None else 1
    sums = _loss_sums(out, config, mask, logp, grad_sq_norm, world)
    if sharded:  # FSDP2's reduce-scatter (or book-keeping's, vcpo/grad_norms/fsdp.py) averaged the gradients
        dist.all_reduce(sums, group=process_group)
    elif process_group is not None:
        _average_gradients(params, process_group, sums)

    grad_norm = (torch.nn.utils.clip_grad_norm_(params, config.grad_clip) if config.grad_clip is not None
                 else torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    if isinstance(grad_norm, DTensor):  # the norm over every shard
        grad_norm = grad_norm.full_tensor()
    extra = _whole_batch_statistics(out, sums)
    metrics = out.metrics(  # the one host sync of the step
        grad_norm=grad_norm, grad_sq_norm_mean=extra["grad_sq_norm_mean"], baseline_mean=out.baseline.mean(),
        advantage_abs_mean=extra["advantage_abs_mean"], outside_support_fraction=extra["outside_support_fraction"],
    )
    # The loss, the norm of the averaged gradient and the ESS are the whole batch's on every rank (a NaN on one rank
    # is NaN on all after the reductions), so the ranks skip together without a collective of their own.
    reason = skip_reason(loss=metrics["loss"], grad_norm=metrics["grad_norm"], lr_scale=metrics["lr_scale"],
                         ess_ratio=metrics["ess_ratio"])
    metrics.update(skipped=float(reason > 0), skip_reason=float(reason))
    metrics["batch_lr_scale"] = metrics["lr_scale"]
    if reason:
        optimizer.zero_grad(set_to_none=True)  # weights, moments and step counts stay as they were
        return metrics
    if config.lr_scale_ema:
        metrics["lr_scale"] = smoothed_lr_scale(optimizer, metrics["lr_scale"], config.lr_scale_ema)
    with scale_lr(optimizer, metrics["lr_scale"]):
        optimizer.step()
    return metrics


def _check_sharded(params: list, config: VCPOConfig, process_group) -> bool:
    """Whether the model is sharded by FSDP2 (DTensor parameters), after checking what the step needs then: the
    data-parallel process_group that is the FSDP mesh (the shards' gradients are means over it)."""
    meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
    if not meshes:
        return False
    if len(meshes) > 1 or len(params) != sum(isinstance(p, DTensor) for p in params):
        raise ValueError("a model sharded by FSDP2 must have every trainable parameter sharded over one device mesh")
    (mesh,) = meshes.values()
    if process_group is None or mesh.ndim != 1 or dist.get_world_size(process_group) != mesh.size():
        raise ValueError("a model sharded by FSDP2 needs process_group = the data-parallel group of its 1-D device "
                         "mesh (mesh.get_group()): the loss's ESS, baselines and counts cover the sequences of every "
                         f"rank that shares the shards; got mesh {tuple(mesh.shape)} and process_group "
                         f"{None if process_group is None else dist.get_world_size(process_group)} ranks")
    if config.fused_lm_head:
        raise ValueError("fused_lm_head=True calls the LM head's weight outside its module's forward, where FSDP2 "
                         "has it sharded: use fused_lm_head=False with FSDP2")
    return True


def _loss_sums(out, config: VCPOConfig, mask: Tensor, logp: Tensor, grad_sq_norm: Optional[Tensor],
               world: int) -> Tensor:
    """This rank's loss statistics as float64 sums (each fraction times the count it is a fraction of): summed
    over the ranks they give the whole batch's (_whole_batch_statistics). The loss is this rank's part of the
    whole batch's times the world size (vcpo/distributed.py)."""
    valid = mask.any(1)
    units = out.num_tokens if config.is_level == "token" else out.num_seqs  # what is_clip_fraction counts
    values = [out.loss.detach() / world, out.is_clip_fraction * units, out.mean_is_coef * units, units,
              out.kl_k3 * out.num_tokens, out.ppo_clip_fraction * out.num_tokens, out.num_tokens, out.num_seqs,
              out.num_nonfinite, grad_sq_norm.sum() if grad_sq_norm is not None else valid.numel(),
              valid.numel(), (out.advantages.abs() * valid).sum(), valid.sum(), out.rejected_fraction * out.num_tokens,
              ((logp == -torch.inf) & mask).sum()]  # sampled tokens outside the trainer's top-k / top-p support
    return torch.stack([torch.as_tensor(v, device=valid.device).double().reshape(()) for v in values])


def _whole_batch_statistics(out, sums: Tensor) -> dict:
    """Sets out's statistics to the ones of the (summed) _loss_sums; returns the step's mean G_i and |A_i|."""
    loss, clipped, coef, units, kl, ppo, tokens, seqs, nonfinite, g, b, adv, valid, rejected, outside = sums.unbind()
    out.loss, out.num_tokens, out.num_seqs, out.num_nonfinite = loss, tokens, seqs, nonfinite
    out.is_clip_fraction, out.mean_is_coef = clipped / units.clamp(min=1), coef / units.clamp(min=1)
    out.kl_k3, out.ppo_clip_fraction = kl / tokens.clamp(min=1), ppo / tokens.clamp(min=1)
    out.rejected_fraction = rejected / tokens.clamp(min=1)
    return {"grad_sq_norm_mean": g / b.clamp(min=1), "advantage_abs_mean": adv / valid.clamp(min=1),
            "outside_support_fraction": outside / tokens.clamp(min=1)}


class _FusedHead:
    """The LM head through vcpo_kernels.linear_logprobs (config.fused_lm_head): log-probs from the last hidden
    states without the [B, T, V] logits. With per-sequence norms the op's backward adds each sequence's
    ||d W_i||^2 + ||d b_i||^2 and, for a head tied to the input embedding, the rows of d W_i at the
    sequence's input ids, from which the cross term <g_emb_i, g_head_i> follows (docs/grad_norms.md)."""

    def __init__(self, model: nn.Module, batch: RolloutBatch, mask: Tensor, config: VCPOConfig, record: bool):
        self.body, self.head, self.embedding, self.softcap = _fused_head_parts(model)
        self.batch, self.config = batch, config
        b, t = batch.input_ids.shape
        self.targets = torch.where(mask, batch.input_ids[:, 1:], -100).reshape(-1)  # uncounted: no gradient
        self.tied = self.embedding is not None and self.embedding.weight is self.head.weight
        self.sq = self.rows = None
        if record:
            self.cu = torch.arange(b + 1, device=mask.device) * (t - 1)
            self.sq = torch.zeros(b, dtype=torch.float64, device=mask.device)
        self.hidden = None

    def logp(self, psg: Optional[PerSequenceGradients], detach_body: bool = False) -> Tensor:
        """`detach_body`: the hidden states as a leaf (only the head's norms are backpropagated: to them)."""
        ids = self.batch.input_ids
        b, t = ids.shape
        with torch.no_grad() if detach_body else nullcontext(), _autocast(self.config, ids.device):
            self.hidden = self.body(input_ids=ids, attention_mask=self.batch.attention_mask,
                                    **_model_kwargs(self.body)).last_hidden_state
        if detach_body:
            self.hidden.requires_grad_()
        record_rows = self.sq is not None and self.tied and self.config.grad_norms == "exact"
        if record_rows:  # d W_i at the input ids: the embedding's rows of the shared weight
            dt = torch.promote_types(self.hidden.dtype, torch.float32)
            self.rows = torch.zeros(b, t, self.hidden.shape[-1], dtype=dt, device=ids.device)
        with psg.pause() if psg is not None else nullcontext():  # the head's part of the norms is added here
            out = vk.linear_logprobs(
                self.hidden[:, :-1].reshape(-1, self.hidden.shape[-1]), self.head.weight, self.targets,
                bias=self.head.bias, cu_seqlens=None if self.sq is None else self.cu, seq_grad_sq_norm=self.sq,
                seq_grad_row_ids=ids if record_rows else None, seq_grad_rows=self.rows, softcap=self.softcap,
                temperature=self.config.temperature, top_k=self.config.top_k, top_p=self.config.top_p,
                validate=False, backend=self.config.backend)
        return out.logp.view(b, t - 1)

    def head_sq_norms(self, psg: Optional[PerSequenceGradients]) -> Tensor:
        """The head's squared per-sequence norms, plus twice the cross term with a tied embedding's gradient
        (psg recorded the embedding)."""
        total = self.sq
        if self.rows is not None:
            total = total + 2 * psg.embedding_inner(self.embedding, self.rows)
        return total

    def head_backward(self, dlogp: Tensor) -> None:
        """The head's weight and bias gradients for upstream dlogp [B, T-1] (book-keeping rebuilt the rest),
        from a second pass of the op over the saved hidden states."""
        h = self.hidden[:, :-1].detach().reshape(-1, self.hidden.shape[-1])
        out = vk.linear_logprobs(h, self.head.weight, self.targets, bias=self.head.bias, softcap=self.softcap,
                                 temperature=self.config.temperature, top_k=self.config.top_k,
                                 top_p=self.config.top_p, validate=False, backend=self.config.backend)
        out.logp.backward(dlogp.reshape(-1).to(out.logp.dtype))
