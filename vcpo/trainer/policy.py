"""The policy being trained: the model, its tokenizer and AdamW on this rank's device, one `vcpo.step` at a time,
and its weights for the engine and the checkpoints.

Two choices are made once, at load, as two small strategies the Policy is composed of:
- what is trained: the whole model (FullModel), or with `lora_rank` peft LoRA adapters on the frozen base model
  (Adapter: AdamW over the adapter alone; the adapter is what the engine gets and what a checkpoint holds,
  vcpo/trainer/lora.py);
- how the ranks hold it: each the whole model, rank 0's weights broadcast at the start (Replicated), or with
  `fsdp` sharded over the ranks (Sharded, FSDP2: only rank 0 reads the weights, every other rank builds the model on
  the meta device and receives its shard; the full weights gathered to rank 0 after each step, for the engine and
  the checkpoints)."""

from __future__ import annotations

import os
import shutil
from functools import partial
from typing import Optional

import torch

import vcpo
from vcpo.distributed import largest_abs
from vcpo.step import RolloutBatch

from . import lora
from .config import PRECISIONS, TrainConfig
from .errors import NonFiniteError
from .lr_schedule import lr_factor
from .placement.fsdp import full_optimizer_state, full_weights, load_full_optimizer_state, load_full_weights, shard
from .placement.ranks import TrainerRanks
from .rollouts import Rollout, pad_rollouts


