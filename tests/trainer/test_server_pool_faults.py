"""Faults of `engine: server` on real vLLM servers started by `vcpo train --engine-servers`: one server killed
mid-run (the run goes on with the other), then the last one (checkpoint and a clear error naming both URLs),
then `--resume` with a different number of servers: every sample is consumed exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

STEPS, K = 40, 2

pytestmark = pytest.mark.slow  # vLLM servers started and killed


def read_jsonl(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie is dead; its parent has not reaped it yet
    except FileNotFoundError:
        return True


def test_servers_killed_mid_run_then_resume_with_another_pool(tmp_path):
    env = {**os.environ, "VCPO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    folder = tmp_path / "run"
    args = ["--engine", "server", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
            "--eval-every", "10", "--checkpoint-every", "5", "--warm-start-steps", "30", "--no-progress",
            "--steps", str(STEPS), "--max-staleness", str(K)]
    proc = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "train", *args, "--engine-servers", "2",
                             "--output-dir", str(folder)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = folder / "metrics.jsonl"

    def wait_for_step(n):
        deadline = time.time() + 600
        while len(read_jsonl(metrics)) < n:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-5000:]
            time.sleep(0.01)

    wait_for_step(4)
    servers = json.load(open(folder / "servers" / "servers.json"))
    assert len(servers) == 2 and all(s["url"].startswith("http://127.0.0.1:") for s in servers)
    os.killpg(servers[0]["pid"], signal.SIGKILL)  # the server and its engine processes
    killed_at = len(read_jsonl(metrics))
    wait_for_step(killed_at + 8)  # the run goes on with one server
    os.killpg(servers[1]["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-5000:]
    assert "every rollout server is down" in err and all(s["url"] in err for s in servers)
    assert "Checkpoint written at step" in err and f"--resume {folder}" in err
    assert f"rollout server {servers[0]['url']} is down" in out + err
    rows = read_jsonl(metrics)
    assert any(r["servers_up"] == 1 for r in rows) and len(rows) < STEPS
    for s in servers:  # nothing left running, nothing left in the temporary directory
        assert gone(s["pid"]) and not os.path.exists(s["tmp"])
    checkpoint = sorted(os.listdir(folder / "checkpoints"))[-1]

    resumed = subprocess.run([sys.executable, "-m", "vcpo.cli", "train", "--resume", str(folder),
                              "--engine-servers", "1", "--no-progress"], env=env, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"resuming {folder} from step {int(checkpoint.split('-')[1])}" in resumed.stdout + resumed.stderr

    from vcpo.trainer.run import BUILTIN_PROBLEMS
    from vcpo.trainer.task import PromptStream

    stream = PromptStream(BUILTIN_PROBLEMS - 16, seed=0)
    expected = {(j, i, r) for j in range(STEPS) for i in stream.batch(j, 4) for r in range(4)}
    rollouts = read_jsonl(folder / "rollouts.jsonl")
    uids = [tuple(r["uid"]) for r in rollouts]
    assert len(uids) == len(set(uids)) and set(uids) == expected  # every sample exactly once
    assert all(0 <= r["step"] - 1 - r["version"] <= K for r in rollouts)
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, STEPS + 1))
    summary = json.load(open(folder / "summary.json"))
    assert summary["steps"] == STEPS and len(summary["servers"]) == 1 and summary["servers"][0]["up"]
    new = json.load(open(folder / "servers" / "servers.json"))
    assert len(new) == 1 and gone(new[0]["pid"]) and not os.path.exists(new[0]["tmp"])


def test_sigterm_checkpoints_and_stops_the_servers_and_sigkill_takes_them_down(tmp_path):
    """SIGTERM (a scheduler's stop): the step finishes, a checkpoint is written, the local server is stopped and
    its temporary folder removed, exit 0. SIGKILL of the trainer: its servers end too (they are told by the
    kernel when their parent dies)."""
    env = {**os.environ, "VCPO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    folder = tmp_path / "run"
    args = ["--engine-servers", "1", "--no-progress", "--steps", "200", "--checkpoint-every", "100"]
    first = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "train", "--engine", "server", "--prompts-per-step",
                              "4", "--responses-per-prompt", "4", "--eval-size", "16", "--eval-every", "0",
                              "--warm-start-steps", "30", "--output-dir", str(folder), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = folder / "metrics.jsonl"

    def wait_for_steps(proc, n):
        deadline = time.time() + 600
        while len(read_jsonl(metrics)) < n:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-5000:]
            time.sleep(0.01)

    wait_for_steps(first, 3)
    server = json.load(open(folder / "servers" / "servers.json"))[0]
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-5000:]
    summary = json.load(open(folder / "summary.json"))
    assert summary["interrupted"] and 3 <= summary["steps"] < 200
    assert f"interrupted at step {summary['steps']}" in out + err
    assert sorted(os.listdir(folder / "checkpoints")) == [f"step-{summary['steps']:06d}"]
    assert gone(server["pid"]) and not os.path.exists(server["tmp"])

    second = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "train", "--resume", str(folder), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(second, summary["steps"] + 2)
    server = json.load(open(folder / "servers" / "servers.json"))[0]
    second.kill()
    out, err = second.communicate(timeout=60)
    assert f"resuming {folder} from step {summary['steps']}" in out + err
    deadline = time.time() + 60
    while not gone(server["pid"]) and time.time() < deadline:
        time.sleep(0.2)
    assert gone(server["pid"]) and not os.path.exists(server["tmp"])
