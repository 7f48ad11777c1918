"""Who can drive a rollout server (docs/scale.md, "Who can drive a server"): `vcpo serve`'s RequireKey refuses every
route without the key; the pool's clients send the key on every request, never through a proxy of the environment,
over TCP or a Unix socket; a refused key is an error naming the server; a relative weights_dir reaches the servers
absolute. Small HTTP servers of the standard library stand in for vLLM's. Real `vcpo serve` servers refusing and
taking the key: tests/trainer/test_server_pool.py; `vcpo train` on servers it starts itself (a Unix socket in a
private folder, the key in no file, a dead proxy in the environment): tests/trainer/test_server_pool_faults.py."""

import asyncio
import http.server
import json
import os
import socketserver
import threading

import httpx
import pytest

from vcpo.trainer.engines.servers import KEY_ENV, LocalServers, RequireKey, http_client, serve, servers_key
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
