"""Data and prompts (docs/trainer.md, "Data" and "Chat templates"): JSONL, Parquet and `datasets` folders with
their errors; chat templates rendered once, the rendered text, the engine's token ids and the trainer's input ids
in agreement (one BOS); and one short `vcpo train` with a chat template and --reward math on a tiny instruct-style
model made here (nothing downloaded)."""

import json
import os
import re
import subprocess
import sys
import types

import pytest

from vcpo.trainer import make_config
from vcpo.trainer.engines.interface import Completion
from vcpo.trainer.rollouts import pad_rollouts
from vcpo.trainer.data import PromptFormat, load_problems, split_problems

SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def instruct_tokenizer(template=TEMPLATE):
    """The built-in character tokenizer plus letters, chat role tokens and a template; it adds a BOS itself
    (as Llama's do), so that a template's BOS could be doubled."""
    from tokenizers import processors

    from vcpo.trainer import tiny

    tok = tiny.build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(list("abcdefghijklmnopqrstuvwxyz.,:?"))
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.chat_template = template
    return tok


def pieces_to_ids(tok, pieces):
    """Token ids of a hand-written token sequence: specials whole, other text one character per token."""
    out = []
    for p in pieces:
        out += tok.convert_tokens_to_ids([p] if p.startswith("<") else list(p))
    return out


def test_chat_template_text_and_ids_have_one_bos():
    tok = instruct_tokenizer()
    fmt = PromptFormat(tok, "auto", "be brief.")
    text = fmt.text("what is 1+2?")
    assert text == "<s><|system|>be brief.<|end|><|user|>what is 1+2?<|end|><|assistant|>"
    expected = pieces_to_ids(tok, ["<s>", "<|system|>", "be brief.", "<|end|>", "<|user|>", "what is 1+2?",
                                   "<|end|>", "<|assistant|>"])
    assert fmt.ids(text) == expected and expected.count(tok.bos_token_id) == 1
    assert PromptFormat(tok, "auto").text("1+2=") == "<s><|user|>1+2=<|end|><|assistant|>"  # no system message


def test_no_template_lets_the_tokenizer_add_its_bos_once(tmp_path):
    tok = instruct_tokenizer(template=None)
    for spec in ("auto", "none"):  # auto without a template is none
        fmt = PromptFormat(tok, spec)
        assert fmt.template is None and fmt.text("1+2=") == "1+2="
        assert fmt.ids("1+2=") == pieces_to_ids(tok, ["<s>", "1+2="])
        assert fmt.ids("<s>1+2=") == pieces_to_ids(tok, ["<s>", "1+2="])  # the prompt's own BOS, not a second
    with pytest.raises(ValueError, match="system_prompt needs a chat template.*has no template"):
        PromptFormat(tok, "auto", "be brief.")
    # "none" ignores the tokenizer's template; a file replaces it
    assert PromptFormat(instruct_tokenizer(), "none").text("1+2=") == "1+2="
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %} a:")
    fmt = PromptFormat(tok, str(path), "hi")
    assert fmt.text("1+2=") == "system: hiuser: 1+2= a:"
    assert fmt.ids(fmt.text("1+2=")) == pieces_to_ids(tok, ["system: hiuser: 1+2= a:"])  # the template's: no BOS
    with pytest.raises(ValueError, match="no such file"):
        PromptFormat(tok, str(tmp_path / "missing.jinja"))


def test_builtin_task_has_no_template():
    from vcpo.trainer import tiny

    tok = tiny.build_tokenizer()
    fmt = PromptFormat(tok, "auto", builtin=True)
    assert fmt.template is None and fmt.ids("1+2=") == [tiny.BOS] + tok.encode("1+2=")
    with pytest.raises(ValueError, match="built-in task"):
        PromptFormat(tok, __file__, builtin=True)
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        PromptFormat(tok, "auto", "be brief.", builtin=True)
    with pytest.raises(ValueError, match="chat_template: no such Jinja template file"):
        make_config(chat_template="no/such.jinja")


