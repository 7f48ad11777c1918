"""bench/staleness_sweep.py: its definitions (collapse, ESS lead time) against brute-force loops
over random curves, and the sweep's bookkeeping (order, skip, resume, budget, the control's learning rate, the
report) with `vcpo train` replaced by a stand-in that writes run folders."""

import json
import math
import os
import random
import shutil
import statistics
from types import SimpleNamespace

import pytest

from support.bench_scripts import bench_module

sweep = bench_module("staleness_sweep")


def random_curve(rng, n):
    """A reward-like curve: a rise, a plateau, and in some curves a fall, with noise."""
    peak, fall = rng.randrange(n), rng.choice([None, rng.randrange(n)])
    return [max(0.0, min(1.0, (min(t, peak) / max(peak, 1)) * (0.2 if fall is not None and t > fall else 1.0)
                         + rng.gauss(0, 0.1))) for t in range(n)]


def test_collapse_step_against_the_definition():
    rng = random.Random(1)
    seen = {True: 0, False: 0}
    for _ in range(400):
        n = rng.randrange(1, 120)
        rewards, window = random_curve(rng, n), rng.randrange(1, 15)
        smooth = [statistics.fmean(rewards[max(0, t - window + 1):t + 1]) for t in range(n)]
        best = max(smooth)
        best_at = smooth.index(best)
        expected = None
        if best >= 0.05:  # the first step after the best from which the smoothed reward stays below half of it
            for i in range(best_at + 1, n):
                if all(s < 0.5 * best for s in smooth[i:]):
                    expected = i + 1
                    break
        assert sweep.collapse_step(rewards, window) == expected
        seen[expected is not None] += 1
    assert seen[True] > 20 and seen[False] > 20  # both kinds of curve were drawn


def test_collapse_edge_cases():
    assert sweep.collapse_step([], 10) is None
    assert sweep.collapse_step([0.04] * 25 + [0.0] * 25, 5) is None  # never learned: nothing to collapse from
    assert sweep.collapse_step([1.0] * 20 + [0.0] * 20, 1) == 21
    assert sweep.collapse_step([1.0] * 20 + [0.0] * 19 + [1.0], 1) is None  # it came back


def test_ess_lead_against_brute_force():
    rng = random.Random(2)
    leads = 0
    for _ in range(300):
        n = rng.randrange(2, 80)
        ess = [rng.choice([0.2, 0.9]) * rng.uniform(0.8, 1.2) for _ in range(n)]
        window, collapse = rng.randrange(1, 5), rng.randrange(1, n + 1)
        smooth = [statistics.fmean(ess[max(0, t - window + 1):t + 1]) for t in range(n)]
        t = collapse - 1
        expected = None
        if smooth[t] < 0.5:
            expected = 0
            while t - expected - 1 >= 0 and smooth[t - expected - 1] < 0.5:
                expected += 1
        assert sweep.ess_lead(ess, collapse, window) == expected
        leads += expected is not None
    assert leads > 20
    assert sweep.ess_lead([0.1] * 10, None, 3) is None


