"""Evaluation on held-out prompts (docs/trainer.md, "Evaluation"): greedy accuracy and mean reward, and from n
samples per prompt at the run's temperature, pass@k (the unbiased estimator) and mean@n. The trainer's periodic and
final evaluation is `held_out` (greedy only); `vcpo eval` is `run_eval` on a checkpoint, written as JSON beside it.

A response is correct when its reward is at least 1: the full score of the exact-match and math rewards, which
score 0 or 1."""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Callable, Optional, Sequence

from . import lora
from .config import make_config
from .data import load_problems
from .engines.interface import OWNED_MODES
from .engines.start import owned_engine
from .rewards import CORRECT_REWARD, RewardJob
from .task import Problems, Task, run_problems


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k responses drawn without replacement from n, of which c are correct,
    is correct: 1 - C(n - c, k) / C(n, k), the unbiased estimate of pass@k from n samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k reported for n samples: 1, 2, 4, ... below n, and n."""
    return [2 ** i for i in range(n.bit_length()) if 2 ** i < n] + [n]


def _scores(task, texts: Sequence[str], problems: Sequence, uids: Sequence) -> list[float]:
    results = task.rewards.score([RewardJob(uid, t, p.answer, p.example) for uid, t, p in zip(uids, texts, problems)])
    return [r.reward for r in results]


SAMPLES = 8  # greedy responses kept beside each evaluation's score


def evaluate(engine, task, prompts: Sequence[Sequence[int]], problems: Sequence, *, n: int = 0,
             seed: int = 0) -> dict:
    """Greedy accuracy and mean reward of `engine` on `prompts` (token ids; `problems` their answers), scored with
    `task`'s reward; with n > 0 also n samples per prompt at the task's temperature (prompt i's j-th seeded with
    seed + i * n + j): pass@k for reported_ks(n) and mean@n, the mean reward of the samples."""
    decode = task.tokenizer.decode
    outs = engine.generate(prompts, n=1, max_tokens=task.max_new, temperature=0.0, stop_token_ids=task.stop_ids)
    texts = [decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
    rewards = _scores(task, texts, problems, [("eval", i) for i in range(len(texts))])
    result = {"prompts": len(prompts),
              "greedy": {"accuracy": sum(r >= CORRECT_REWARD for r in rewards) / len(rewards),
                         "reward": sum(rewards) / len(rewards),
                         # what was scored, so that a gamed score can be seen beside it
                         "samples": [{"answer": p.answer, "response": t, "reward": r}
                                     for p, t, r in zip(problems[:SAMPLES], texts, rewards)]}}
    if n > 0:
        outs = engine.generate(prompts, n=n, max_tokens=task.max_new, temperature=task.temperature,
                               top_k=task.top_k, top_p=task.top_p,
                               seeds=[seed + i * n for i in range(len(prompts))], stop_token_ids=task.stop_ids)
        samples = [(i, j, decode(c.token_ids, skip_special_tokens=True))
                   for i, completions in enumerate(outs) for j, c in enumerate(completions)]
        rewards = _scores(task, [t for _, _, t in samples], [problems[i] for i, _, _ in samples],
                          [("eval", i, j) for i, j, _ in samples])
        correct = [0] * len(prompts)
        for (i, _, _), r in zip(samples, rewards):
            correct[i] += r >= CORRECT_REWARD
        result["sampled"] = {"n": n, "temperature": task.temperature, "top_k": task.top_k, "top_p": task.top_p,
                             "seed": seed,
                             **{f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct)
                                for k in reported_ks(n)},
                             f"mean@{n}": sum(rewards) / len(rewards)}
    return result


def held_out(engine, task, version: int, log_path: str) -> tuple[float, float]:
    """The trainer's evaluation: greedy accuracy and mean reward on the run's held-out prompts, appended to
    `log_path` (the run's evals.jsonl) with the first SAMPLES responses, so that a gamed score can be seen."""
    greedy = evaluate(engine, task, task.eval_prompts, task.problems.eval)["greedy"]
    with open(log_path, "a") as f:
        f.write(json.dumps({"version": version, **greedy}) + "\n")
    return greedy["accuracy"], greedy["reward"]


# -- vcpo eval -----------------------------------------------------------------------------------------------------
def _run_settings(folder: str) -> Optional[dict]:
    """The settings of the run whose folder this is, or None."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved["settings"] if isinstance(saved.get("settings"), dict) else None


def resolve_model(model: str) -> tuple[str, Optional[dict]]:
    """(the model folder to evaluate, the settings of its run or None): a run folder gives its latest checkpoint,
    a checkpoint of a run (<run>/checkpoints/step-N) that run's settings, any other folder is a model, and a .gguf
    file its converted folder."""
    from .gguf_models import is_gguf, model_folder
    from .run_folder import RunFolder

    if is_gguf(model):
        return model_folder(model), None
    if not os.path.isdir(model):
        raise ValueError(f"model must be a run folder, a local Hugging Face model folder or a .gguf file, got "
                         f"{model!r}")
    settings = _run_settings(model)
    if settings is not None:
        try:
            return RunFolder.latest_checkpoint(model), settings
        except IndexError:
            raise ValueError(f"model: the run folder {model!r} has no checkpoint yet") from None
    parent = os.path.dirname(os.path.dirname(os.path.abspath(model)))
    if os.path.basename(os.path.dirname(os.path.abspath(model))) == "checkpoints":
        return model, _run_settings(parent)
    return model, None


def default_output(model_dir: str, data: Optional[str]) -> str:
    stem = "heldout" if data is None else os.path.splitext(os.path.basename(os.path.normpath(data)))[0]
    return os.path.join(model_dir, f"eval-{stem}.json")


def run_eval(model: str, *, data: Optional[str] = None, reward: Optional[str] = None, n: int = 8,
             engine: str = "inprocess", output: Optional[str] = None, seed: int = 0,
             max_new_tokens: Optional[int] = None, prompt_field: Optional[str] = None,
             answer_field: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    """`vcpo eval`: evaluate `model` (a run folder's latest checkpoint, a checkpoint, or a model folder) on `data`
    (every row) or, without data, on its run's held-out split, with vLLM; the result is also written to `output`
    (default: eval-<data stem>.json, or eval-heldout.json, in the model folder)."""
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0 (0: greedy only), got {n!r}")
    if engine not in OWNED_MODES:
        raise ValueError(f"engine must be one of {list(OWNED_MODES)}, got {engine!r}")
    model_dir, settings = resolve_model(model)
    given = {k: v for k, v in (("reward", reward), ("max_new_tokens", max_new_tokens),
                               ("prompt_field", prompt_field), ("answer_field", answer_field)) if v is not None}
    if settings is None:
        if data is None:
            raise ValueError(f"data: {model!r} is a model folder, not a run: give the file to evaluate on")
        cfg = make_config(model=model_dir, data=data, **given)
    elif data is not None and settings.get("model") is None:
        raise ValueError("data: the built-in model knows only the built-in task: drop --data to evaluate on its "
                         "held-out split")
    else:
        cfg = make_config(settings, **given, **({"data": data} if data is not None else {}))
    if data is not None:
        rows = load_problems(data, cfg.prompt_field, cfg.answer_field)
    else:
        rows = run_problems(cfg, log, make_model=False).eval
        if not rows:
            raise ValueError(f"data: the run of {model!r} held out no prompts (eval_size 0): give a file")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # a LoRA checkpoint: the base model served with the adapter, as the trainer's engine serves it
    served = lora.base_model_dir(model_dir) if lora.is_adapter(model_dir) else model_dir
    task = Task(cfg, Problems(rows, rows, model_dir), tokenizer, model_dir, AutoConfig.from_pretrained(served))
    path = output or default_output(model_dir, data)
    started = time.perf_counter()
    vllm = None
    try:
        adapter = lora.read_adapter_config(model_dir) if served != model_dir else None
        vllm = owned_engine(cfg, served, mode=engine, max_len=task.max_len, sync_dir=model_dir, adapter=adapter)
        if adapter is not None:
            vllm.use_adapter(model_dir, 0)
        result = evaluate(vllm, task, task.eval_prompts, rows, n=n, seed=seed)
    finally:
        if vllm is not None:
            vllm.close()
        task.rewards.close()
    step = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.normpath(model_dir)))
    result = {"model": model_dir, "step": int(step.group(1)) if step else None,
              "data": data if data is not None else "held-out split of the run", "reward": cfg.reward,
              "max_new_tokens": task.max_new, **result, "seconds": time.perf_counter() - started}
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    log(f"{path}: greedy accuracy {result['greedy']['accuracy']:.4f}"
        + "".join(f", {k} {v:.4f}" for k, v in result.get("sampled", {}).items() if "@" in k))
    return result
