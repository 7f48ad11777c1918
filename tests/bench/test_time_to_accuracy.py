"""bench/time_to_accuracy.py: the time to the threshold and the paired speed-ups against loops written another way
over random runs, and its report from summaries alone."""

import json
import math
import os
import random
import statistics
import sys

import numpy as np
import pytest

from support.bench_scripts import bench_module

T975 = bench_module("staleness_sweep").T975  # the t quantiles (time_to_accuracy imports the module by name)
tta = bench_module("time_to_accuracy")


def random_summary(rng, rule="vcpo", k=4, seed=0, steps=200, every=20):
    """A run's summary as the sweep writes it: evaluations every `every` versions (logged some steps later), the
    final one repeating the last version, and an increasing wall clock per step."""
    wall = list(np.cumsum([rng.uniform(0.1, 0.5) for _ in range(steps)]))
    level = rng.uniform(0.1, 0.4)
    evals = []
    for v in range(0, steps + 1, every):
        level = min(1.0, max(0.0, level + rng.gauss(0.01, 0.05)))
        evals.append([v, wall[min(steps - 1, v + 3)], round(level, 4)])
    evals.append([steps, wall[-1], evals[-1][2]])
    return {"rule": rule, "k": k, "seed": seed, "steps": steps, "wall": wall, "evals": evals, "eval_size": 128,
            "final_accuracy": evals[-1][2], "reward_last10": rng.random(), "rewards": [rng.random() for _ in wall], "collapsed_at": None, "mean_lag": 1.0,
            "wall_s": wall[-1], "commit": "c" * 40, "train_args": [], "base_lr": 3e-4}


def test_time_to_against_rolling_means():
    rng = random.Random(5)
    outcomes = {True: 0, False: 0}
    for _ in range(300):
        d = random_summary(rng, steps=rng.choice([40, 100, 200]))
        threshold, n = rng.uniform(0.2, 0.6), rng.randrange(1, 5)
        acc = np.array([a for _, _, a in d["evals"][:-1]])  # the last line repeats the last version
        versions = [v for v, _, _ in d["evals"][:-1]]
        means = np.convolve(acc, np.ones(n) / n, mode="valid")  # means[j] ends at evaluation j + n - 1
        hits = np.nonzero(means >= threshold - 1e-12)[0] if n <= len(acc) else []
        got = tta.time_to(d, threshold, n)
        if len(hits) == 0:
            assert got is None
        else:
            version = versions[hits[0] + n - 1]
            assert got == (version, pytest.approx(0.0 if version == 0 else d["wall"][version - 1]))
        outcomes[got is not None] += 1
    assert outcomes[True] > 30 and outcomes[False] > 30


def test_the_repeated_final_evaluation_counts_once():
    d = {"steps": 40, "wall": [float(t) for t in range(1, 41)],
         "evals": [[0, 0.5, 0.2], [20, 21.0, 0.3], [40, 40.0, 0.5], [40, 40.0, 0.9]]}
    assert tta.evaluations(d) == [(0, 0.2), (20, 0.3), (40, 0.5)]
    assert tta.time_to(d, 0.45, 3) is None  # (0.2 + 0.3 + 0.5) / 3; a double count of 40 would make 0.57
    assert tta.time_to(d, 0.33, 3) == (40, 40.0)
    assert tta.time_to(d, 0.2, 1) == (0, 0.0)  # reached before the first step


def test_late_spread_is_the_last_third():
    d = {"steps": 90, "evals": [[v, 0.0, a] for v, a in [(0, 0.9), (30, 0.1), (60, 0.2), (80, 0.4), (90, 0.3)]]}
    assert tta.late_spread(d) == pytest.approx(statistics.stdev([0.2, 0.4, 0.3]))


