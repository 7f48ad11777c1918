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
from torch import Tensor, nn

import vcpo_kernels as vk

from .config import VCPOConfig
from .grad_norms import PerSequenceGradients, UnsupportedModuleError
from .loss import policy_loss
from .lr import scale_lr

__all__ = ["RolloutBatch", "step", "token_logp"]


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


def token_logp(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target], in fp32 at least (materialises the logits over the vocabulary)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# Config fields of models whose logits are not the plain LM head's output (softcapped or rescaled).
_LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")


def _fused_head_parts(model: nn.Module):
    """(body returning the last hidden states, LM head, input embedding) of a Hugging Face causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or body is None or body is model:
        raise ValueError("fused_lm_head=True needs a Hugging Face causal LM whose get_output_embeddings() is an "
                         f"nn.Linear and whose base_model returns the last hidden states; got {type(model).__name__}")
    config = getattr(model, "config", None)
    for name in _LOGIT_MODIFIERS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"fused_lm_head=True: {type(model).__name__} modifies its logits ({name} = "
                             f"{getattr(config, name)!r}); use fused_lm_head=False")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return body, head, embedding


def _bookkeeping_exact(config: VCPOConfig, batch: RolloutBatch) -> bool:
    """Book-keeping needs d loss / d log pi constant within each sequence: the ratio r must be 1 (bypass
    mode) and the IS coefficient per sequence (not per token)."""
    return batch.old_logp is None and config.is_level != "token"


def _average_gradients(params: list, group) -> None:
    """Mean of every parameter's gradient over the ranks of `group`, in one all_reduce of a flat buffer."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
        offset += g.numel()


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
         config: Optional[VCPOConfig] = None, process_group=None) -> dict[str, float]:
    """One VCPO update of `model` (a causal LM returning `.logits`, e.g. any Hugging Face model; not wrapped
    in DDP). Returns the metrics; the only host sync is the one that reads them (and the lr scale with them):
    the batch's values are not validated here (vcpo.policy_loss does that, at the cost of host reads).
    With a data-parallel `process_group` (every rank calling with its own sequences, as many as the others,
    and a global `num_groups`), the ESS, lr scale and baselines cover the sequences of all ranks and the
    gradients are averaged over the ranks before clipping, so every rank takes the same step."""
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


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, config: VCPOConfig,
          process_group) -> dict[str, float]:
    exact_ok = _bookkeeping_exact(config, batch)
    if config.assembly == "bookkeeping" and not exact_ok:
        raise ValueError("assembly='bookkeeping' needs bypass mode (no old_logp) and is_level != 'token'; "
                         "use assembly='two_pass' or 'auto'")
    record = config.grad_norms in ("exact", "lm_head")
    # Book-keeping rebuilds every parameter's gradient from the recorded layers: all of them must be recorded.
    if config.assembly == "bookkeeping" and config.grad_norms != "exact":
        raise ValueError("assembly='bookkeeping' needs grad_norms='exact' (every layer recorded)")
    bookkeeping = config.grad_norms == "exact" and (config.assembly == "bookkeeping" or
                                                    (config.assembly == "auto" and exact_ok))
    ids = batch.input_ids
    mask = batch.loss_mask[:, 1:] != 0
    b = ids.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]

    optimizer.zero_grad(set_to_none=True)
    if config.fused_lm_head:
        fused = _FusedHead(model, batch, mask, config, record)
        psg_needed = config.grad_norms == "exact"  # the head's own norm comes from the fused op
    else:
        fused, psg_needed = None, record
    modules = None if config.grad_norms == "exact" else [model.get_output_embeddings()]
    recorder = (PerSequenceGradients(model, num_seqs=b, seq_len=ids.shape[1], modules=modules,
                                     freeze_parameters=bookkeeping)
                if psg_needed else nullcontext())
    with recorder as psg:
        if fused is not None:
            logp = fused.logp(psg)
        else:
            logits = model(input_ids=ids, attention_mask=batch.attention_mask, **_model_kwargs(model)).logits
            logp = token_logp(logits[:, :-1], ids[:, 1:])
            del logits
        if record:  # the norm pass: sum_i sum_t log pi(y_it) back to the recorded layers, no weight gradients
            objective = torch.where(mask, logp, 0).sum()
            if psg_needed:
                psg.backward(objective, retain_graph=not bookkeeping)
            else:  # the fused head alone: its backward adds the per-sequence norms
                torch.autograd.grad(objective, fused.hidden, retain_graph=True)
    if record:
        grad_sq_norm = psg.sq_norms() if psg_needed else 0
        if fused is not None:
            grad_sq_norm = grad_sq_norm + fused.head_sq_norms(psg if psg_needed else None)
        grad_sq_norm = grad_sq_norm.to(logp.dtype)
        if psg_needed and not bookkeeping:
            psg.release()
    elif config.grad_norms == "length":
        grad_sq_norm = mask.sum(1).to(logp.dtype)
    else:
        grad_sq_norm = None

    leaf = logp.detach().requires_grad_()
    out = policy_loss(
        leaf, batch.behavior_logp[:, 1:], mask=mask,
        old_logp=None if batch.old_logp is None else batch.old_logp[:, 1:],
        rewards=batch.rewards, group_index=batch.group_index, num_groups=batch.num_groups,
        grad_sq_norm=grad_sq_norm, config=config, process_group=process_group, validate=False,
    )
    (dlogp,) = torch.autograd.grad(out.loss, leaf)
    if bookkeeping:
        # d loss / d log pi_it = k_i on every counted token of sequence i: the gradient is sum_i k_i g_i.
        k = (dlogp * mask).sum(1) / mask.sum(1).clamp(min=1)
        psg.assemble(k.double())
        psg.release()
        if fused is not None:
            fused.head_backward(dlogp)
    else:
        logp.backward(dlogp)
    if process_group is not None:
        _average_gradients(params, process_group)

    grad_norm = (torch.nn.utils.clip_grad_norm_(params, config.grad_clip) if config.grad_clip is not None
                 else torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    mean_g = grad_sq_norm.mean() if grad_sq_norm is not None else torch.ones((), device=grad_norm.device)
    valid = mask.any(1).to(out.advantages.dtype)
    metrics = out.metrics(  # the one host sync of the step
        grad_norm=grad_norm, grad_sq_norm_mean=mean_g, baseline_mean=out.baseline.mean(),
        advantage_abs_mean=(out.advantages.abs() * valid).sum() / valid.sum().clamp(min=1),
    )
    lr_scale = metrics["lr_scale"]
    if not math.isfinite(lr_scale):
        lr_scale = 0.0
    with scale_lr(optimizer, lr_scale):
        optimizer.step()
    return metrics


class _FusedHead:
    """The LM head through vcpo_kernels.linear_logprobs (config.fused_lm_head): log-probs from the last hidden
    states without the [B, T, V] logits. With per-sequence norms the op's backward adds each sequence's
    ||d W_i||^2 + ||d b_i||^2 and, for a head tied to the input embedding, the rows of d W_i at the
    sequence's input ids, from which the cross term <g_emb_i, g_head_i> follows (docs/grad_norms.md)."""

    def __init__(self, model: nn.Module, batch: RolloutBatch, mask: Tensor, config: VCPOConfig, record: bool):
        self.body, self.head, self.embedding = _fused_head_parts(model)
        self.batch, self.config = batch, config
        b, t = batch.input_ids.shape
        self.targets = torch.where(mask, batch.input_ids[:, 1:], -100).reshape(-1)  # uncounted: no gradient
        self.tied = self.embedding is not None and self.embedding.weight is self.head.weight
        self.sq = self.rows = None
        if record:
            self.cu = torch.arange(b + 1, device=mask.device) * (t - 1)
            self.sq = torch.zeros(b, dtype=torch.float64, device=mask.device)
        self.hidden = None

    def logp(self, psg: Optional[PerSequenceGradients]) -> Tensor:
        ids = self.batch.input_ids
        b, t = ids.shape
        self.hidden = self.body(input_ids=ids, attention_mask=self.batch.attention_mask,
                                **_model_kwargs(self.body)).last_hidden_state
        record_rows = self.sq is not None and self.tied and self.config.grad_norms == "exact"
        if record_rows:  # d W_i at the input ids: the embedding's rows of the shared weight
            dt = torch.promote_types(self.hidden.dtype, torch.float32)
            self.rows = torch.zeros(b, t, self.hidden.shape[-1], dtype=dt, device=ids.device)
        with psg.pause() if psg is not None else nullcontext():  # the head's part of the norms is added here
            out = vk.linear_logprobs(
                self.hidden[:, :-1].reshape(-1, self.hidden.shape[-1]), self.head.weight, self.targets,
                bias=self.head.bias, cu_seqlens=None if self.sq is None else self.cu, seq_grad_sq_norm=self.sq,
                seq_grad_row_ids=ids if record_rows else None, seq_grad_rows=self.rows, validate=False,
                backend=self.config.backend)
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
        out = vk.linear_logprobs(h, self.head.weight, self.targets, bias=self.head.bias, validate=False,
                                 backend=self.config.backend)
        out.logp.backward(dlogp.reshape(-1).to(out.logp.dtype))
