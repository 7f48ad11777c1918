"""Faults of `engine: server` on real vLLM servers started by `vcpo train --engine-servers`: one server killed
during a weight sync (the run goes on with the other), then the last one mid-run (checkpoint and a clear error
naming both URLs), then `--resume` with a different number of servers: every sample is consumed exactly once; all
under a dead HTTP_PROXY, the servers on Unix sockets in private folders, their key in no file or log line
(docs/scale.md, "Who can drive a server"). The trainer killed (its servers go too) and resumed, then stopped by
SIGTERM with a batch in flight (out within 10 s)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support.processes import RunProcesses
from support.vllm_metrics import requests_running

from vcpo.trainer.engines.servers import KEY_ENV
from vcpo.trainer.net import free_port

pytest.importorskip("vllm")

STEPS, K = 24, 2
PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# long_answers' responses: nearly all of its 512 positions, so a batch's generation outlasts a step and its
# checkpoint even on a loaded machine (the SIGTERM must find a batch in flight; at 300 one was once done first)
ANSWER_TOKENS = 480
DRIVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "faulty_train.py")

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


def test_servers_killed_mid_sync_and_mid_run_then_resume_with_another_pool(tmp_path):
    """Server 0 SIGKILLed at the sync of version 3, paused and about to reload (tests/support/faulty_train.py): the
    sync goes on with server 1 and so does the run; server 1 SIGKILLed mid-run: a checkpoint and an error; a resume
    with one new server consumes every sample exactly once. A dead proxy in the environment, and the key
    (VLLM_API_KEY's here, to look for it) in no file of the run folder and no line of output."""
    key = "the-key-" + os.urandom(8).hex()
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = {**{k: v for k, v in os.environ.items() if k.upper() != "NO_PROXY"}, **dict.fromkeys(PROXY_VARIABLES,
           dead_proxy), KEY_ENV: key, "VCPO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    folder = tmp_path / "run"
    args = ["--engine", "server", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
            "--eval-every", "10", "--checkpoint-every", "5", "--warm-start-steps", "30", "--no-progress",
            "--steps", str(STEPS), "--max-staleness", str(K)]
    faults = {"kill_server_mid_sync": {"version": 3, "run_dir": str(folder)}}
    proc = subprocess.Popen([sys.executable, DRIVER, json.dumps(faults), *args, "--engine-servers", "2",
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
    # no port another user can reach: a socket in the server's private folder
    assert len(servers) == 2 and all(s["url"] == f"unix:{s['tmp']}/http.sock" for s in servers)
    killed_at = len(read_jsonl(metrics))
    wait_for_step(killed_at + 8)  # the run goes on with one server
    assert gone(servers[0]["pid"])
    os.killpg(servers[1]["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-5000:]
    assert "every rollout server is down" in err and all(s["url"] in err for s in servers)
    assert "Checkpoint written at step" in err and f"--resume {folder}" in err
    assert f"SIGKILL to server {servers[0]['url']} (pid {servers[0]['pid']}) during the sync of version 3" in out
    # the sync's reload or a generation request held by the paused server: whichever sees the death first
    assert f"rollout server {servers[0]['url']} is down (" in out + err
    rows = read_jsonl(metrics)
    assert any(r["servers_up"] == 1 for r in rows) and len(rows) < STEPS
    for s in servers:  # nothing left running, nothing left in the temporary directory
        assert gone(s["pid"]) and not os.path.exists(s["tmp"])
    checkpoint = sorted(os.listdir(folder / "checkpoints"))[-1]

    resumed = subprocess.run([sys.executable, "-m", "vcpo.trainer.cli", "train", "--resume", str(folder),
                              "--engine-servers", "1", "--no-progress"], env=env, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"resuming {folder} from step {int(checkpoint.split('-')[1])}" in resumed.stdout + resumed.stderr

    from vcpo.trainer.task import BUILTIN_PROBLEMS
    from vcpo.trainer.data import PromptStream

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
    used = {r["server"] for r in rollouts}
    assert new[0]["url"] in used and used <= {s["url"] for s in servers + new}
    written = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]
    assert len(written) > 5 and not [f for f in written if key.encode() in open(f, "rb").read()]
    assert key not in out + err + resumed.stdout + resumed.stderr


def long_answers(folder):
    """A tiny random Llama (the built-in architecture, 512 positions) that never ends a response: its LM head is
    scaled up so the logits are peaked, and the EOS row is 0, so EOS is never sampled and every response runs to
    max_new_tokens (a batch takes long to generate, the trainer's step on its few sequences does not); and a
    data file of addition prompts for it. Returns (model folder, data file)."""
    from vcpo.trainer import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyRecipe(max_positions=512), len(tok))
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(100)
        head[tok.eos_token_id] = 0
    model.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(40)))
    return str(folder / "model"), str(data)


def test_sigkill_takes_the_servers_down_and_sigterm_with_a_batch_in_flight_exits_within_10_s(tmp_path):
    """SIGKILL of the trainer: within 10 s no process it started is alive (its server and the server's engine
    processes, its reward workers, its watchdog), and the server's temporary folder is gone; the resume removes the
    checkpoint being written and drops the log lines after its checkpoint. SIGTERM of the resumed run with a batch
    in flight (a scheduler's stop: SIGKILL follows within about 30 s): the step finishes, the
    checkpoint is written, the generation is aborted, the server stopped and its temporary folder removed, exit 0
    within 10 s; every sample consumed by the two runs is in rollouts.jsonl exactly once."""
    from vcpo.trainer.run_folder import RunFolder
    from vcpo.trainer.data import PromptStream, load_problems, split_problems

    key = "the-key-" + os.urandom(8).hex()  # known here, to ask the server what it is generating
    env = {**os.environ, KEY_ENV: key, "VCPO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    model, data = long_answers(tmp_path)
    folder = tmp_path / "run"
    args = ["--engine-servers", "1", "--no-progress", "--steps", "200", "--checkpoint-every", "2"]
    first = subprocess.Popen([sys.executable, "-m", "vcpo.trainer.cli", "train", "--engine", "server", "--model", model,
                              "--data", data, "--max-new-tokens", str(ANSWER_TOKENS), "--prompts-per-step", "2",
                              "--responses-per-prompt", "2", "--loss", "grpo", "--max-staleness", "2", "--eval-size",
                              "8", "--eval-every", "0", "--output-dir", str(folder), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = folder / "metrics.jsonl"

    def wait_for(proc, done):
        deadline = time.time() + 900
        while not done():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-5000:]
            time.sleep(0.01)

    processes = RunProcesses(first.pid)
    wait_for(first, lambda: os.path.isdir(folder / "checkpoints" / "step-000002"))  # a checkpoint to resume from
    server = json.load(open(folder / "servers" / "servers.json"))[0]
    first.kill()
    first.communicate(timeout=60)
    assert not processes.left_alive(within=10.0)  # the server, its engine processes, the reward workers, ...
    deadline = time.time() + 60
    while not gone(server["pid"]) and time.time() < deadline:
        time.sleep(0.2)
    assert gone(server["pid"]) and not os.path.exists(server["tmp"])
    resumed_from = int(os.path.basename(RunFolder.latest_checkpoint(str(folder))).split("-")[1])

    second = subprocess.Popen([sys.executable, "-m", "vcpo.trainer.cli", "train", "--resume", str(folder), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # its lines reach the file whole at each checkpoint (count them by their ends: one may be half written)
    wait_for(second, lambda: metrics.read_bytes().count(b"\n") >= resumed_from + 2)
    server = json.load(open(folder / "servers" / "servers.json"))[0]
    # a batch in flight: the producer may be ahead by k and waiting for the next version, or loading it
    wait_for(second, lambda: requests_running(server["url"], key) > 0)
    signalled = time.perf_counter()
    second.send_signal(signal.SIGTERM)
    out, err = second.communicate(timeout=300)
    exit_seconds = time.perf_counter() - signalled
    assert second.returncode == 0, err[-5000:]
    print(f"SIGTERM to exit: {exit_seconds:.1f} s")
    assert f"resuming {folder} from step {resumed_from}" in out + err
    assert "batch(es) in flight abandoned" in out + err  # the SIGTERM came with a batch in flight
    assert exit_seconds < 10, (exit_seconds, err[-3000:])
    summary = json.load(open(folder / "summary.json"))
    steps = summary["steps"]
    assert summary["interrupted"] and resumed_from + 2 <= steps < 200
    assert f"interrupted at step {steps}" in out + err
    assert sorted(os.listdir(folder / "checkpoints"))[-1] == f"step-{steps:06d}"  # and no .tmp left
    assert gone(server["pid"]) and not os.path.exists(server["tmp"])

    train, _ = split_problems(load_problems(data, "prompt", "answer"), 8, 0)
    stream = PromptStream(len(train), seed=0)
    uids = [tuple(r["uid"]) for r in read_jsonl(folder / "rollouts.jsonl")]
    assert len(uids) == len(set(uids))
    assert set(uids) == {(j, i, r) for j in range(steps) for i in stream.batch(j, 2) for r in range(2)}
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, steps + 1))
    assert all(len(r["response_ids"]) == ANSWER_TOKENS for r in read_jsonl(folder / "rollouts.jsonl"))
