"""Side-by-side table of `vcpo train` runs (e.g. synchronous k = 0 against asynchronous k = 4) and one figure
of their curves.

    .venv/bin/python bench/compare_runs.py sync=runs/k0 async=runs/k4 -o bench/results/sync_vs_async.png
"""

import argparse
import json
import os
import statistics

from vcpo.trainer.plot import plot_runs, read_metrics


def describe(folder: str) -> dict:
    rows = read_metrics(folder)
    if not rows:
        raise SystemExit(f"{folder}: no metrics.jsonl")
    summary = json.load(open(os.path.join(folder, "summary.json")))
    config = json.load(open(os.path.join(folder, "config.json")))
    n = len(rows)
    tail = rows[-max(1, n // 10):]  # the last tenth of the run
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return {
        "k": config["settings"]["max_staleness"],
        "loss": config["settings"]["loss"],
        "steps": n,
        "wall s": summary["wall_seconds"],
        "s/step": summary["wall_seconds"] / n,
        "trainer wait s": sum(r["wait_seconds"] for r in rows),
        "train s": sum(r["train_seconds"] for r in rows),
        "generate s": summary["generate_seconds"],
        "sync s": summary["sync_seconds"],
        "sync ms/each": 1000 * summary["mean_sync_seconds"],
        "reward first 10%": statistics.mean(r["reward"] for r in rows[:max(1, n // 10)]),
        "reward last 10%": statistics.mean(r["reward"] for r in tail),
        "held-out acc start": evals[0] if evals else float("nan"),
        "held-out acc final": (summary["final_eval"] or {}).get("accuracy", float("nan")),
        "ESS ratio median": statistics.median(r["ess_ratio"] for r in rows),
        "ESS ratio p10": sorted(r["ess_ratio"] for r in rows)[n // 10],
        "lr scale median": statistics.median(r["lr_scale"] for r in rows),
        "mean lag": sum(r["lag"] for r in rows) / n,
        "engine start s": summary.get("engine_start_seconds", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN")
    parser.add_argument("-o", "--output", help="also write a figure of the curves")
    args = parser.parse_args()
    runs = dict(spec.rsplit("=", 1) for spec in args.runs)  # labels may hold "=", paths rarely
    table = {label: describe(folder) for label, folder in runs.items()}
    labels = list(table)
    print(f"{'':22s}" + "".join(f"{label:>14s}" for label in labels))
    for key in table[labels[0]]:
        cells = []
        for label in labels:
            v = table[label][key]
            cells.append(f"{v:>14.3f}" if isinstance(v, float) else f"{v!s:>14s}")
        print(f"{key:22s}" + "".join(cells))
    if len(labels) == 2:
        a, b = (table[label] for label in labels)
        print(f"\nwall-clock ratio {labels[0]}/{labels[1]}: {a['wall s'] / b['wall s']:.2f}x")
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        plot_runs({label: read_metrics(folder) for label, folder in runs.items()}, args.output)
        print(args.output)


if __name__ == "__main__":
    main()
