"""`weight_transfer: nccl` without a GPU: its settings, the check of a server's weight-transfer engine, the
watchdog of a blocked NCCL call, and the pool's handling of a failed send (a scripted server)."""

import json
import threading
import time

import pytest

from vcpo.trainer import make_config


# -- weight_transfer nccl: settings, the server check, the watchdog, the pool's handling of a failed send ------------
def test_weight_transfer_settings(monkeypatch, capsys):
    import torch

    from vcpo.trainer.cli import main

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
    from vcpo.trainer.engines.weight_transfer import NCCLTransfer

    def answer(request):
        if request.url.path == "/init_weight_transfer_engine":
            assert json.loads(request.content) == {"init_info": {}}  # an empty request sets nothing up
            return httpx.Response(500, json={"error": {"message": message, "code": 500}})
        assert request.url.path == "/get_world_size"
        return httpx.Response(200, json={"world_size": 2})

    async def check(transfer):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://node1:8000") as client:
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
    from vcpo.trainer.engines import weight_transfer
    from vcpo.trainer.engines.interface import TransferError

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
    from vcpo.trainer.engines.interface import TransferError
    from vcpo.trainer.engines.pool import ServerPool
    from vcpo.trainer.errors import WeightSyncError

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

    async def mock_client(url):
        return httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url=url)

    for s in pool.servers:
        pool._call(s.client.aclose())
        s.client = pool._call(mock_client(s.url))
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
