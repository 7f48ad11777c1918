"""Starting a run's rollout engine: where it runs (cores on a CPU machine, GPUs on a GPU machine) and, for
`engine: server`, the pool of vLLM servers checked and loaded with the trainer's weights (docs/scale.md).

`start_engine` is a context manager: whatever it started (an engine, local servers) is stopped when the run
ends, on error and on a signal."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from .config import TrainConfig, parse_cores
from .engine import RolloutEngine
from .pool import ServerPool, WeightSyncError
from .servers import LocalServers, servers_key, split_cores


def local_server_count(cfg: TrainConfig) -> int:
    """How many vLLM servers this run starts itself (engine: server with engine_servers)."""
    return cfg.engine_servers if cfg.engine == "server" and cfg.engine_servers is not None else 0


def core_plan(cfg: TrainConfig) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """CPU with engine='process' or local servers: (engine cores, trainer cores), disjoint when there are enough,
    so that generation and training overlap as on separate GPU pools (default: the last core for the engine, the
    last N for N servers). Otherwise (None, None): nothing is pinned."""
    if cfg.ray is not None or torch.cuda.is_available() or not (cfg.engine == "process" or local_server_count(cfg)):
        return None, None  # on Ray, the placement group's bundles place the ranks and servers
    allowed = sorted(os.sched_getaffinity(0))
    count = max(1, local_server_count(cfg))
    engine = parse_cores(cfg.engine_cores, "engine_cores") if cfg.engine_cores else allowed[-count:]
    trainer = (parse_cores(cfg.trainer_cores, "trainer_cores") if cfg.trainer_cores
               else [c for c in allowed if c not in engine] or allowed)
    return engine, trainer


def _set_affinity(pid: int, cores: list[int]) -> None:
    """Every thread of process `pid` (sched_setaffinity on a pid moves only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended


def _pin_engine_processes(engine_cores: list[int]) -> None:
    """The engine's processes (this one's descendants) onto the engine cores. Done after the engine started: it
    starts twice as fast with all cores."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            _set_affinity(child.pid, engine_cores)
        except FileNotFoundError:
            pass  # a helper process that just ended


def _pin_trainer(trainer_cores: list[int]) -> None:
    _set_affinity(os.getpid(), trainer_cores)
    torch.set_num_threads(len(trainer_cores))


def _gpu_plan(count: int, trainer_gpus: int) -> Optional[list[str]]:
    """GPU machine: the device of each local server; the trainer ranks keep GPUs 0..R-1 when there are enough
    GPUs for the servers besides, otherwise the servers share the GPUs (the trainer's too) in turn."""
    if not torch.cuda.is_available():
        return None
    devices = list(range(torch.cuda.device_count()))
    pool = devices[trainer_gpus:] if len(devices) >= trainer_gpus + count else devices
    return [str(pool[i % len(pool)]) for i in range(count)]


@contextmanager
def start_engine(cfg: TrainConfig, *, model_dir: str, max_len: int, run_dir: str, probe: str,
                 probe_ids: list[int], weights: Callable[[], dict], version: int, warm_up_prompt: list[int],
                 log: Callable[[str], None], adapter: Optional[dict] = None) -> Iterator[tuple]:
    """(engine, seconds it took to start): a RolloutEngine or a ServerPool (both with generate, load_weights,
    close), started from `model_dir` with the trainer's `weights()` at `version`; closed (and local servers
    stopped) on exit. With `adapter` (a LoRA run's adapter config), `model_dir` is the base model and `weights()`
    the adapter, loaded at once."""
    started = time.perf_counter()
    engine_cores, trainer_cores = core_plan(cfg)
    engine = servers = None
    try:
        if cfg.engine == "server":
            engine, servers = _start_server_pool(cfg, model_dir=model_dir, max_len=max_len, run_dir=run_dir,
                                                 engine_cores=engine_cores, probe=probe, probe_ids=probe_ids,
                                                 weights=weights(), version=version,
                                                 warm_up_prompt=warm_up_prompt, log=log)
        else:
            engine = RolloutEngine(model_dir, mode=cfg.engine, dtype=cfg.dtype, max_model_len=max_len,
                                   kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
                                   engine_cores=None if engine_cores is None else ",".join(map(str, engine_cores)),
                                   sync_dir=os.path.join(run_dir, ".weights"),
                                   gpu_memory_utilization=cfg.gpu_memory_utilization, lora=adapter)
            if adapter is not None:
                engine.load_weights(weights(), version)
            if engine_cores is not None:
                _pin_engine_processes(engine_cores)
        if engine_cores is not None:
            _pin_trainer(trainer_cores)
        seconds = time.perf_counter() - started
        log(f"engine ({cfg.engine}) started in {seconds:.1f} s"
            + (f"; cores: engine {engine_cores}, trainer {trainer_cores}" if engine_cores else "")
            + (f"; servers: {', '.join(engine.urls)}" if cfg.engine == "server" else ""))
        yield engine, seconds
    finally:
        if engine is not None:
            engine.close()
        if servers is not None:
            servers.stop()


def _start_server_pool(cfg: TrainConfig, *, model_dir: str, max_len: int, run_dir: str, engine_cores, probe: str,
                       probe_ids: list[int], weights: dict, version: int, warm_up_prompt: list[int],
                       log) -> tuple[ServerPool, Optional[LocalServers]]:
    """engine: server: start the local servers (engine_servers) or use the running ones (engine_urls), check
    that each is reachable and serves the trainer's tokenizer, and load the trainer's `weights` into each: the
    servers may hold any weights of the architecture, and the pool labels them with `version`."""
    servers = key = None  # running servers: the key in VLLM_API_KEY, if any (ServerPool reads it)
    urls = cfg.server_urls()
    count = local_server_count(cfg)
    if count:
        kind, key = LocalServers, servers_key()
        if cfg.ray is not None:  # each server on its own bundle of the run's placement group
            from .ray_launch import RayServers as kind
        servers = kind(model_dir, count, log_dir=os.path.join(run_dir, "servers"), dtype=cfg.dtype,
                       max_model_len=max_len, kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
                       cores=None if engine_cores is None else split_cores(engine_cores, count),
                       gpus=None if cfg.ray is not None else _gpu_plan(count, cfg.trainer_ranks),
                       gpu_memory_utilization=cfg.gpu_memory_utilization, weight_transfer=cfg.weight_transfer,
                       key=key, unix_socket=True, log=log)
        urls = servers.start()
    pool = ServerPool(urls, weights_dir=cfg.weights_dir or os.path.join(run_dir, ".weights"),
                      weight_swap=cfg.weight_swap, timeout=cfg.engine_timeout, weight_transfer=cfg.weight_transfer,
                      weight_transfer_host=cfg.weight_transfer_host,
                      device=torch.device("cuda:0") if cfg.weight_transfer == "nccl" else None, key=key, log=log)
    setting = "engine_servers" if servers else "engine_urls"
    try:
        pool.check(setting=setting, probe_text=probe, probe_ids=probe_ids, max_model_len=max_len,
                   temperature=cfg.temperature)
        try:
            pool.load_weights(weights, version)
        except WeightSyncError as e:
            raise ValueError(f"{setting}: {e}: does it serve a model of the trainer's architecture "
                             f"({model_dir})?") from None
        pool.generate([warm_up_prompt] * len(urls), n=1, max_tokens=1, temperature=1.0)  # one warm-up each
    except BaseException:
        pool.close()
        if servers is not None:
            servers.stop()
        raise
    return pool, servers
