"""curves.png of a run folder: reward and accuracy against wall clock and against step, ESS ratio, lr scale. The
per-step reward and ESS ratio are noisy: each is drawn thin, under its trailing rolling mean."""

from __future__ import annotations

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def smoothing_window(steps: int) -> int:
    """The rolling mean's width for a run of `steps` steps: about a twentieth of the run, 1 to 100 steps."""
    return max(1, min(100, steps // 20))


def rolling_mean(values: list[float], window: int) -> list[float]:
    """out[i] = the mean of values[max(0, i - window + 1) : i + 1] (the first window - 1 points average what there
    is so far)."""
    if window < 1:
        raise ValueError(f"rolling mean window must be >= 1, got {window}")
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return [(prefix[i + 1] - prefix[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def plot_runs(runs: dict[str, list[dict]], path: str) -> None:
    """One figure comparing runs (label -> metrics rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_wall, ax_step), (ax_ess, ax_lr) = axes
    for label, rows in runs.items():
        if not rows:
            continue
        window = smoothing_window(len(rows))
        steps = [r["step"] for r in rows]
        wall = [r["wall_seconds"] / 60 for r in rows]
        raw_reward = [r["reward"] for r in rows]
        reward = rolling_mean(raw_reward, window)
        mean = f"rolling mean of {window} steps" if window > 1 else "per step"
        line, = ax_wall.plot(wall, reward, label=f"{label} reward (train, {mean})")
        ax_step.plot(steps, raw_reward, color=line.get_color(), lw=0.5, alpha=0.3)
        ax_step.plot(steps, reward, color=line.get_color(), label=f"{label} reward (train, {mean})")
        ev = [r for r in rows if "eval_accuracy" in r]
        if ev:
            ax_wall.plot([r["wall_seconds"] / 60 for r in ev], [r["eval_accuracy"] for r in ev], "o--",
                         color=line.get_color(), ms=3, label=f"{label} accuracy (held-out, greedy)")
            ax_step.plot([r["eval_version"] for r in ev], [r["eval_accuracy"] for r in ev], "o--",
                         color=line.get_color(), ms=3, label=f"{label} accuracy (held-out, greedy)")
        ess = [r["ess_ratio"] for r in rows]
        ax_ess.plot(steps, ess, color=line.get_color(), lw=0.5, alpha=0.3)
        ax_ess.plot(steps, rolling_mean(ess, window), color=line.get_color(), label=f"{label} ({mean})")
        ax_lr.plot(steps, [r["lr_scale"] for r in rows], color=line.get_color(), lw=0.8, label=label)
    ax_wall.set(xlabel="wall clock (min)", ylabel="reward / accuracy", title="vs wall clock")
    ax_step.set(xlabel="step", ylabel="reward / accuracy", title="vs step")
    ax_ess.set(xlabel="step", ylabel="ESS / B", title="ESS ratio", ylim=(0, 1.05))
    ax_lr.set(xlabel="step", ylabel="lr scale", title="ESS lr scale", ylim=(0, 1.05))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def plot_run(run_dir: str) -> str:
    path = os.path.join(run_dir, "curves.png")
    plot_runs({os.path.basename(os.path.normpath(run_dir)): read_metrics(run_dir)}, path)
    return path
