"""Wall-clock time to a held-out accuracy: synchronous GRPO and VCPO (k = 0) against VCPO at
k = 4 (the main job) and k = 16, in the main job's default mode and placement (k only bounds the lag, the engine
generates ahead on its own core, so asynchrony buys speed), several seeds, the main job's 1500 steps.

    .venv/bin/python bench/time_to_accuracy.py --out runs/wallclock --seeds 0,1,2,3,4      # at a constant lr
    .venv/bin/python bench/time_to_accuracy.py --cells vcpo-cosine:4,grpo-cosine:0 ...     # the default cosine lr
    .venv/bin/python bench/time_to_accuracy.py --cells vcpo:4 --seeds 5      # one more run of one cell
    .venv/bin/python bench/time_to_accuracy.py --report-only                  # the tables in bench/RESULTS.md

The runs go through bench/staleness_sweep.py's runner: one at a time, seed by seed, each leaving its summary in
bench/results/wallclock/ (the per-step wall clock included), so the study resumes and grows across sessions. The
machine must be otherwise idle while they run: their wall clock is the measurement.

The threshold was fixed before any run: the mean of THRESHOLD_EVALS consecutive held-out evaluations (each greedy on
the 128 held-out prompts, one every 20 versions) at or above THRESHOLD. The time to it is the wall clock, from the
first step's start, at the end of the step that made the last of those versions; a run that never gets there counts
as not reached, never as its run time. The report also has, per cell, the spread of the final accuracy and of the
late evaluations within a run against one evaluation's binomial noise, and the worst fall of the training reward
in the second half of a run (does the policy itself oscillate late in a run, and in which cells).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from types import SimpleNamespace
from typing import Optional

from staleness_sweep import RULES, Run, mean_ci, read_summary, sweep

THRESHOLD = 0.35
THRESHOLD_EVALS = 3
CELLS = ["vcpo:4", "grpo:0", "vcpo:0", "vcpo:16"]  # per seed, the main job first
# the synchronous cells every other cell of the same lr schedule (a "-cosine" rule or not) is measured against
REFERENCES = ("grpo:0", "vcpo:0", "grpo-cosine:0")
SUMMARIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "wallclock")
LATE_PART = 3  # the late evaluations: those of the last third of the versions
FALL_WINDOW = 50  # steps in the training reward's trailing mean for its falls


def cell_run(cell: str, seed: int) -> Run:
    rule, k = cell.split(":")
    return Run(rule, int(k), seed)


def evaluations(summary: dict) -> list[tuple[int, float]]:
    """(version, accuracy) of the run's held-out evaluations, one per version, in version order (the final
    evaluation repeats the last version when it falls on the evaluation schedule)."""
    seen: dict[int, float] = {}
    for version, _, accuracy in summary["evals"]:
        seen.setdefault(version, accuracy)
    return sorted(seen.items())


def time_to(summary: dict, threshold: float = THRESHOLD, n: int = THRESHOLD_EVALS) -> Optional[tuple[int, float]]:
    """(version, wall seconds) when the mean of `n` consecutive evaluations first reached `threshold`: the last
    of those versions and the wall clock at the end of the step that made it (0 for version 0). None: never."""
    evals = evaluations(summary)
    for i in range(n - 1, len(evals)):
        if statistics.fmean(a for _, a in evals[i - n + 1:i + 1]) >= threshold:
            version = evals[i][0]
            return version, 0.0 if version == 0 else summary["wall"][version - 1]
    return None


def late_spread(summary: dict) -> float:
    """Standard deviation of the evaluations of the last third of the versions (NaN for fewer than 2)."""
    evals = evaluations(summary)
    late = [a for v, a in evals if v >= summary["steps"] - summary["steps"] // LATE_PART]
    return statistics.stdev(late) if len(late) > 1 else math.nan


def reward_fall(summary: dict, window: int = FALL_WINDOW) -> float:
    """The largest fall of the trailing-`window` mean training reward from its best so far, over the second half of
    the run: how far the policy itself slides back (the training reward averages window x batch samples, so it is
    far less noisy than one evaluation)."""
    rewards = summary["rewards"]
    smooth = [statistics.fmean(rewards[max(0, t - window + 1):t + 1]) for t in range(len(rewards))]
    best, fall = -math.inf, 0.0
    for t, value in enumerate(smooth):
        best = max(best, value)
        if t >= len(smooth) // 2:
            fall = max(fall, best - value)
    return fall


def cells_table(summaries: dict[Run, dict], cells: list[str], threshold: float = THRESHOLD) -> list[dict]:
    rows = []
    for cell in cells:
        ds = [d for run, d in sorted(summaries.items(), key=lambda x: x[0].seed) if cell_run(cell, run.seed) == run]
        if not ds:
            continue
        reached = [t for d in ds if (t := time_to(d, threshold)) is not None]
        accuracy = mean_ci([d["final_accuracy"] for d in ds])
        p = accuracy[0]
        rows.append({
            "cell": cell, "seeds": [d["seed"] for d in ds], "reached": len(reached),
            "seconds": mean_ci([t[1] for t in reached]), "seconds_median": statistics.median(t[1] for t in reached)
            if reached else math.nan, "versions": mean_ci([t[0] for t in reached]),
            "final_accuracy": accuracy, "reward_last10": mean_ci([d["reward_last10"] for d in ds]),
            "late_spread": statistics.fmean(late_spread(d) for d in ds),
            "reward_fall": mean_ci([reward_fall(d) for d in ds]),
            "eval_noise": math.sqrt(p * (1 - p) / ds[0]["eval_size"]) if 0 <= p <= 1 else math.nan,
            "collapses": sum(d["collapsed_at"] is not None for d in ds),
            "mean_lag": statistics.fmean(d["mean_lag"] for d in ds),
            "run_seconds": mean_ci([d["wall_s"] for d in ds]),
            "commits": sorted({d["commit"] for d in ds})})
    return rows


def speedups(summaries: dict[Run, dict], cells: list[str], threshold: float = THRESHOLD) -> list[dict]:
    """Per reference cell and other cell, seed by seed: the reference's time to the threshold over the cell's.
    The geometric mean of the ratios where both reached it, with its 95% interval (a t interval of the log
    ratios); the seeds where only one of the two reached it are listed apart."""
    rows = []
    def cosine(cell: str) -> bool:
        return cell.partition(":")[0].endswith("-cosine")

    for ref in REFERENCES:
        for cell in cells:
            if cell == ref or cosine(cell) != cosine(ref):
                continue
            logs, only_ref, only_cell, neither = [], [], [], []
            for run, d in sorted(summaries.items(), key=lambda x: x[0].seed):
                if run != cell_run(cell, run.seed) or cell_run(ref, run.seed) not in summaries:
                    continue
                t_cell, t_ref = time_to(d, threshold), time_to(summaries[cell_run(ref, run.seed)], threshold)
                if t_cell and t_ref:
                    logs.append(math.log(t_ref[1] / t_cell[1]))
                else:
                    (only_ref if t_ref else only_cell if t_cell else neither).append(run.seed)
            if logs or only_ref or only_cell or neither:
                mean, _, half = mean_ci(logs)
                rows.append({"reference": ref, "cell": cell, "paired": len(logs), "speedup": math.exp(mean),
                             "low": math.exp(mean - half) if not math.isnan(half) else math.nan,
                             "high": math.exp(mean + half) if not math.isnan(half) else math.nan,
                             "faster": sum(x > 0 for x in logs), "only_reference_reached": only_ref,
                             "only_cell_reached": only_cell, "neither_reached": neither})
    return rows


def _pm(cell: tuple[float, float, float], digits: int = 3) -> str:
    mean, _, half = cell
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} +- {half:.{digits}f}"


def markdown(table: list[dict], pairs: list[dict], threshold: float = THRESHOLD) -> str:
    lines = [f"| cell (rule:k) | seeds | reached {threshold} | seconds to it (mean +- 95% CI; median) | versions to it | "
             "final acc (mean +- 95% CI) | late evals' sd (one eval's noise) | reward last 10% | worst reward fall "
             "| collapses | mean lag | run seconds |", "|" + "---|" * 12]
    for r in table:
        median = "" if math.isnan(r["seconds_median"]) else f"; {r['seconds_median']:.0f}"
        lines.append(f"| {r['cell']} | {len(r['seeds'])} | {r['reached']} of {len(r['seeds'])} | "
                     f"{_pm(r['seconds'], 0)}{median} | {_pm(r['versions'], 0)} | "
                     f"{_pm(r['final_accuracy'])} | {r['late_spread']:.3f} ({r['eval_noise']:.3f}) | "
                     f"{_pm(r['reward_last10'])} | {_pm(r['reward_fall'])} | {r['collapses']} | {r['mean_lag']:.1f} | {_pm(r['run_seconds'], 0)} |")
    if pairs:
        lines += ["", "Speed-up to the threshold, paired by seed (the reference's time over the cell's; geometric mean "
                  "and 95% interval over the seeds where both reached it):", "",
                  "| reference | cell | seeds paired | speed-up (95% CI) | cell faster on | only the reference reached "
                  "| only the cell reached | neither |", "|" + "---|" * 8]
        for p in pairs:
            interval = "" if math.isnan(p["low"]) else f" ({p['low']:.2f}-{p['high']:.2f})"
            speedup = f"{p['speedup']:.2f}x{interval}" if p["paired"] else "-"
            lines.append(f"| {p['reference']} | {p['cell']} | {p['paired']} | {speedup} | {p['faster']} of "
                         f"{p['paired']} | {p['only_reference_reached'] or '-'} | {p['only_cell_reached'] or '-'} | "
                         f"{p['neither_reached'] or '-'} |")
    return "\n".join(lines) + "\n"


def figure(summaries: dict[Run, dict], cells: list[str], path: str, threshold: float = THRESHOLD) -> None:
    """Held-out accuracy (the mean of THRESHOLD_EVALS consecutive evaluations) against the wall clock, one thin
    line per run, one colour per cell, the threshold dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, cell in enumerate(cells):
        for run, d in summaries.items():
            if run != cell_run(cell, run.seed):
                continue
            evals = evaluations(d)
            points = [(0.0 if evals[j][0] == 0 else d["wall"][evals[j][0] - 1],
                       statistics.fmean(a for _, a in evals[j - THRESHOLD_EVALS + 1:j + 1]))
                      for j in range(THRESHOLD_EVALS - 1, len(evals))]
            ax.plot([p[0] / 60 for p in points], [p[1] for p in points], color=f"C{i}", lw=0.8, alpha=0.8,
                    label=cell if run.seed == min(r.seed for r in summaries if r == cell_run(cell, r.seed)) else None)
    ax.axhline(threshold, color="k", ls="--", lw=0.8)
    ax.set_xlabel("wall clock (minutes from the first step)")
    ax.set_ylabel(f"held-out accuracy (mean of {THRESHOLD_EVALS} evaluations)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    def cell_list(text: str) -> list[str]:
        cells = [c.strip() for c in text.split(",") if c.strip()]
        for cell in cells:
            rule, _, k = cell.partition(":")
            if rule not in RULES or not k.isdigit():
                raise argparse.ArgumentTypeError(f"{cell!r} is not rule:k with a rule of {list(RULES)}")
        return cells

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/wallclock", help="one run folder per (rule, k, seed), and the report")
    p.add_argument("--summaries", default=SUMMARIES, help="one JSON summary per finished run (default: %(default)s)")
    p.add_argument("--cells", type=cell_list, default=CELLS, help="rule:k pairs (default: %(default)s)")
    p.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",") if v.strip()], default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=1500, help="the main job's")
    p.add_argument("--lr", type=float, default=3e-4, help="the main job's")
    p.add_argument("--report-only", action="store_true", help="write the report of the finished runs, run nothing")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help="another accuracy to report the time to (default: %(default)s, the one fixed before any run)")
    p.add_argument("train_args", nargs="*", help="after --: more `vcpo train` settings for every run")
    args = p.parse_args()
    sweep_args = SimpleNamespace(out=args.out, summaries=args.summaries, steps=args.steps, lr=args.lr,
                                 train_args=args.train_args, budget_minutes=None)
    runs = [cell_run(cell, seed) for seed in args.seeds for cell in args.cells]
    if not args.report_only:
        sweep(sweep_args, runs)
    summaries = {run: s for run in runs if (s := read_summary(sweep_args, run)) is not None}
    if not summaries:
        raise SystemExit(f"{args.summaries}: no finished run of these cells and seeds yet")
    table = cells_table(summaries, args.cells, args.threshold)
    pairs = speedups(summaries, args.cells, args.threshold)
    text = markdown(table, pairs, args.threshold)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "time_to_accuracy.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "time_to_accuracy.json"), "w") as f:
        json.dump({"threshold": args.threshold, "threshold_evals": THRESHOLD_EVALS, "cells": table, "speedups": pairs},
                  f, indent=1)
    figure(summaries, args.cells, os.path.join(args.out, "time_to_accuracy.png"), args.threshold)
    commits = sorted({c for row in table for c in row["commits"]})
    print(text + f"\n{len(summaries)} of {len(runs)} runs finished (code: {', '.join(c[:12] for c in commits)}); "
          f"threshold: the mean of {THRESHOLD_EVALS} consecutive held-out evaluations >= {args.threshold}. Written to "
          f"{args.out}/")


if __name__ == "__main__":
    main()
