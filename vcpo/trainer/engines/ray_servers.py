"""`vcpo train --ray` with `engine: server` and `engine_servers` (docs/trainer.md, "Trainer ranks on Ray"): each
vLLM server as a `vcpo serve` process started by a Ray actor on its own bundle of the run's placement group, which
rank 0 starts (RayServers, LocalServers' interface); and the bundles the launcher (vcpo/trainer/ray_launch.py) reserves."""

from __future__ import annotations

import json
import os

from ..errors import ServerStartError
from .servers import LocalServers


def bundle_shape(gpus: bool) -> dict:
    return {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}


def bundle_options(bundle: dict, pg, index: int) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


class _Server:
    """One vLLM server (a Ray actor): a `vcpo serve` child process on this actor's node, which ends with the
    actor (LocalServers' parent-death watch). On the trainer's node (`trainer_node`) it listens on 127.0.0.1
    only; on another node, on that node's address (behind the servers' key)."""

    def start(self, model: str, index: int, log_dir: str, settings: dict, timeout: float, trainer_node: str) -> dict:
        import ray

        gpus = [os.environ["CUDA_VISIBLE_DEVICES"]] if ray.get_gpu_ids() else None  # the bundle's GPU
        node = ray.util.get_node_ip_address()
        self.servers = LocalServers(model, 1, log_dir=os.path.join(log_dir, str(index)), gpus=gpus,
                                    host="127.0.0.1" if node == trainer_node else node, **settings)
        url = self.servers.start(timeout)[0]
        return {"url": url, "pid": self.servers.procs[0].pid, "tmp": self.servers.tmp_dirs[0],
                "log": os.path.join(log_dir, str(index), "server-0.log"), "node": node}

    def stop(self) -> None:
        self.servers.stop()


class RayServers:
    """LocalServers' interface (start -> URLs, stop) for rank 0 on Ray: server i on bundle `first + i` of the
    placement group this actor runs in (the run's last `count` bundles)."""

    def __init__(self, model: str, count: int, *, log_dir: str, log=print, cores=None, gpus=None, unix_socket=False,
                 **settings) -> None:
        # LocalServers' placement: here each server's bundle places it, and rank 0 reaches it over TCP (_Server)
        del cores, gpus, unix_socket
        self.model, self.count, self.log_dir, self.settings, self.log = model, count, log_dir, settings, log
        self.actors: list = []
        self.urls: list[str] = []

    def start(self, timeout: float = 900.0) -> list[str]:
        import ray

        pg = ray.util.get_current_placement_group()
        first = len(pg.bundle_specs) - self.count
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            self.actors = [ray.remote(_Server).options(**bundle_options(pg.bundle_specs[first + i], pg, first + i))
                           .remote() for i in range(self.count)]
            here = ray.util.get_node_ip_address()  # rank 0's node: the trainer's
            started = ray.get([a.start.remote(self.model, i, self.log_dir, self.settings, timeout, here)
                               for i, a in enumerate(self.actors)])
        except ray.exceptions.RayTaskError as e:
            self.stop()
            raise e.cause if isinstance(e.cause, ServerStartError) else e
        except BaseException:
            self.stop()
            raise
        with open(os.path.join(self.log_dir, "servers.json"), "w") as f:
            json.dump(started, f, indent=2)
        for i, s in enumerate(started):
            self.log(f"server {i}: {s['url']} (Ray actor on {s['node']}, pid {s['pid']}), log {s['log']}")
        self.urls = [s["url"] for s in started]
        return self.urls

    def stop(self, grace: float = 30.0) -> None:
        """Each server stopped by its actor (SIGTERM, then SIGKILL of its session), then the actor killed."""
        import ray

        try:
            ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors), timeout=grace)
        finally:
            for a in self.actors:
                ray.kill(a)
            self.actors = []
