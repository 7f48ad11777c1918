"""Fault injection (issue 24): a run of `vcpo train` SIGKILLed at five random moments (one of them in the middle of
a checkpoint write) and resumed each time, with rare non-finite behaviour log-probs and a reward that now and then
hangs, burns the CPU holding the interpreter lock, or raises; and a full disk at a checkpoint. The rollouts come from
tests/support/fake_engine.py (these are faults of the trainer's loop and files, not of vLLM; real servers killed
mid-run and mid-sync are in test_server_pool_faults.py), the faults from tests/support/faulty_train.py."""

import json
import os
import random
import subprocess
import sys
import time
import zlib

import pytest
import torch
from safetensors.torch import load_file

from support.fake_engine import FakeEngine
from support.processes import RunProcesses

pytestmark = pytest.mark.slow  # vcpo train subprocesses

DRIVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "faulty_train.py")
STEPS, PROMPTS, RESPONSES, POISON = 36, 2, 2, 13
SETTINGS = dict(prompts_per_step=PROMPTS, responses_per_prompt=RESPONSES, max_new_tokens=8, eval_size=0,
                warm_start_steps=0, checkpoint_every=3, max_staleness=2, reward="support.reward_fns:faulty",
                reward_timeout=1.0, reward_errors="zero")
ENGINE = {"poison": POISON, "seconds": 0.1}  # 2 in 13 batches have a -inf behaviour log-prob (batch 0 among them)


def cli_args(folder):
    return ["--output-dir", str(folder), "--steps", str(STEPS), "--no-progress",
            *[a for k, v in SETTINGS.items() for a in (f"--{k.replace('_', '-')}", str(v))]]