ROWS = [{"q": f"what is {i}+{i}?", "a": str(2 * i), "level": i % 3} for i in range(12)]


def _write_all_formats(tmp_path, rows):
    import datasets

    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dsdict"))
    return [str(jl), str(tmp_path / "d.parquet"), str(tmp_path / "ds"), str(tmp_path / "dsdict")]


def test_jsonl_parquet_and_datasets_folders_give_the_same_problems(tmp_path):
    for path in _write_all_formats(tmp_path, ROWS):
        got = load_problems(path, "q", "a")
        assert [(p.prompt, p.answer, p.row, p.index) for p in got] == \
            [(r["q"], r["a"], r, i) for i, r in enumerate(ROWS)], path
        assert got[5].example == ROWS[5]  # the row a three-argument reward gets


def test_data_errors_name_the_problem(tmp_path):
    import datasets

    for path in _write_all_formats(tmp_path, ROWS):
        with pytest.raises(ValueError, match=r"row 0 of .* has no field 'question' \(set prompt_field"):
            load_problems(path, "question", "a")
        with pytest.raises(ValueError, match=r"has no field 'answer' \(set answer_field"):
            load_problems(path, "q", "answer")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no rows"):
        load_problems(str(tmp_path / "empty.jsonl"), "q", "a")
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match="empty.parquet holds no rows"):
        load_problems(str(tmp_path / "empty.parquet"), "q", "a")
    os.makedirs(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a `datasets` folder"):
        load_problems(str(tmp_path / "plain"), "q", "a")
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}) \
        .save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\]: none is 'train'"):
        load_problems(str(tmp_path / "nosplit"), "q", "a")
    with pytest.raises(ValueError, match="no such file or folder"):
        load_problems(str(tmp_path / "missing.jsonl"), "q", "a")