class Policy:
    def __init__(self, path: str, cfg: TrainConfig, ranks: TrainerRanks, resume: bool = False) -> None:
        """From the model folder or checkpoint `path`; its optimizer.pt only with `resume` (a model folder's, such
        as a Hugging Face Trainer checkpoint's, belongs to another run: its lr and moments are not this run's)."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no bar per checkpoint write
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device, self.process_group, self.ranks = ranks.device, ranks.group, ranks
        dtype = getattr(torch, PRECISIONS[cfg.precision][0])  # the parameters' and the optimizer state's
        self.trained = Adapter(cfg, dtype) if cfg.lora_rank is not None else FullModel(dtype)
        # FSDP2: a rank but 0 never holds the whole model, only its shard (Sharded)
        self.model = self.trained.skeleton(path) if cfg.fsdp and not ranks.main else self.trained.load(path)
        self.placement = Sharded(self.model, ranks, PRECISIONS[cfg.precision][1],
                                 trainable_only=cfg.lora_rank is not None) if cfg.fsdp else \
            Replicated(self.model, ranks)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter alone
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.resolved_lr(), weight_decay=cfg.weight_decay)
        self.placement.use_optimizer(self.optimizer, os.path.join(path, "optimizer.pt") if resume else None)
        self.vcpo_config = cfg.vcpo_config()
        self.fit = vcpo.MicroBatchFit(cfg.memory_budget_gib) if cfg.memory_budget_gib is not None else None
        self.lr_at = partial(lr_factor, steps=cfg.steps, schedule=cfg.lr_schedule, warmup_steps=cfg.lr_warmup_steps,
                             min_ratio=cfg.lr_min_ratio)
        self.base_lr = cfg.resolved_lr()
        self.groups, self.group_size = cfg.prompts_per_step, cfg.responses_per_prompt
        self._trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        bad = self._nonfinite(dict(self.model.named_parameters()))
        if bad is not None:
            raise NonFiniteError(f"the weights in {path} are not finite ({bad}: a NaN or an infinity): a run cannot "
                                 "start from them")

    @property
    def adapter(self) -> Optional[dict]:
        """With LoRA: the adapter's config (what the engine serves beside the base model); else None."""
        return self.trained.adapter

    def engine_model(self, start: str, base: str) -> str:
        """The model folder the engine starts from, for a run that starts from `start` (its base model `base`)."""
        return self.trained.engine_model(start, base)

    def step(self, batch: RolloutBatch, number: int) -> dict:
        """vcpo.step on this rank's share, as optimizer step `number` of the run (1-based: its scheduled lr), in
        bypass mode (a trust region's ratio is pi / mu). The metrics add `lr`, the step's lr with its ESS scale (0 for
        a skipped step)."""
        lr = self.base_lr * self.lr_at(number)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        if self.fit is not None:
            metrics = self.fit.step(self.model, self.optimizer, batch, self.vcpo_config, process_group=self.process_group)
            size = self.fit.size
        else:
            metrics = vcpo.step(self.model, self.optimizer, batch, self.vcpo_config, process_group=self.process_group)
            size = self.vcpo_config.micro_batch_size
        metrics["micro_batch_size"] = min(size or len(batch.rewards), len(batch.rewards))
        # Every rank checks (the ranks agree: the same weights, or the shards' result reduced) and gathers; then
        # rank 0 raises, and stops the others. Nothing non-finite is published to the engine or saved.
        bad = None if metrics["skipped"] else self._nonfinite(self._trainable)
        self.placement.stepped()
        if bad is not None and self.ranks.main:
            raise NonFiniteError(f"the weights are not finite after a step with a finite loss, gradient and lr scale "
                                 f"({bad}: a NaN or an infinity): nothing of them was sent to the engine or saved; "
                                 "the newest checkpoint holds finite weights")
        metrics["lr"] = 0.0 if metrics["skipped"] else lr * metrics["lr_scale"]
        return metrics

    def _nonfinite(self, tensors: dict) -> Optional[str]:
        """The name of a tensor of `tensors` that holds a NaN or an infinity, or None. One fused reduction and one
        host read (with FSDP, the shards' maxima are reduced over the ranks: every rank agrees); the tensor is
        looked for only when there is one."""
        from torch.distributed.tensor import DTensor

        if bool(torch.isfinite(largest_abs(list(tensors.values())))):
            return None
        for name, t in tensors.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if not bool(torch.isfinite(local).all()):
                return name
        return "a tensor of another rank's shard"

    def rollout_batch(self, rollouts: list[Rollout], pad_id: int) -> RolloutBatch:
        """The generated batch as vcpo.step's padded tensors; prompt groups in order, group_size each."""
        ids, attn, loss_mask, mu = (t.to(self.device) for t in pad_rollouts(rollouts, pad_id))
        group = torch.arange(self.groups, device=self.device).repeat_interleave(self.group_size)
        rewards = torch.tensor([r.reward for r in rollouts], device=self.device)
        return RolloutBatch(ids, attn, loss_mask, mu, rewards, group_index=group, num_groups=self.groups)

    def weights(self) -> dict:
        """A CPU copy of the weights (with LoRA: of the adapter), for the engine (which reads it while training
        goes on); rank 0's."""
        return self.trained.weights(self.model, self.placement)

    def save(self, folder: str, model_dir: str) -> None:
        """Rank 0: a Hugging Face model folder (with LoRA: peft's adapter folder) with optimizer.pt (torch.optim's
        layout, with or without FSDP)."""
        optimizer = self.placement.save(folder, self.optimizer)
        self.tokenizer.save_pretrained(folder)
        generation = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation) and not os.path.isfile(os.path.join(folder, "generation_config.json")):
            shutil.copy(generation, folder)
        torch.save(optimizer, os.path.join(folder, "optimizer.pt"))


# -- what is trained ------------------------------------------------------------------------------------------------
class FullModel:
    """Every weight is trained, in `dtype`; the engine gets them all."""

    adapter = None

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def load(self, path: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)

    def skeleton(self, path: str):
        """The model of `path` on the meta device: its modules and shapes, no weights read or held."""
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=self.dtype)

    def engine_model(self, start: str, base: str) -> str:
        return start

    def weights(self, model, placement) -> dict:
        return placement.full_weights()


class Adapter:
    """`lora_rank`: peft LoRA adapters on the frozen base model; the engine serves the base model with the
    adapter, which is all it gets after each step."""

    def __init__(self, cfg: TrainConfig, dtype: torch.dtype) -> None:
        self.rank, self.alpha, self.targets = cfg.lora_rank, cfg.resolved_lora_alpha(), cfg.lora_targets
        self.dtype, self.seed = dtype, cfg.seed
        self.adapter: Optional[dict] = None

    def load(self, path: str):
        """`path`: the base model, or an adapter checkpoint naming it."""
        model = lora.load_policy(path, self.rank, self.alpha, self.targets, self.dtype, self.seed)
        self.adapter = lora.adapter_config(model)
        return model

    def skeleton(self, path: str):
        """The policy of `path` on the meta device (FSDP2's other ranks): the base model's modules with fresh
        adapters of the run's settings, the structure an adapter checkpoint of this run loads into."""
        from transformers import AutoConfig, AutoModelForCausalLM

        base = lora.base_model_dir(path) if lora.is_adapter(path) else path
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=self.dtype)
            model = lora.wrap(model, self.rank, self.alpha, self.targets, self.seed)
        self.adapter = lora.adapter_config(model)
        return model

    def engine_model(self, start: str, base: str) -> str:
        return base

    def weights(self, model, placement) -> dict:
        return lora.adapter_state(model, placement.gathered())


