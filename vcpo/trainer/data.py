"""The data: the built-in addition task, a user's data set (JSONL, Parquet, a `datasets` folder), and how a prompt
becomes the text and the token ids the engine is given (a chat template or none). A run's task: task.py; rewards:
rewards.py.

A dataset is a list of problems: a prompt (a string or chat messages), an answer (a string, or a number compared as
a number by the exact reward) and the data row. Batch j of a run takes the prompts at
positions [j * P, (j + 1) * P) of an endless stream made of seeded permutations of the training split, one per
epoch, so the prompts of every batch are a function of (seed, j) alone: a resumed run sees the same stream."""

from __future__ import annotations

import json
import math
import numbers
import os
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence



@dataclass(frozen=True)
class Problem:
    prompt: "str | tuple"  # the text, or a conversation: ({"role": ..., "content": ...}, ...)
    answer: "str | int | float"  # as in the data: a string, or a finite number (never a bool)
    row: Optional[dict] = field(default=None, compare=False)  # the whole data row (a reward's `example`)
    index: Optional[int] = field(default=None, compare=False)  # its row number in the data

    @property
    def example(self) -> dict:
        return self.row if self.row is not None else {"prompt": self.prompt, "answer": self.answer}


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


def _read_rows(path: str, setting: str = "data") -> list[tuple[dict, str]]:
    """The rows of a .jsonl or .parquet file, or of a `datasets` folder saved with save_to_disk (a DatasetDict
    folder: its train split, or its only one), each with where it is ("row 3 of PATH", plus "(line 5)" in a JSONL
    file) for error messages, which start with the name of the `setting` that gave the path."""
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")):
            raise ValueError(f"{setting}: {path!r} is a folder but not a `datasets` folder (save_to_disk)")
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds and len(ds) != 1:
                raise ValueError(f"{setting}: the `datasets` folder {path} holds the splits {sorted(ds)}: none is "
                                 "'train'; point data at the split's own folder")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [(row, f"row {i} of {path}") for i, row in enumerate(ds.to_list())]
    if not os.path.isfile(path):
        raise ValueError(f"{setting}: no such file or folder {path!r}")
    if path.endswith(".jsonl"):
        rows = []
        with open(path, "rb") as f:  # bytes: a decoding error then names its line
            for line_no, raw in enumerate(f, 1):
                try:  # a byte-order mark at the start of the file is not part of the first row
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{setting}: {path}:{line_no} is not UTF-8 text (byte "
                                     f"{raw[e.start:e.start + 1]!r} at byte {e.start + 1} of the line)") from None
                if line.strip():
                    try:
                        rows.append((json.loads(line), f"row {len(rows)} of {path} (line {line_no})"))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{setting}: {path}:{line_no} is not valid JSON ({e})") from None
        return rows
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [(row, f"row {i} of {path}") for i, row in enumerate(pq.read_table(path).to_pylist())]
    raise ValueError(f"{setting} must be a .jsonl or .parquet file or a `datasets` folder, got {path!r}")


