"""Where a run's processes go on one machine (docs/scale.md): on a CPU machine, the engine's cores and the
trainer's, disjoint when there are enough; on a GPU machine, the GPU of each local vLLM server. On Ray, the placement
group's bundles place the ranks and servers instead (../ray_launch.py, ../engines/ray_servers.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..config import TrainConfig, parse_cores


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


def pin_engine_processes(engine_cores: list[int]) -> None:
    """The engine's processes (this one's descendants) onto the engine cores. Done after the engine started: it
    starts twice as fast with all cores."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            _set_affinity(child.pid, engine_cores)
        except FileNotFoundError:
            pass  # a helper process that just ended


def pin_trainer(trainer_cores: list[int]) -> None:
    _set_affinity(os.getpid(), trainer_cores)
    torch.set_num_threads(len(trainer_cores))


def gpu_plan(count: int, trainer_gpus: int) -> Optional[list[str]]:
    """GPU machine: the device of each local server; the trainer ranks keep GPUs 0..R-1 when there are enough
    GPUs for the servers besides, otherwise the servers share the GPUs (the trainer's too) in turn."""
    if not torch.cuda.is_available():
        return None
    devices = list(range(torch.cuda.device_count()))
    pool = devices[trainer_gpus:] if len(devices) >= trainer_gpus + count else devices
    return [str(pool[i % len(pool)]) for i in range(count)]