def test_plan_runs_vcpo_before_its_controls_seed_by_seed():
    runs = sweep.plan(["seq-tis", "vcpo", "grpo", "vcpo-no-ess"], [0, 4], [0, 1], control_ks=[4])
    names = [r.name for r in runs]
    # 4 rules at each k + the controls of seq-tis, grpo and vcpo-no-ess at k = 4
    assert len(names) == len(set(names)) == 2 * (2 * 4 + 3)
    assert not any(r.rule.endswith(sweep.CONTROL) and r.k == 0 for r in runs)
    for r in runs:
        if r.rule.endswith(sweep.CONTROL):
            assert names.index(f"vcpo-k{r.k}-s{r.seed}") < names.index(r.name)
    assert all(r.seed == 0 for r in runs[:len(runs) // 2])  # a cut-short sweep has whole seeds
    assert not any(r.rule.endswith(sweep.CONTROL) for r in sweep.plan(["vcpo", "grpo"], [0, 4], [0], control_ks=[]))
    only = sweep.plan(["seq-tis", "vcpo-no-ess"], [16], [0, 1], control_ks=[16], controls_only=True)
    assert [r.name for r in only] == [f"{rule}-k16-s{seed}" for seed in (0, 1) for rule in
                                      ("vcpo", "seq-tis@vcpo-lr", "vcpo-no-ess@vcpo-lr")]


def fake_train(calls, steps, lr_scale=0.5, spread=0.01, ess=0.9):
    """Stands in for `vcpo train`: writes the run folder a finished run leaves."""
    def call(cmd, **kwargs):
        argv = cmd[cmd.index("train") + 1:]
        calls.append(argv)
        if "--resume" in argv:
            folder = argv[argv.index("--resume") + 1]
            config = json.load(open(os.path.join(folder, "config.json")))
        else:
            folder = argv[argv.index("--output-dir") + 1]
            os.makedirs(folder)
            config = {"settings": {"eval_size": 100}, "lr": float(argv[argv.index("--lr") + 1])}
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            for t in range(steps):
                f.write(json.dumps({"reward": t / steps, "ess_ratio": ess, "lag": t % 3,
                                    "lr_scale": lr_scale + spread * (t % 3), "wall_seconds": 0.05 * (t + 1)}) + "\n")
        os.makedirs(os.path.join(folder, "checkpoints", f"step-{steps:06d}"), exist_ok=True)
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump({"interrupted": False, "steps": steps, "wall_seconds": 1.0,
                       "final_eval": {"version": steps, "accuracy": 0.5 + 0.1 * ("vcpo" in folder)}}, f)
        return 0
    return call


def run_sweep(args):
    sweep.sweep(args, sweep.plan(args.rules, args.ks, args.seeds, args.control_ks))


def args_for(out, **kw):
    base = dict(out=str(out), summaries=str(out / "summaries"), rules=["vcpo", "grpo"], ks=[0, 4], seeds=[0, 1], control_ks=[4], steps=20, lr=1e-3,
                budget_minutes=None, train_args=["--eval-size", "100"], report_only=False)
    return SimpleNamespace(**{**base, **kw})


def test_sweep_skips_finished_runs_resumes_started_ones_and_sets_the_control_lr(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep.subprocess, "call", fake_train(calls, steps=20))
    args = args_for(tmp_path)
    run_sweep(args)
    assert len(calls) == 2 * (2 * 2 + 1)  # controls at k = 4 only
    for argv in calls:
        assert argv[-2:] == ["--eval-size", "100"] and "--no-progress" in argv
    control = next(a for a in calls if os.path.basename(a[a.index("--output-dir") + 1]) == "grpo@vcpo-lr-k4-s1")
    # lr x the median of the VCPO run's lr scales (0.50, 0.51, 0.52 repeated): 0.51
    assert float(control[control.index("--lr") + 1]) == pytest.approx(1e-3 * 0.51)
    assert control[control.index("--loss") + 1] == "grpo"

    calls.clear()
    os.remove(tmp_path / "grpo-k4-s1" / "summary.json")  # a run that stopped before its end
    os.remove(tmp_path / "summaries" / "grpo-k4-s1.json")
    run_sweep(args)
    assert calls == [["--resume", str(tmp_path / "grpo-k4-s1"), "--no-progress"]]

    calls.clear()
    os.remove(tmp_path / "summaries" / "grpo-k4-s1.json")  # stopped before its first checkpoint: started again
    shutil.rmtree(tmp_path / "grpo-k4-s1" / "checkpoints")
    os.remove(tmp_path / "grpo-k4-s1" / "summary.json")
    run_sweep(args)
    assert len(calls) == 1 and "--resume" not in calls[0]
    assert calls[0][calls[0].index("--output-dir") + 1] == str(tmp_path / "grpo-k4-s1")

    calls.clear()
    os.remove(tmp_path / "summaries" / "vcpo-k0-s0.json")  # finished, but killed before its summary was written
    run_sweep(args)
    assert calls == [] and os.path.isfile(tmp_path / "summaries" / "vcpo-k0-s0.json")


def test_summaries_carry_the_facts_and_outlive_the_run_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep.subprocess, "call", fake_train([], steps=20))
    args = args_for(tmp_path)
    run_sweep(args)
    summary = json.load(open(tmp_path / "summaries" / "vcpo-k4-s1.json"))
    assert {"rule", "k", "seed", "final_accuracy", "reward_last10", "collapsed_at", "ess_median", "lr_scale_median",
            "mean_lag", "wall_s", "commit"} <= set(summary)
    assert (summary["rule"], summary["k"], summary["seed"], summary["steps"]) == ("vcpo", 4, 1, 20)
    assert summary["final_accuracy"] == pytest.approx(0.6)
    assert summary["reward_last10"] == pytest.approx(statistics.fmean([18 / 20, 19 / 20]))
    assert summary["rewards"] == [pytest.approx(t / 20) for t in range(20)]
    assert summary["evals"] == [[20, 1.0, pytest.approx(0.6)]]
    assert summary["wall"] == [pytest.approx(0.05 * t) for t in range(1, 21)]
    assert len(summary["commit"]) >= 40  # this repository's HEAD
    import torch

    assert summary["machine"].endswith(f", {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}")

    for run in sweep.plan(args.rules, args.ks, args.seeds, args.control_ks):  # the run folders are lost
        shutil.rmtree(tmp_path / run.name)
    calls = []
    monkeypatch.setattr(sweep.subprocess, "call", fake_train(calls, steps=20))
    run_sweep(args)
    assert calls == []  # nothing runs again
    sweep.report(args)
    assert json.load(open(tmp_path / "sweep.json"))["cells"]


def test_a_run_that_only_changes_an_unused_step_rule_is_not_run_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep.subprocess, "call", fake_train(calls, steps=20, lr_scale=1.0, spread=0.0, ess=1.0))
    exact = ["--exact-staleness", "--eval-size", "100"]
    rules = ["vcpo", "vcpo-lr-linear", "vcpo-no-ess", "vcpo-loo-linear", "gspo", "gspo-ess"]
    run_sweep(args_for(tmp_path, rules=rules, ks=[0, 4], seeds=[0], control_ks=[], train_args=exact))
    ran = [os.path.basename(argv[argv.index("--output-dir") + 1]) for argv in calls]
    # at k = 0 the linear rule and the plain step repeat vcpo's run, the ESS-scaled GSPO repeats GSPO's; loo-linear
    # is another loss; at k = 4 the lr scale can differ
    assert ran == ["vcpo-k0-s0", "vcpo-loo-linear-k0-s0", "gspo-k0-s0",
                   *[f"{rule}-k4-s0" for rule in rules]]
    for rule, same in (("vcpo-lr-linear", "vcpo"), ("vcpo-no-ess", "vcpo"), ("gspo-ess", "gspo")):
        twin = json.load(open(tmp_path / "summaries" / f"{rule}-k0-s0.json"))
        original = json.load(open(tmp_path / "summaries" / f"{same}-k0-s0.json"))
        assert twin.pop("same_run_as") == f"{same}-k0-s0" and twin.pop("rule") == rule
        assert twin == {key: value for key, value in original.items() if key != "rule"}

    for train_args, ess in ((exact, 0.5), (["--eval-size", "100"], 1.0)):  # an ESS ratio below 1, or lags below k
        calls.clear()
        shutil.rmtree(tmp_path)
        monkeypatch.setattr(sweep.subprocess, "call", fake_train(calls, steps=20, lr_scale=1.0, spread=0.0, ess=ess))
        run_sweep(args_for(tmp_path, rules=["gspo", "gspo-ess"], ks=[0], seeds=[0], control_ks=[],
                           train_args=train_args))
        assert [argv[argv.index("--output-dir") + 1].endswith("gspo-ess-k0-s0") for argv in calls] == \
            [False, False, True]  # vcpo (every plan's first), gspo, and gspo-ess run


