"""`vcpo train --ray` on a local Ray cluster (real Ray, 2 gloo trainer ranks as Ray actors): a trainer actor killed
mid-run ends the run with an error naming it and leaves nothing running (rank 0's vLLM engine processes included),
as does a SIGTERM during the engine's start-up, with the signal's exit code;
`--resume --ray` with a vLLM server in a Ray actor continues from the last checkpoint, and a SIGTERM to the driver
then checkpoints and ends the run cleanly, again with nothing left running (the server included)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

COMMON = ["--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16", "--eval-every", "0",
          "--checkpoint-every", "2", "--warm-start-steps", "30", "--no-progress", "--max-staleness", "0",
          "--steps", "500"]


def read_jsonl(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Run:
    """`vcpo train ARGS` as a subprocess, with every process it ever had below it (Ray's own processes, the rank
    and server actors, vLLM's) noted while it runs."""

    def __init__(self, args, env, log):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "vcpo.trainer.cli", "train", *args], env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.seen = {}

    def poll(self):
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return self.proc.poll()

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_for(self, condition, what, timeout=600):
        deadline = time.time() + timeout
        while not condition():
            assert self.poll() is None, f"exited before {what}:\n{self.output()[-6000:]}"
            assert time.time() < deadline, f"no {what} within {timeout} s:\n{self.output()[-6000:]}"
            time.sleep(0.2)

    def finish(self, timeout=300):
        deadline = time.time() + timeout
        while self.poll() is None:
            assert time.time() < deadline, self.output()[-6000:]
            time.sleep(0.2)
        return self.proc.returncode

    def assert_nothing_left(self, timeout=60):
        """Every process that was below the run has ended (a server's parent-death watch takes up to ~10 s)."""
        assert len(self.seen) >= 3  # at least Ray's processes and the two rank actors were seen
        deadline = time.time() + timeout
        alive = self.seen
        while alive and time.time() < deadline:
            alive = {pid: p for pid, p in alive.items()
                     if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
            time.sleep(0.5)
        assert not alive, [" ".join(p.cmdline())[:200] for p in alive.values()]

    def close(self):
        """A test that failed: its run ends too (SIGTERM twice, as a second Ctrl-C, then SIGKILL)."""
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                return
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


@pytest.mark.slow
def test_stopped_start_up_killed_rank_actor_then_resume_and_sigterm_leave_nothing_running(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    folder = tmp_path / "run"
    runs = []
    try:
        _stopped_during_start_up(tmp_path / "stopped", env, tmp_path, runs)
        _killed_then_resumed(folder, env, tmp_path, runs)
    finally:
        for run in runs:
            run.close()


def _stopped_during_start_up(folder, env, tmp_path, runs):
    """A SIGTERM while rank 0 starts its engine: the run stops at once with the signal's exit code (the rank's stop
    is returned to the driver, not taken by Ray for the actor's death) and leaves nothing running."""
    run = Run(["--ray", "--engine", "process", "--trainer-ranks", "2", *COMMON, "--output-dir", str(folder)], env,
              tmp_path / "start-up.log")
    runs.append(run)
    run.wait_for(lambda: "ray: trainer rank 1: pid" in run.output(), "the rank actors")
    time.sleep(3)
    assert "started in" not in run.output()  # still before the steps: the engine has not started
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=60) == 128 + signal.SIGTERM, run.output()[-6000:]
    assert "vcpo train: stopped by SIGTERM" in run.output() and "died" not in run.output()
    run.assert_nothing_left()


def _killed_then_resumed(folder, env, tmp_path, runs):
    first = Run(["--ray", "--engine", "process", "--trainer-ranks", "2", *COMMON, "--output-dir", str(folder)], env,
                tmp_path / "first.log")
    runs.append(first)
    first.wait_for(lambda: (folder / "checkpoints" / "step-000002").is_dir(), "checkpoint at step 2")
    pid = int(re.search(r"ray: trainer rank 1: pid (\d+)", first.output()).group(1))
    assert pid in first.seen
    os.kill(pid, signal.SIGKILL)
    assert first.finish() == 1, first.output()[-6000:]
    assert re.search(rf"vcpo train: error: trainer rank 1 \(Ray actor, pid {pid} on [\d.]+\) died", first.output())
    assert f"its last checkpoint with `vcpo train --resume {folder}`" in first.output()
    first.assert_nothing_left()
    done = int(sorted(os.listdir(folder / "checkpoints"))[-1].split("-")[1])

    # resumed (on Ray: the run's setting) with one vLLM server (an actor on the group's last bundle), then SIGTERM
    second = Run(["--resume", str(folder), "--engine", "server", "--engine-servers", "1", "--no-progress"],
                 env, tmp_path / "second.log")
    runs.append(second)
    second.wait_for(lambda: len(read_jsonl(folder / "metrics.jsonl")) >= done + 2, "2 steps after the resume")
    server = json.load(open(folder / "servers" / "servers.json"))[0]
    assert server["pid"] in second.seen  # below the run: started by its Ray actor
    assert server["url"].startswith("http://127.0.0.1:")  # on the trainer's node: loopback only (and a key)
    second.proc.send_signal(signal.SIGTERM)
    assert second.finish() == 0, second.output()[-6000:]
    assert f"resuming {folder} from step {done}" in second.output()
    second.assert_nothing_left()
    assert not os.path.exists(server["tmp"])
    summary = json.load(open(folder / "summary.json"))
    assert summary["interrupted"] and summary["steps"] >= done + 2
    assert sorted(os.listdir(folder / "checkpoints"))[-1] == f"step-{summary['steps']:06d}"
    rows = read_jsonl(folder / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss", "ess_ratio", "lr_scale", "grad_norm", "reward"))
    uids = [tuple(r["uid"]) for r in read_jsonl(folder / "rollouts.jsonl")]
    assert len(uids) == len(set(uids)) == summary["steps"] * 16  # k = 0: each step's batch exactly once


def test_ray_settings_are_checked():
    from vcpo.trainer.config import make_config

    with pytest.raises(ValueError, match="ray must be local or a Ray cluster's address"):
        make_config(ray=5).validate()
    proc = subprocess.run([sys.executable, "-m", "vcpo.trainer.cli", "train", "--ray", "127.0.0.1:1", "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "ray: nothing answers at '127.0.0.1:1'" in proc.stderr, proc.stderr[-3000:]