# -- how the ranks hold it ------------------------------------------------------------------------------------------
class Replicated:
    """Every rank holds the whole model on its device, rank 0's weights broadcast at the start (as DDP does)."""

    def __init__(self, model, ranks: TrainerRanks) -> None:
        self.model, self.ranks = model, ranks
        model.to(ranks.device)
        ranks.same_weights(model)

    def use_optimizer(self, optimizer: torch.optim.Optimizer, state: Optional[str]) -> None:
        """The optimizer of the model, its state read from the file `state` (None: a fresh one)."""
        if state is not None:
            optimizer.load_state_dict(torch.load(state, weights_only=True, map_location=self.ranks.device))

    def stepped(self) -> None:
        """After each step, on every rank: nothing to gather."""

    def full_weights(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def gathered(self) -> None:
        """The model's own tensors are whole: nothing gathered to read instead."""
        return None

    def save(self, folder: str, optimizer: torch.optim.Optimizer) -> dict:
        """Rank 0: the model into `folder`; the optimizer's state to save beside it."""
        self.model.save_pretrained(folder, safe_serialization=True)
        return optimizer.state_dict()


class Sharded:
    """`fsdp`: FSDP2 over the ranks; the full weights are gathered to rank 0 after each step, and the optimizer's
    state for each checkpoint (in torch.optim's layout: a checkpoint resumes with or without FSDP)."""

    def __init__(self, model, ranks: TrainerRanks, compute_dtype: Optional[str] = None,
                 trainable_only: bool = False) -> None:
        """`model`: rank 0's loaded from the files, the others' on the meta device (`skeleton`);
        `compute_dtype`: FSDP2's mixed precision (bf16-mixed), else None; `trainable_only`: after each step only
        the trainable parameters are gathered (a LoRA adapter: the frozen base never moves)."""
        self.model, self.ranks, self.trainable_only = model, ranks, trainable_only
        # rank 0 keeps the weights it read (not a copy: sharding gives the model new storage, and the engine takes
        # these before the first step) for the engine's first weights, and sends each rank its shard of them; a
        # LoRA adapter is copied (sharding a peft model invalidates the storage of its trainable factors)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else set()
        self._weights = {k: v.detach().clone() if k in trainable else v.detach()
                         for k, v in model.state_dict().items()} if ranks.main else None
        shard(model, ranks, compute_dtype)
        # a copy of the mapping: set_model_state_dict puts the shards in place of the values of the one it gets
        load_full_weights(model, None if self._weights is None else dict(self._weights), ranks)

    def use_optimizer(self, optimizer: torch.optim.Optimizer, state: Optional[str]) -> None:
        """As Replicated's; besides, the other ranks take part in gathering its state for rank 0's checkpoints."""
        self.ranks.on_save = lambda: full_optimizer_state(self.model, optimizer, self.ranks)
        if state is not None:
            full = torch.load(state, weights_only=True) if self.ranks.main else None
            load_full_optimizer_state(self.model, optimizer, full, self.ranks)

    def stepped(self) -> None:
        self._weights = full_weights(self.model, self.ranks, self.trainable_only)  # every rank takes part

    def full_weights(self) -> dict:
        return self._weights

    def gathered(self) -> dict:
        """Rank 0: the state dict gathered after the last step (the whole one before the first)."""
        return self._weights

    def save(self, folder: str, optimizer: torch.optim.Optimizer) -> dict:
        self.ranks.save()  # the other ranks gather the optimizer state with this one
        state = full_optimizer_state(self.model, optimizer, self.ranks)
        self.model.save_pretrained(folder, state_dict=self._weights, safe_serialization=True)
        return state