BAD_VALUES = [  # (rows, the row and field named, what the error says it is): each column of one type, for Parquet
    ([{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": None}], r"row 1 of .*: the answer \('a'\) is null", "a null answer"),
    ([{"q": None, "a": "2"}], r"row 0 of .*: the prompt \('q'\) is null", "a null prompt"),
    ([{"q": {"text": "1+1="}, "a": "2"}], r"row 0 of .*: the prompt \('q'\) is a mapping; a prompt must be",
     "a mapping prompt"),
    ([{"q": "1+1=", "a": {"value": 2}}], r"row 0 of .*: the answer \('a'\) is a mapping; an answer must be a string or a finite",
     "a mapping answer"),
    ([{"q": "1+1=", "a": [2]}], r"row 0 of .*: the answer \('a'\) is a list", "a list answer"),
    ([{"q": 11, "a": "2"}], r"row 0 of .*: the prompt \('q'\) is a number \(11\)", "a number prompt"),
    ([{"q": "1+1=", "a": True}], r"row 0 of .*: the answer \('a'\) is a boolean \(True\)", "a boolean answer"),
    ([{"q": "1+1=", "a": 2.0}, {"q": "0/0=", "a": float("nan")}], r"row 1 of .*: the answer \('a'\) is a number "
     r"\(nan\), not finite", "a NaN answer"),
    ([{"q": ["1+1="], "a": "2"}], r"row 0 of .*: the prompt \('q'\) is a list that is not chat messages", "a list of strings"),
]


@pytest.mark.parametrize("rows, error, case", BAD_VALUES, ids=[case for _, _, case in BAD_VALUES])
def test_bad_values_name_the_file_row_and_field(tmp_path, rows, error, case):
    """What used to become plausible text ("None", a dict's repr) is an error naming the file, row and field, in
    JSONL, Parquet and `datasets` folders alike."""
    for path in _write_all_formats(tmp_path, rows):
        with pytest.raises(ValueError, match=f"^data: {error}") as bad:
            load_problems(path, "q", "a")
        assert path in str(bad.value)
    with pytest.raises(ValueError) as bad:  # JSONL rows: their line too
        load_problems(str(tmp_path / "d.jsonl"), "q", "a")
    row = int(re.search(r"row (\d+) of", str(bad.value)).group(1))
    assert f"d.jsonl (line {row + 1}): the" in str(bad.value)


def test_numeric_answers_stay_numbers_and_exact_compares_them(tmp_path):
    """4.0 in the data is the number 4.0 (not the text "4.0"), and --reward exact counts "4" right for it; an
    integer answer keeps its every digit."""
    from vcpo.trainer.rewards import exact_match

    rows = [{"q": "2+2=", "a": 4.0}, {"q": "0.1+0.2=", "a": 0.30000000000000004}, {"q": "big", "a": 1e22}]
    for path in _write_all_formats(tmp_path, rows):
        got = load_problems(path, "q", "a")
        assert [p.answer for p in got] == [r["a"] for r in rows] and all(type(p.answer) is float for p in got)
        assert [exact_match(text, p.answer) for text, p in zip(["4", "0.30000000000000004", "1e22"], got)] == [1] * 3
        assert [exact_match(text, p.answer) for text, p in zip(["4.0000001", "0.3", "4.0"], got)] == [0] * 3
    jl = tmp_path / "int.jsonl"
    jl.write_text(json.dumps({"q": "x", "a": 10 ** 22 + 1}) + "\n")
    (p,) = load_problems(str(jl), "q", "a")
    assert p.answer == 10 ** 22 + 1 and exact_match("10000000000000000000001", p.answer) == 1.0
    assert exact_match("1e22", p.answer) == 0.0  # the nearest double would say equal; the integer does not


def test_undecodable_bytes_name_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"q": "1+1=", "a": "2"}\n\n{"q": "caf\xe9", "a": "2"}\n')  # line 3: Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"^data: .*d.jsonl:3 is not UTF-8 text \(byte b'\\xe9' at byte 11 of the "
                                         r"line\)$"):
        load_problems(str(path), "q", "a")
    path.write_bytes(b'\xef\xbb\xbf{"q": "caf\xc3\xa9", "a": "2"}\n')  # UTF-8 with a byte-order mark
    assert [p.prompt for p in load_problems(str(path), "q", "a")] == ["caf\u00e9"]


def test_a_conversation_prompt_is_rendered_as_its_messages(tmp_path):
    chat = [{"role": "user", "content": "what is 1+2?"}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "and 2+2?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": chat, "answer": "4"}) + "\n")
    (p,) = load_problems(str(path), "prompt", "answer")
    fmt = PromptFormat(instruct_tokenizer(), "auto", "be brief.")
    assert fmt.text(p.prompt) == ("<s><|system|>be brief.<|end|><|user|>what is 1+2?<|end|><|assistant|>3<|end|>"
                                  "<|user|>and 2+2?<|end|><|assistant|>")
    with pytest.raises(ValueError, match="chat messages needs a chat template"):
        PromptFormat(instruct_tokenizer(), "none").text(p.prompt)
    path.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 .*: the prompt \('prompt'\) is a list that is not chat messages"):
        load_problems(str(path), "prompt", "answer")


def _model_dir(tmp_path, tok):
    """A tiny random Llama over `tok`'s vocabulary, with it, in a model folder."""
    from vcpo.trainer import tiny

    folder = tmp_path / "instruct-model"
    tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return str(folder)


