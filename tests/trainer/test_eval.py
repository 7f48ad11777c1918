"""Evaluation (vcpo/trainer/evaluate.py): the pass@k estimator against an enumeration of subsets, `evaluate` on a
scripted engine against brute-force counts, and `vcpo eval` on a short built-in run against the trainer's own
final evaluation (summary.json), with vLLM; that run also reports to TensorBoard (--report-to)."""

import itertools
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vcpo.trainer.engines.interface import Completion
from vcpo.trainer.evaluate import evaluate, pass_at_k, reported_ks, run_eval
from vcpo.trainer.rewards import RewardPool


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_against_an_enumeration_of_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k([True] * c + [False] * (n - c), k),
                                                           abs=1e-12)
    assert pass_at_k(100, 0, 50) == 0.0 and pass_at_k(100, 51, 50) == 1.0
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_reported_ks():
    assert reported_ks(1) == [1] and reported_ks(6) == [1, 2, 4, 6] and reported_ks(8) == [1, 2, 4, 8]


class ScriptedEngine:
    """generate() answers from a script: `greedy[i]` at temperature 0, `samples[i]` (n of them) at 1; token ids
    are digits, decoded as text."""

    def __init__(self, greedy, samples):
        self.greedy, self.samples, self.calls = greedy, samples, []

    def generate(self, prompts, *, n, max_tokens, temperature, top_k=-1, top_p=1.0, seeds=None, stop_token_ids=()):
        self.calls.append({"n": n, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seeds": seeds,
                           "max_tokens": max_tokens})
        script = [[g] for g in self.greedy] if temperature == 0 else self.samples
        assert len(prompts) == len(script) and all(len(s) == n for s in script)
        return [[Completion([int(ch) for ch in text], [0.0] * len(text), "stop") for text in s] for s in script]


def test_evaluate_against_brute_force_counts():
    answers = ["12", "7", "30"]
    greedy = ["12", "70", "30"]
    samples = [["12", "1", "12", "2"], ["0", "0", "0", "0"], ["30", "3", "0", "30"]]
    engine = ScriptedEngine(greedy, samples)
    rewards = RewardPool("exact", workers=2, timeout=10.0, errors="raise")
    task = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(str, ids))),
                           max_new=5, stop_ids=[9], rewards=rewards, temperature=0.7,
                           top_k=20, top_p=0.9)
    problems = [SimpleNamespace(answer=a, example={"answer": a}) for a in answers]
    try:
        result = evaluate(engine, task, [[1], [2], [3]], problems, n=4, seed=100)
    finally:
        rewards.close()
    assert result["prompts"] == 3
    assert result["greedy"] == {"accuracy": pytest.approx(2 / 3), "reward": pytest.approx(2 / 3),
                                "samples": [{"answer": a, "response": g, "reward": float(a == g)}
                                            for a, g in zip(answers, greedy)]}  # what was scored, beside the score
    correct = [[s == a for s in row] for row, a in zip(samples, answers)]
    sampled = result["sampled"]
    assert sampled["n"] == 4 and sampled["temperature"] == 0.7  # the run's sampling temperature
    for k in (1, 2, 4):
        assert sampled[f"pass@{k}"] == pytest.approx(sum(brute_pass_at_k(c, k) for c in correct) / 3, abs=1e-12)
    assert sampled["mean@4"] == pytest.approx(sum(map(sum, correct)) / 12)
    assert set(sampled) == {"n", "temperature", "top_k", "top_p", "seed", "pass@1", "pass@2", "pass@4", "mean@4"}
    assert (sampled["top_k"], sampled["top_p"]) == (20, 0.9)
    assert engine.calls[1]["seeds"] == [100, 104, 108]  # prompt i's j-th sample: seed 100 + 4 i + j
    assert engine.calls[0]["temperature"] == 0.0 and engine.calls[1]["temperature"] == 0.7
    assert (engine.calls[0]["top_k"], engine.calls[0]["top_p"]) == (-1, 1.0)  # greedy: no truncation asked for
    assert (engine.calls[1]["top_k"], engine.calls[1]["top_p"]) == (20, 0.9)  # the samples: the run's
    assert all(c["max_tokens"] == 5 for c in engine.calls)


