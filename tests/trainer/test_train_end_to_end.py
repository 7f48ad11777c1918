"""`vcpo train` end to end with a real vLLM engine (in-process, eager, float32) on the built-in tiny model:
outputs, bounded staleness, Ctrl-C and resume, weight sync, a user model with user data and reward.
Each run is a `vcpo` subprocess: vLLM's engine changes process-wide settings (thread binding). Last, faults with a
fake engine in this process: steps skipped in a row stop the run, SIGTERM with a batch in flight."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.fake_engine import FakeEngine, serve
from support.processes import RunProcesses

pytest.importorskip("vllm")

STEPS = 10
COMMON = ["--engine", "inprocess", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
          "--eval-every", "4", "--checkpoint-every", "4", "--warm-start-steps", "30", "--no-progress"]

pytestmark = pytest.mark.slow  # vcpo train with a vLLM engine


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vcpo-cache")
    return {**os.environ, "VCPO_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def _cli(args, env, **kw):
    return [sys.executable, "-m", "vcpo.trainer.cli", "train", *args]


def run(args, env, timeout=600):
    proc = subprocess.run(_cli(args, env), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def expected_uids(steps):
    """(batch, prompt index, response index) of every sample a run must consume: the prompt stream over the
    built-in task's training split (all 2-digit problems but the 16 held out)."""
    from vcpo.trainer.task import BUILTIN_PROBLEMS
    from vcpo.trainer.data import PromptStream

    stream = PromptStream(BUILTIN_PROBLEMS - 16, seed=0)
    return {(j, i, r) for j in range(steps) for i in stream.batch(j, 4) for r in range(4)}


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    """One uninterrupted run per staleness bound k; k = 1 with the fused LM head."""
    out = {}
    for k in (0, 1, 4):
        folder = tmp_path_factory.mktemp(f"run-k{k}") / "run"
        fused = ["--fused-lm-head", "true"] if k == 1 else []
        run([*COMMON, *fused, "--steps", str(STEPS), "--max-staleness", str(k), "--output-dir", str(folder)], env)
        out[k] = str(folder)
    return out


