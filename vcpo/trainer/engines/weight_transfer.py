"""`weight_transfer: nccl`: new weights go from the trainer's GPU to each server's GPUs over NCCL, with vLLM's own
trainer-side weight-transfer engine (`NCCLTrainerWeightTransferEngine`, built by `WeightTransferTrainerFactory`)
driving each server through vLLM's HTTP client (`HTTPVLLMWeightSyncClient`: /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update), whose requests go through the pool's kind of client
(the servers' key, no proxy; servers.http_client). The pool (pool.py) pauses, labels and resumes
each server around `send` exactly as for the storage transfer (docs/scale.md).

One NCCL group per server: the trainer is rank 0, the server's workers ranks 1..W. A server that dies breaks
only its own group, so the pool's mark-down applies as for storage; the price is one send per server (they go
one after another from the trainer's GPU).

NCCL calls block until every rank of the group takes part, and one whose peer died never returns. So each runs
in a daemon thread of its own, watched from the pool's event loop: a failed HTTP call, a server that stops
answering /health or no end within the timeout aborts the group (ncclCommAbort), which ends the blocked call."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Iterator, Optional
from urllib.parse import urlsplit

import httpx
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from .interface import TransferError, unique_tensors
from ..net import free_port
from .servers import NCCL_SERVER_ARGS, UNIX, http_client

SERVER_FLAG = " ".join(NCCL_SERVER_ARGS[:1] + [f"'{NCCL_SERVER_ARGS[1]}'"])  # as typed in a shell
HANDSHAKE_SECONDS = 330.0  # vLLM's rendezvous store waits 300 s for the workers; then it fails by itself
ABORT_GRACE_SECONDS = 30.0  # after an abort, how long the blocked call gets to return
POLL_SECONDS = 1.0  # how often a transfer in progress is checked for a failed call or a dead server


class _Client(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client, its requests sent by http_client (vLLM's own sends no key and goes through
    any proxy of the environment), keeping the first failure (with the server's answer): the NCCL half of a call
    whose HTTP half failed never returns by itself, and the watchdog needs to know."""

    def __init__(self, url: str, key: Optional[str], timeout: float) -> None:
        super().__init__(url, timeout=timeout)
        self.http = http_client(url, key, sync=True, timeout=timeout)
        self.error: Optional[str] = None

    def _post(self, path: str, json: Optional[dict] = None) -> None:
        try:
            self.http.post("/" + path, json=json).raise_for_status()
        except Exception as e:
            answer = getattr(e, "response", None)
            detail = f"answered {answer.status_code}: {answer.text[:500]}" if answer is not None \
                else f"{type(e).__name__}: {e}"
            self.error = self.error or f"/{path} {detail}"
            raise


