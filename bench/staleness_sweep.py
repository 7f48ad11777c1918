"""The staleness sweep: the built-in task under each update rule at each bound k on the staleness, several seeds,
plus the control a sceptic asks for first (each non-VCPO rule at VCPO's median effective learning rate).

    .venv/bin/python bench/staleness_sweep.py --out runs/sweep --rules vcpo,seq-tis,grpo --ks 0,16,64 \
        --seeds 0,1,2 --control-ks 64 --steps 400 --budget-minutes 85      # the sweep in bench/RESULTS.md
    .venv/bin/python bench/staleness_sweep.py --out runs/sweep --budget-minutes 600   # the whole default grid
    .venv/bin/python bench/staleness_sweep.py --out runs/sweep --report-only
    .venv/bin/python bench/staleness_sweep.py --out runs/sweep-exact ... -- --exact-staleness   # every rule at lag k
    .venv/bin/python bench/staleness_sweep.py --rules vcpo,vcpo-opob-truncated,vcpo-opob-median ...  # OPOB variants
    .venv/bin/python bench/staleness_sweep.py --rules vcpo,vcpo-ess-corrected,vcpo-c4 --ks 16 ...  # ablations
    .venv/bin/python bench/staleness_sweep.py --out runs/sweep5 --rules vcpo,seq-tis,grpo,vcpo-no-opob \
        --ks 0,4,16,64 --seeds 0,1,2,3,4 --control-ks 4,16,64 --steps 400 -- --exact-staleness   # bench/results/sweep

Without `--exact-staleness` k only bounds the lag: a rule with a slower step (VCPO's exact norms) lets the engine
run further ahead, so it trains on older samples than the others at the same k (the table's mean lag says how old).

Runs go one at a time (`vcpo train`, the main job's engine and core placement), seed by seed, so a cut-short
sweep has whole tables for its first seeds. Each finished run leaves its summary in the summaries folder
(`--summaries`, default bench/results/sweep/, one JSON file per run, committed to the repository: the facts the
report needs, its curves and the commit that ran it), so a sweep outlives its run folders and grows across days
and machines: a run with a summary is skipped, an unfinished one is resumed from its folder. Before each run the
budget is checked against the median duration of the runs done so far. A run that would repeat a finished one step
for step (k = 0 under `--exact-staleness`, rules that differ only in their ESS-scaled step: `step_rule_twin`) is not
run again:
its summary is that run's, naming it in `same_run_as`. The report (OUT/sweep.md, OUT/sweep.json,
OUT/curves.png, OUT/accuracy.png) is written from the summaries alone. Definitions (collapse, the ESS lead time)
are in `collapse_step` and `ess_lead`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from vcpo.trainer.plot import read_metrics, rolling_mean
from vcpo.trainer.run_folder import committed_checkpoints

# The square-root lr rule, pinned in every ESS-scaled rule that names no other: a rule's name is one computation
# whatever `vcpo train`'s default lr rule is (its summaries from before a change of the default stay comparable).
SQRT = ["--lr-rule", "sqrt"]
# rule name -> `vcpo train` arguments; the loss presets are vcpo.trainer.config.LOSS_PRESETS
RULES = {
    "vcpo": ["--loss", "vcpo", *SQRT],
    "vcpo-no-ess": ["--loss", "vcpo", "--no-ess-scaling"],
    "vcpo-no-opob": ["--loss", "vcpo", "--no-opob", *SQRT],
    "seq-tis": ["--loss", "seq-tis"],
    "grpo": ["--loss", "grpo"],
    "token-tis": ["--loss", "token-tis"],
    "mis": ["--loss", "mis"],
    "ppo": ["--loss", "ppo"],
}
# VCPO with another OPOB weight or aggregation (VCPOConfig's options): measured on request, not in the default grid
OPOB_VARIANTS = {
    "vcpo-opob-truncated": ["--loss", "vcpo", "--opob-truncated-weights", "true", *SQRT],
    "vcpo-opob-median": ["--loss", "vcpo", "--opob-aggregation", "median", *SQRT],
    "vcpo-loo": ["--loss", "vcpo", "--opob-leave-one-out", "true", *SQRT],  # each sequence's baseline without itself
}
# VCPO with one part of its lr rule or its truncation changed (the k = 16 ablation in bench/RESULTS.md): on request
ABLATIONS = {
    "vcpo-ess-corrected": ["--loss", "vcpo", "--ess-on-corrected", "true", *SQRT],  # the ESS of the truncated weights
    "vcpo-ess-base-0.5": ["--loss", "vcpo", "--ess-base-ratio", "0.5", *SQRT],  # full lr down to an ESS ratio of 0.5
    "vcpo-lr-linear": ["--loss", "vcpo", "--lr-rule", "linear"],
    "vcpo-c4": ["--loss", "vcpo", "--is-threshold", "4", *SQRT],  # truncation at C = 4 instead of 8
    "vcpo-lr-ema-0.9": ["--loss", "vcpo", "--lr-scale-ema", "0.9", *SQRT],  # the lr scale averaged over about 20 steps
    "ppo-ess": ["--loss", "ppo", "--ess-scaling", *SQRT],  # PPO's clipped loss with VCPO's ESS-scaled step
    # the linear lr rule (the scale is the ESS ratio, not its square root) beside each variant: the protocol's grid
    "vcpo-loo-linear": ["--loss", "vcpo", "--opob-leave-one-out", "true", "--lr-rule", "linear"],
    "vcpo-no-opob-linear": ["--loss", "vcpo", "--no-opob", "--lr-rule", "linear"],
    "ppo-ess-linear": ["--loss", "ppo", "--ess-scaling", "--lr-rule", "linear"],
}
# The peers' stabilisers (vcpo train's presets), alone and with VCPO's ESS-scaled step under the linear rule (a
# user's --ess-scaling since the default became linear): on request
PEERS = ("gspo", "gmpo", "cispo", "dppo", "sapo", "icepop", "m2po")
ESS_TWIN = "-ess"  # suffix of a peer's rule with VCPO's ESS-scaled step: the report pairs it with the rule alone
PEER_RULES = {**{rule: ["--loss", rule] for rule in PEERS},
              **{rule + ESS_TWIN: ["--loss", rule, "--ess-scaling", "--lr-rule", "linear"] for rule in PEERS}}
# The rules above at a constant lr, the only schedule before 0eb50e8 (every summary of rule r at an older commit ran at
# a constant lr); these with the lr decayed over the run, `vcpo train`'s default since
# (bench/RESULTS.md, "The main job with a decaying lr").
SCHEDULES = {
    "vcpo-cosine": ["--loss", "vcpo", *SQRT, "--lr-schedule", "cosine"],  # cosine from lr to 0.1 x lr at the last step
    "grpo-cosine": ["--loss", "grpo", "--lr-schedule", "cosine"],
    "vcpo-no-opob-cosine": ["--loss", "vcpo", "--no-opob", *SQRT, "--lr-schedule", "cosine"],
    "vcpo-lr-linear-cosine": ["--loss", "vcpo", "--lr-rule", "linear", "--lr-schedule", "cosine"],
}
GRID = list(RULES)
RULES.update(OPOB_VARIANTS)
RULES.update(ABLATIONS)
RULES.update(PEER_RULES)
RULES = {name: [*argv, "--lr-schedule", "constant"] for name, argv in RULES.items()}
RULES.update(SCHEDULES)
CONTROL = "@vcpo-lr"  # suffix of a control run: the rule at lr x VCPO's median lr scale (same k, same seed)
# vcpo-no-ess at VCPO's lr: OPOB at a constant lr, the cell that splits the k = 16 gap between OPOB and the lr's moves
CONTROLLED = ("seq-tis", "grpo", "token-tis", "mis", "ppo", "vcpo-no-ess")
SUMMARIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sweep")


@dataclass(frozen=True)
class Run:
    rule: str  # a RULES key, or a CONTROLLED key + CONTROL
    k: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.rule}-k{self.k}-s{self.seed}"

    @property
    def base_rule(self) -> str:
        return self.rule.removesuffix(CONTROL)


def plan(rules: list[str], ks: list[int], seeds: list[int], control_ks: list[int],
         controls_only: bool = False) -> list[Run]:
    """Seed by seed, k by k: VCPO first (a control needs its lr scale), then the other rules (not with
    `controls_only`), then the controls (at the k in `control_ks` only)."""
    ordered = ["vcpo"] + [r for r in rules if r != "vcpo" and not controls_only]
    runs = []
    for seed in seeds:
        for k in ks:
            runs += [Run(r, k, seed) for r in ordered]
            if k in control_ks:
                runs += [Run(r + CONTROL, k, seed) for r in rules if r in CONTROLLED]
    return runs


# -- the curves' facts ------------------------------------------------------------------------------------------
def collapse_window(steps: int) -> int:
    """The trailing window of the collapse test: 100 steps, or a tenth of a shorter run (at least 10)."""
    return min(100, max(10, steps // 10))


def collapse_step(rewards: list[float], window: int, fraction: float = 0.5, min_best: float = 0.05) -> Optional[int]:
    """A run collapsed at step t (1-based) when its trailing-`window` mean reward, having reached a best of at least
    `min_best`, falls below `fraction` x that best at t and stays below to the end of the run. None: no collapse."""
    smooth = rolling_mean(rewards, window)
    if not smooth:
        return None
    best_at = max(range(len(smooth)), key=smooth.__getitem__)
    best = smooth[best_at]
    if best < min_best:
        return None
    t = len(smooth)
    while t > best_at + 1 and smooth[t - 1] < fraction * best:
        t -= 1
    return t + 1 if t < len(smooth) else None


def ess_lead(ess: list[float], collapse: Optional[int], window: int, level: float = 0.5) -> Optional[int]:
    """Steps between the ESS ratio falling and a collapse at step `collapse`: with the trailing-`window` mean ESS
    ratio below `level` at the collapse step, the length of the stretch of steps before it that stayed below.
    None when there is no collapse or the ESS ratio was not below `level` when it came."""
    if collapse is None:
        return None
    smooth = rolling_mean(ess, window)
    t = collapse - 1
    if smooth[t] >= level:
        return None
    start = t
    while start > 0 and smooth[start - 1] < level:
        start -= 1
    return t - start


def autocorrelation(values: list[float], lag: int) -> float:
    """The lag-`lag` autocorrelation of a series about its mean (NaN when it is constant or too short)."""
    n = len(values)
    if lag < 1 or n <= lag:
        return math.nan
    mean = statistics.fmean(values)
    dev = [v - mean for v in values]
    var = sum(d * d for d in dev)
    return sum(dev[t] * dev[t + lag] for t in range(n - lag)) / var if var > 0 else math.nan


def lr_scale_variation(summary: dict) -> tuple[float, float, float]:
    """How the lr scale moves from step to step once the lag has reached k: its standard deviation, its lag-1
    autocorrelation (near 0: batch-to-batch noise; near 1: slow drifts) and its autocorrelation at lag k (negative
    when the ESS, which sees the last k steps' moves, pushes the lr back k steps later: a delayed-feedback swing)."""
    scale = summary["lr_scale"][summary["k"]:]
    if len(scale) < 2 or len(set(scale)) == 1:
        return 0.0, math.nan, math.nan
    return statistics.stdev(scale), autocorrelation(scale, 1), autocorrelation(scale, summary["k"])


# Student's t quantiles t(0.975, df) for df = 1..30 (beyond, the normal 1.96): the half-width of a 95% interval of
# a mean of n values is t(0.975, n - 1) x std / sqrt(n).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean, standard deviation and the half-width of the 95% interval of the mean (NaN for fewer than 2 values)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], math.nan, math.nan
    std = statistics.stdev(values)
    t = T975[len(values) - 2] if len(values) - 1 <= len(T975) else 1.96
    return statistics.fmean(values), std, t * std / math.sqrt(len(values))


# -- one run ------------------------------------------------------------------------------------------------------
def code_commit() -> str:
    """The commit of the code that runs the sweep, with "-dirty" when its Python or C++ sources differ from it."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", repo, *argv], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "vcpo", "vcpo_kernels", "csrc", "setup.py")
    return head + ("-dirty" if changed else "")


def machine() -> str:
    """What a run's numerics depend on beyond the code and the seed: the CPU, its core count and the vector
    instructions torch's CPU kernels use. A seed fixes an exact-staleness run on one machine only: the same commit
    and seed took another path on another machine (bench/RESULTS.md, "The k = 16 gap on one machine")."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


def summary_path(args, run: Run) -> str:
    return os.path.join(args.summaries, run.name + ".json")


def read_summary(args, run: Run) -> Optional[dict]:
    """The run's summary in the summaries folder, if it was run with these settings; a summary of the same run
    with other settings is an error (a sweep with other settings needs its own folder)."""
    path = summary_path(args, run)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    if summary["steps"] != args.steps or summary["train_args"] != args.train_args or summary["base_lr"] != args.lr:
        raise SystemExit(f"{path} is {run.name} with other settings (steps {summary['steps']}, train args "
                         f"{summary['train_args']}, lr {summary['base_lr']}) than this sweep's (steps {args.steps}, "
                         f"train args {args.train_args}, lr {args.lr}): pass another --summaries folder")
    return summary


def finished(folder: str, steps: int) -> bool:
    path = os.path.join(folder, "summary.json")
    if not os.path.isfile(path):
        return False
    summary = json.load(open(path))
    return not summary["interrupted"] and summary["steps"] >= steps


def summarize(folder: str, run: Run, args, commit: str) -> dict:
    """The facts of a finished run that the report needs, its curves (per step: reward, ESS ratio, lr scale, wall
    seconds at its end; the held-out evaluations as [version, wall seconds when logged, accuracy]) and what ran it."""
    rows = read_metrics(folder)
    summary = json.load(open(os.path.join(folder, "summary.json")))
    config = json.load(open(os.path.join(folder, "config.json")))
    window = collapse_window(args.steps)
    rewards, ess = [r["reward"] for r in rows], [r["ess_ratio"] for r in rows]
    collapse = collapse_step(rewards, window)
    tail = rows[-max(1, len(rows) // 10):]
    final = summary["final_eval"] or {}
    evals = [[r["eval_version"], r["wall_seconds"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r]
    if final:
        evals.append([final["version"], summary["wall_seconds"], final["accuracy"]])
    return {"rule": run.rule, "k": run.k, "seed": run.seed, "steps": summary["steps"],
            "final_accuracy": final.get("accuracy", math.nan), "eval_size": config["settings"]["eval_size"],
            "reward_last10": statistics.fmean(r["reward"] for r in tail),  # the mean over the last 10% of the steps
            "collapsed_at": collapse, "ess_lead": ess_lead(ess, collapse, window),
            "ess_median": statistics.median(ess), "lr_scale_median": statistics.median(r["lr_scale"] for r in rows),
            "mean_lag": statistics.fmean(r["lag"] for r in rows), "lr": config["lr"], "base_lr": args.lr,
            "wall_s": summary["wall_seconds"], "commit": commit, "machine": machine(), "train_args": args.train_args,
            "evals": evals, "rewards": [round(v, 5) for v in rewards], "ess": [round(v, 5) for v in ess],
            "lr_scale": [round(r["lr_scale"], 5) for r in rows], "wall": [round(r["wall_seconds"], 2) for r in rows]}


def write_summary(args, run: Run, summary: dict) -> None:
    os.makedirs(args.summaries, exist_ok=True)
    path = summary_path(args, run)
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=0)
    os.replace(path + ".tmp", path)


def without_step_rule(argv: list[str]) -> list[str]:
    """The arguments but those of the ESS-scaled step: its switch and its lr rule."""
    argv = [a for a in argv if a not in ("--ess-scaling", "--no-ess-scaling")]
    i = argv.index("--lr-rule") if "--lr-rule" in argv else len(argv)
    return argv[:i] + argv[i + 2:]


def step_rule_twin(args, run: Run) -> Optional[dict]:
    """The summary of a finished run that this run would repeat step for step, if there is one: the same k and seed,
    a rule that differs from this run's only in its ESS-scaled step (on or off, its lr rule), and an ESS ratio of 1
    at every step. At k = 0 under `--exact-staleness` the samples are the trainer's own policy's, so the ESS ratio is
    1, every lr rule gives a scale of 1 and the ESS-scaled step is the plain one (the 3e-4 sweep's k = 0 runs of vcpo
    and vcpo-lr-linear matched step for step)."""
    if run.k != 0 or "--exact-staleness" not in args.train_args or run.rule.endswith(CONTROL):
        return None
    mine = without_step_rule(RULES[run.rule])
    for rule in RULES:
        if rule != run.rule and without_step_rule(RULES[rule]) == mine:
            summary = read_summary(args, Run(rule, run.k, run.seed))
            if summary is not None and "same_run_as" not in summary and set(summary["ess"]) == {1.0}:
                return summary
    return None


def control_lr(args, run: Run) -> float:
    """lr x the median lr scale of the VCPO run at the same k and seed (which ran before)."""
    vcpo = Run("vcpo", run.k, run.seed)
    summary = read_summary(args, vcpo)
    if summary is None:
        raise RuntimeError(f"{run.name} needs the finished VCPO run {vcpo.name} ({summary_path(args, vcpo)}) for its "
                           f"learning rate")
    return args.lr * summary["lr_scale_median"]


def train_args(run: Run, args) -> list[str]:
    folder = os.path.join(args.out, run.name)
    if committed_checkpoints(folder):  # started before: continue it
        return ["--resume", folder, "--no-progress"]
    if os.path.isdir(folder):  # stopped before its first checkpoint: nothing to resume (one sweep per --out folder)
        shutil.rmtree(folder)
    lr = control_lr(args, run) if run.rule.endswith(CONTROL) else args.lr
    return [*RULES[run.base_rule], "--max-staleness", str(run.k), "--seed", str(run.seed), "--steps",
            str(args.steps), "--lr", repr(lr), "--output-dir", folder, "--no-progress", *args.train_args]


def sweep(args, runs: list[Run]) -> None:
    """Runs `runs` in order, one at a time, each left with its summary (see the module's doc)."""
    os.makedirs(args.out, exist_ok=True)
    commit = code_commit()
    t0, durations = time.monotonic(), []
    for i, run in enumerate(runs, 1):
        folder = os.path.join(args.out, run.name)
        if read_summary(args, run) is not None:
            continue
        if finished(folder, args.steps):  # finished, but stopped before its summary was written
            write_summary(args, run, summarize(folder, run, args, commit))
            continue
        twin = step_rule_twin(args, run)
        if twin is not None:
            same = Run(twin["rule"], run.k, run.seed).name
            write_summary(args, run, {**twin, "rule": run.rule, "same_run_as": same})
            print(f"[{i}/{len(runs)}] {run.name}: the same run as {same} (an ESS ratio of 1 at every step)", flush=True)
            continue
        spent = (time.monotonic() - t0) / 60
        expected = statistics.median(durations) / 60 if durations else 0.0
        if args.budget_minutes is not None and spent + expected > args.budget_minutes:
            print(f"budget: {spent:.0f} of {args.budget_minutes:.0f} min spent, a run takes about {expected:.0f} min:"
                  f" stopping before {run.name} ({len(runs) - i + 1} runs left)", flush=True)
            break
        print(f"[{i}/{len(runs)}] {run.name} ...", flush=True)
        started = time.monotonic()
        log_path = os.path.join(args.out, run.name + ".log")
        with open(log_path, "a") as log:
            code = subprocess.call([sys.executable, "-m", "vcpo.trainer.cli", "train", *train_args(run, args)],
                                   stdout=log, stderr=subprocess.STDOUT)
        durations.append(time.monotonic() - started)
        if code != 0:
            raise SystemExit(f"{run.name} failed (exit {code}); its log: {log_path}")
        summary = summarize(folder, run, args, commit)
        write_summary(args, run, summary)
        print(f"[{i}/{len(runs)}] {run.name}: {durations[-1]:.0f} s, reward over the last 10% "
              f"{summary['reward_last10']:.3f}, final accuracy {summary['final_accuracy']:.3f}", flush=True)


# -- the report ---------------------------------------------------------------------------------------------------
def aggregate(summaries: dict[Run, dict]) -> list[dict]:
    """One row per (rule, k) over its seeds."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for run, d in summaries.items():
        cells.setdefault((run.rule, run.k), []).append(d)
    table = []
    for (rule, k), ds in sorted(cells.items(), key=lambda c: (c[0][1], c[0][0])):
        acc = mean_ci([d["final_accuracy"] for d in ds])
        p = acc[0]
        collapsed = [d for d in ds if d["collapsed_at"] is not None]
        table.append({
            "rule": rule, "k": k, "seeds": len(ds), "final_accuracy": acc,
            # the binomial standard error of one evaluation on eval_size prompts, at the mean accuracy
            "eval_noise": math.sqrt(p * (1 - p) / ds[0]["eval_size"]) if 0 <= p <= 1 else math.nan,
            "reward_last10": mean_ci([d["reward_last10"] for d in ds]),
            "collapses": len(collapsed), "collapse_steps": [d["collapsed_at"] for d in collapsed],
            "ess_leads": [d["ess_lead"] for d in collapsed],
            "ess_median": statistics.median(d["ess_median"] for d in ds),
            "lr_scale_median": statistics.median(d["lr_scale_median"] for d in ds),
            # the seeds' mean of each of (sd, lag-1 autocorrelation, lag-k autocorrelation) of the lr scale
            "lr_scale_variation": [statistics.fmean(v) for v in zip(*(lr_scale_variation(d) for d in ds))],
            "lr": statistics.median(d["lr"] for d in ds),
            "mean_lag": statistics.fmean(d["mean_lag"] for d in ds),
            "wall_s": statistics.fmean(d["wall_s"] for d in ds),
            "commits": sorted({d["commit"] for d in ds})})
    return table


def paired(summaries: dict[Run, dict], key: str = "final_accuracy") -> list[dict]:
    """Seed by seed at the same k (every rule runs on the same seeds), over the seeds both ran: VCPO minus each
    other rule (`reference` "vcpo"), and each peer's rule with the ESS-scaled step minus the rule alone
    (`reference` the twin, e.g. "gspo-ess" minus "gspo": where VCPO's step helps another rule). The mean difference
    of `key` with its 95% interval, and on how many seeds the reference was ahead."""
    rows = []
    for k in sorted({run.k for run in summaries}):
        rules = sorted({run.rule for run in summaries if run.k == k})
        pairs = [("vcpo", rule) for rule in rules if rule != "vcpo"]
        pairs += [(rule, rule.removesuffix(ESS_TWIN)) for rule in rules
                  if rule.endswith(ESS_TWIN) and rule.removesuffix(ESS_TWIN) in rules]
        for reference, rule in pairs:
            diffs = [summaries[Run(reference, k, run.seed)][key] - d[key] for run, d in summaries.items()
                     if run.k == k and run.rule == rule and Run(reference, k, run.seed) in summaries]
            if diffs:
                mean, _, half = mean_ci(diffs)
                rows.append({"k": k, "reference": reference, "rule": rule, "seeds": len(diffs), "diff": mean,
                             "ci95": half, "reference_ahead": sum(d > 0 for d in diffs)})
    return rows


def _pm(cell: tuple[float, float, float]) -> str:
    mean, _, half = cell
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} +- {half:.3f}"


def _variation(cell: list[float]) -> str:
    sd, lag1, lag_k = cell
    return "-" if sd == 0 else f"{sd:.3f} ({lag1:.2f}, {'-' if math.isnan(lag_k) else f'{lag_k:.2f}'})"


def markdown(table: list[dict], pairs: list[dict]) -> str:
    lines = ["| rule | k | seeds | final acc (mean +- 95% CI) | eval noise | reward last 10% (+- 95% CI) | collapses "
             "(step; ESS lead) | ESS ratio med | lr scale med | lr scale sd (autocorr. lag 1, lag k) | lr | mean lag "
             "| wall s |", "|" + "---|" * 13]
    for row in table:
        falls = ", ".join(f"{s}; {'-' if lead is None else lead}"
                          for s, lead in zip(row["collapse_steps"], row["ess_leads"]))
        lines.append(f"| {row['rule']} | {row['k']} | {row['seeds']} | {_pm(row['final_accuracy'])} | "
                     f"{row['eval_noise']:.3f} | {_pm(row['reward_last10'])} | "
                     f"{row['collapses']}{f' ({falls})' if falls else ''} | {row['ess_median']:.3f} | "
                     f"{row['lr_scale_median']:.3f} | {_variation(row['lr_scale_variation'])} | {row['lr']:.2e} | {row['mean_lag']:.1f} | {row['wall_s']:.0f} |")
    if pairs:
        lines += ["", "Paired by seed, the reference (VCPO, or a peer's rule with the ESS-scaled step) minus the rule "
                  "(final held-out accuracy):", "",
                  "| k | reference | rule | seeds | reference - rule (mean +- 95% CI) | seeds with the reference ahead |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {p['k']} | {p['reference']} | {p['rule']} | {p['seeds']} | {_pm((p['diff'], 0.0, p['ci95']))} | "
                  f"{p['reference_ahead']} of {p['seeds']} |" for p in pairs]
    return "\n".join(lines) + "\n"


def figures(summaries: dict[Run, dict], out: str, window: int) -> None:
    """curves.png: the seed-mean trailing reward against step, a panel per k, the ESS ratio below; accuracy.png:
    the final held-out accuracy against k per rule (mean and 95% interval over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({run.k for run in summaries})
    rules = sorted({run.rule for run in summaries})
    fig, axes = plt.subplots(2, len(ks), figsize=(4 * len(ks), 7), squeeze=False, sharey="row")
    for col, k in enumerate(ks):
        for rule in rules:
            ds = [d for run, d in summaries.items() if run.k == k and run.rule == rule]
            if not ds:
                continue
            for row, key in ((0, "rewards"), (1, "ess")):
                n = min(len(d[key]) for d in ds)
                mean = [statistics.fmean(d[key][t] for d in ds) for t in range(n)]
                axes[row][col].plot(range(1, n + 1), rolling_mean(mean, window), label=rule, lw=1,
                                    color=f"C{rules.index(rule)}")  # one colour per rule in every panel
        axes[0][col].set_title(f"k = {k}")
        axes[1][col].set_xlabel("step")
    axes[0][0].set_ylabel(f"reward (trailing {window}-step mean)")
    axes[1][0].set_ylabel("ESS ratio (same smoothing)")
    handles = {}  # every rule once, whichever panels it is in
    for ax in axes[0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(os.path.join(out, "curves.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for rule in rules:
        points = [(k, mean_ci([d["final_accuracy"] for run, d in summaries.items() if run.k == k and run.rule == rule]))
                  for k in ks]
        points = [(k, m, 0.0 if math.isnan(h) else h) for k, (m, _, h) in points if not math.isnan(m)]
        ax.errorbar([p[0] for p in points], [p[1] for p in points], [p[2] for p in points], label=rule, capsize=3,
                    color=f"C{rules.index(rule)}")
    ax.set_xlabel("k (staleness bound)")
    ax.set_ylabel("final held-out accuracy (95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=110)
    plt.close(fig)


def report(args) -> None:
    runs = plan(args.rules, args.ks, args.seeds, args.control_ks)
    summaries = {run: s for run in runs if (s := read_summary(args, run)) is not None}
    if not summaries:
        raise SystemExit(f"{args.summaries}: no finished run of this grid yet")
    table, pairs = aggregate(summaries), paired(summaries)
    text = markdown(table, pairs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"cells": table, "paired": pairs}, f, indent=1)
    figures(summaries, args.out, collapse_window(args.steps))
    commits = sorted({s["commit"] for s in summaries.values()})
    print(text + f"\n{len(summaries)} of {len(runs)} runs finished (code: {', '.join(c[:12] for c in commits)}); "
          f"collapse: the trailing {collapse_window(args.steps)}-step mean reward below half its best (>= 0.05) to "
          f"the end; ESS lead: steps the same mean ESS ratio stayed below 0.5 before the collapse. Written to "
          f"{args.out}/")


def main() -> None:
    def names(text: str) -> list[str]:
        rules = [r.strip() for r in text.split(",") if r.strip()]
        unknown = [r for r in rules if r not in RULES]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown rules {unknown}; known: {list(RULES)}")
        return rules

    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/sweep", help="the sweep's folder: one run folder per (rule, k, seed)")
    p.add_argument("--summaries", default=SUMMARIES,
                   help="one JSON summary per finished run, kept across sweeps (default: bench/results/sweep)")
    p.add_argument("--rules", type=names, default=GRID, help=f"default: {','.join(GRID)}; also: "
                   f"{','.join([*OPOB_VARIANTS, *ABLATIONS, *SCHEDULES])}")
    p.add_argument("--ks", type=ints, default=[0, 4, 16, 32, 64])
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4, help="every rule's learning rate (the controls' base)")
    p.add_argument("--control-ks", type=ints,
                   help="the k at which to run each non-VCPO rule at VCPO's median effective learning rate (default:"
                        " every k > 0; at k = 0 the lr scale is 1 by construction); '' for none")
    p.add_argument("--controls-only", action="store_true",
                   help="of the rules, only their controls (and the VCPO runs the controls need)")
    p.add_argument("--budget-minutes", type=float, help="start no run that would end past this")
    p.add_argument("--report-only", action="store_true", help="write the report of the finished runs, run nothing")
    p.add_argument("train_args", nargs="*", help="after --: more `vcpo train` settings for every run")
    args = p.parse_args()
    if args.control_ks is None:
        args.control_ks = [k for k in args.ks if k > 0]
    if not args.report_only:
        sweep(args, plan(args.rules, args.ks, args.seeds, args.control_ks, args.controls_only))
    report(args)


if __name__ == "__main__":
    main()