class FakeEngine:
    """Records the prompts it is given; answers each with the token ids of "3" and one of "no"."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, prompts, *, n, **kw):
        self.prompts += [list(p) for p in prompts]
        replies = [self.tok.encode("3", add_special_tokens=False), self.tok.encode("no", add_special_tokens=False)]
        return [[Completion(replies[r % 2], [-0.5] * len(replies[r % 2]), "stop") for r in range(n)]
                for _ in prompts]


def _task(tmp_path, rows=ROWS, **settings):
    from transformers import AutoTokenizer

    from vcpo.trainer.task import Task, run_problems

    model = _model_dir(tmp_path, instruct_tokenizer())
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(model=model, data=str(data), prompt_field="q", answer_field="a", eval_size=2,
                      prompts_per_step=3, responses_per_prompt=2, **settings)
    problems = run_problems(cfg, print)
    tok = AutoTokenizer.from_pretrained(model)  # as the trainer loads it
    return Task(cfg, problems, tok, model, types.SimpleNamespace(max_position_embeddings=256)), tok


def test_rendered_prompt_engine_ids_and_trainer_ids_agree(tmp_path):
    task, tok = _task(tmp_path, system_prompt="be brief.", reward="math")
    engine = FakeEngine(tok)
    batch = task.make_batch(engine, 0, 0)
    ids, attn, _, _ = pad_rollouts(batch.rollouts, task.pad_id)
    for k, r in enumerate(batch.rollouts):
        p = task.problems.train[r.prompt_index]
        text = f"<s><|system|>be brief.<|end|><|user|>{p.prompt}<|end|><|assistant|>"
        assert task.train_texts[r.prompt_index] == text
        expected = pieces_to_ids(tok, ["<s>", "<|system|>", "be brief.", "<|end|>", "<|user|>", p.prompt,
                                       "<|end|>", "<|assistant|>"])
        assert engine.prompts[k // 2] == expected  # what the engine was sent
        assert ids[k, :len(expected)].tolist() == expected  # what the trainer's forward pass reads
        assert ids[k, len(expected):int(attn[k].sum())].tolist() == r.response_ids
        assert r.reward == float(r.response_index == 0 and p.answer == "3")  # math reward of "3" and "no"
    assert task.probe_ids == tok(task.train_texts[0], add_special_tokens=False)["input_ids"]


def test_a_prompt_longer_than_the_context_names_its_row(tmp_path):
    rows = [{"q": "1+1=", "a": "2"}] * 7 + [{"q": "12+34=", "a": "46"}] + [{"q": "1+1=", "a": "2"}] * 4
    _task(tmp_path, rows, max_model_len=13)  # <s><|user|>12+34=<|end|><|assistant|>: 10 tokens, 3 to generate
    with pytest.raises(ValueError, match="data row 7 has 10 tokens: the context \\(max_model_len 10\\) leaves no"):
        _task(tmp_path, rows, max_model_len=10)


@pytest.mark.slow
def test_train_with_a_chat_template_and_math_reward(tmp_path):
    """`vcpo train` end to end (vLLM in-process, 2 steps): prompt_example.txt is the rendered first prompt, every
    sample is in rollouts.jsonl with its math reward."""
    pytest.importorskip("vllm")
    from vcpo.trainer.rewards import math_reward

    tok = instruct_tokenizer(template=None)  # the template comes from a file
    model = _model_dir(tmp_path, tok)
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    folder = tmp_path / "run"
    env = {**os.environ, "VCPO_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", model, "--data", str(data), "--prompt-field", "q",
         "--answer-field", "a", "--chat-template", str(template), "--system-prompt", "be brief.", "--reward", "math",
         "--engine", "inprocess", "--steps", "2", "--prompts-per-step", "2", "--responses-per-prompt", "2",
         "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "0", "--loss", "grpo", "--lr", "1e-4",
         "--output-dir", str(folder), "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train, _ = split_problems(load_problems(str(data), "q", "a"), 2, 0)
    assert (folder / "prompt_example.txt").read_text() == \
        f"<s><|system|>be brief.<|end|><|user|>{train[0].prompt}<|end|><|assistant|>"
    rows = [json.loads(line) for line in open(folder / "rollouts.jsonl")]
    assert len({tuple(r["uid"]) for r in rows}) == len(rows) == 2 * 2 * 2  # every sample, once
    for r in rows:
        text = tok.decode(r["response_ids"], skip_special_tokens=True)
        assert r["reward"] == math_reward(text, train[r["uid"][1]].answer) and "reward_error" not in r
    metrics = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    assert [m["reward_errors"] for m in metrics] == [0, 0]