def _kind(value) -> str:
    """A data value's kind, in the words of an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, numbers.Number):
        return f"a number ({value!r})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


def _prompt(value, where: str, column: str, setting: str = "data") -> "str | tuple":
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    what = "a list that is not chat messages (dicts with a role and a content string)" \
        if isinstance(value, list) and value else _kind(value)
    raise ValueError(f"{setting}: {where}: the prompt ({column!r}) is {what}; a prompt must be a string or a list "
                     "of chat messages")


def _answer(value, where: str, column: str, setting: str = "data") -> "str | int | float":
    if isinstance(value, str) or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                  and math.isfinite(value)):
        return value
    what = f"{_kind(value)}, not finite" if isinstance(value, numbers.Real) and not isinstance(value, bool) \
        else _kind(value)
    raise ValueError(f"{setting}: {where}: the answer ({column!r}) is {what}; an answer must be a string or a "
                     "finite number")


def load_problems(path: str, prompt_field: str, answer_field: str, setting: str = "data") -> list[Problem]:
    """The rows of `path` (_read_rows) with a prompt (a string, or chat messages) and an answer (a string or a
    finite number); anything else is an error naming the setting that gave the path (data, eval_data), the file,
    the row and the field."""
    rows = _read_rows(path, setting)
    if not rows:
        raise ValueError(f"{setting}: {path} holds no rows")
    problems = []
    for i, (row, where) in enumerate(rows):
        for name, column in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if not isinstance(row, dict) or column not in row:
                raise ValueError(f"{setting}: {where} has no field {column!r} (set {name}; its fields: "
                                 f"{sorted(row) if isinstance(row, dict) else _kind(row)})")
        problems.append(Problem(_prompt(row[prompt_field], where, prompt_field, setting),
                                _answer(row[answer_field], where, answer_field, setting), row, i))
    return problems


def split_problems(problems: Sequence[Problem], eval_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """A seeded held-out split: (train, eval). eval_size must leave at least one training problem."""
    if eval_size >= len(problems):
        raise ValueError(f"eval_size ({eval_size}) must be smaller than the dataset ({len(problems)} problems)")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    held = set(order[:eval_size])
    return [p for i, p in enumerate(problems) if i not in held], [problems[i] for i in order[:eval_size]]


def train_and_held_out(data: str, eval_data: Optional[str], prompt_field: str, answer_field: str, eval_size: int,
                       seed: int) -> tuple[list[Problem], list[Problem]]:
    """A user's data set as (train, held-out). Without eval_data: eval_size rows of `data` held out, seeded
    (split_problems). With eval_data (a separate held-out file, in the same formats and with the same fields):
    every row of `data` trains and every row of `eval_data` is held out; eval_size is not used."""
    problems = load_problems(data, prompt_field, answer_field)
    if eval_data is None:
        return split_problems(problems, eval_size, seed)
    return problems, load_problems(eval_data, prompt_field, answer_field, setting="eval_data")


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


class PromptFormat:
    """A data prompt -> the text the model sees -> the token ids sent to the engine (and trained on).

    chat_template "auto" is the tokenizer's own template when it has one, else none; "none" uses the prompt as
    written; anything else is the path of a Jinja template file. A template renders [system, user] messages
    (system only with system_prompt; a conversation prompt is its own messages, after the system one) with the
    generation prompt, and the rendered text is tokenized without
    the tokenizer's special tokens: the template writes them (a BOS it writes is the only one). Without a
    template the tokenizer adds its special tokens, except a BOS the prompt already starts with. The built-in
    task's prompts get the BOS its model was warm-started with."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: Optional[str] = None,
                 builtin: bool = False) -> None:
        self.tokenizer, self.builtin, self.system_prompt = tokenizer, builtin, system_prompt
        if builtin and chat_template not in ("auto", "none"):
            raise ValueError("chat_template: the built-in task's tokenizer has no chat template and its model was "
                             "trained on bare prompts; a template file needs --model")
        if chat_template == "auto":
            self.template = None if builtin else getattr(tokenizer, "chat_template", None)
        elif chat_template == "none":
            self.template = None
        elif os.path.isfile(chat_template):
            with open(chat_template) as f:
                self.template = f.read()
        else:
            raise ValueError(f"chat_template must be auto, none or a Jinja template file, got {chat_template!r} "
                             "(no such file)")
        if system_prompt is not None and self.template is None:
            raise ValueError("system_prompt needs a chat template, and this run has none (chat_template "
                             f"{chat_template!r}" + (", the tokenizer has no template)" if chat_template == "auto"
                                                     else ")"))

    def text(self, prompt: "str | tuple") -> str:
        if self.template is None:
            if not isinstance(prompt, str):
                raise ValueError("a prompt made of chat messages needs a chat template, and this run has none")
            return prompt
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []) \
            + (list(prompt) if isinstance(prompt, tuple) else [{"role": "user", "content": prompt}])
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)

    def ids(self, text: str) -> list[int]:
        tok = self.tokenizer
        if self.builtin:
            return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
        own_bos = self.template is None and not (tok.bos_token and text.startswith(tok.bos_token))
        return tok(text, add_special_tokens=own_bos)["input_ids"]
