"""The trainer's precision (`precision`, docs/trainer.md "Precision") on a short run with the fake engine: the
weights, the checkpoints and AdamW's state in the dtype each precision says, the step's autocast, a resume in the
same dtype, and the settings that are refused."""

import json

import pytest
import torch
from safetensors import safe_open

from support.fake_engine import serve
from vcpo.trainer import make_config
from vcpo.trainer import run as run_module

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16"}
PRECISIONS = {"fp32": (torch.float32, None), "bf16-mixed": (torch.float32, "bfloat16"), "bf16": (torch.bfloat16, None)}


def _tensor_dtypes(folder):
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_run_keeps_its_precision_across_a_resume(precision, monkeypatch, tmp_path):
    serve(monkeypatch)
    folder = str(tmp_path / "run")
    cfg = make_config(output_dir=folder, steps=2, engine="inprocess", prompts_per_step=2, responses_per_prompt=2,
                      max_new_tokens=4, eval_size=0, warm_start_steps=0, checkpoint_every=2, lr=1e-3,
                      precision=precision)
    run_module.train(cfg, progress=False)
    run_module.train(run_module.resume_config(folder, steps=4), resume=True, progress=False)
    dtype, autocast = PRECISIONS[precision]
    config = json.load(open(f"{folder}/config.json"))
    assert config["settings"]["precision"] == precision and config["vcpo"]["autocast"] == autocast
    rows = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and not any(r["skipped"] for r in rows)
    for step in (2, 4):
        checkpoint = f"{folder}/checkpoints/step-{step:06d}"
        assert _tensor_dtypes(checkpoint) == {SAFETENSORS_NAMES[dtype]}
        state = torch.load(f"{checkpoint}/optimizer.pt", weights_only=True)["state"]
        assert {s["exp_avg"].dtype for s in state.values()} == {dtype}


def test_vcpo_autocast_follows_the_precision_setting():
    with pytest.raises(ValueError, match="vcpo.autocast follows the precision setting: set precision instead"):
        make_config(vcpo={"autocast": "bfloat16"})
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16-mixed', 'bf16'\], got 'fp16'"):
        make_config(precision="fp16")
