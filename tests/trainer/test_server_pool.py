"""`engine: server` on real vLLM servers (`vcpo serve`, 127.0.0.1, with a key): two servers started once for the
module (LocalServers), shared by every test here. Weight sync reaches every server in each swap mode, with per-token
versions that match the weights that produced the tokens; `vcpo train --engine-urls` end to end, with the key in
VLLM_API_KEY and a dead HTTP_PROXY; every route refuses requests without the key; bad servers and keys are named.
The fault tests (servers killed mid-run, resume) start their own servers: tests/trainer/test_server_pool_faults.py;
the key's mechanics and servers the trainer starts itself (a Unix socket): tests/trainer/test_server_keys.py."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("vllm")

from support.tiny_models import logprobs, save_tiny_model  # noqa: E402
from support.vllm_metrics import requests_running  # noqa: E402
from vcpo.trainer import tiny  # noqa: E402
from vcpo.trainer.engines.servers import KEY_ENV  # noqa: E402
from vcpo.trainer.net import free_port  # noqa: E402

KEY = "test-key-" + os.urandom(8).hex()  # the servers'

STEPS = 8
COMMON = ["--engine", "server", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "16",
          "--eval-every", "4", "--checkpoint-every", "4", "--warm-start-steps", "30", "--no-progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """`vcpo train`'s environment: the servers' key, and every proxy variable pointing where nothing listens (the
    pool's requests must not go there)."""
    cache = tmp_path_factory.mktemp("vcpo-cache")
    dead = f"http://127.0.0.1:{free_port()}"
    proxies = {name: dead for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY")}
    return {**{k: v for k, v in os.environ.items() if k.upper() != "NO_PROXY"}, **proxies, KEY_ENV: KEY,
            "VCPO_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two vLLM servers on the built-in architecture, each on its own core when there are two."""
    from vcpo.trainer.engines.servers import LocalServers, split_cores

    root = tmp_path_factory.mktemp("servers")
    cores = sorted(os.sched_getaffinity(0))
    local = LocalServers(save_tiny_model(root / "model"), 2, log_dir=str(root / "logs"), dtype="float32",
                         max_model_len=64, kv_cache_gib=1, seed=0, key=KEY,
                         cores=split_cores(cores, 2) if len(cores) >= 2 else None)
    urls = local.start()
    yield urls
    local.stop()
    for entry in json.load(open(root / "logs" / "servers.json")):
        assert not os.path.exists(f"/proc/{entry['pid']}") and not os.path.exists(entry["tmp"])


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["wait", "keep", "abort"])
def test_weight_sync_reaches_every_server_and_versions_are_exact(servers, tmp_path, swap):
    """Version 0 is loaded, then version 1 while a batch is being generated. Every token's behaviour
    log-prob matches, to 1e-4, a recomputation with the weights of the version the server reports for it."""
    import torch

    from vcpo.trainer.engines.pool import ServerPool

    tok = tiny.build_tokenizer()
    models = [tiny.build_model(tiny.TinyRecipe(), len(tok)) for _ in range(2)]
    with torch.no_grad():  # version 1: far from version 0, so a token under the wrong version shows
        for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
            p1.copy_(p0 + 0.3 * torch.randn_like(p0))
    pool = ServerPool(servers, weights_dir=str(tmp_path / "weights"), weight_swap=swap, key=KEY)
    try:
        pool.load_weights(models[0].state_dict(), 0)
        prompt = [tiny.BOS] + tok.encode("12+34=")
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=pool.generate(
            [prompt] * 16, n=8, max_tokens=56, temperature=1.0, seeds=range(16))))
        thread.start()
        # decoding is under way on both (not a guessed sleep: a fast machine ends the batch within 0.2 s)
        while thread.is_alive() and not all(requests_running(url, KEY) > 0 for url in servers):
            time.sleep(0.005)
        pool.load_weights(models[1].state_dict(), 1)
        thread.join()
        during = [c for group in result["out"] for c in group]
        after = [c for group in pool.generate([prompt] * 2, n=4, max_tokens=8, temperature=1.0, seeds=[1, 2])
                 for c in group]  # all of version 1
        assert {c.server for c in during} == set(servers)  # the requests were spread over both
        assert all(len(s.reload_seconds) == 2 for s in pool.servers)
        worst, stale = 0.0, 0.0
        for c in during + after:
            assert c.versions[0][1] == 0 and c.versions[-1][2] == len(c.token_ids)
            for version, start, end in c.versions:
                reported = torch.tensor(c.logprobs[start:end])
                worst = max(worst, (logprobs(models[version], prompt, c.token_ids)[start:end] - reported).abs().max())
                if version == 1:  # the check can fail: version 0's log-probs of these tokens are far off
                    stale = max(stale, (logprobs(models[0], prompt, c.token_ids)[start:end] - reported).abs().max())
        assert worst < 1e-4 and stale > 1e-2
        assert {tuple(v for v, _, _ in c.versions) for c in after} == {(1,)}
        spans = {tuple(v for v, _, _ in c.versions) for c in during}
        if swap == "keep":  # requests in flight continued under the new weights
            assert (0, 1) in spans and spans <= {(0,), (0, 1), (1,)}
        else:  # each sample has one version; abort: the interrupted ones were generated again under version 1
            assert spans <= {(0,), (1,)}
        if swap == "abort":
            assert pool.stats.aborted > 0 and (1,) in spans
    finally:
        pool.close()


