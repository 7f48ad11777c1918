"""Every `--loss` preset of `vcpo train` (docs/trainer.md, "Update rules") runs end to end: a short run with the fake
engine at a lag, each step finite and taken, the trust region's and the rejection's statistics in the metrics."""

import json
import math
import pytest

from support.fake_engine import serve
from vcpo_kernels.options import CLIPPED_RULES
from vcpo.trainer import LOSS_PRESETS, make_config
from vcpo.trainer import run as run_module


@pytest.mark.parametrize("loss", list(LOSS_PRESETS))
def test_every_preset_trains(loss, monkeypatch, tmp_path):
    serve(monkeypatch)
    folder = str(tmp_path / "run")
    cfg = make_config(output_dir=folder, steps=3, engine="inprocess", prompts_per_step=2, responses_per_prompt=4,
                      max_new_tokens=6, eval_size=0, warm_start_steps=0, lr=1e-2, loss=loss, max_staleness=2,
                      reward="support.reward_fns:token_parity")
    run_module.train(cfg, progress=False)
    rows = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["advantage_abs_mean"] > 0 for r in rows)  # rewards that differ: the loss is not trivially 0
    for r in rows:
        assert not r["skipped"] and math.isfinite(r["loss"]) and 0 <= r["ppo_clip_fraction"] <= 1
        assert 0 <= r["rejected_fraction"] <= 1
    options = cfg.vcpo_config()
    # The fake engine's mu = e^-1 is far above the tiny model's pi: the bounds act, except CISPO's, an upper cap only
    if options.trust_rule in CLIPPED_RULES and options.trust_rule != "cispo":
        assert any(r["ppo_clip_fraction"] > 0 for r in rows)
    if options.trust_rule in ("none", "sapo"):
        assert all(r["ppo_clip_fraction"] == 0 for r in rows)
    if not options.rejection:
        assert all(r["rejected_fraction"] == 0 for r in rows)
