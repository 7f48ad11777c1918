"""The trainer's parts that need no engine: settings and their errors, the prompt stream, rewards, data files,
padding, and the staleness-bounded producer driven by a fake engine."""

import json
import random
import threading
import time

import pytest

from vcpo.trainer import LOSS_PRESETS, load_file, make_config
from vcpo.trainer.rollouts import GeneratedBatch, Rollout, RolloutProducer, StalenessError, pad_rollouts
from vcpo.trainer.task import (PromptStream, addition_problems, exact_match, load_problems, resolve_reward,
                               split_problems)


# -- settings ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, name", [
    ({"steps": 0}, "steps"), ({"steps": 2.5}, "steps"), ({"prompts_per_step": -1}, "prompts_per_step"),
    ({"responses_per_prompt": 0}, "responses_per_prompt"), ({"max_staleness": -1}, "max_staleness"),
    ({"lr": float("nan")}, "lr"), ({"lr": -1e-3}, "lr"),
    ({"loss": "ppo2"}, "loss"), ({"engine": "remote"}, "engine"), ({"dtype": "int8"}, "dtype"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"ess_scaling": "yes"}, "ess_scaling"),
    ({"vcpo": {"is_threshold": -1}}, "is_threshold"), ({"vcpo": {"no_such_option": 1}}, "no_such_option"),
    ({"model": "/no/such/folder"}, "model"), ({"engine_cores": "0-x"}, "engine_cores"),
    ({"trainer_cores": "4096"}, "trainer_cores"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"kv_cache_gib": 0}, "kv_cache_gib"),
    ({"engine": "server", "engine_servers": 0}, "engine_servers"),
    ({"engine": "server", "engine_urls": "http://127.0.0.1:80a"}, "engine_urls"),
    ({"engine": "server", "engine_urls": "127.0.0.1:8000"}, "engine_urls"),
    ({"engine": "server"}, "engine_urls"), ({"engine_servers": 2}, "engine_servers"),
    ({"engine": "server", "engine_servers": 1, "weight_swap": "later"}, "weight_swap"),
    ({"engine": "server", "engine_servers": 1, "engine_timeout": 0}, "engine_timeout"),
    ({"engine": "server", "engine_servers": 1, "exact_staleness": True}, "exact_staleness"),
    ({"exact_staleness": "yes"}, "exact_staleness"),
])
def test_bad_settings_name_the_setting(change, name):
    with pytest.raises(ValueError, match=name):
        make_config(**change)


def test_unknown_setting_and_data_without_model():
    with pytest.raises(ValueError, match="unknown settings"):
        make_config(stepz=3)
    with pytest.raises(ValueError, match="data needs model"):
        make_config(data="x.jsonl")


def test_presets_and_switches():
    for name in LOSS_PRESETS:
        make_config(loss=name).vcpo_config()  # every preset is a valid VCPOConfig
    default = make_config().vcpo_config()
    assert (default.is_level, default.is_correction, default.is_threshold) == ("sequence", "truncate", 8.0)
    assert (default.advantage, default.grad_norms, default.lr_rule) == ("opob", "exact", "sqrt")
    grpo = make_config(loss="grpo").vcpo_config()
    assert (grpo.is_correction, grpo.advantage, grpo.lr_rule) == ("none", "grpo", None)
    both = make_config(loss="token-tis", ess_scaling=True, opob=True).vcpo_config()
    assert (both.is_level, both.lr_rule, both.advantage, both.grad_norms) == ("token", "sqrt", "opob", "exact")
    off = make_config(ess_scaling=False, opob=False, vcpo={"is_threshold": 4.0}).vcpo_config()
    assert (off.lr_rule, off.advantage, off.is_threshold) == (None, "grpo", 4.0)
    assert make_config(loss="ppo").vcpo_config().clip_ratio == (0.2, 0.28)


@pytest.mark.parametrize("suffix", ["yaml", "toml", "json"])
def test_config_files(tmp_path, suffix):
    text = {"yaml": "steps: 7\nloss: seq-tis\nvcpo:\n  is_threshold: 4.0\n",
            "toml": 'steps = 7\nloss = "seq-tis"\n[vcpo]\nis_threshold = 4.0\n',
            "json": json.dumps({"steps": 7, "loss": "seq-tis", "vcpo": {"is_threshold": 4.0}})}[suffix]
    path = tmp_path / f"c.{suffix}"
    path.write_text(text)
    cfg = make_config(load_file(str(path)), steps=9, vcpo={"ess_base_ratio": 0.5})
    assert (cfg.steps, cfg.loss) == (9, "seq-tis")  # the command line wins
    assert cfg.vcpo == {"is_threshold": 4.0, "ess_base_ratio": 0.5}  # option mappings merge


