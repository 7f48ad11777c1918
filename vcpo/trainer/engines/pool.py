"""`engine: server`: a pool of vLLM OpenAI-compatible servers over HTTP, an Engine (interface.py) as RolloutEngine
is.

- Generation: one `POST /inference/v1/generate` per prompt (token ids in; n completions out with their token
  ids, the sampled tokens' log-probs and the weight version of every token), sent to the server with the least
  outstanding work. Connection pooling, timeouts and retries with backoff come from httpx.
- Weight sync: every server, in parallel, pauses (`/pause?mode=wait|keep|abort`), takes the new weights, labels
  them with the policy version (`/update_weight_version`) and resumes. The weights travel by `weight_transfer`:
  `storage` writes them once (safetensors) to `weights_dir` and each server reloads them from there
  (`/collective_rpc reload_weights`); `nccl` sends them from the trainer's GPU to each server's GPUs with vLLM's
  NCCL engine (weight_transfer.py). vLLM's engine tags each generated token with the label of the weights that
  produced it, so a sample's versions are exact even when weights change while it is being generated (`keep`).
- LoRA (`lora`, the adapter's config): the servers serve the base model with vLLM's LoRA support; a sync writes
  the adapter folder once to `weights_dir` and loads it into every server under a new name per version
  (`/v1/load_lora_adapter`), and each request names the newest (`model`): a request keeps its adapter to its
  end, so a sample's tokens all come from that version, and the servers are not paused. The last
  `keep_adapters` versions stay loaded (those requests in flight or resent may name); older ones are unloaded
  and their folders removed.
- Faults: a server that times out, or fails a request and then its /health check, is marked down; its requests
  are sent to the others. With every server down, EngineUnavailable names them all.
- Access: every request carries the servers' key (VLLM_API_KEY, or the one the trainer made for the servers it
  started) and goes to the server directly, never through a proxy of the environment (servers.http_client)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx
import torch

from vcpo_kernels.truncation import truncates

from ..config import WEIGHT_SWAPS, WEIGHT_TRANSFERS
from ..errors import EngineUnavailable, WeightSyncError
from ..lora import SERVER_ENV, write_adapter
from .interface import LOGPROBS_MODE, Completion, Engine, TransferError, unique_tensors
from .servers import KEY_ENV, http_client, refused

def check_reachable(urls: Sequence[str], setting: str = "engine_urls", timeout: float = 5.0,
                    key: Optional[str] = None) -> None:
    """Every URL answers /health with 200 within `timeout` seconds (checked at once, before the slow start-up
    work), to a request with `key` (default: VLLM_API_KEY); else ValueError naming `setting` and the URLs that did
    not, or that refused the key."""
    key = key or os.environ.get(KEY_ENV)

    async def health(url: str) -> tuple[Optional[str], Optional[str]]:
        async with http_client(url, key, timeout=timeout) as client:
            try:
                code = (await client.get("/health")).status_code
            except httpx.HTTPError as e:
                return f"{url} ({type(e).__name__}: {e or 'no answer'})", None
        if code == 401:
            return None, refused(url, key)
        return (None if code == 200 else f"{url} (/health answered {code})"), None

    answers = asyncio.run(_all(*(health(u) for u in urls)))
    unreachable, refusals = [u for u, _ in answers if u], [r for _, r in answers if r]
    if unreachable:
        raise ValueError(f"{setting}: unreachable: {'; '.join(unreachable)}")
    if refusals:
        raise ValueError(f"{setting}: {'; '.join(refusals)}")


async def check_logprobs_mode(client: httpx.AsyncClient, url: str, setting: str) -> None:
    """The server at `url` (`client` is its own: http_client) reports its sampled tokens' log-probs after the
    temperature (vLLM's logprobs_mode, in its /server_info: VLLM_SERVER_DEV_MODE), as the trainer takes them; else
    ValueError naming `setting` and `url`."""
    try:  # the answer also holds the machine's environment, which vLLM collects once (seconds)
        info = (await client.get("/server_info", params={"config_format": "json"}, timeout=120.0)).json()
        mode = info["vllm_config"]["model_config"]["logprobs_mode"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{setting}: {url} does not report its logprobs_mode at /server_info ({type(e).__name__}: "
                         f"{e})") from None
    if mode != LOGPROBS_MODE:
        raise ValueError(f"{setting}: {url} reports {mode} (log-probs before the temperature and top-k / top-p), but "
                         f"with temperature != 1 or top-k / top-p the behaviour log-probs must be of the distribution "
                         f"sampled from: start it with --logprobs-mode {LOGPROBS_MODE}")


class _Failed(Exception):
    """A request that did not get an answer from its server (the request is sent again)."""


@dataclass
class Server:
    url: str
    client: Optional[httpx.AsyncClient] = field(default=None, repr=False)  # its own (servers.http_client)
    up: bool = True
    down_reason: str = ""
    outstanding: int = 0  # work of the requests in flight: sequences x (prompt + max new tokens)
    inflight: set = field(default_factory=set)  # the HTTP calls in flight, cancelled when marked down
    requests: int = 0  # answered generation requests
    reload_seconds: list = field(default_factory=list)  # pause + reload + label + resume, per sync


@dataclass
class PoolStats:
    write_seconds: float = 0.0  # writing the safetensors file, all syncs (storage transfer)
    resent: int = 0  # requests sent again after their server failed
    aborted: int = 0  # requests aborted by a sync in `abort` mode and sent again from their prompt
    sync_bytes: int = 0  # the files written for the servers to load, all syncs (storage transfer)


class ServerPool(Engine):
    """The rollout engine of `engine: server`. Thread-safe: the trainer's generation and sync threads call it
    at the same time (syncs run while requests are in flight)."""

    concurrent_sync = True  # the producer may load weights while a batch is being generated

    def __init__(self, urls: Sequence[str], *, weights_dir: str, weight_swap: str = "wait", timeout: float = 600.0,
                 retries: int = 3, backoff: float = 0.5, weight_transfer: str = "storage",
                 weight_transfer_host: Optional[str] = None, device: Optional[torch.device] = None,
                 key: Optional[str] = None, lora: Optional[dict] = None, keep_adapters: int = 2,
                 log: Callable[[str], None] = print) -> None:
        """`key`: the servers' (default: VLLM_API_KEY). `weight_transfer` nccl: `device` is the trainer's GPU the
        weights are sent from (default: the current CUDA device of the calling thread), `weight_transfer_host` the
        address the servers join it at. `lora`: the adapter's config (a LoRA run: the weights are adapters),
        the last `keep_adapters` versions kept loaded."""
        if weight_swap not in WEIGHT_SWAPS:
            raise ValueError(f"weight_swap must be one of {list(WEIGHT_SWAPS)}, got {weight_swap!r}")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {list(WEIGHT_TRANSFERS)}, got {weight_transfer!r}")
        if lora is not None and weight_transfer != "storage":
            raise ValueError("a LoRA adapter travels as files: weight_transfer storage, not nccl")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        # absolute: the servers read it, from their own working folders
        self.weights_dir, self.weight_swap, self.timeout = os.path.abspath(weights_dir), weight_swap, timeout
        self.key = key or os.environ.get(KEY_ENV)
        self.retries, self.backoff, self.log = retries, backoff, log
        self.stats = PoolStats()
        self._nccl = None
        if weight_transfer == "nccl":
            from .weight_transfer import NCCLTransfer

            if device is None and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            self._nccl = NCCLTransfer(device=device, host=weight_transfer_host, timeout=timeout, key=self.key,
                                      log=log)
        self.lora, self.keep_adapters = lora, keep_adapters
        self._adapters: list[tuple[str, str]] = []  # (name, folder) of the loaded versions, oldest first
        self._adapter: Optional[tuple[int, str]] = None  # (version, name) the requests name
        self._weights_from = f"weights in {self.weights_dir}" if self._nccl is None else "weights sent over NCCL"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vcpo-pool", daemon=True)
        self._thread.start()
        for s in self.servers:
            s.client = self._call(self._make_client(s.url))

    async def _make_client(self, url: str) -> httpx.AsyncClient:
        # read timeout = a whole generation (or a paused server's drain); connecting must be quick
        return http_client(url, self.key, timeout=httpx.Timeout(self.timeout, connect=5.0),
                           limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def up(self) -> list[Server]:
        return [s for s in self.servers if s.up]

    # -- start-up checks ------------------------------------------------------------------------------------------
    def check(self, *, setting: str, probe_text: str, probe_ids: list[int], max_model_len: int,
              temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> None:
        """Each server is reachable (within seconds), serves a model with the trainer's tokenizer and a long
        enough context, has the endpoints the pool needs (with weight_transfer nccl: vLLM's NCCL engine, whose
        groups are then set up) and, to sample at a temperature other than 1 or with top-k / top-p, reports the
        log-probs after them; else ValueError naming `setting` and the URL."""
        self._call(_all(*(self._check(s, setting, probe_text, probe_ids, max_model_len) for s in self.servers)))
        # untempered and untruncated, vLLM's raw and processed log-probs are the same numbers
        if temperature != 1 or truncates(top_k, top_p):
            self._call(_all(*(check_logprobs_mode(s.client, s.url, setting) for s in self.servers)))
        if self._nccl is not None:
            self._call(self._nccl.connect(self.urls, setting, self._healthy_url))

    async def _check(self, s: Server, setting: str, probe_text: str, probe_ids: list[int], max_len: int) -> None:
        try:
            answers = [await s.client.get("/health", timeout=5.0), await s.client.get("/v1/models", timeout=10.0),
                       await s.client.post("/tokenize", timeout=10.0,
                                           json={"prompt": probe_text, "add_special_tokens": False}),
                       await s.client.get("/is_paused", timeout=10.0)]
        except httpx.HTTPError as e:
            raise ValueError(f"{setting}: {s.url} is unreachable ({type(e).__name__}: {e})") from None
        if any(a.status_code == 401 for a in answers):
            raise ValueError(f"{setting}: {refused(s.url, self.key)}")
        health, models, tokens, paused = answers
        try:
            models, tokens = models.json()["data"][0], tokens.json()
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{setting}: {s.url} is not a vLLM server ({type(e).__name__}: {e})") from None
        if health.status_code != 200:
            raise ValueError(f"{setting}: {s.url}/health answered {health.status_code}")
        if tokens.get("tokens") != probe_ids:
            raise ValueError(f"{setting}: {s.url} serves {models.get('id')!r}, whose tokenizer differs from the "
                             f"trainer's model: {probe_text!r} -> {tokens.get('tokens')} there, {probe_ids} here")
        if (models.get("max_model_len") or 0) < max_len:
            raise ValueError(f"{setting}: {s.url} serves at most {models.get('max_model_len')} tokens; the run "
                             f"needs {max_len} (start it with --max-model-len {max_len})")
        if paused.status_code == 404:
            raise ValueError(f"{setting}: {s.url} has no weight-sync endpoints: start it with "
                             f"VLLM_SERVER_DEV_MODE=1")
        if self._nccl is not None:
            await self._nccl.check(s.client, s.url, setting)

    # -- generation -------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int, temperature: float,
                 top_k: int = -1, top_p: float = 1.0, seeds: Optional[Sequence[int]] = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[Completion]]:
        """n completions of each prompt (token ids), as RolloutEngine.generate, each with the versions of its
        tokens and the URL of the server that made it."""
        adapter = self._adapter  # one adapter for the whole batch, even if a sync lands while it is sent
        if self.lora is not None and adapter is None:
            raise RuntimeError("a LoRA pool generates with an adapter: load_weights first")
        bodies = [{"token_ids": list(p), **({} if adapter is None else {"model": adapter[1]}),
                   "sampling_params": {"n": n, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                                       "max_tokens": max_tokens, "logprobs": 0,
                                       "seed": None if seeds is None else int(seeds[i]),
                                       "stop_token_ids": list(stop_token_ids), "detokenize": False}}
                  for i, p in enumerate(prompts)]
        work = [n * (len(p) + max_tokens) for p in prompts]
        return self._call(_all(*(self._request(b, w, adapter) for b, w in zip(bodies, work))))

    def _pick(self) -> Server:
        up = self.up()
        if not up:
            raise EngineUnavailable("every rollout server is down: "
                                    + "; ".join(f"{s.url} ({s.down_reason})" for s in self.servers))
        return min(up, key=lambda s: s.outstanding)

    async def _request(self, body: dict, work: int, adapter: Optional[tuple[int, str]]) -> list[Completion]:
        failures = 0
        while True:
            server = self._pick()
            try:
                answer = await self._post_generate(server, body, work)
            except _Failed as e:
                failures += 1
                self.stats.resent += 1
                if failures > self.retries + len(self.servers):
                    raise RuntimeError(f"a generation request failed {failures} times; last: {e}") from None
                if server.up:  # a failure on a healthy server: back off before trying again
                    await asyncio.sleep(self.backoff * 2 ** min(failures - 1, 4))
                continue
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if any(c["finish_reason"] == "abort" for c in choices):  # a sync in `abort` mode: start again
                self.stats.aborted += 1
                continue
            server.requests += 1
            return [_completion(c, server.url, None if adapter is None else adapter[0]) for c in choices]

    async def _post_generate(self, server: Server, body: dict, work: int) -> dict:
        server.outstanding += work
        call = asyncio.ensure_future(server.client.post("/inference/v1/generate", json=body))
        server.inflight.add(call)
        try:
            await asyncio.wait({call})  # not `await call`: a call cancelled by _mark_down must not cancel us
            if call.cancelled():
                raise _Failed(f"{server.url} was marked down")
            response = call.result()
        except httpx.TimeoutException:
            self._mark_down(server, f"no answer within {self.timeout:.0f} s")
            raise _Failed(f"{server.url} timed out") from None
        except httpx.TransportError as e:
            if not await self._healthy(server):
                self._mark_down(server, f"{type(e).__name__}: {e}")
            raise _Failed(f"{server.url}: {type(e).__name__}: {e}") from None
        finally:
            server.outstanding -= work
            server.inflight.discard(call)
            call.cancel()
        if response.status_code >= 500:
            raise _Failed(f"{server.url} answered {response.status_code}: {response.text[:300]}")
        if response.status_code == 401:
            raise RuntimeError(refused(server.url, self.key))
        if response.status_code == 403:
            raise RuntimeError(f"{server.url} refuses /inference/v1/generate: start it with --enable-scale-out")
        if response.status_code != 200:
            raise RuntimeError(f"{server.url} rejected a generation request ({response.status_code}): "
                               f"{response.text[:500]}")
        return response.json()

    async def _healthy(self, server: Server) -> bool:
        try:
            return (await server.client.get("/health", timeout=3.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _healthy_url(self, url: str) -> bool:
        return await self._healthy(next(s for s in self.servers if s.url == url))

    def _mark_down(self, server: Server, reason: str) -> None:
        if not server.up:
            return
        server.up, server.down_reason = False, reason
        for call in list(server.inflight):
            call.cancel()  # its requests go to the other servers
        alive = [s.url for s in self.up()]
        self.log(f"rollout server {server.url} is down ({reason}); "
                 + (f"{len(server.inflight)} request(s) resent to {alive}" if alive else "no server is left"))

    # -- weight sync ----------------------------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Every server that is up takes `state` (storage: written once to weights_dir, then reloaded by each;
        nccl: sent to each) and labels its tokens with `version` from then on (in parallel). With LoRA `state` is
        the adapter, loaded beside the older ones; the requests sent from then on name it."""
        if self.lora is not None:
            t0 = time.perf_counter()
            folder = os.path.join(self.weights_dir, f"adapter-v{version}")
            self.stats.sync_bytes += write_adapter(folder, state, self.lora)
            self.stats.write_seconds += time.perf_counter() - t0
            self._call(self._load_adapter_all(version, folder))
            return
        if self._nccl is None:
            from safetensors.torch import save_file

            t0 = time.perf_counter()
            os.makedirs(self.weights_dir, exist_ok=True)
            tmp = os.path.join(self.weights_dir, "model.safetensors.tmp")
            save_file({k: v.contiguous() for k, v in unique_tensors(state).items()}, tmp)
            os.replace(tmp, os.path.join(self.weights_dir, "model.safetensors"))
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.sync_bytes += os.path.getsize(os.path.join(self.weights_dir, "model.safetensors"))
        elif self._nccl.source is None:
            raise RuntimeError("weight_transfer nccl: ServerPool.check sets up the NCCL groups; call it first")
        else:
            self._nccl.prepare(state)
        self._call(self._reload_all(version))

    async def _reload_all(self, version: int) -> None:
        self._pick()  # EngineUnavailable when none is up
        await asyncio.gather(*(self._reload(s, version) for s in self.up()))
        if self._nccl is not None and self._nccl.broken:
            raise WeightSyncError(f"{self._nccl.broken}: the trainer's GPU cannot send more weights")
        self._pick()

    async def _reload(self, s: Server, version: int) -> None:
        t0 = time.perf_counter()
        try:
            await self._control(s, f"/pause?mode={self.weight_swap}")
            try:
                await self._take_weights(s)
                await self._control(s, "/update_weight_version", {"new_version": str(version)})
            finally:
                await self._control(s, "/resume")
        except (httpx.TransportError, TransferError) as e:
            if not await self._healthy(s):  # it died: it would serve old weights; the others carry on
                self._mark_down(s, f"weight sync failed: {type(e).__name__}: {e}")
                return
            raise WeightSyncError(f"{s.url} failed to load the {self._weights_from} "
                                  f"({type(e).__name__}: {e}); see its log") from None
        s.reload_seconds.append(time.perf_counter() - t0)

    async def _load_adapter_all(self, version: int, folder: str) -> None:
        self._pick()  # EngineUnavailable when none is up
        name = f"vcpo-v{version}"
        await asyncio.gather(*(self._load_adapter(s, name, folder) for s in self.up()))
        self._pick()
        self._adapter = (version, name)
        self._adapters = [a for a in self._adapters if a[0] != name] + [(name, folder)]
        while len(self._adapters) > self.keep_adapters:  # no request in flight names these any more
            old, old_folder = self._adapters.pop(0)
            await asyncio.gather(*(self._control(s, "/v1/unload_lora_adapter", {"lora_name": old})
                                   for s in self.up()), return_exceptions=True)
            shutil.rmtree(old_folder, ignore_errors=True)

    async def _load_adapter(self, s: Server, name: str, folder: str) -> None:
        t0 = time.perf_counter()
        body = {"lora_name": name, "lora_path": folder}
        try:
            response = await s.client.post("/v1/load_lora_adapter", json=body)
            if response.status_code == 400 and "already" in response.text:  # a resumed run's version, loaded before
                await self._control(s, "/v1/unload_lora_adapter", {"lora_name": name})
                response = await s.client.post("/v1/load_lora_adapter", json=body)
        except httpx.TransportError as e:
            if not await self._healthy(s):  # it died: the others carry on
                self._mark_down(s, f"adapter load failed: {type(e).__name__}: {e}")
                return
            raise WeightSyncError(f"{s.url} failed to load the adapter {folder} ({type(e).__name__}: {e}); see its "
                                  "log") from None
        if response.status_code == 401:
            raise WeightSyncError(refused(s.url, self.key))
        if response.status_code in (404, 405):
            raise WeightSyncError(f"{s.url} has no /v1/load_lora_adapter: start it with --enable-lora --max-lora-rank "
                                  f"R (the adapter's rank or more) --max-loras {self.keep_adapters} and "
                                  f"{', '.join(f'{k}={v}' for k, v in SERVER_ENV.items())} in its environment")
        if response.status_code != 200:
            raise WeightSyncError(f"{s.url} did not load the adapter {folder} ({response.status_code}): "
                                  f"{response.text[:500]}")
        s.reload_seconds.append(time.perf_counter() - t0)

    async def _take_weights(self, s: Server) -> None:
        if self._nccl is None:
            await self._control(s, "/collective_rpc",
                                {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}})
        else:
            await self._nccl.send(s.url, self._healthy_url)

    async def _control(self, s: Server, path: str, body: Optional[dict] = None) -> None:
        response = await s.client.post(path, json=body)
        if response.status_code == 401:
            raise WeightSyncError(refused(s.url, self.key))
        if response.status_code != 200:
            raise WeightSyncError(f"{s.url}{path.split('?')[0]} failed ({response.status_code}): "
                                  f"{response.text[:500]} ({self._weights_from})")

    def metrics(self, rollouts: Sequence) -> dict:
        """Servers up, requests resent and aborted so far, the samples of `rollouts` whose weights changed while
        they were generated."""
        return {"servers_up": len(self.up()), "resent_requests": self.stats.resent,
                "aborted_requests": self.stats.aborted,
                "swapped_samples": sum(r.last_version is not None for r in rollouts)}

    def summary(self) -> dict:
        servers = [{"url": s.url, "up": s.up, "down_reason": s.down_reason, "requests": s.requests,
                    "syncs": len(s.reload_seconds),
                    "mean_reload_seconds": sum(s.reload_seconds) / max(len(s.reload_seconds), 1)}
                   for s in self.servers]
        return {"servers": servers, "weights_write_seconds": self.stats.write_seconds,
                "sync_bytes": self.stats.sync_bytes,
                "resent_requests": self.stats.resent, "aborted_requests": self.stats.aborted}

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._nccl is not None:
            self._nccl.close()
        self._call(_all(*(s.client.aclose() for s in self.servers)))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _all(*coroutines):
    """The results of every coroutine; when one fails, the others are cancelled (not left running)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _completion(choice: dict, url: str, adapter_version: Optional[int]) -> Completion:
    """A choice of /inference/v1/generate; its tokens' versions are the server's labels, or with LoRA the version
    of the adapter the request named (all of its tokens)."""
    ids = list(choice["token_ids"] or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if adapter_version is not None:  # the servers' own label is never set with LoRA ("default")
        spans = [(adapter_version, 0, len(ids))]
    else:
        spans = [(int(v["version"]), v["start"], v["end"]) for v in choice.get("weight_versions") or []]
    return Completion(ids, [float(c["logprob"]) for c in content], choice["finish_reason"], versions=spans,
                      server=url)
