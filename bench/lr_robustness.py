"""Which update rule needs no lr tuning: each rule's final held-out accuracy and collapses across a grid of base
learning rates and staleness bounds, from the staleness sweep's summaries (bench/staleness_sweep.py, one summary
folder per base lr), ranked by the worst cell (bench/RESULTS.md, "Protocol: an update rule for every lag").

A cell is (rule, k, base lr): the mean final held-out accuracy over the seeds asked for, a collapsed run counting
as 0 (a run that fell apart is the worst case a user meets, whatever it reached before); a rule's score is its
worst cell, over every k and base lr. A run collapsed when the sweep says so (its training reward) or when its final
held-out accuracy is below half its best held-out accuracy, once that was at least 0.1 (a fall in the last
evaluations, too late for the reward's trailing window). A rule missing a cell is not ranked (its worst case is
unknown).

`--pairs` adds, at each (k, base lr), paired by seed with the same collapse-as-0 values: the best rule (the highest
cell with every seed) minus each other rule, and each peer's rule with the ESS-scaled step minus the rule alone
(bench/RESULTS.md, "Protocol: the peers' stabilisers at long lags").

    .venv/bin/python bench/staleness_sweep.py --lr 1.5e-4 --summaries bench/results/sweep_lr1.5e-4 --ks 16 \\
        --seeds 0,1,2,3,4 --steps 400 --rules vcpo,vcpo-lr-linear -- --exact-staleness
    .venv/bin/python bench/lr_robustness.py bench/results/sweep_lr3e-4 bench/results/sweep_lr1.5e-4 \\
        bench/results/sweep_lr7.5e-5 --seeds 0,1,2,3,4 --ks 16,64
    .venv/bin/python bench/lr_robustness.py bench/results/sweep_lr1.5e-4 --pairs   # the peers' comparison
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics

from staleness_sweep import ESS_TWIN, mean_ci


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


def run_values(summaries: list[dict], seeds: list[int], ks: list[int]) -> dict:
    """(rule, k, base_lr) -> {seed: (the final held-out accuracy, 0 for a collapse; collapsed)}."""
    values: dict = {}
    for s in summaries:
        if s["seed"] in seeds and s["k"] in ks:
            fell = collapsed(s)
            values.setdefault((s["rule"], s["k"], s["base_lr"]), {})[s["seed"]] = \
                (0.0 if fell else s["final_accuracy"], fell)
    return values


def cells(summaries: list[dict], seeds: list[int], ks: list[int]) -> dict:
    """(rule, k, base_lr) -> {"accuracy": mean over the seeds (a collapse counts 0), "collapses", "seeds"}."""
    return {key: {"accuracy": statistics.fmean(v for v, _ in runs.values()),
                  "collapses": sum(fell for _, fell in runs.values()), "seeds": len(runs)}
            for key, runs in run_values(summaries, seeds, ks).items()}


def paired(summaries: list[dict], seeds: list[int], ks: list[int]) -> list[dict]:
    """At each (k, base lr), over the seeds both ran: the best rule (the highest cell among those with every seed)
    minus each other rule, and each rule with the ESS-scaled step (`<rule>-ess`) minus the rule alone. The mean
    difference (a collapse counting 0), the half-width of its 95% interval and the seeds with the first ahead."""
    values = run_values(summaries, seeds, ks)
    rows = []
    for k, lr in sorted({(k, lr) for _, k, lr in values}, key=lambda c: (c[0], -c[1])):
        here = {rule: runs for (rule, k2, lr2), runs in values.items() if (k2, lr2) == (k, lr)}
        complete = [rule for rule, runs in here.items() if len(runs) == len(seeds)]
        best = max(sorted(complete), key=lambda rule: statistics.fmean(v for v, _ in here[rule].values()),
                   default=None)
        pairs = [] if best is None else [(best, rule) for rule in sorted(here) if rule != best]
        pairs += [(rule, rule.removesuffix(ESS_TWIN)) for rule in sorted(here)
                  if rule.endswith(ESS_TWIN) and rule.removesuffix(ESS_TWIN) in here]
        for first, second in pairs:
            diffs = [here[first][seed][0] - here[second][seed][0]
                     for seed in sorted(here[first]) if seed in here[second]]
            mean, _, half = mean_ci(diffs)
            rows.append({"k": k, "base_lr": lr, "first": first, "second": second, "seeds": len(diffs),
                         "diff": mean, "ci95": half, "first_ahead": sum(d > 0 for d in diffs),
                         "best": first == best})
    return rows


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


def pairs_markdown(rows: list[dict]) -> str:
    lines = ["Paired by seed (a collapse counts 0): the best rule at each k and lr minus each other rule, and each "
             "rule with the ESS-scaled step minus the rule alone", "",
             "| k | lr | first | second | seeds | first - second (mean +- 95% CI) | seeds with the first ahead |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "" if math.isnan(r["ci95"]) else f" +- {r['ci95']:.3f}"  # NaN: one seed
        lines.append(f"| {r['k']} | {r['base_lr']:g} | {r['first']}{' (best)' if r['best'] else ''} | {r['second']} | "
                     f"{r['seeds']} | {r['diff']:+.3f}{ci} | {r['first_ahead']} of {r['seeds']} |")
    return "\n".join(lines)


def main() -> None:
    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="summary folders of the sweep, one per base lr")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2, 3, 4])
    p.add_argument("--ks", type=ints, default=[0, 4, 16, 64])
    p.add_argument("--rules", type=lambda t: [r for r in t.split(",") if r.strip()],
                   help="only these rules (default: every rule with a summary)")
    p.add_argument("--pairs", action="store_true", help="also the paired differences at each k and lr")
    args = p.parse_args()
    summaries = [s for s in read_summaries(args.folders) if args.rules is None or s["rule"] in args.rules]
    table = cells(summaries, args.seeds, args.ks)
    if not table:
        raise SystemExit(f"no summaries of seeds {args.seeds} at k in {args.ks} in {args.folders}")
    print(markdown(table, args.seeds))
    if args.pairs:
        print("\n" + pairs_markdown(paired(summaries, args.seeds, args.ks)))


if __name__ == "__main__":
    main()