def test_config_file_errors(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match="stepz"):
        load_file(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        load_file(str(tmp_path / "missing.yaml"))
    other = tmp_path / "c.ini"
    other.write_text("")
    with pytest.raises(ValueError, match=".yaml"):
        load_file(str(other))


def test_server_urls_are_parsed():
    cfg = make_config(engine="server", engine_urls="http://127.0.0.1:8000/, http://gpu-node-2:8001")
    assert cfg.server_urls() == ["http://127.0.0.1:8000", "http://gpu-node-2:8001"]
    with pytest.raises(ValueError, match="listed twice"):
        make_config(engine="server", engine_urls="http://a:1,http://a:1")


def test_cli_reports_bad_settings(capsys):
    from vcpo.cli import main

    assert main(["train", "--steps", "0"]) == 2
    assert "steps must be an integer >= 1" in capsys.readouterr().err
    assert main(["train", "--engine", "server", "--engine-servers", "0"]) == 2
    assert "engine_servers must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["train", "--engine", "server", "--engine-urls", "http://127.0.0.1:eighty"]) == 2
    assert "engine_urls: the port of 'http://127.0.0.1:eighty' is not a number" in capsys.readouterr().err
    assert main(["train", "--is-threshold", "-3"]) == 2
    assert "is_threshold" in capsys.readouterr().err
    assert main(["train", "--resume", "/no/such/run"]) == 2
    assert "not a run folder" in capsys.readouterr().err


# -- weight_transfer nccl: settings, the server check, the watchdog, the pool's handling of a failed send ------------
def test_weight_transfer_settings(monkeypatch, capsys):
    import torch

    from vcpo.cli import main

    assert make_config().weight_transfer == "storage"
    with pytest.raises(ValueError, match="weight_transfer must be one of"):
        make_config(engine="server", engine_servers=1, weight_transfer="disk")
    with pytest.raises(ValueError, match="weight_transfer: nccl is a setting of the server pool"):
        make_config(weight_transfer="nccl")
    with pytest.raises(ValueError, match="weight_transfer_host is a setting of the NCCL transfer"):
        make_config(engine="server", engine_servers=1, weight_transfer_host="127.0.0.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="weight_transfer: nccl .* no CUDA device"):
        make_config(engine="server", engine_urls="http://127.0.0.1:8000", weight_transfer="nccl")
    assert main(["train", "--engine", "server", "--engine-servers", "1", "--weight-transfer", "nccl"]) == 2
    assert "weight_transfer: nccl" in capsys.readouterr().err
    # a machine with 2 GPUs: one server (and the trainer) fits, two do not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert make_config(engine="server", engine_servers=1, weight_transfer="nccl").weight_transfer == "nccl"
    with pytest.raises(ValueError, match="engine_servers 2 and trainer_ranks 1 needs 3 GPUs.*has 2"):
        make_config(engine="server", engine_servers=2, weight_transfer="nccl")
    with pytest.raises(ValueError, match="engine_servers 1 and trainer_ranks 2 needs 3 GPUs.*has 2"):
        make_config(engine="server", engine_servers=1, trainer_ranks=2, prompts_per_step=16, weight_transfer="nccl")
    urls = {"engine": "server", "engine_urls": "http://127.0.0.1:8000", "weight_transfer": "nccl"}
    assert make_config(**urls, weight_transfer_host="127.0.0.1").weight_transfer_host == "127.0.0.1"
    for host in ("203.0.113.9", "no-such-host.invalid"):  # not this machine's (TEST-NET-3), not resolvable
        with pytest.raises(ValueError, match=f"weight_transfer_host must be an address of this machine.*{host}"):
            make_config(**urls, weight_transfer_host=host)


# What vLLM 0.32 servers answered an empty init request, measured on this machine: one started with
# --weight-transfer-config '{"backend": "nccl"}', one without.
ANSWER_NCCL = ("Call to collective_rpc method failed: Worker failed with error 'Invalid init_info for "
               "NCCLWeightTransferEngine: NCCLWeightTransferInitInfo.__init__() missing 2 required keyword-only "
               "arguments: 'rank_offset' and 'world_size'', please check the stack trace above for the root cause")
ANSWER_NONE = ("Call to collective_rpc method failed: Worker failed with error 'Weight transfer not configured. "
               "Please set weight_transfer_config to enable weight transfer.', please check the stack trace above "
               "for the root cause")


@pytest.mark.parametrize("message, refused", [(ANSWER_NCCL, None), (ANSWER_NONE, "has no NCCL weight-transfer"),
                                              (ANSWER_NCCL.replace("NCCLWeight", "IPCWeight"), "runs IPCWeight")])
def test_nccl_check_reads_the_servers_engine(message, refused):
    import asyncio

    import httpx

    pytest.importorskip("vllm")
    from vcpo.trainer.weight_transfer import NCCLTransfer

    def answer(request):
        if request.url.path == "/init_weight_transfer_engine":
            assert json.loads(request.content) == {"init_info": {}}  # an empty request sets nothing up
            return httpx.Response(500, json={"error": {"message": message, "code": 500}})
        assert request.url.path == "/get_world_size"
        return httpx.Response(200, json={"world_size": 2})

    async def check(transfer):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await transfer.check(client, "http://node1:8000", "engine_urls")

    transfer = NCCLTransfer(device=None, host=None, timeout=5.0, log=print)
    if refused is None:
        asyncio.run(check(transfer))
        assert transfer.worlds == {"http://node1:8000": 2}
    else:
        with pytest.raises(ValueError, match=f"engine_urls: http://node1:8000 {refused}.*--weight-transfer-config "
                                             f"'{{\"backend\": \"nccl\"}}'"):
            asyncio.run(check(transfer))
        assert transfer.worlds == {}


def test_nccl_watchdog_stops_a_blocked_call(monkeypatch):
    """A call blocked as an NCCL call whose peer is gone: it ends only when aborted. The watchdog returns a
    finished call's result, aborts on a reported problem or a timeout, and marks the transfer broken when the
    aborted call still does not end."""
    import asyncio

    import torch

    pytest.importorskip("vllm")
    from vcpo.trainer import weight_transfer
    from vcpo.trainer.pool import TransferError

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(weight_transfer, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(weight_transfer, "ABORT_GRACE_SECONDS", 0.3)
    transfer = weight_transfer.NCCLTransfer(device=torch.device("cpu"), host=None, timeout=30.0, log=print)

    def blocked(released: threading.Event):
        def call():
            if not released.wait(10):
                raise AssertionError("never aborted")
            raise RuntimeError("NCCL communicator aborted")
        return call

    async def no_problem():
        return None

    polls = []

    async def problem_after_3():
        polls.append(1)
        return "/update_weights answered 500: bad shape" if len(polls) >= 3 else None

    run = lambda *a, **k: asyncio.run(transfer._watched(*a, **k))  # noqa: E731
    assert run(lambda: 42, "ok", no_problem, 5.0, abort=lambda: pytest.fail("aborted a finished call")) == 42
    released = threading.Event()
    with pytest.raises(TransferError, match="bad shape"):
        run(blocked(released), "send", problem_after_3, 5.0, abort=released.set)
    assert released.is_set() and len(polls) == 3 and transfer.broken is None
    released = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(TransferError, match="no end within 0 s"):
        run(blocked(released), "send", no_problem, 0.2, abort=released.set)
    assert released.is_set() and time.perf_counter() - t0 < 5
    with pytest.raises(TransferError, match="ValueError: metadata disagrees"):
        run(lambda: (_ for _ in ()).throw(ValueError("metadata disagrees")), "send", no_problem, 5.0,
            abort=lambda: None)
    stuck = threading.Event()
    with pytest.raises(TransferError, match="bad shape"):
        run(blocked(stuck), "vcpo-nccl-send http://node1:8000", problem_after_3, 5.0, abort=lambda: None)
    assert "did not end after its abort (vcpo-nccl-send http://node1:8000" in transfer.broken
    stuck.set()


def test_pool_handles_a_failed_nccl_send_as_a_failed_reload():
    """The pool's one sync path with the NCCL transfer (servers faked over HTTP): pause, send, label, resume on
    every server; a send that fails on a server that is up stops the sync (WeightSyncError); on a server that
    is gone it marks that server down and the others carry on."""
    import httpx

    pytest.importorskip("vllm")
    from vcpo.trainer.pool import ServerPool, TransferError, WeightSyncError

    calls, dead = [], set()

    def answer(request):
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        calls.append((url, request.url.path, request.content.decode() or None))
        if request.url.path == "/health":
            return httpx.Response(500 if url in dead else 200)
        return httpx.Response(200, json={})

    class FakeNCCL:
        source, broken, failing = {}, None, set()

        def prepare(self, state):
            self.state = state

        async def send(self, url, alive):
            calls.append((url, "send", None))
            if url in self.failing:
                raise TransferError("/update_weights answered 500: wrong shapes")

        def close(self):
            pass

    urls = ["http://a:1", "http://b:2"]
    pool = ServerPool(urls, weights_dir="/unused", weight_transfer="nccl")

    async def mock_client():
        return httpx.AsyncClient(transport=httpx.MockTransport(answer))

    pool._call(pool._client.aclose())
    pool._client = pool._call(mock_client())
    pool._nccl = FakeNCCL()
    try:
        pool.load_weights({"w": None}, 3)
        for url in urls:
            assert [(p, b) for u, p, b in calls if u == url] == [
                ("/pause", None), ("send", None), ("/update_weight_version", '{"new_version":"3"}'), ("/resume", None)]
        assert pool._nccl.state == {"w": None} and all(len(s.reload_seconds) == 1 for s in pool.servers)
        pool._nccl.failing, start = {"http://b:2"}, len(calls)
        with pytest.raises(WeightSyncError, match="http://b:2 failed to load the weights sent over NCCL.*wrong shapes"):
            pool.load_weights({"w": None}, 4)
        assert [p for u, p, _ in calls[start:] if u == "http://b:2"] == ["/pause", "send", "/resume", "/health"]
        dead.add("http://b:2")
        pool.load_weights({"w": None}, 5)
        assert [s.up for s in pool.servers] == [True, False] and "wrong shapes" in pool.servers[1].down_reason
        assert [len(s.reload_seconds) for s in pool.servers] == [3, 1]
    finally:
        pool.close()


# -- prompts, rewards, data ----------------------------------------------------------------------------------------
def test_addition_problems_are_correct_and_distinct():
    probs = addition_problems(500, 2, seed=3)
    assert len({p.prompt for p in probs}) == 500
    for p in probs:
        a, b = map(int, p.prompt.rstrip("=").split("+"))
        assert int(p.answer) == a + b and 0 <= a < 100 and 0 <= b < 100
    with pytest.raises(ValueError):
        addition_problems(101, 1, seed=0)


def test_prompt_stream_is_a_function_of_seed_and_batch():
    s1, s2 = PromptStream(37, seed=5), PromptStream(37, seed=5)
    batches = [s1.batch(j, 8) for j in range(20)]
    assert [s2.batch(j, 8) for j in reversed(range(20))] == list(reversed(batches))  # any order, same stream
    flat = [i for b in batches for i in b]
    for epoch in range(4):  # each epoch is a permutation: nothing repeated, nothing skipped
        assert sorted(flat[epoch * 37:(epoch + 1) * 37]) == list(range(37))
    assert PromptStream(37, seed=6).batch(0, 8) != batches[0]


def test_split_is_disjoint_and_seeded():
    probs = addition_problems(200, 2, seed=0)
    train, held = split_problems(probs, 50, seed=1)
    assert len(train) == 150 and len(held) == 50 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert split_problems(probs, 50, seed=1) == (train, held)
    with pytest.raises(ValueError, match="eval_size"):
        split_problems(probs, 200, seed=1)


def test_exact_match_and_reward_resolution():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("42 ", "43") == 0.0 and exact_match("4 2", "42") == 0.0
    assert resolve_reward(None) is exact_match
    assert resolve_reward("os.path:join") is __import__("os").path.join
    for spec, msg in [("nocolon", "module:function"), ("no_such_module_xyz:f", "cannot import"),
                      ("os:no_such_function", "no function")]:
        with pytest.raises(ValueError, match=msg):
            resolve_reward(spec)


def test_load_problems_jsonl_and_parquet(tmp_path):
    rows = [{"q": f"{i}+1=", "a": i + 1} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_problems(str(jl), "q", "a")
    assert [(p.prompt, p.answer) for p in got] == [(r["q"], str(r["a"])) for r in rows]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    assert load_problems(str(tmp_path / "d.parquet"), "q", "a") == got
    with pytest.raises(ValueError, match="no field 'prompt'"):
        load_problems(str(jl), "prompt", "a")
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_problems(str(tmp_path / "bad.jsonl"), "q", "a")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        load_problems(__file__, "q", "a")


def test_pad_rollouts_aligns_tokens_and_logprobs():
    rs = [Rollout(0, 0, 0, [1, 5, 6], [7, 2], [-0.5, -0.25], "stop", 1.0, 0),
          Rollout(0, 0, 1, [1, 5], [9, 9, 9, 2], [-1.0, -2.0, -3.0, -4.0], "stop", 0.0, 0)]
    ids, attn, loss_mask, mu = pad_rollouts(rs, pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 7, 2, 0], [1, 5, 9, 9, 9, 2]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6]
    assert loss_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert mu[0, 3:5].tolist() == [-0.5, -0.25] and mu[1, 2:].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_generated_batch_round_trips():
    b = GeneratedBatch(3, 1, [Rollout(3, 4, 0, [1], [2], [-0.1], None, 0.5, 1)])
    assert GeneratedBatch.from_state(json.loads(json.dumps(b.to_state()))) == b


# -- the producer with a fake engine --------------------------------------------------------------------------------
def _drive(k: int, steps: int, gen_s: float, train_s: float, seed: int = 0, stop_at: int | None = None,
           pending=(), next_batch=0, version=0, eval_s: float | None = None, exact: bool = False):
    """Run a producer against a trainer loop with random delays; returns (consumed batches, producer)."""
    rng = random.Random(seed)
    engine = {"version": version, "loads": []}
    lock = threading.Lock()

    def make_batch(index, v):
        assert v == engine["version"]
        time.sleep(rng.uniform(0, gen_s))
        return GeneratedBatch(index, v, [Rollout(index, index, 0, [1], [2], [0.0], None, 0.0, v)])

    def load(weights, v):
        assert v == weights["v"]
        with lock:
            engine["version"] = weights["v"]
            engine["loads"].append(weights["v"])

    def evaluate(v):  # evaluations interleave with generation, as in the trainer
        time.sleep(rng.uniform(0, gen_s) if eval_s is None else eval_s)
        return (0.0, 0.0)

    prod = RolloutProducer(make_batch=make_batch, load_weights=load, max_staleness=k, version=version,
                           next_batch=next_batch, end_batch=steps, pending=list(pending), evaluate=evaluate,
                           eval_every=2, exact_staleness=exact).start()
    consumed = []
    try:
        for step in range(version, steps if stop_at is None else stop_at):
            batch = prod.take(step)
            consumed.append(batch)
            time.sleep(rng.uniform(0, train_s))
            prod.publish(step + 1, {"v": step + 1})
    finally:
        prod.stop()
    return consumed, prod


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("fast", ["generation", "training"])
def test_producer_bounds_staleness_and_drops_nothing(k, fast):
    gen_s, train_s = (0.001, 0.01) if fast == "generation" else (0.01, 0.001)
    consumed, prod = _drive(k, steps=40, gen_s=gen_s, train_s=train_s, seed=k)
    assert [b.index for b in consumed] == list(range(40))
    lags = [b.index - b.version for b in consumed]
    assert all(0 <= lag <= k for lag in lags)
    if fast == "generation":  # pacing lets the engine run ahead by exactly k, no more and no less
        assert max(lags) == k
    if k == 0:
        assert lags == [0] * 40


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("fast", ["generation", "training"])
def test_exact_staleness_gives_every_batch_lag_k_whichever_side_is_faster(k, fast):
    gen_s, train_s = (0.001, 0.01) if fast == "generation" else (0.01, 0.001)
    consumed, _ = _drive(k, steps=30, gen_s=gen_s, train_s=train_s, seed=k, exact=True)
    assert [b.index for b in consumed] == list(range(30))
    assert [b.index - b.version for b in consumed] == [min(j, k) for j in range(30)]


def test_exact_staleness_refuses_concurrent_sync():
    with pytest.raises(ValueError, match="exact staleness"):
        RolloutProducer(make_batch=None, load_weights=None, max_staleness=2, version=0, next_batch=0, end_batch=4,
                        concurrent_sync=True, exact_staleness=True)


def test_producer_loads_weights_while_a_batch_is_generated():
    """concurrent_sync (engine: server): weights published during a batch go in at once, from the sync thread;
    the admissible batches are generated at the same time; a rollout records its first and last version and the
    bound holds for the first."""
    engine = {"version": 0, "in_flight": 0, "most": 0}
    spans = []
    lock = threading.Lock()

    def make_batch(index, admitted):
        first = engine["version"]
        assert first >= admitted
        with lock:
            engine["in_flight"] += 1
            engine["most"] = max(engine["most"], engine["in_flight"])
        time.sleep(0.02)
        with lock:
            engine["in_flight"] -= 1
        last = engine["version"]
        spans.append((first, last))
        return GeneratedBatch(index, first, [Rollout(index, index, 0, [1], [2], [0.0], None, 0.0, first,
                                                     last_version=last if last != first else None)])

    def load(weights, v):
        time.sleep(0.003)
        engine["version"] = v

    prod = RolloutProducer(make_batch=make_batch, load_weights=load, max_staleness=2, version=0, next_batch=0,
                           end_batch=30, concurrent_sync=True).start()
    try:
        for step in range(30):
            batch = prod.take(step)
            assert 0 <= step - batch.version <= 2
            prod.publish(step + 1, {"v": step + 1})
    finally:
        prod.stop()
    assert any(first != last for first, last in spans)  # weights changed while a batch was being generated
    assert engine["most"] > 1  # several batches were in flight at once


def test_producer_resumes_with_pending_batches():
    # an interrupted run: stop after 10 steps, keep (next batch, pending), continue in a new producer
    first, prod = _drive(3, steps=30, gen_s=0.001, train_s=0.01, stop_at=10)
    next_batch, pending = prod.snapshot()
    assert [b.index for b in pending] == list(range(10, next_batch))
    rest, _ = _drive(3, steps=30, gen_s=0.001, train_s=0.01, pending=pending, next_batch=next_batch, version=10)
    assert [b.index for b in first + rest] == list(range(30))
    assert rest[:len(pending)] == pending  # the pending batches are consumed as they were, not regenerated
    assert all(0 <= b.index - b.version <= 3 for b in rest)


def test_producer_loads_weights_published_during_an_evaluation():
    # resumed synchronous run: the engine evaluates its first version while the trainer consumes the pending
    # batch and publishes new weights; the next batch must be generated with those, not the evaluated ones
    pending = [GeneratedBatch(10, 10, [])]
    rest, prod = _drive(0, steps=14, gen_s=0.001, train_s=0.0, pending=pending, next_batch=11, version=10,
                        eval_s=0.05)
    assert [(b.index, b.version) for b in rest] == [(j, j) for j in range(10, 14)]


def test_producer_reports_its_failures_and_out_of_bounds_lag():
    def broken(index, version):
        raise OSError("engine died")

    prod = RolloutProducer(make_batch=broken, load_weights=lambda w, v: None, max_staleness=1, version=0,
                           next_batch=0, end_batch=3).start()
    with pytest.raises(RuntimeError, match="rollout thread failed") as info:
        prod.take(0)
    assert isinstance(info.value.__cause__, OSError)
    prod.stop()
    stale = GeneratedBatch(5, 0, [])
    prod = RolloutProducer(make_batch=broken, load_weights=lambda w, v: None, max_staleness=2, version=5,
                           next_batch=6, end_batch=6, pending=[stale])
    with pytest.raises(StalenessError, match="lag 5"):
        prod.take(5)


def test_plot_command_draws_runs(tmp_path, capsys):
    from vcpo.cli import main

    for name, k in (("sync", 0), ("async", 4)):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": s, "wall_seconds": 0.5 * s, "reward": s / 40, "ess_ratio": 1.0 if k == 0 else 0.5,
                 "lr_scale": 1.0 if k == 0 else 0.7, **({"eval_accuracy": s / 50, "eval_version": s} if s % 5 == 0
                                                       else {})} for s in range(1, 21)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    assert main(["plot", f"sync={tmp_path / 'sync'}", f"async={tmp_path / 'async'}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert main(["plot", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_local_servers_get_the_gpus_the_trainer_ranks_leave(monkeypatch):
    import torch

    from vcpo.trainer.launch import _gpu_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _gpu_plan(2, 2) == ["2", "3"] and _gpu_plan(3, 1) == ["1", "2", "3"]
    assert _gpu_plan(3, 2) == ["0", "1", "2"]  # not enough GPUs: the servers share them, the trainer's too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_plan(2, 1) is None