@pytest.mark.slow
def test_nccl_transfer_refuses_servers_without_its_flag(servers, tmp_path):
    """weight_transfer nccl: the start-up check names a server started without --weight-transfer-config (the
    fixture's), before anything needs a GPU; the check's probe leaves the servers serving."""
    import httpx

    from vcpo.trainer.engines.pool import ServerPool

    tok = tiny.build_tokenizer()
    pool = ServerPool(servers, weights_dir=str(tmp_path / "unused"), weight_transfer="nccl", key=KEY)
    try:
        with pytest.raises(ValueError) as refused:
            pool.check(setting="engine_urls", probe_text="12+34=", max_model_len=64,
                       probe_ids=tok.encode("12+34=", add_special_tokens=False))
        message = str(refused.value)
        assert any(message.startswith(f"engine_urls: {url} has no NCCL weight-transfer engine") for url in servers)
        assert message.endswith("""needs servers started with --weight-transfer-config '{"backend": "nccl"}'""")
        for url in servers:
            done = httpx.post(url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                              json={"prompt": [tiny.BOS] + tok.encode("1+2="), "max_tokens": 2, "ignore_eos": True,
                                    "return_token_ids": True})
            assert done.status_code == 200 and len(done.json()["choices"][0]["token_ids"]) == 2
    finally:
        pool.close()