def test_a_summary_with_other_settings_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep.subprocess, "call", fake_train([], steps=20))
    run_sweep(args_for(tmp_path, rules=["vcpo"], ks=[0], seeds=[0]))
    with pytest.raises(SystemExit, match="vcpo-k0-s0.json"):
        run_sweep(args_for(tmp_path, rules=["vcpo"], ks=[0], seeds=[0], steps=30))


def test_autocorrelation_against_numpy():
    import numpy as np

    rng = random.Random(9)
    for _ in range(100):
        n = rng.randrange(3, 200)
        values = [rng.gauss(0, 1) + 0.5 * math.sin(t / rng.uniform(1, 10)) for t in range(n)]
        x = np.array(values) - np.mean(values)
        full = np.correlate(x, x, mode="full")[n - 1:] / np.dot(x, x)  # full[L]: lag L
        for lag in (1, rng.randrange(1, n)):
            assert sweep.autocorrelation(values, lag) == pytest.approx(full[lag], abs=1e-12)
    assert math.isnan(sweep.autocorrelation([0.3] * 10, 1)) and math.isnan(sweep.autocorrelation([1.0, 2.0], 2))


def test_lr_scale_variation_starts_once_the_lag_is_k():
    scale = [5.0] * 4 + [0.4, 0.6] * 10  # the first k = 4 steps (lag below k) must not count
    sd, lag1, lag_k = sweep.lr_scale_variation({"k": 4, "lr_scale": scale})
    assert sd == pytest.approx(statistics.stdev([0.4, 0.6] * 10))
    assert lag1 == pytest.approx(sweep.autocorrelation([0.4, 0.6] * 10, 1)) and lag1 < -0.9  # alternating
    assert lag_k == pytest.approx(sweep.autocorrelation([0.4, 0.6] * 10, 4)) and lag_k > 0.7
    assert sweep.lr_scale_variation({"k": 0, "lr_scale": [1.0] * 30})[0] == 0.0  # a rule without the ESS scaling


