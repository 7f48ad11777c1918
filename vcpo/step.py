"""One VCPO update of a causal LM on a batch of rollouts: forward, exact per-sequence gradient norms, the fused
loss, the gradient (book-keeping or a second backward), clipping and the ESS-scaled optimizer step
(docs/grad_norms.md)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from .config import VCPOConfig
from .grad_norms import PerSequenceGradients
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
    modules = None if config.grad_norms == "exact" else [model.get_output_embeddings()]
    recorder = (PerSequenceGradients(model, num_seqs=b, modules=modules, freeze_parameters=bookkeeping)
                if record else nullcontext())
    with recorder as psg:
        logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits
        logp = token_logp(logits[:, :-1], ids[:, 1:])
        del logits
        if record:  # the norm pass: sum_i sum_t log pi(y_it) back to the recorded layers, no weight gradients
            psg.backward(torch.where(mask, logp, 0).sum(), retain_graph=not bookkeeping)
    if record:
        grad_sq_norm = psg.sq_norms().to(logp.dtype)
        if not bookkeeping:
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
