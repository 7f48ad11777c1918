"""The one place a rollout engine is built from the settings: the run's (start_engine: where it runs, cores on a CPU
machine, GPUs on a GPU machine, and for `engine: server` the pool of vLLM servers checked and loaded with the
trainer's weights, docs/scale.md) and `vcpo eval`'s (owned_engine).

`start_engine` is a context manager: whatever it started (an engine, local servers) is stopped when the run
ends, on error and on a signal."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from ..config import TrainConfig
from ..errors import WeightSyncError
from ..lora import adapters_in_flight, server_args
from ..placement.devices import core_plan, gpu_plan, local_server_count, pin_engine_processes, pin_trainer
from .interface import Engine
from .pool import ServerPool, check_reachable
from .ray_servers import RayServers
from .rollout_engine import RolloutEngine
from .servers import LocalServers, servers_key, split_cores


def preflight(cfg: TrainConfig) -> None:
    """The checks that take seconds, made before the slow start-up work: running servers (engine_urls) answer."""
    if cfg.engine == "server" and cfg.engine_urls is not None:
        check_reachable(cfg.server_urls())


@contextmanager
def start_engine(cfg: TrainConfig, *, model_dir: str, max_len: int, run_dir: str, probe: str,
                 probe_ids: list[int], weights: Callable[[], dict], version: int, warm_up_prompt: list[int],
                 log: Callable[[str], None], adapter: Optional[dict] = None) -> Iterator[tuple[Engine, float]]:
    """(engine, seconds it took to start): a RolloutEngine or a ServerPool, started from `model_dir` with the
    trainer's `weights()` at `version`; closed (and local servers stopped) on exit. With `adapter` (a LoRA run's
    adapter config), `model_dir` is the base model and `weights()` the adapter, loaded at once."""
    started = time.perf_counter()
    engine_cores, trainer_cores = core_plan(cfg)
    engine = servers = None
    try:
        if cfg.engine == "server":
            engine, servers = _start_server_pool(cfg, model_dir=model_dir, max_len=max_len, run_dir=run_dir,
                                                 engine_cores=engine_cores, probe=probe, probe_ids=probe_ids,
                                                 weights=weights(), version=version,
                                                 warm_up_prompt=warm_up_prompt, adapter=adapter, log=log)
        else:
            engine = owned_engine(cfg, model_dir, mode=cfg.engine, max_len=max_len,
                                  sync_dir=os.path.join(run_dir, ".weights"), engine_cores=engine_cores,
                                  adapter=adapter)
            if adapter is not None:
                engine.load_weights(weights(), version)
            if engine_cores is not None:
                pin_engine_processes(engine_cores)
        if engine_cores is not None:
            pin_trainer(trainer_cores)
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


def owned_engine(cfg: TrainConfig, model_dir: str, *, mode: str, max_len: int, sync_dir: str,
                 engine_cores: Optional[list[int]] = None, adapter: Optional[dict] = None) -> RolloutEngine:
    """vLLM owned by this process (`mode` process or inprocess) serving `model_dir` with the run's settings; with
    `adapter` (a LoRA adapter's config) `model_dir` is the base model, and the adapter is yet to be loaded."""
    return RolloutEngine(model_dir, mode=mode, dtype=cfg.dtype, max_model_len=max_len, kv_cache_gib=cfg.kv_cache_gib,
                         seed=cfg.seed, engine_cores=None if engine_cores is None else ",".join(map(str, engine_cores)),
                         sync_dir=sync_dir, gpu_memory_utilization=cfg.gpu_memory_utilization, lora=adapter)


def _start_server_pool(cfg: TrainConfig, *, model_dir: str, max_len: int, run_dir: str, engine_cores, probe: str,
                       probe_ids: list[int], weights: dict, version: int, warm_up_prompt: list[int],
                       adapter: Optional[dict], log) -> tuple[ServerPool, Optional[LocalServers]]:
    """engine: server: start the local servers (engine_servers) or use the running ones (engine_urls), check
    that each is reachable and serves the trainer's tokenizer, and load the trainer's `weights` into each: the
    servers may hold any weights of the architecture, and the pool labels them with `version`."""
    servers = key = None  # running servers: the key in VLLM_API_KEY, if any (ServerPool reads it)
    urls = cfg.server_urls()
    count = local_server_count(cfg)
    if count:
        key = servers_key()
        kind = LocalServers if cfg.ray is None else RayServers  # Ray: each server on a bundle of the run's group
        servers = kind(model_dir, count, log_dir=os.path.join(run_dir, "servers"), dtype=cfg.dtype,
                       max_model_len=max_len, kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
                       cores=None if engine_cores is None else split_cores(engine_cores, count),
                       gpus=None if cfg.ray is not None else gpu_plan(count, cfg.trainer_ranks),
                       gpu_memory_utilization=cfg.gpu_memory_utilization, weight_transfer=cfg.weight_transfer,
                       key=key, unix_socket=True, log=log,
                       lora_args=() if adapter is None else server_args(adapter["r"], cfg.max_staleness))
        urls = servers.start()
    pool = ServerPool(urls, weights_dir=cfg.weights_dir or os.path.join(run_dir, ".weights"),
                      weight_swap=cfg.weight_swap, timeout=cfg.engine_timeout, weight_transfer=cfg.weight_transfer,
                      weight_transfer_host=cfg.weight_transfer_host,
                      device=torch.device("cuda:0") if cfg.weight_transfer == "nccl" else None, key=key, log=log,
                      lora=adapter, keep_adapters=adapters_in_flight(cfg.max_staleness))
    setting = "engine_servers" if servers else "engine_urls"
    try:
        pool.check(setting=setting, probe_text=probe, probe_ids=probe_ids, max_model_len=max_len,
                   temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
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
