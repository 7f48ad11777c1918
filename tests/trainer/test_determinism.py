"""Determinism (docs/trainer.md, "Determinism"): with `--exact-staleness` a seed fixes the whole run, so two runs of
the same command give the same metrics, bit for bit, at every step (all but the clock's), and the same samples;
another seed gives another run. Without it the two sides meet in a timing-dependent order (not tested: it may or
may not differ on a given try)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # four `vcpo train` runs with a vLLM engine

ARGS = ["--engine", "inprocess", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
        "--eval-every", "3", "--checkpoint-every", "100", "--warm-start-steps", "30", "--no-progress",
        "--max-staleness", "2", "--exact-staleness", "--steps", "8"]


def timing(key: str) -> bool:
    """A metric that says when, not what: the clock's (wall, waiting, generation, sync and training times and
    rates), the engine's count of weight loads (it skips versions published while it was busy) and the held-out
    evaluation, whose result is logged with whichever step comes after it finished (compared by version below)."""
    return "seconds" in key or key.endswith("per_second") or key == "syncs" or key.startswith("eval_")


def evaluations(folder) -> dict:
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl") if line.strip()]
    return {r["eval_version"]: (r["eval_accuracy"], r["eval_reward"]) for r in rows if "eval_version" in r}


def run(folder, seed):
    # a reward that varies from the first step (the briefly warmed-up model rarely adds right): every step moves
    reward = folder.parent / "length_reward.py"
    reward.write_text("def score(response, answer):\n    return len(response) / 10\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(reward.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "vcpo.trainer.cli", "train", *ARGS, "--reward", "length_reward:score",
                           "--seed", str(seed), "--output-dir", str(folder)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = [json.loads(line) for line in open(folder / "metrics.jsonl") if line.strip()]
    rollouts = [json.loads(line) for line in open(folder / "rollouts.jsonl") if line.strip()]
    return [{k: v for k, v in row.items() if not timing(k)} for row in metrics], rollouts


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tmp_path):
    first, again, other = run(tmp_path / "a", 3), run(tmp_path / "b", 3), run(tmp_path / "c", 4)
    metrics, rollouts = first
    assert len(metrics) == 8 and [r["lag"] for r in metrics][2:] == [2] * 6  # exact lag k from step k + 1
    assert all(r["grad_norm"] > 0 for r in metrics)  # every step moved the weights
    assert again == first  # every metric (floats compared exactly) and every sample: ids, versions, rewards
    seen, seen_again = evaluations(tmp_path / "a"), evaluations(tmp_path / "b")
    shared = seen.keys() & seen_again.keys()
    assert shared and all(seen[v] == seen_again[v] for v in shared)
    assert other[0] != metrics and [r["response_ids"] for r in other[1]] != [r["response_ids"] for r in rollouts]
