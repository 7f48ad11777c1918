"""Prompts and rewards: the built-in addition task, a user's JSONL/Parquet dataset, and the reward function.

A dataset is a list of (prompt, answer) strings. Batch j of a run takes the prompts at positions
[j * P, (j + 1) * P) of an endless stream made of seeded permutations of the training split, one per epoch,
so the prompts of every batch are a function of (seed, j) alone: a resumed run sees the same stream."""

from __future__ import annotations

import importlib
import json
import os
import random
from dataclasses import dataclass
from typing import Callable, Sequence

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def addition_problems(count: int, digits: int, seed: int) -> list[Problem]:
    """`count` distinct problems "a+b=" -> "a+b" with 0 <= a, b < 10**digits."""
    if count > 10 ** (2 * digits):
        raise ValueError(f"cannot draw {count} distinct {digits}-digit addition problems")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < count:
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        if (a, b) not in seen:
            seen.add((a, b))
            out.append(Problem(f"{a}+{b}=", str(a + b)))
    return out


def load_problems(path: str, prompt_field: str, answer_field: str) -> list[Problem]:
    """Rows of a .jsonl or .parquet file with a prompt and an answer field (answers are compared as text)."""
    if not os.path.isfile(path):
        raise ValueError(f"data: no such file {path!r}")
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"data: {path}:{line_no} is not valid JSON ({e})") from None
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"data must be a .jsonl or .parquet file, got {path!r}")
    problems = []
    for i, row in enumerate(rows):
        for field in (prompt_field, answer_field):
            if not isinstance(row, dict) or field not in row:
                raise ValueError(f"data: row {i} of {path} has no field {field!r} (set prompt_field/answer_field)")
        problems.append(Problem(str(row[prompt_field]), str(row[answer_field])))
    if not problems:
        raise ValueError(f"data: {path} holds no rows")
    return problems


def split_problems(problems: Sequence[Problem], eval_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """A seeded held-out split: (train, eval). eval_size must leave at least one training problem."""
    if eval_size >= len(problems):
        raise ValueError(f"eval_size ({eval_size}) must be smaller than the dataset ({len(problems)} problems)")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    held = set(order[:eval_size])
    return [p for i, p in enumerate(problems) if i not in held], [problems[i] for i in order[:eval_size]]


class PromptStream:
    """Position k of the stream is problem perm_e[k mod n] with e = k // n and perm_e a permutation seeded
    by (seed, e)."""

    def __init__(self, num_problems: int, seed: int) -> None:
        self.n, self.seed = num_problems, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(self.n))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._perms = {epoch: order}  # batches walk forward: keep one epoch
        return self._perms[epoch]

    def batch(self, index: int, size: int) -> list[int]:
        return [self._perm(k // self.n)[k % self.n] for k in range(index * size, (index + 1) * size)]


def normalise_answer(text: str) -> str:
    return " ".join(text.strip().split())


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding and repeated whitespace, equals the answer, else 0.0."""
    return float(normalise_answer(response) == normalise_answer(answer))


def resolve_reward(spec: str | None) -> RewardFn:
    """`None` -> exact_match; "module:function" -> that function, called as fn(response, answer) -> float."""
    if spec is None:
        return exact_match
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward: {module_name!r} has no function {attr!r}")
    return fn