def test_mean_ci_covers_the_mean_95_percent_of_the_time():
    rng = random.Random(3)
    for n in (2, 5, 12):
        covered = 0
        for _ in range(3000):
            mean, _, half = sweep.mean_ci([rng.gauss(1.0, 2.0) for _ in range(n)])
            covered += abs(mean - 1.0) <= half
        assert 0.935 < covered / 3000 < 0.965, n
    assert sweep.mean_ci([0.5])[0] == 0.5 and math.isnan(sweep.mean_ci([0.5])[2])
    assert math.isnan(sweep.mean_ci([])[0])


def test_paired_differences_against_a_loop():
    """VCPO against every rule, and each peer's ESS-scaled twin against the rule alone, over the seeds both ran."""
    rng = random.Random(4)
    summaries = {}
    for seed in range(6):
        for rule in ("vcpo", "seq-tis", "grpo", "gspo", "gspo" + sweep.ESS_TWIN, "cispo" + sweep.ESS_TWIN):
            for k in (4, 16):
                if (rule, seed) not in (("grpo", 5), ("gspo", 0)):  # missed seeds: only the shared ones are paired
                    summaries[sweep.Run(rule, k, seed)] = {"final_accuracy": rng.random()}
    rows = sweep.paired(summaries)
    for row in rows:
        ref, rule = row["reference"], row["rule"]
        diffs = [summaries[sweep.Run(ref, row["k"], s)]["final_accuracy"]
                 - summaries[sweep.Run(rule, row["k"], s)]["final_accuracy"]
                 for s in range(6) if sweep.Run(rule, row["k"], s) in summaries and sweep.Run(ref, row["k"], s) in summaries]
        assert row["seeds"] == len(diffs) == (5 if rule in ("grpo", "gspo") else 6)
        assert row["diff"] == pytest.approx(statistics.fmean(diffs))
        assert row["ci95"] == pytest.approx(sweep.T975[len(diffs) - 2] * statistics.stdev(diffs) / len(diffs) ** 0.5)
        assert row["reference_ahead"] == sum(d > 0 for d in diffs)
    rules = ("grpo", "seq-tis", "gspo", "gspo-ess", "cispo-ess")
    assert {(r["k"], r["reference"], r["rule"]) for r in rows} == (  # a twin without its base rule is not paired
        {(k, "vcpo", rule) for k in (4, 16) for rule in rules} | {(k, "gspo-ess", "gspo") for k in (4, 16)})


def test_sweep_stops_at_the_budget(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep.subprocess, "call", fake_train(calls, steps=20))
    clock = iter(range(0, 10_000, 60))  # every reading of the clock is a minute later
    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    run_sweep(args_for(tmp_path, budget_minutes=4.5))
    # run 1 starts at minute 1 and takes a minute; then each run starts when spent + 1 minute fits in 4.5
    assert 1 <= len(calls) < 10
    spent_runs = len(calls)
    run_sweep(args_for(tmp_path, budget_minutes=4.5))  # a second call goes on where it stopped
    assert len(calls) > spent_runs


def test_a_control_without_its_vcpo_run_is_an_error_naming_it(tmp_path):
    run = sweep.Run("grpo" + sweep.CONTROL, 4, 0)
    with pytest.raises(RuntimeError, match="vcpo-k4-s0"):
        sweep.train_args(run, args_for(tmp_path))


