"""bench/lr_robustness.py: the cells, the worst-case ranking and the paired differences against plain loops over
random summaries, a collapse (of the reward, or a late fall of the held-out accuracy) counted as 0, and a rule
missing a cell or a seed left unranked."""

import json
import math
import random
import statistics

from support.bench_scripts import bench_module

bench_module("staleness_sweep")  # lr_robustness imports it by name
lr_robustness = bench_module("lr_robustness")

RULES, KS, LRS, SEEDS = ("vcpo", "vcpo-lr-linear", "seq-tis"), (16, 64), (3e-4, 1.5e-4), (0, 1, 2)


def summaries(rng, drop=(), rules=RULES):
    out = []
    for rule in rules:
        for k in KS:
            for lr in LRS:
                for seed in (*SEEDS, 7):  # seed 7 is not asked for: it must not count
                    if (rule, k, lr, seed) in drop:
                        continue
                    collapsed = rng.random() < 0.2  # by the training reward
                    best, final = rng.random(), rng.random()  # a final accuracy below best / 2: a late collapse
                    out.append({"rule": rule, "k": k, "base_lr": lr, "seed": seed, "final_accuracy": final,
                                "evals": [[0, 0.0, 0.05], [200, 1.0, best], [400, 2.0, final]],
                                "collapsed_at": rng.randrange(400) if collapsed else None})
    return out


def test_worst_cell_ranking_against_a_plain_loop(tmp_path):
    rng = random.Random(5)
    rows = summaries(rng, drop={("seq-tis", 64, 1.5e-4, 2)})  # seq-tis lacks a seed in one cell: not ranked
    for lr in LRS:
        folder = tmp_path / f"lr{lr}"
        folder.mkdir()
        for i, r in enumerate(x for x in rows if x["base_lr"] == lr):
            (folder / f"{i}.json").write_text(json.dumps(r))
        (folder / "sweep.json").write_text(json.dumps({"cells": {}}))  # the sweep's report: skipped
    table = lr_robustness.cells(lr_robustness.read_summaries([str(tmp_path / f"lr{lr}") for lr in LRS]),
                                list(SEEDS), list(KS))
    worst = {}
    for rule in RULES:
        means = {}
        for k in KS:
            for lr in LRS:
                runs = [r for r in rows if (r["rule"], r["k"], r["base_lr"]) == (rule, k, lr) and r["seed"] in SEEDS]
                fell = [r["collapsed_at"] is not None or (max(e[2] for e in r["evals"]) >= 0.1 and
                                                          r["final_accuracy"] < max(e[2] for e in r["evals"]) / 2)
                        for r in runs]
                accs = [0.0 if f else r["final_accuracy"] for r, f in zip(runs, fell)]
                assert table[(rule, k, lr)]["accuracy"] == statistics.fmean(accs)
                assert table[(rule, k, lr)]["collapses"] == sum(fell)
                means[(k, lr)] = statistics.fmean(accs)
        if rule != "seq-tis":
            worst[rule] = min(means.values())
    ranked = lr_robustness.ranking(table, list(SEEDS))
    assert [r for r, _, _ in ranked] == sorted(worst, key=lambda r: -worst[r])
    assert all(acc == worst[r] for r, acc, _ in ranked)
    text = lr_robustness.markdown(table, list(SEEDS))
    assert "| seq-tis |" in text and "incomplete" in text and "[2 seeds]" in text
    for rule in RULES:  # the last column: every collapse of the rule over the grid, on the seeds asked for
        line = next(line for line in text.splitlines() if line.startswith(f"| {rule} |"))
        fell = sum(r["collapsed_at"] is not None or (max(e[2] for e in r["evals"]) >= 0.1 and
                                                     r["final_accuracy"] < max(e[2] for e in r["evals"]) / 2)
                   for r in rows if r["rule"] == rule and r["seed"] in SEEDS)
        assert line.rstrip(" |").rsplit("| ", 1)[1] == str(fell)


def _fell(r):
    best = max(e[2] for e in r["evals"])
    return r["collapsed_at"] is not None or (best >= 0.1 and r["final_accuracy"] < best / 2)


def test_pairs_against_a_plain_loop():
    """The best rule at each (k, lr) minus every other, and each -ess twin minus its rule alone, seed by seed over
    the seeds both ran, a collapse as 0, Student's t interval; a rule short of a seed can be paired but not be the
    best."""
    t975 = {1: 12.706, 2: 4.303}  # Student's t, 97.5% quantile, by degrees of freedom (a printed table)
    rng = random.Random(11)
    rows = summaries(rng, drop={("gspo-ess", 64, 3e-4, 1), ("vcpo", 16, 1.5e-4, 0)},
                     rules=("gspo", "gspo-ess", "cispo", "cispo-ess", "vcpo"))
    got = lr_robustness.paired(rows, list(SEEDS), list(KS))
    expected = []
    for k in KS:
        for lr in sorted(LRS, reverse=True):
            value = {}
            for r in rows:
                if (r["k"], r["base_lr"]) == (k, lr) and r["seed"] in SEEDS:
                    value.setdefault(r["rule"], {})[r["seed"]] = 0.0 if _fell(r) else r["final_accuracy"]
            means = {rule: sum(v.values()) / len(v) for rule, v in value.items() if len(v) == len(SEEDS)}
            best = max(means, key=means.get)
            pairs = [(best, rule) for rule in sorted(value) if rule != best]
            pairs += [(f"{rule}-ess", rule) for rule in ("cispo", "gspo")]
            for first, second in pairs:
                diffs = [value[first][s] - value[second][s] for s in SEEDS if s in value[first] and s in value[second]]
                mean = sum(diffs) / len(diffs)
                half = t975[len(diffs) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))
                expected.append((k, lr, first, second, len(diffs), mean, half, sum(d > 0 for d in diffs),
                                 first == best))
    assert len(got) == len(expected)
    for row, (k, lr, first, second, n, mean, half, ahead, is_best) in zip(got, expected):
        assert (row["k"], row["base_lr"], row["first"], row["second"], row["seeds"]) == (k, lr, first, second, n)
        assert math.isclose(row["diff"], mean, abs_tol=1e-12) and math.isclose(row["ci95"], half, rel_tol=1e-3)
        assert (row["first_ahead"], row["best"]) == (ahead, is_best)
    assert any(row["seeds"] == 2 for row in got)  # the dropped seed shortens its pairs
    text = lr_robustness.pairs_markdown(got)
    assert text.count("(best)") == sum(row["best"] for row in got) and len(text.splitlines()) == 4 + len(got)