def test_run_writes_metrics_checkpoints_and_plot(runs):
    folder = runs[4]
    rows = read_jsonl(os.path.join(folder, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in ("reward", "accuracy", "ess_ratio", "lr_scale", "baseline_mean", "lag", "grad_norm",
                    "generated_tokens_per_second", "train_seconds", "wait_seconds", "sync_seconds_total"):
            assert key in r and r[key] == r[key], key  # present and not NaN
        assert 0 < r["ess_ratio"] <= 1 and 0 <= r["lr_scale"] <= 1 and 0 <= r["reward"] <= 1
    assert rows[0]["ess_ratio"] == pytest.approx(1.0, abs=1e-5)  # version 0 samples, version 0 policy
    assert all(r["generated_tokens_per_second"] > 0 for r in rows)  # the engine's rate, never 0 between batches
    evals = [(r["eval_version"], r["eval_accuracy"], r["eval_reward"]) for r in rows if "eval_accuracy" in r]
    logged = read_jsonl(os.path.join(folder, "evals.jsonl"))  # each evaluation with the responses it scored
    assert evals and set(evals) <= {(e["version"], e["accuracy"], e["reward"]) for e in logged}
    from vcpo.trainer.rewards import exact_match

    for e in logged:
        assert len(e["samples"]) == 8 and all(x["reward"] == exact_match(x["response"], x["answer"])
                                              for x in e["samples"])
        assert e["accuracy"] >= sum(x["reward"] >= 1 for x in e["samples"]) / 16  # of 16 held-out prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(folder, "checkpoints", "step-000010"))
    rollouts = read_jsonl(os.path.join(folder, "rollouts.jsonl"))
    for r in rollouts:  # the text as the reward saw it; the prompt once per group, as the engine got it
        assert r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True)
        assert ("prompt" in r) == (r["uid"][2] == 0) and isinstance(r["answer"], str)
    for r in rollouts[::4]:  # the built-in task: "a+b=" with answer a + b
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["prompt"].endswith("=") and int(a) + int(b) == int(r["answer"])
    ckpts = sorted(os.listdir(os.path.join(folder, "checkpoints")))
    assert ckpts == ["step-000008", "step-000010"]  # every 4 steps and at the end, the last two kept
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "trainer_state.pt"):
        assert os.path.getsize(os.path.join(folder, "checkpoints", "step-000010", name)) > 0
    with open(os.path.join(folder, "curves.png"), "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24])[0] > 500
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["settings"]["max_staleness"] == 4 and config["vcpo"]["is_threshold"] == 8.0
    summary = json.load(open(os.path.join(folder, "summary.json")))
    assert summary["steps"] == STEPS and not summary["interrupted"] and summary["syncs"] >= 1
    assert sum(summary["lag_histogram"].values()) == STEPS
    assert summary["final_eval"]["version"] == STEPS


@pytest.mark.parametrize("k", [0, 1, 4])
def test_staleness_is_bounded_and_nothing_is_dropped(runs, k):
    rows = read_jsonl(os.path.join(runs[k], "rollouts.jsonl"))
    uids = [tuple(r["uid"]) for r in rows]
    assert len(uids) == len(set(uids)) and set(uids) == expected_uids(STEPS)
    lags = [r["step"] - 1 - r["version"] for r in rows]
    assert all(0 <= lag <= k for lag in lags)
    metrics = read_jsonl(os.path.join(runs[k], "metrics.jsonl"))
    assert [m["lag"] for m in metrics] == [m["step"] - 1 - m["version"] for m in metrics]
    if k == 0:
        assert set(lags) == {0} and all(m["ess_ratio"] == pytest.approx(1.0, abs=1e-5) for m in metrics)


def test_fused_lm_head_run(runs):
    """`--fused-lm-head true` reaches vcpo.step: recorded in the config, finite per-sequence norms and steps."""
    config = json.load(open(os.path.join(runs[1], "config.json")))
    assert config["vcpo"]["fused_lm_head"] is True
    assert json.load(open(os.path.join(runs[0], "config.json")))["vcpo"]["fused_lm_head"] is False
    metrics = read_jsonl(os.path.join(runs[1], "metrics.jsonl"))
    for m in metrics:  # a step whose rewards are all equal has zero advantages and a zero gradient
        assert 0 < m["grad_sq_norm_mean"] < float("inf") and 0 <= m["grad_norm"] < float("inf")
    assert any(m["grad_norm"] > 0 for m in metrics)


def _interrupt_and_resume(args, folder, env, hard_kill=False):
    """Start a run, Ctrl-C it after a few steps, check the clean exit, then resume it to the end; with `hard_kill`
    the resumed run is SIGKILLed a step on (no process it started may be alive 10 s later) and resumed again."""
    proc = subprocess.Popen(_cli([*args, "--output-dir", folder], env), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(folder, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and len(read_jsonl(metrics)) >= 3:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-5000:]
    summary = json.load(open(os.path.join(folder, "summary.json")))
    assert summary["interrupted"] and 3 <= summary["steps"] < STEPS, summary
    assert "--resume" in output
    stopped_at = summary["steps"]
    state_before = sorted(os.listdir(os.path.join(folder, "checkpoints")))[-1]
    assert state_before == f"step-{stopped_at:06d}"
    if hard_kill:
        proc = subprocess.Popen(_cli(["--resume", folder, "--no-progress"], env), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        processes = RunProcesses(proc.pid)
        while proc.poll() is None and len(read_jsonl(metrics)) <= stopped_at:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[0][-5000:]
        proc.kill()
        proc.communicate(timeout=60)
        assert not processes.left_alive(within=10.0)
    run(["--resume", folder, "--no-progress"], env)
    return stopped_at


@pytest.mark.parametrize("k", [0, 4])
def test_interrupt_and_resume_give_the_same_sample_stream(runs, env, tmp_path, k):
    """Ctrl-C, then resume; at k = 4 the resumed run is also SIGKILLed mid-step and resumed again."""
    folder = str(tmp_path / "run")
    args = [*COMMON, "--steps", str(STEPS), "--max-staleness", str(k)]
    stopped_at = _interrupt_and_resume(args, folder, env, hard_kill=k == 4)
    resumed = read_jsonl(os.path.join(folder, "rollouts.jsonl"))
    straight = read_jsonl(os.path.join(runs[k], "rollouts.jsonl"))
    uids = [tuple(r["uid"]) for r in resumed]
    assert uids == [tuple(r["uid"]) for r in straight]  # same samples in the same order: none lost or repeated
    assert len(set(uids)) == len(uids)
    assert [r["step"] for r in read_jsonl(os.path.join(folder, "metrics.jsonl"))] == list(range(1, STEPS + 1))
    assert all(0 <= r["step"] - 1 - r["version"] <= k for r in resumed)
    if k == 0:  # synchronous: the whole run is deterministic, so the resumed one equals the straight one
        assert [(r["response_ids"], r["reward"], r["version"]) for r in resumed] == \
               [(r["response_ids"], r["reward"], r["version"]) for r in straight]
    else:  # batches generated before the Ctrl-C were kept and consumed after the resume, not regenerated
        after = [r for r in resumed if r["step"] == stopped_at + 1]
        assert after and all(r["version"] <= stopped_at for r in after)


SYNC_CHECK = textwrap.dedent("""
    import json, sys, torch
    from vcpo.trainer import tiny
    from vcpo.trainer.engines.rollout_engine import RolloutEngine
    folder, mode = sys.argv[1], sys.argv[2]
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyRecipe(), len(tok))
    model.save_pretrained(folder); tok.save_pretrained(folder)
    engine = RolloutEngine(folder, mode=mode, max_model_len=64, sync_dir=folder + "/sync")
    prompt = [tiny.BOS] + tok.encode("12+34=")

    def gap():
        # largest |engine - trainer| log-prob over the tokens of 4 sampled continuations, and their count
        worst, count = 0.0, 0
        for c in engine.generate([prompt], n=4, max_tokens=12, temperature=1.0, seeds=[7])[0]:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            mine = lp.gather(-1, ids[0, 1:, None])[len(prompt) - 1:, 0]
            worst = max(worst, (mine - torch.tensor(c.logprobs)).abs().max().item())
            count += len(c.token_ids)
        return worst, count

    before, _ = gap()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    stale, _ = gap()
    engine.load_weights({k: v.clone() for k, v in model.state_dict().items()}, 1)
    synced, n = gap()
    print(json.dumps({"before": before, "stale": stale, "synced": synced, "tokens": n}))
    engine.close()
""")


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_weight_sync_gives_the_trainers_logprobs(env, tmp_path, mode):
    code = "if __name__ == '__main__':\n" + textwrap.indent(SYNC_CHECK, "    ")
    script = tmp_path / "sync_check.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), mode], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] >= 8  # a random model may end a continuation early, not all four
    assert result["before"] < 1e-4  # the engine loaded the trainer's weights
    assert result["stale"] > 1e-2  # the trainer moved: the engine's log-probs are now off...
    assert result["synced"] < 1e-4  # ...until the sync, after which they agree again (fp32)


def test_user_model_data_and_reward(env, tmp_path):
    """--model/--data/--reward: a model folder, a JSONL file with custom field names, a reward function."""
    code = textwrap.dedent("""
        import sys
        from vcpo.trainer import tiny
        tok = tiny.build_tokenizer()
        tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(sys.argv[1])
        tok.save_pretrained(sys.argv[1])
    """)
    model_dir = tmp_path / "model"
    subprocess.run([sys.executable, "-c", code, str(model_dir)], check=True, env=env, timeout=300)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"<s>{a}+{a}=", "target": str(2 * a)}) + "\n"
                            for a in range(40)))
    (tmp_path / "my_reward.py").write_text("def score(response, answer):\n    return len(response) / 100.0\n")
    folder = tmp_path / "run"
    run(["--model", str(model_dir), "--data", str(data), "--prompt-field", "question", "--answer-field", "target",
         "--reward", "my_reward:score", "--engine", "inprocess", "--steps", "3", "--prompts-per-step", "4",
         "--responses-per-prompt", "2", "--max-new-tokens", "5", "--eval-size", "8", "--loss", "grpo",
         "--lr", "1e-4", "--output-dir", str(folder), "--no-progress"],
        {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"})
    from vcpo.trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    rows = read_jsonl(folder / "rollouts.jsonl")
    assert len(rows) == 3 * 4 * 2
    for r in rows:
        assert len(r["response_ids"]) <= 5 and r["finish_reason"] in ("stop", "length")
        assert r["reward"] == pytest.approx(len(tok.decode(r["response_ids"], skip_special_tokens=True)) / 100)
    config = json.load(open(folder / "config.json"))
    assert config["vcpo"]["advantage"] == "grpo" and config["max_new_tokens"] == 5


def test_default_engine_runs_in_its_own_processes_on_its_own_cores(env, tmp_path):
    """The main job's configuration: vLLM in its own processes, weights through safetensors files, engine
    and trainer on disjoint cores."""
    folder = tmp_path / "run"
    proc = run(["--steps", "4", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
                "--warm-start-steps", "30", "--no-progress", "--output-dir", str(folder)], env)
    assert len(read_jsonl(folder / "metrics.jsonl")) == 4
    summary = json.load(open(folder / "summary.json"))
    assert summary["syncs"] >= 1 and summary["final_eval"]["version"] == 4
    assert os.path.isfile(folder / ".weights" / "model.safetensors")  # the file the engine reloaded
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        assert f"cores: engine [{cores[-1]}], trainer {cores[:-1]}" in proc.stdout + proc.stderr


# -- faults with a fake engine (in this process; no vLLM engine is started) -----------------------------------------------
def train_with(engine, monkeypatch, tmp_path, resume=False, **settings):
    """vcpo.trainer.train in this process with `engine` for the rollouts: the built-in task, no held-out split."""
    from vcpo.trainer import make_config
    from vcpo.trainer import run as run_module

    serve(monkeypatch, engine)
    folder = str(tmp_path / "run")
    cfg = run_module.resume_config(folder, **settings) if resume else make_config(
        output_dir=folder, engine="inprocess", prompts_per_step=2, responses_per_prompt=2, max_new_tokens=4,
        eval_size=0, warm_start_steps=0, checkpoint_every=100, **settings)
    return run_module.train(cfg, resume=resume, progress=False), folder


def test_a_run_stops_after_max_skipped_steps_with_a_checkpoint_of_the_last_finite_weights(monkeypatch, tmp_path):
    """Every batch has a -inf behaviour log-prob: each step is skipped (logged as such), and the third in a row stops
    the run with NonFiniteError after a checkpoint whose weights are the model's own, and finite."""
    from safetensors.torch import load_file

    from vcpo.trainer.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="3 steps in a row were skipped .*steps 1-3.*Checkpoint written at "
                                             "step 3 with the weights of step 0.*--resume"):
        train_with(FakeEngine(poison=True), monkeypatch, tmp_path, steps=10, max_skipped_steps=3)
    folder = tmp_path / "run"
    rows = read_jsonl(folder / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["skipped"] == 1.0 and r["skip_reason"] > 0 and r["lr"] == 0.0 for r in rows)
    assert len(read_jsonl(folder / "rollouts.jsonl")) == 3 * 4
    checkpoint = folder / "checkpoints" / "step-000003"
    start = json.load(open(folder / "config.json"))["model_dir"]
    saved, initial = load_file(checkpoint / "model.safetensors"), load_file(os.path.join(start, "model.safetensors"))
    assert saved.keys() == initial.keys() and all(torch.equal(saved[k], initial[k]) for k in saved)
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"] == {}  # no step was taken


def test_sigterm_with_a_batch_in_flight_checkpoints_first_then_aborts_and_resume_loses_nothing(monkeypatch, tmp_path):
    """SIGTERM while the trainer waits for batch 2, which is being generated: the checkpoint of step 2 is written
    before the generation is aborted (a scheduler's SIGKILL may follow), the run returns at once, and a resume
    generates batch 2 again and consumes every sample exactly once."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    seen = {}
    engine = FakeEngine(block_from=2, on_abort=lambda: seen.setdefault("checkpoint_at_abort", checkpoint.is_dir()))
    summary, folder = train_with(engine, monkeypatch, tmp_path, steps=4, max_staleness=0)  # batch 2 after step 2
    stopped = time.perf_counter() - engine.signalled
    assert summary["interrupted"] and summary["steps"] == 2
    assert seen["checkpoint_at_abort"]  # the checkpoint came first
    assert stopped < 5, stopped  # no wait for the batch in flight
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["next_batch"] == 2 and state["pending"] == []  # batch 2 was in flight: not in the checkpoint

    summary, _ = train_with(FakeEngine(), monkeypatch, tmp_path, resume=True)
    assert summary["steps"] == 4 and not summary["interrupted"]
    uids = [tuple(r["uid"]) for r in read_jsonl(os.path.join(folder, "rollouts.jsonl"))]
    from vcpo.trainer.task import BUILTIN_PROBLEMS
    from vcpo.trainer.data import PromptStream

    stream = PromptStream(BUILTIN_PROBLEMS, seed=0)
    assert len(uids) == len(set(uids)) == 16
    assert set(uids) == {(j, i, r) for j in range(4) for i in stream.batch(j, 2) for r in range(2)}
    assert [r["step"] for r in read_jsonl(os.path.join(folder, "metrics.jsonl"))] == [1, 2, 3, 4]