def test_report_aggregates_over_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep.subprocess, "call", fake_train([], steps=20))
    args = args_for(tmp_path, seeds=[0, 1, 2])
    run_sweep(args)
    sweep.report(args)
    report = json.load(open(tmp_path / "sweep.json"))
    table = report["cells"]
    assert {(r["rule"], r["k"]) for r in table} == {("vcpo", 0), ("grpo", 0), ("vcpo", 4), ("grpo", 4),
                                                    ("grpo@vcpo-lr", 4)}
    row = next(r for r in table if r["rule"] == "vcpo" and r["k"] == 4)
    assert row["seeds"] == 3 and row["final_accuracy"][:2] == [pytest.approx(0.6), 0.0]
    assert row["eval_noise"] == pytest.approx(math.sqrt(0.6 * 0.4 / 100))
    assert row["reward_last10"][0] == pytest.approx(statistics.fmean([18 / 20, 19 / 20]))
    assert row["collapses"] == 0
    assert row["mean_lag"] == pytest.approx(statistics.fmean(t % 3 for t in range(20)))
    pair = next(p for p in report["paired"] if p["rule"] == "grpo" and p["k"] == 4)
    assert pair["seeds"] == 3 and pair["diff"] == pytest.approx(0.1) and pair["reference_ahead"] == 3
    assert os.path.getsize(tmp_path / "curves.png") > 0 and os.path.getsize(tmp_path / "accuracy.png") > 0
    out = capsys.readouterr().out
    assert "| vcpo | 4 | 3 | 0.600 +- 0.000 |" in out and "| 4 | vcpo | grpo | 3 | 0.100 +- 0.000 | 3 of 3 |" in out


def test_every_rule_is_the_loss_it_names(monkeypatch):
    """Each rule's `vcpo train` arguments parse, and the VCPO variants differ from `vcpo` in their one option."""
    import vcpo.trainer.process_guard
    import vcpo.trainer.run
    from vcpo.trainer.cli import main

    configs, schedules = {}, {}
    def train(cfg, **kwargs):
        configs[rule], schedules[rule] = cfg.vcpo_config(), cfg.lr_schedule  # and no summary, as on a rank > 0

    monkeypatch.setattr(vcpo.trainer.run, "train", train)
    monkeypatch.setattr(vcpo.trainer.process_guard, "guard", lambda: None)  # no watchdog for the test's process
    for rule, argv in sweep.RULES.items():
        assert main(["train", *argv]) == 0
    base = vars(configs["vcpo"])
    changed = {rule: {k: v for k, v in vars(c).items() if base[k] != v} for rule, c in configs.items()}
    assert changed["vcpo-opob-truncated"] == {"opob_truncated_weights": True}
    assert changed["vcpo-opob-median"] == {"opob_aggregation": "median"}
    assert changed["vcpo-no-ess"] == {"lr_rule": None}
    assert changed["vcpo-no-opob"] == {"advantage": "grpo", "grad_norms": "uniform"}
    assert changed["vcpo-ess-corrected"] == {"ess_on_corrected": True}
    assert changed["vcpo-ess-base-0.5"] == {"ess_base_ratio": 0.5}
    assert changed["vcpo-lr-linear"] == {"lr_rule": "linear"}
    assert changed["vcpo-c4"] == {"is_threshold": 4.0}
    assert changed["vcpo-lr-ema-0.9"] == {"lr_scale_ema": 0.9}
    assert changed["vcpo-cosine"] == {} and vars(configs["grpo-cosine"]) == vars(configs["grpo"])
    assert vars(configs["vcpo-no-opob-cosine"]) == vars(configs["vcpo-no-opob"])
    assert vars(configs["vcpo-lr-linear-cosine"]) == vars(configs["vcpo-lr-linear"])
    assert {r: s for r, s in schedules.items() if s != "constant"} == dict.fromkeys(sweep.SCHEDULES, "cosine")
    assert base["advantage"] == "opob" and base["lr_rule"] == "sqrt" and base["is_threshold"] == 8.0
    # every ESS-scaled rule is the square root unless its name says linear or it is a peer's twin, whatever
    # vcpo train's default
    linear = {r for r in sweep.RULES if "linear" in r or (r in sweep.PEER_RULES and r.endswith(sweep.ESS_TWIN))}
    assert {r: c.lr_rule for r, c in configs.items() if c.lr_rule is not None} == \
        {r: "linear" if r in linear else "sqrt" for r in sweep.RULES if configs[r].lr_rule is not None}
    assert sweep.GRID == [r for r in sweep.RULES
                          if r not in {**sweep.OPOB_VARIANTS, **sweep.ABLATIONS, **sweep.SCHEDULES, **sweep.PEER_RULES}]
    for peer in sweep.PEERS:  # each alone at a constant lr, and with the linear ESS-scaled step
        assert configs[peer].lr_rule is None and configs[f"{peer}-ess"].lr_rule == "linear"
        assert {k: v for k, v in vars(configs[f"{peer}-ess"]).items() if vars(configs[peer])[k] != v} == \
            {"lr_rule": "linear"}
    assert configs["gspo"].trust_region == "gspo" and configs["dppo"].trust_region == "dppo_tv"
    assert configs["icepop"].rejection == (("token_k1", 0.5, 5.0),)