class _StateSource(WeightSource):
    """The weights of the sync under way (set by NCCLTransfer.prepare), on the trainer's GPU as each is sent;
    metadata and iteration read the same dict, so they agree name by name as vLLM's engine requires."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.state.items():
            yield name, t.to(self.device)


def route_address(url: str) -> str:
    """This machine's IPv4 address (vLLM's rendezvous listens on IPv4) on the route to the server at `url`: one
    the server can reach it at. No packet is sent: connecting a UDP socket only picks the route."""
    if url.startswith(UNIX):  # a server of this machine
        return "127.0.0.1"
    address = socket.getaddrinfo(urlsplit(url).hostname, 9, family=socket.AF_INET, type=socket.SOCK_DGRAM)[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def check_nccl_available() -> None:
    """vLLM's NCCL library loads here; without it vLLM's communicator silently does nothing (and the servers
    wait for weights that never come)."""
    import vllm.envs as envs
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    if envs.VLLM_DISABLE_PYNCCL:
        raise ValueError("weight_transfer: nccl, but VLLM_DISABLE_PYNCCL is set in the trainer's environment")
    try:
        NCCLLibrary()
    except Exception as e:
        raise ValueError(f"weight_transfer: nccl, but vLLM cannot load the NCCL library here "
                         f"({type(e).__name__}: {e})") from None


class NCCLTransfer:
    """The trainer's side of the NCCL transfer to the servers of a pool (check, connect and send run on the pool's
    event loop)."""

    def __init__(self, *, device: Optional[torch.device], host: Optional[str], timeout: float,
                 log: Callable[[str], None], key: Optional[str] = None) -> None:
        self.device, self.host, self.timeout, self.key, self.log = device, host, timeout, key, log
        self.worlds: dict[str, int] = {}  # url -> the server's worker count (TP x PP x DP)
        self.engines: dict[str, Any] = {}  # url -> its NCCLTrainerWeightTransferEngine
        self.source: Optional[_StateSource] = None
        self.broken: Optional[str] = None  # set when an aborted call did not return: no more sends from here
        self._sending: Optional[asyncio.Lock] = None

    async def check(self, client, url: str, setting: str) -> None:
        """The server at `url` (`client` is its own: http_client) runs vLLM's NCCL weight-transfer engine; else
        ValueError naming `setting`, the URL and the flag. An empty init request is refused by the server either way, but the refusal names its engine, or
        says there is none (a server without --weight-transfer-config); nothing is set up by it."""
        try:
            world = (await client.get("/get_world_size", timeout=30.0)).json()["world_size"]
            # the server closes the connection after an error it raised (uvicorn): not one to reuse
            answer = await client.post("/init_weight_transfer_engine", json={"init_info": {}}, timeout=30.0,
                                       headers={"Connection": "close"})
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{setting}: {url}: the NCCL weight-transfer check failed ({type(e).__name__}: {e})") \
                from None
        engine = re.search(r"Invalid init_info for (\w+)", answer.text)
        if engine is None or engine.group(1) != "NCCLWeightTransferEngine":
            found = f"runs {engine.group(1)}" if engine else \
                f"has no NCCL weight-transfer engine (/init_weight_transfer_engine answered {answer.status_code}: " \
                f"{answer.text[:300]})"
            raise ValueError(f"{setting}: {url} {found}: weight_transfer nccl needs servers started with "
                             f"{SERVER_FLAG}")
        self.worlds[url] = int(world)

    async def connect(self, urls: list[str], setting: str, alive: Callable[[str], Awaitable[bool]]) -> None:
        """The NCCL group of each checked server (one after another); ValueError naming `setting` and the URL of
        a server that does not join."""
        if not torch.cuda.is_available():
            raise ValueError("weight_transfer: nccl sends the weights from the trainer's GPU, and this process sees "
                             "no CUDA device")
        check_nccl_available()
        self.device = torch.device(self.device if self.device is not None else torch.cuda.current_device())
        self.source = _StateSource(self.device)
        for url in urls:
            await self._connect(url, setting, alive)

    async def _connect(self, url: str, setting: str, alive: Callable[[str], Awaitable[bool]]) -> None:
        try:
            host = self.host or route_address(url)
            port = free_port(host)
        except OSError as e:
            raise ValueError(f"{setting}: {url}: no address of this machine to meet it at ({type(e).__name__}: "
                             f"{e}): set weight_transfer_host") from None
        world = 1 + self.worlds[url]
        info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world, rank=0)
        client = _Client(url, self.key, self.timeout)

        async def problem() -> Optional[str]:
            return client.error or (None if await alive(url) else "it stopped answering /health")

        t0 = time.perf_counter()
        try:
            self.engines[url] = await self._watched(
                lambda: WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source),
                f"vcpo-nccl-init {url}", problem, HANDSHAKE_SECONDS)
        except TransferError as e:
            if client.error is not None:  # the server answered: its own error
                raise ValueError(f"{setting}: {url} failed to join the NCCL group at {host}:{port}: {e}") from None
            raise ValueError(f"{setting}: {url} did not join the NCCL group at {host}:{port} ({e}): it must reach "
                             f"that address (set weight_transfer_host to one it can)") from None
        self.log(f"NCCL weight transfer to {url}: trainer {self.device} + {world - 1} worker(s), rendezvous "
                 f"{host}:{port}, ready in {time.perf_counter() - t0:.1f} s")

    def prepare(self, state: dict[str, torch.Tensor]) -> None:
        """The weights of the next sends (tied duplicates dropped, as in the safetensors file of storage)."""
        self.source.state = unique_tensors(state)

    async def send(self, url: str, alive: Callable[[str], Awaitable[bool]]) -> None:
        """start_weight_update, the packed broadcast with update_weights, finish_weight_update on one server,
        through vLLM's engine. One send at a time: they share the trainer's GPU streams and link. TransferError
        when it failed (its group is then aborted and forgotten)."""
        if self._sending is None:
            self._sending = asyncio.Lock()
        async with self._sending:
            if self.broken:
                raise TransferError(self.broken)
            if url not in self.engines:
                raise TransferError(f"no NCCL group with {url}: an earlier transfer to it failed")
            engine = self.engines[url]
            client = engine.client
            client.error = None

            async def problem() -> Optional[str]:
                return client.error or (None if await alive(url) else "it stopped answering /health")

            try:
                await self._watched(engine.send_weights, f"vcpo-nccl-send {url}", problem, self.timeout,
                                    abort=engine.shutdown)
            except TransferError:
                del self.engines[url]
                raise

    async def _watched(self, call: Callable[[], Any], name: str, problem: Callable[[], Awaitable[Optional[str]]],
                       timeout: float, abort: Optional[Callable[[], None]] = None):
        """call() in a daemon thread on the trainer's GPU, its result; TransferError once `problem()` gives a
        reason or `timeout` passes (after `abort()`, which ends a call blocked in NCCL). A call that does not end
        after the abort marks the transfer broken."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: given up on, it may fail later

        def settle(result, error) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def run() -> None:
            try:
                torch.cuda.set_device(self.device)
                result, error = call(), None
            except BaseException as e:
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the pool closed meanwhile
                pass

        threading.Thread(target=run, name=name, daemon=True).start()
        deadline = time.perf_counter() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(done), POLL_SECONDS)
            except asyncio.TimeoutError:
                reason = await problem() or \
                    (f"no end within {timeout:.0f} s" if time.perf_counter() > deadline else None)
            except Exception as e:
                reason = (await problem()) or f"{type(e).__name__}: {e}"
            if reason is not None:
                break
        if abort is not None:
            await asyncio.to_thread(abort)
            try:
                await asyncio.wait_for(asyncio.shield(done), ABORT_GRACE_SECONDS)
            except asyncio.TimeoutError:
                self.broken = f"an NCCL call to the servers did not end after its abort ({name}: {reason})"
            except Exception:
                pass
        raise TransferError(reason)

    def close(self) -> None:
        """Each server's side of its group (best effort: a server may be gone), then the trainer's."""
        for url, engine in self.engines.items():
            closing = _Client(url, self.key, 10.0)
            try:
                closing.shutdown_weight_transfer_engine()
            except Exception as e:
                self.log(f"{url}: /shutdown_weight_transfer_engine failed ({type(e).__name__}: {e})")
            for client in (closing, engine.client):
                client.http.close()
            engine.shutdown()
        self.engines = {}
