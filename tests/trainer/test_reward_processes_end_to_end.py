"""The reward pool's worker processes in a real `vcpo train` (vLLM in-process, a random tiny model, a few steps),
on data whose answers include the power tower 9^{9^{9}} that froze a run (issue 24): math-verify runs away on it
holding the interpreter lock. Each run is a `vcpo` process, started from its run's folder: the console script,
a reward module in the current directory; after it ends no process it started is left."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytest.importorskip("vllm")
pytest.importorskip("math_verify")
pytestmark = pytest.mark.slow  # vcpo train with a vLLM engine

TOWER = "9^{9^{9}}"
VCPO = os.path.join(os.path.dirname(sys.executable), "vcpo")  # the console script: the current directory is not
# on its sys.path, as it is for `python -m`


def _setup(tmp_path):
    """A random tiny model and data: "<s>a+a=", answered 2a for odd a and the tower for even a."""
    code = textwrap.dedent("""
        import sys
        from vcpo.trainer import tiny
        tok = tiny.build_tokenizer()
        tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(sys.argv[1])
        tok.save_pretrained(sys.argv[1])
    """)
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-c", code, str(model)], check=True, timeout=300)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"<s>{a}+{a}=", "target": str(2 * a) if a % 2 else TOWER}) + "\n"
                            for a in range(40)))
    marker = f"vcpo-reward-e2e-{uuid.uuid4().hex}"  # in the environment of every process the run starts
    env = {**os.environ, "VCPO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", "REWARD_E2E": marker}
    args = [VCPO, "train", "--model", str(model), "--data", str(data), "--prompt-field", "question",
            "--answer-field", "target", "--engine", "inprocess", "--prompts-per-step", "4",
            "--responses-per-prompt", "2", "--max-new-tokens", "5", "--eval-size", "4", "--eval-every", "0",
            "--loss", "grpo", "--lr", "1e-4", "--reward-workers", "2", "--output-dir", str(tmp_path / "run"),
            "--no-progress"]
    return args, env, marker


def _processes_with(marker):
    """Processes whose environment holds `marker` (what the run started and left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_tower_answers_time_out_in_the_trainer_and_the_run_ends_clean(tmp_path):
    """--reward math-lenient (math-verify's extraction: every response with a digit is compared, and against the
    tower that never returns) with a 3 s timeout: the tower samples score 0 with a TimeoutError, the others are
    scored, the run ends, and its workers are gone. (--reward math compares a number gold only with a number, and
    the tiny model never writes a final answer, so the tower is never evaluated there.)"""
    args, env, marker = _setup(tmp_path)
    proc = subprocess.run([*args, "--steps", "2", "--reward", "math-lenient", "--reward-timeout", "3",
                           "--reward-errors", "zero"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    from vcpo.trainer.data import load_problems, split_problems

    rows = _read_jsonl(tmp_path / "run" / "rollouts.jsonl")

    train, _ = split_problems(load_problems(str(tmp_path / "data.jsonl"), "question", "target"), 4, 0)
    assert len(rows) == 2 * 4 * 2
    timed_out = 0
    for r in rows:
        tower = train[r["uid"][1]].answer == TOWER
        error = r.get("reward_error")
        if tower:  # timed out, or nothing in the response to compare
            assert r["reward"] == 0.0 and (error is None or "TimeoutError" in error), error
            timed_out += error is not None
        else:
            assert error is None
    assert timed_out >= 1  # the kill path ran
    metrics = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sum(m["reward_errors"] for m in metrics) == timed_out
    assert _processes_with(marker) == []


def test_sigterm_stops_the_run_while_a_reward_runs_away(tmp_path):
    """A reward module in the current directory (found by the console script and by its workers) that computes
    9^(9^9) holding the interpreter lock, with a timeout of 600 s: SIGTERM during that call checkpoints and ends the
    run, the runaway worker killed, nothing left behind."""
    args, env, marker = _setup(tmp_path)
    started = tmp_path / "runaway.pid"
    (tmp_path / "tower_reward.py").write_text(textwrap.dedent(f"""
        import os

        def score(response, answer):
            if answer == {TOWER!r}:
                with open({str(started)!r}, "a") as f:
                    f.write(f"{{os.getpid()}}\\n")
                return float(9 ** (9 ** 9) > 0)
            return float(response.strip() == answer)
    """))
    proc = subprocess.Popen([*args, "--steps", "50", "--reward", "tower_reward:score", "--reward-timeout", "600"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=60)[1][-20000:]
        time.sleep(1.0)  # well inside the runaway call
        runaway = int(started.read_text().split()[0])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    print(f"the run ended {stopped:.1f} s after SIGTERM")
    # far below the call's 600 s: it was killed, not waited for (the rest is the run's checkpoint and shutdown:
    # 12-32 s on the busy 2-core machine)
    assert "interrupted at step" in out and stopped < 120, (stopped, out[-2000:])
    assert os.path.isdir(tmp_path / "run" / "checkpoints")
    assert not os.path.exists(f"/proc/{runaway}")
    assert _processes_with(marker) == []