def test_reward_fall_against_pairs_of_steps():
    rng = random.Random(8)
    for _ in range(200):
        n, window = rng.randrange(2, 120), rng.randrange(1, 20)
        rewards = [rng.random() for _ in range(n)]
        smooth = [statistics.fmean(rewards[max(0, t - window + 1):t + 1]) for t in range(n)]
        # every (earlier step, step in the second half) pair: how far the second is below the first
        expected = max([0.0] + [smooth[s] - smooth[t] for t in range(n // 2, n) for s in range(t + 1)])
        assert tta.reward_fall({"rewards": rewards}, window) == pytest.approx(expected)
    assert tta.reward_fall({"rewards": [0.1, 0.5, 0.9]}, 1) == 0.0  # it only rose


def summaries_for(rng, cells, seeds):
    runs = [tta.cell_run(c, s) for c in cells for s in seeds]
    return {run: random_summary(rng, run.rule, run.k, run.seed) for run in runs}


def test_speedups_against_a_loop():
    rng = random.Random(6)
    cells = ["vcpo:4", "grpo:0", "vcpo:0", "vcpo:16", "vcpo-cosine:4", "grpo-cosine:0"]
    for trial in range(30):
        summaries = summaries_for(rng, cells, range(6))
        if trial % 3 == 0:  # a missing reference run: that seed is not paired
            del summaries[tta.Run("grpo", 0, 2)]
        rows = {(r["reference"], r["cell"]): r for r in tta.speedups(summaries, cells)}
        for ref in tta.REFERENCES:
            for cell in cells:
                if cell == ref or ("-cosine:" in cell) != ("-cosine:" in ref):  # one lr schedule against itself
                    assert (ref, cell) not in rows
                    continue
                ratios, one_sided = [], 0
                for seed in range(6):
                    a, b = summaries.get(tta.cell_run(ref, seed)), summaries.get(tta.cell_run(cell, seed))
                    if a is None or b is None:
                        continue
                    ta, tb = tta.time_to(a), tta.time_to(b)
                    if ta and tb:
                        ratios.append(ta[1] / tb[1])
                    else:
                        one_sided += 1
                row = rows.get((ref, cell))
                if not ratios and not one_sided:
                    assert row is None
                    continue
                assert row["paired"] == len(ratios)
                assert len(row["only_reference_reached"] + row["only_cell_reached"] + row["neither_reached"]) \
                    == one_sided
                assert row["faster"] == sum(r > 1 for r in ratios)
                if ratios:
                    assert row["speedup"] == pytest.approx(math.prod(ratios) ** (1 / len(ratios)))
                if len(ratios) > 1:
                    logs = [math.log(r) for r in ratios]
                    half = T975[len(logs) - 2] * statistics.stdev(logs) / math.sqrt(len(logs))
                    assert row["low"] == pytest.approx(row["speedup"] * math.exp(-half))
                    assert row["high"] == pytest.approx(row["speedup"] * math.exp(half))


def test_report_from_summaries_alone(tmp_path, monkeypatch, capsys):
    rng = random.Random(7)
    cells = ["vcpo:4", "grpo:0"]
    summaries = summaries_for(rng, cells, range(3))
    os.makedirs(tmp_path / "summaries")
    for run, d in summaries.items():
        d["steps"] = 1500
        with open(tmp_path / "summaries" / f"{run.name}.json", "w") as f:
            json.dump(d, f)
    monkeypatch.setattr(sys, "argv", ["time_to_accuracy.py", "--report-only", "--out", str(tmp_path / "out"),
                                      "--summaries", str(tmp_path / "summaries"), "--cells", "vcpo:4,grpo:0",
                                      "--seeds", "0,1,2,3"])
    tta.main()
    report = json.load(open(tmp_path / "out" / "time_to_accuracy.json"))
    row = next(r for r in report["cells"] if r["cell"] == "vcpo:4")
    assert row["seeds"] == [0, 1, 2]
    assert row["reached"] == sum(tta.time_to(summaries[tta.Run("vcpo", 4, s)]) is not None for s in range(3))
    assert row["final_accuracy"][0] == pytest.approx(
        statistics.fmean(summaries[tta.Run("vcpo", 4, s)]["final_accuracy"] for s in range(3)))
    assert os.path.getsize(tmp_path / "out" / "time_to_accuracy.png") > 0
    assert "| vcpo:4 | 3 |" in capsys.readouterr().out


def test_a_cell_that_is_not_rule_k_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["time_to_accuracy.py", "--report-only", "--cells", "vcpo-4"])
    with pytest.raises(SystemExit):
        tta.main()
    assert "'vcpo-4' is not rule:k" in capsys.readouterr().err
