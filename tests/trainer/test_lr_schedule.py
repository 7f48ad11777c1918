"""The lr over a run (`lr_schedule`, vcpo/trainer/lr_schedule.py): the factor of each step against torch's own
schedulers, and a run of the trainer's loop (a fake engine, in this process) whose optimizer steps at the scheduled
lr times the ESS scale, on rank 0 and after a resume."""

import json
import math

import pytest
import torch
from support.fake_engine import FakeEngine, serve

from vcpo.trainer.lr_schedule import LR_SCHEDULES, lr_factor


def torch_factors(schedule, steps, warmup, min_ratio):
    """The lr of steps 1..steps from torch.optim.lr_scheduler (an independent implementation), base lr 1."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    S = torch.optim.lr_scheduler
    after = steps - warmup - 1  # the decay's length in steps after its first
    decay = {"constant": lambda: S.ConstantLR(opt, factor=1.0, total_iters=0),
             "cosine": lambda: S.CosineAnnealingLR(opt, T_max=after, eta_min=min_ratio),
             "linear": lambda: S.LinearLR(opt, start_factor=1.0, end_factor=min_ratio, total_iters=after)}[schedule]
    if warmup:
        scheduler = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                                    total_iters=warmup - 1), decay()], milestones=[warmup])
    else:
        scheduler = decay()
    factors = []
    for _ in range(steps):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return factors


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
@pytest.mark.parametrize("steps, warmup, min_ratio", [(40, 0, 0.1), (40, 5, 0.0), (7, 2, 0.3), (300, 30, 0.05)])
def test_factors_match_torchs_schedulers(schedule, steps, warmup, min_ratio):
    ours = [lr_factor(s, steps, schedule, warmup, min_ratio) for s in range(1, steps + 1)]
    assert ours == pytest.approx(torch_factors(schedule, steps, warmup, min_ratio), rel=1e-9, abs=1e-12)
    if schedule != "constant":
        assert ours[warmup] == 1.0 and ours[-1] == pytest.approx(min_ratio, abs=1e-12)
    # a run extended on resume holds the last step's lr
    assert lr_factor(steps + 5, steps, schedule, warmup, min_ratio) == pytest.approx(ours[-1], abs=1e-12)


def test_edges():
    assert [lr_factor(s, 4, "cosine", 4, 0.1) for s in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]  # warm-up to the end
    assert lr_factor(1, 1, "linear", 0, 0.1) == 1.0  # one step: the first after the warm-up is at the full lr
    assert lr_factor(2, 2, "cosine", 0, 0.2) == pytest.approx(0.2)
    assert math.isclose(lr_factor(6, 11, "cosine", 0, 0.0), 0.5)  # the half-way point of a cosine


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_run_steps_at_the_scheduled_lr_times_the_ess_scale_across_a_resume(monkeypatch, tmp_path, capsys):
    """12 steps of cosine with 3 of warm-up, stopped by SIGTERM with batch 6 in flight and resumed: every step's
    logged lr is lr x factor x lr_scale, and the AdamW of each checkpoint holds its step's scheduled lr (scale_lr
    restores it after the step). Then extended to 16 steps: the decay's end moves to step 16, as the resume says."""
    from vcpo.trainer import make_config
    from vcpo.trainer import run as run_module

    serve(monkeypatch, FakeEngine(block_from=6), FakeEngine(), FakeEngine())
    folder = str(tmp_path / "run")
    cfg = make_config(output_dir=folder, steps=12, engine="inprocess", prompts_per_step=2, responses_per_prompt=2,
                      max_new_tokens=4, eval_size=0, warm_start_steps=0, checkpoint_every=4, keep_checkpoints=5,
                      lr=1e-3, lr_schedule="cosine", lr_warmup_steps=3, lr_min_ratio=0.2, max_staleness=1)
    assert run_module.train(cfg, progress=False)["interrupted"]
    stopped = len(read_jsonl(f"{folder}/metrics.jsonl"))
    assert 4 <= stopped < 12
    run_module.train(run_module.resume_config(folder), resume=True, progress=False)
    rows = read_jsonl(f"{folder}/metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        expected = 1e-3 * lr_factor(r["step"], 12, "cosine", 3, 0.2) * r["lr_scale"]
        assert not r["skipped"] and r["lr"] == pytest.approx(expected, rel=1e-12)
    assert len({round(r["lr"] / r["lr_scale"], 12) for r in rows}) == 11  # steps 3 and 4 are both at the full lr
    for step in (stopped, 12):
        saved = torch.load(f"{folder}/checkpoints/step-{step:06d}/optimizer.pt", weights_only=True)
        assert saved["param_groups"][0]["lr"] == pytest.approx(1e-3 * lr_factor(step, 12, "cosine", 3, 0.2))
    capsys.readouterr()
    run_module.train(run_module.resume_config(folder, steps=16), resume=True, progress=False)
    assert (f"lr_schedule cosine: the lr decays to 0.2 x lr at step 16; step 13 is at "
            f"{lr_factor(13, 16, 'cosine', 3, 0.2):.3g} x lr") in capsys.readouterr().out
    rows = read_jsonl(f"{folder}/metrics.jsonl")[12:]
    assert [r["step"] for r in rows] == [13, 14, 15, 16]
    for r in rows:
        assert r["lr"] == pytest.approx(1e-3 * lr_factor(r["step"], 16, "cosine", 3, 0.2) * r["lr_scale"], rel=1e-12)
