"""A run's task: its problems (the built-in addition task, or a data set split into training and held-out
problems), their prompts as the engine gets them, and what a rollout batch asks of the engine and how its responses
are scored (Task). The data and the prompt format: data.py."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import tiny
from .config import TrainConfig
from .data import PromptFormat, PromptStream, addition_problems, split_problems, train_and_held_out
from .gguf_models import model_folder
from .rewards import CORRECT_REWARD, RewardJob, RewardPool
from .rollouts import GeneratedBatch, Rollout

BUILTIN_DIGITS = 2  # the built-in task: a + b with a, b < 100
BUILTIN_PROBLEMS = 10_000  # every such problem


@dataclass
class Problems:
    train: list
    eval: list
    model_dir: str


def run_problems(cfg: TrainConfig, log, make_model: bool = True) -> Problems:
    """The run's (train, held-out) problems and the model folder it starts from (the built-in one is made, or
    taken from the cache, unless make_model is False: then model_dir is None)."""
    if cfg.builtin:
        train, held = split_problems(addition_problems(BUILTIN_PROBLEMS, BUILTIN_DIGITS, seed=0), cfg.eval_size, 0)
        recipe = tiny.TinyRecipe(warm_start_steps=cfg.warm_start_steps)
        return Problems(train, held, tiny.tiny_model_dir(train, recipe, log=log) if make_model else None)
    if cfg.data is None:
        raise ValueError("model needs data: a .jsonl or .parquet file or a `datasets` folder with prompt and answer "
                         "fields")
    train, held = train_and_held_out(cfg.data, cfg.eval_data, cfg.prompt_field, cfg.answer_field, cfg.eval_size,
                                     cfg.seed)
    if cfg.eval_data is not None:
        log(f"held out: every row of eval_data {cfg.eval_data} ({len(held)} prompts); every row of data trains "
            f"({len(train)}; eval_size is not used)")
    return Problems(train, held, model_folder(cfg.model, log) if make_model else cfg.model)


class Task:
    """The prompts (token ids), answers and reward of a run: what each rollout batch and evaluation asks of the
    engine, and how the responses are scored."""

    def __init__(self, cfg: TrainConfig, problems: Problems, tokenizer, model_dir: str, model_config) -> None:
        self.problems, self.tokenizer, self.builtin = problems, tokenizer, cfg.builtin
        self.seed, self.groups, self.group_size = cfg.seed, cfg.prompts_per_step, cfg.responses_per_prompt
        # of the rollouts and of the evaluation's samples
        self.temperature, self.top_k, self.top_p = cfg.temperature, cfg.top_k, cfg.top_p
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
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
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