def launch(faults, args):
    return subprocess.Popen([sys.executable, DRIVER, json.dumps(faults), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def expected_uids(steps):
    from vcpo.trainer.task import BUILTIN_PROBLEMS
    from vcpo.trainer.data import PromptStream

    stream = PromptStream(BUILTIN_PROBLEMS, seed=0)  # eval_size 0: every problem trains
    return {(j, i, r) for j in range(steps) for i in stream.batch(j, PROMPTS) for r in range(RESPONSES)}


def weights(folder):
    return load_file(os.path.join(folder, "checkpoints", f"step-{STEPS:06d}", "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, monkeypatch_module):
    """The same run without a kill, in this process."""
    from contextlib import contextmanager

    from vcpo.trainer import make_config
    from vcpo.trainer import run as run_module

    @contextmanager
    def start_engine(cfg, **kwargs):
        yield FakeEngine(**ENGINE), 0.0

    monkeypatch_module.setattr(run_module, "start_engine", start_engine)
    folder = tmp_path_factory.mktemp("reference") / "run"
    summary = run_module.train(make_config(output_dir=str(folder), steps=STEPS, **SETTINGS), progress=False)
    assert summary["steps"] == STEPS and not summary["interrupted"]
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_sigkill_at_five_random_moments_then_resume_loses_no_sample(tmp_path, reference):
    """Five SIGKILLs at random moments (seeded, the seed printed): the first once a checkpoint exists, a few steps
    on; the second during start-up (loading, the resume's checks); the third while a checkpoint is being written
    (between its files and its rename); the fourth in the middle of a weight sync; the last a random number of steps
    after the resumed step. Each time no process the run started (its reward workers, its watchdog) is alive 10 s
    later, and `--resume` goes on; the last launch finishes the run. Every sample is consumed exactly once, the steps
    are 1..STEPS once each, the final weights are finite and equal, bit for bit, to those of the same run never killed
    (the rollouts do not depend on the weights here, so the lag each batch had does not matter)."""
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    folder = tmp_path / "run"
    metrics, marker = folder / "metrics.jsonl", tmp_path / "writing"
    log, kills, leftovers = [], [], []

    def lines():  # whole lines (the last may be half written)
        return metrics.read_bytes().count(b"\n") if metrics.exists() else 0

    def wait_for(proc, done, started):
        while not done():
            assert proc.poll() is None and time.time() < started + 600, \
                f"seed {seed}: " + proc.communicate()[0][-5000:]
            time.sleep(0.01)

    for kill in range(5):
        faults = {"fake_engine": ENGINE, **({"slow_commit": str(marker)} if kill == 2 else {}),
                  **({"slow_sync": str(marker)} if kill == 3 else {})}
        base = lines()
        proc = launch(faults, cli_args(folder) if kill == 0 else ["--resume", str(folder), "--no-progress"])
        processes = RunProcesses(proc.pid)
        started = time.time()
        if kill == 1:
            time.sleep(rng.uniform(0, 5))
            moment = f"{time.time() - started:.1f} s after the launch"
        elif kill == 2:
            wait_for(proc, marker.exists, started)
            moment = "during a checkpoint write"
            assert any(n.endswith(".tmp") for n in os.listdir(folder / "checkpoints"))
        elif kill == 3:
            wait_for(proc, marker.exists, started)
            moment = "during a weight sync"
        else:
            ahead = 3 if kill == 0 else rng.randint(1, 5)  # the first: the checkpoint of step 3 is written
            wait_for(proc, lambda: lines() >= base + ahead, started)
            time.sleep(rng.uniform(0, 0.5))
            moment = f"{time.time() - started:.1f} s after the launch, {lines() - base} steps on"
        assert proc.poll() is None, f"launch {kill} ended before its kill (seed {seed}): " + proc.communicate()[0]
        if marker.exists():
            marker.unlink()
        proc.kill()
        log.append(proc.communicate()[0])
        kills.append(moment)
        left = processes.left_alive(within=10.0)
        assert not left, f"kill {kill} ({moment}, seed {seed}) left {left}"
        leftovers.append(len(left))
    proc = launch({"fake_engine": ENGINE}, ["--resume", str(folder), "--no-progress"])
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-5000:]
    print(f"kill seed {seed}: " + "; ".join(kills))

    rollouts = read_jsonl(folder / "rollouts.jsonl")
    uids = [tuple(r["uid"]) for r in rollouts]
    expected = expected_uids(STEPS)
    lost, repeated = len(expected - set(uids)), len(uids) - len(set(uids))
    print(f"faults: 5 SIGKILLs, {sum(r.get('reward_error') is not None for r in rollouts)} failed reward calls, "
          f"{sum(r['skipped'] for r in read_jsonl(folder / 'metrics.jsonl'))} skipped steps; "
          f"{len(uids)} samples consumed, {lost} lost, {repeated} consumed twice; "
          f"{sum(leftovers)} processes left alive 10 s after the kills")
    assert lost == 0 and repeated == 0 and set(uids) == expected
    assert [r["step"] for r in read_jsonl(folder / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert "removed" in "".join(log[3:]) + out and ".tmp: a checkpoint that was being written" in "".join(log[3:]) + out
    got, want = weights(folder), weights(reference)
    assert all(torch.isfinite(t).all() for t in got.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    rows = read_jsonl(folder / "metrics.jsonl")
    assert any(r["skipped"] for r in rows) and any(r.get("reward_errors", 0) for r in rows)  # the faults happened
    for r in rollouts:  # the prompt text once per group, the answer on every sample
        assert ("prompt" in r) == (r["uid"][2] == 0)
        if "prompt" in r:
            a, b = r["prompt"].removesuffix("=").split("+")
            assert int(a) + int(b) == int(r["answer"])
    scored = [r for r in rollouts if r.get("reward_error") is None]  # each with the text its reward saw
    assert all(r["reward"] == zlib.crc32(r["response"].encode()) % 7 / 6 for r in scored) and len(scored) > 100


def test_a_full_disk_at_a_checkpoint_is_an_error_that_keeps_the_previous_one(tmp_path):
    """The real writers failing while they write the checkpoint of step 6 (a file size limit: EFBIG, as ENOSPC on a
    full disk): exit 1 with an error naming the cause and the checkpoint of step 3, which stays whole; the partial
    one is removed. Once there is room, --resume finishes the run from step 3
    with every sample once."""
    from vcpo.trainer.run_folder import unreadable

    folder = tmp_path / "run"
    proc = launch({"fake_engine": ENGINE, "disk_full_at_step": 6}, cli_args(folder))
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 1, out[-5000:]
    newest = folder / "checkpoints" / "step-000003"
    assert "vcpo train: error: writing the checkpoint of step 6 failed (" in out and "File too large" in out and \
        f"the newest whole checkpoint is {newest}, untouched" in out and f"--resume {folder}" in out
    assert "Traceback" not in out
    assert sorted(os.listdir(folder / "checkpoints")) == ["step-000003"] and unreadable(str(newest)) is None

    proc = launch({"fake_engine": ENGINE}, ["--resume", str(folder), "--no-progress", "--steps", "9"])
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0 and f"resuming {folder} from step 3" in out, out[-5000:]
    uids = [tuple(r["uid"]) for r in read_jsonl(folder / "rollouts.jsonl")]
    assert len(uids) == len(set(uids)) and set(uids) == expected_uids(9)