def test_vcpo_eval_refuses_what_it_cannot_evaluate(tmp_path):
    with pytest.raises(ValueError, match="model must be"):
        run_eval(str(tmp_path / "missing"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"settings": {"model": None}}))
    with pytest.raises(ValueError, match="no checkpoint"):
        run_eval(str(run))
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    with pytest.raises(ValueError, match="built-in model knows only the built-in task"):
        run_eval(str(run), data=str(tmp_path / "any.jsonl"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="is a model folder, not a run"):
        run_eval(str(model))
    with pytest.raises(ValueError, match="n must be"):
        run_eval(str(model), n=-1)


STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short built-in run (in-process vLLM, reporting to TensorBoard), then `vcpo eval` on its folder, and on a
    copy of its last checkpoint as a plain model folder with the held-out problems as a data file."""
    pytest.importorskip("vllm")
    pytest.importorskip("tensorboard")
    from vcpo.trainer.config import make_config
    from vcpo.trainer.task import run_problems

    root = tmp_path_factory.mktemp("eval")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    folder = root / "run"

    def vcpo(*commands):
        """`vcpo` commands, one after the other in one process (vLLM is imported once)."""
        code = "from vcpo.trainer.cli import main\nfor args in %r:\n    assert main(args) == 0, args\n" % (
            [list(map(str, c)) for c in commands],)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    vcpo(["train", "--engine", "inprocess", "--steps", STEPS, "--prompts-per-step", 4, "--responses-per-prompt", 4,
          "--eval-size", 32, "--eval-every", 2, "--checkpoint-every", 2, "--warm-start-steps", 220,
          "--report-to", "tensorboard", "--no-progress", "--output-dir", folder])
    # the built-in prompts are [BOS] + the text: written with the BOS, a data file's prompts tokenize the same
    held = run_problems(make_config(eval_size=32), print, make_model=False).eval
    data = root / "heldout32.jsonl"
    data.write_text("".join(json.dumps({"question": "<s>" + p.prompt, "sum": p.answer}) + "\n" for p in held))
    shutil.copytree(folder / "checkpoints" / f"step-{STEPS:06d}", root / "model",
                    ignore=shutil.ignore_patterns("*.pt", "eval-*"))
    vcpo(["eval", "--model", folder, "--n", 4],
         ["eval", "--model", root / "model", "--data", data, "--prompt-field", "question", "--answer-field", "sum",
          "--max-new-tokens", 8, "--n", 0])
    return folder


@pytest.mark.slow
def test_vcpo_eval_matches_the_trainers_final_evaluation(trained):
    final = json.load(open(trained / "summary.json"))["final_eval"]
    assert final["version"] == STEPS
    result = json.load(open(trained / "checkpoints" / f"step-{STEPS:06d}" / "eval-heldout.json"))
    assert result["step"] == STEPS and result["prompts"] == 32
    # the same weights, prompts and greedy decoding: the same answers
    assert result["greedy"]["accuracy"] == pytest.approx(final["accuracy"], abs=1e-12)
    assert result["greedy"]["reward"] == pytest.approx(final["reward"], abs=1e-12)
    assert result["greedy"]["accuracy"] > 0  # a match of zeros would prove little
    s = result["sampled"]
    assert s["n"] == 4 and 0 <= s["pass@1"] <= s["pass@2"] <= s["pass@4"] <= 1
    assert s["pass@1"] == pytest.approx(s["mean@4"])  # exact match scores 0 or 1: mean reward = pass@1


@pytest.mark.slow
def test_vcpo_eval_on_a_model_folder_and_a_data_file(trained):
    """The same checkpoint as a plain model folder, on the held-out problems as a data file: the same accuracy."""
    of_run = json.load(open(trained / "checkpoints" / f"step-{STEPS:06d}" / "eval-heldout.json"))
    result = json.load(open(trained.parent / "model" / "eval-heldout32.json"))
    assert result["step"] is None and result["data"].endswith("heldout32.jsonl") and result["prompts"] == 32
    assert "sampled" not in result  # --n 0
    assert result["greedy"] == of_run["greedy"]


@pytest.mark.slow
def test_the_run_reported_its_metrics_to_tensorboard(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(trained / "tensorboard"))
    acc.Reload()
    rows = [json.loads(line) for line in open(trained / "metrics.jsonl")]
    for tag in ("reward", "ess_ratio", "grad_norm", "lag"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[tag] for r in rows], rel=1e-6, abs=1e-7)
    final = json.load(open(trained / "summary.json"))["final_eval"]
    last = acc.Scalars("eval_accuracy")[-1]
    assert last.step == STEPS and last.value == pytest.approx(final["accuracy"], rel=1e-6)
