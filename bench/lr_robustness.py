"""Which update rule needs no lr tuning: each rule's final held-out accuracy and collapses across a grid of base
learning rates and staleness bounds, from the staleness sweep's summaries (bench/staleness_sweep.py, one summary
folder per base lr), ranked by the worst cell (bench/RESULTS.md, "Protocol: an update rule for every lag").

A cell is (rule, k, base lr): the mean final held-out accuracy over the seeds asked for, a collapsed run counting
as 0 (a run that fell apart is the worst case a user meets, whatever it reached before); a rule's score is its
worst cell, over every k and base lr. A run collapsed when the sweep says so (its training reward) or when its final
held-out accuracy is below half its best held-out accuracy, once that was at least 0.1 (a fall in the last
evaluations, too late for the reward's trailing window). A rule missing a cell is not ranked (its worst case is
unknown).

    .venv/bin/python bench/staleness_sweep.py --lr 1.5e-4 --summaries bench/results/sweep_lr1.5e-4 --ks 16 \\
        --seeds 0,1,2,3,4 --steps 400 --rules vcpo,vcpo-lr-linear -- --exact-staleness
    .venv/bin/python bench/lr_robustness.py bench/results/sweep_lr3e-4 bench/results/sweep_lr1.5e-4 \\
        bench/results/sweep_lr7.5e-5 --seeds 0,1,2,3,4 --ks 16,64
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def read_summaries(folders: list[str]) -> list[dict]:
    rows = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            with open(path) as f:
                summary = json.load(f)
            if "rule" in summary and "base_lr" in summary:  # a run's summary (not sweep.json)
                rows.append(summary)
    return rows


def collapsed(summary: dict) -> bool:
    """The sweep's collapse (of the training reward), or a held-out accuracy ([version, seconds, accuracy] rows) that
    ended below half its best, once the best was at least 0.1."""
    best = max((e[2] for e in summary["evals"]), default=0.0)
    return summary["collapsed_at"] is not None or (best >= 0.1 and summary["final_accuracy"] < best / 2)


def cells(summaries: list[dict], seeds: list[int], ks: list[int]) -> dict:
    """(rule, k, base_lr) -> {"accuracy": mean over the seeds (a collapse counts 0), "collapses", "seeds"}."""
    runs: dict = {}
    for s in summaries:
        if s["seed"] in seeds and s["k"] in ks:
            runs.setdefault((s["rule"], s["k"], s["base_lr"]), []).append(s)
    return {key: {"accuracy": statistics.fmean(0.0 if collapsed(r) else r["final_accuracy"] for r in rs),
                  "collapses": sum(map(collapsed, rs)), "seeds": len(rs)}
            for key, rs in runs.items()}


def ranking(table: dict, seeds: list[int]) -> list[tuple[str, float, tuple]]:
    """[(rule, its worst cell's accuracy, that cell's (k, base_lr))], best worst case first; only rules with every
    (k, base_lr) of the grid, each with every seed."""
    grid = {(k, lr) for _, k, lr in table}
    out = []
    for rule in sorted({r for r, _, _ in table}):
        mine = {(k, lr): c for (r, k, lr), c in table.items() if r == rule}
        if set(mine) != grid or any(c["seeds"] != len(seeds) for c in mine.values()):
            continue
        worst = min(mine, key=lambda cell: mine[cell]["accuracy"])
        out.append((rule, mine[worst]["accuracy"], worst))
    return sorted(out, key=lambda row: -row[1])


def markdown(table: dict, seeds: list[int]) -> str:
    lrs = sorted({lr for _, _, lr in table}, reverse=True)
    ks = sorted({k for _, k, _ in table})
    head = " | ".join(f"k={k} lr={lr:g}" for k in ks for lr in lrs)
    lines = [f"seeds {','.join(map(str, seeds))}: mean final held-out accuracy (a collapse counts 0), collapses",
             "", f"| rule | {head} | worst | collapses |", "|---|" + "---|" * (len(ks) * len(lrs) + 2)]
    ranked = {rule: (worst, cell) for rule, worst, cell in ranking(table, seeds)}
    for rule in sorted({r for r, _, _ in table}, key=lambda r: -ranked.get(r, (-1.0,))[0]):
        row = []
        for k in ks:
            for lr in lrs:
                c = table.get((rule, k, lr))
                row.append("-" if c is None else f"{c['accuracy']:.3f}" + (f" ({c['collapses']}c)" if c["collapses"]
                                                                             else "") + (
                    f" [{c['seeds']} seeds]" if c["seeds"] != len(seeds) else ""))
        worst = f"{ranked[rule][0]:.3f} at k={ranked[rule][1][0]} lr={ranked[rule][1][1]:g}" if rule in ranked \
            else "incomplete"
        collapses = sum(c["collapses"] for (r, _, _), c in table.items() if r == rule)  # the protocol's tie-break
        lines.append(f"| {rule} | " + " | ".join(row) + f" | {worst} | {collapses} |")
    return "\n".join(lines)


def main() -> None:
    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="summary folders of the sweep, one per base lr")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2, 3, 4])
    p.add_argument("--ks", type=ints, default=[0, 4, 16, 64])
    args = p.parse_args()
    table = cells(read_summaries(args.folders), args.seeds, args.ks)
    if not table:
        raise SystemExit(f"no summaries of seeds {args.seeds} at k in {args.ks} in {args.folders}")
    print(markdown(table, args.seeds))


if __name__ == "__main__":
    main()