def run_cli(args, env, timeout=900):
    return subprocess.run([sys.executable, "-m", "vcpo.trainer.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_train_on_running_servers_is_on_policy_at_k0(servers, env, tmp_path):
    """--engine-urls, k = 0: every batch is sampled by both servers with the trainer's current weights, so the
    importance weights are 1 and the ESS ratio is 1 at every step."""
    folder = tmp_path / "run"
    proc = run_cli([*COMMON, "--engine-urls", ",".join(servers), "--steps", str(STEPS), "--max-staleness", "0",
                    "--output-dir", str(folder)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = read_jsonl(folder / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["lag"] == 0 and m["servers_up"] == 2 and m["ess_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert abs(m["kl_k3"]) < 1e-6
    rollouts = read_jsonl(folder / "rollouts.jsonl")
    assert {r["server"] for r in rollouts} == set(servers)
    assert all(r["version"] == r["step"] - 1 and "last_version" not in r for r in rollouts)
    summary = json.load(open(folder / "summary.json"))
    assert [s["up"] for s in summary["servers"]] == [True, True]
    assert all(s["syncs"] == STEPS + 1 for s in summary["servers"])  # the start, then every step
    assert summary["final_eval"]["version"] == STEPS
    assert os.path.isfile(folder / ".weights" / "model.safetensors")


@pytest.mark.slow
def test_train_with_in_flight_weight_swaps(servers, env, tmp_path):
    """--weight-swap keep, k = 1: a sample may span a weight swap; its first version obeys the bound."""
    folder = tmp_path / "run"
    proc = run_cli([*COMMON, "--engine-urls", ",".join(servers), "--steps", str(STEPS), "--max-staleness", "1",
                    "--weight-swap", "keep", "--max-new-tokens", "16", "--output-dir", str(folder)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rollouts = read_jsonl(folder / "rollouts.jsonl")
    assert len({tuple(r["uid"]) for r in rollouts}) == len(rollouts) == STEPS * 16
    for r in rollouts:
        assert 0 <= r["step"] - 1 - r["version"] <= 1
        assert r.get("last_version", r["version"]) >= r["version"]
    metrics = read_jsonl(folder / "metrics.jsonl")
    assert sum(m["swapped_samples"] for m in metrics) == sum("last_version" in r for r in rollouts)


@pytest.mark.slow
def test_every_route_needs_the_key(servers, tmp_path):
    """Without the key, or with a wrong one, a server refuses the routes that change its weights, their label or
    its state, and generation (401); with it, they work."""
    import httpx

    url, weights = servers[0], save_tiny_model(tmp_path / "model")  # the weights the servers started with
    reload = {"method": "reload_weights", "kwargs": {"weights_path": weights}}
    calls = [("POST", "/collective_rpc", reload), ("POST", "/update_weight_version", {"new_version": "99"}),
             ("POST", "/pause?mode=wait", None), ("POST", "/v1/completions", {"prompt": [tiny.BOS, 5], "max_tokens": 1}),
             ("GET", "/health", None), ("GET", "/server_info", None)]
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}):
        for method, path, body in calls:
            answer = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
            assert answer.status_code == 401, (headers, path, answer.text)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        assert client.post("/pause?mode=wait").status_code == 200 and client.get("/is_paused").json()["is_paused"]
        assert client.post("/collective_rpc", json=reload).json() == {"results": [None]}
        assert client.post("/resume").status_code == 200 and not client.get("/is_paused").json()["is_paused"]
        done = client.post("/v1/completions", json={"prompt": [tiny.BOS, 5], "max_tokens": 1})
        assert done.status_code == 200 and len(done.json()["choices"]) == 1


@pytest.mark.slow
def test_bad_servers_are_named(servers, env, tmp_path):
    """An unreachable URL fails within seconds; a server whose model has another tokenizer is refused; a missing or
    wrong key is named with the server."""
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    proc = run_cli([*COMMON, "--engine-urls", f"{servers[0]},{dead}", "--output-dir", str(tmp_path / "a")], env)
    assert proc.returncode == 2 and time.perf_counter() - t0 < 30
    assert f"engine_urls: unreachable: {dead}" in proc.stderr and servers[0] not in proc.stderr
    assert not os.path.exists(tmp_path / "a")
    for key, said in (("not-the-key", "refused the key it was sent"), (None, "needs a key")):
        keyed = {k: v for k, v in {**env, KEY_ENV: key}.items() if v is not None}
        proc = run_cli([*COMMON, "--engine-urls", servers[0], "--output-dir", str(tmp_path / "k")], keyed)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"engine_urls: {servers[0]} {said} (401 Unauthorized): set {KEY_ENV} to the key" in proc.stderr
    from vcpo.trainer.engines.pool import ServerPool

    pool = ServerPool(servers, weights_dir=str(tmp_path / "unused"), key="not-the-key")
    try:  # past the reachability check (a server run with vLLM's own --api-key answers /health to anyone)
        with pytest.raises(ValueError, match=f"^engine_urls: ({'|'.join(map(re.escape, servers))}) refused the key"):
            pool.check(setting="engine_urls", probe_text="1+1=", probe_ids=[1], max_model_len=64)
    finally:
        pool.close()

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(reversed(tiny.CHARS))  # the same symbols, other ids
    vocab = {t: i for i, t in enumerate(tiny.SPECIALS + chars)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                    unk_token="<unk>")
    model = save_tiny_model(tmp_path / "other-model", other)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(40)))
    proc = run_cli(["--model", model, "--data", str(data), "--engine", "server", "--engine-urls", servers[1],
                    "--eval-size", "8", "--steps", "2", "--no-progress", "--output-dir", str(tmp_path / "b")], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"engine_urls: {servers[1]} serves" in proc.stderr and "tokenizer differs" in proc.stderr
