"""`vcpo train --memory-budget-gib`: steps 1 and 2 at one prompt group per micro-batch, step 3 at two, then the
fitted size (here, a budget every batch fits: the whole batch), in metrics.jsonl and the log, the fit in GiB; with vcpo's own
micro_batch_size it is refused, naming both."""

import json

import pytest

from support.fake_engine import serve
from vcpo.trainer import make_config
from vcpo.trainer import run as run_module


def _memory_of_one_gib_and_a_mib_a_token(monkeypatch):
    """The step's peak as 1 GiB + 1 MiB per token of its micro-batch: a process's resident set, which the fit reads
    on a CPU, moves with whatever else the test process allocates, so that a peak may not grow with the tokens
    (the fit then keeps the larger measured size). test_micro_batch_fit.py measures real steps."""
    from vcpo import memory
    tokens = [0]
    inner = memory.step

    def step(model, optimizer, batch, config, process_group=None):
        count, width = batch.input_ids.shape
        tokens[0] = min(config.micro_batch_size or count, count) * width
        return inner(model, optimizer, batch, config, process_group=process_group)

    monkeypatch.setattr(memory, "step", step)
    monkeypatch.setattr(memory, "peak_reset", lambda device: memory.GIB)
    monkeypatch.setattr(memory, "peak_bytes", lambda device: memory.GIB + tokens[0] * 2 ** 20)


def test_the_micro_batch_size_is_measured_then_fitted(monkeypatch, tmp_path, capsys):
    serve(monkeypatch)
    _memory_of_one_gib_and_a_mib_a_token(monkeypatch)
    folder = str(tmp_path / "run")
    cfg = make_config(output_dir=folder, steps=5, engine="inprocess", prompts_per_step=3, responses_per_prompt=4,
                      max_new_tokens=6, eval_size=0, warm_start_steps=0, max_staleness=1, memory_budget_gib=1000,
                      reward="support.reward_fns:token_parity")
    run_module.train(cfg, progress=False)
    rows = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
    assert [r["micro_batch_size"] for r in rows] == [4, 4, 8, 12, 12]
    assert all(not r["skipped"] for r in rows)
    out = capsys.readouterr()
    assert "memory_budget_gib: 1.00 GiB fixed + 1.000 MiB a padded token" in out.out + out.err
    assert "the whole batch" in out.out + out.err


def test_a_budget_and_a_micro_batch_size_are_refused_together():
    with pytest.raises(ValueError, match=r"memory_budget_gib \(8\) chooses the micro-batch size; vcpo sets "
                                         r"micro_batch_size \(4\): give one or the other"):
        make_config(memory_budget_gib=8, vcpo={"micro_batch_size": 4})
