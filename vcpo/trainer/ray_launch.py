"""`vcpo train --ray [ADDRESS]` (docs/trainer.md, "Trainer ranks on Ray"): the N trainer ranks as Ray actors and,
for `engine: server` with `engine_servers`, each vLLM server as a `vcpo serve` process started by a Ray actor, all
on the bundles of one placement group (a CPU, plus a GPU on a cluster that has GPUs, per rank and per server).

This process is Ray's driver: it connects to the cluster (or starts a local one), reserves the placement group,
gives each rank actor torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT at rank 0's actor), so
that `train()` and TrainerRanks run in them as under torchrun, and waits. Rank 0 starts the server actors on the
group's last bundles (RayServers, LocalServers' interface). Whatever happens, the actors are killed and the
placement group removed (which also ends the server actors) and a local cluster shut down."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys
import time
from typing import Optional

from .config import TrainConfig
from .errors import ServerStartError, TrainerRankDied
from .launch import local_server_count
from .servers import LocalServers, free_port

LOCAL = ("local", "")  # --ray with no address: a Ray cluster on this machine, shut down at the end
STOP_GRACE_S = 120.0  # after a Ctrl-C / SIGTERM: time for rank 0 to finish its step and checkpoint
FAILED_GRACE_S = 30.0  # after rank 0 failed: time for the other ranks to take its stop message and return


def _bundle(gpus: bool) -> dict:
    return {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}


def _options(bundle: dict, pg, index: int) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


class _Rank:
    """One trainer rank (a Ray actor): `train()` in its own process, with torchrun's environment."""

    def where(self) -> tuple[str, str, int]:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def master_port(self) -> int:
        import ray

        return free_port(ray.util.get_node_ip_address())

    def train(self, cfg: TrainConfig, resume: bool, env: dict) -> Optional[dict]:
        from .run import train

        os.environ.update(env)
        return train(cfg, resume=resume, progress=False)


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
            self.actors = [ray.remote(_Server).options(**_options(pg.bundle_specs[first + i], pg, first + i)).remote()
                           for i in range(self.count)]
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


def _connect(cfg: TrainConfig, bundles: int) -> None:
    """ray.init at cfg.ray (an address) or, for LOCAL, a new local cluster with at least one logical CPU per bundle
    (the ranks and servers then share the cores), which ray.shutdown() ends."""
    import ray

    if cfg.ray in LOCAL:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, bundles), include_dashboard=False)
        return
    host, _, port = cfg.ray.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():  # ray.init waits minutes for an address where nothing listens
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ValueError(f"ray: nothing answers at {cfg.ray!r} ({e}): give a running Ray cluster's address "
                             "(ray start --head prints it), auto, or no address for a local cluster") from None
    try:
        ray.init(address=cfg.ray)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ValueError(f"ray: cannot connect to the Ray cluster at {cfg.ray!r}: {e}") from None


def train_on_ray(cfg: TrainConfig, resume: bool, log=print) -> Optional[dict]:
    """Run `train(cfg, resume)` on the Ray cluster of cfg.ray; rank 0's summary."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError("ray: the launcher needs the ray package: pip install 'vcpo[ray]'")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    servers = local_server_count(cfg)
    _connect(cfg, cfg.trainer_ranks + servers)
    pg, actors = None, []
    previous = signal.signal(signal.SIGTERM, _as_interrupt)
    try:
        bundle = _bundle(ray.cluster_resources().get("GPU", 0) > 0)
        pg = placement_group([bundle] * (cfg.trainer_ranks + servers), strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=cfg.engine_timeout)
        if not ready:
            raise ValueError(f"ray: the cluster cannot place {cfg.trainer_ranks} trainer rank(s) and {servers} "
                             f"server(s), {bundle} each, within {cfg.engine_timeout:.0f} s (engine_timeout); it has "
                             f"{ray.available_resources()} free")
        actors = [ray.remote(_Rank).options(**_options(bundle, pg, r)).remote() for r in range(cfg.trainer_ranks)]
        places = ray.get([a.where.remote() for a in actors])
        for r, (ip, _, pid) in enumerate(places):
            log(f"ray: trainer rank {r}: pid {pid} on {ip}")
        master = {"MASTER_ADDR": places[0][0], "MASTER_PORT": str(ray.get(actors[0].master_port.remote())),
                  "WORLD_SIZE": str(cfg.trainer_ranks), "LOCAL_RANK": "0"}  # each actor sees only its own GPU
        runs = {a.train.remote(cfg, resume, {**master, "RANK": str(r)}): r for r, a in enumerate(actors)}
        return _wait(runs, places, cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)  # and so the server actors rank 0 placed in it
        ray.shutdown()  # a local cluster ends; from another one this process disconnects


def _wait(runs: dict, places: list, cfg: TrainConfig) -> Optional[dict]:
    """Rank 0's summary once every rank returned. A Ctrl-C or SIGTERM here goes to rank 0 (which finishes its step,
    checkpoints and stops the others); a second one, or no end within STOP_GRACE_S, ends the ranks at once. A rank
    that failed or died: the others get FAILED_GRACE_S to end (rank 0 tells them to stop; a dead peer fails rank 0's
    collectives), then the error, naming a dead actor first (the others' errors follow from it)."""
    import ray

    pending, summary, deadline, failed = list(runs), None, None, []
    while pending:
        try:
            timeout = FAILED_GRACE_S if failed else None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=len(pending) if failed else 1, timeout=timeout)
        except KeyboardInterrupt:
            if deadline is not None or failed:
                raise
            _signal_rank0(places[0])
            deadline = time.monotonic() + STOP_GRACE_S
            continue
        if not done and not failed:
            raise KeyboardInterrupt(f"the trainer ranks did not stop within {STOP_GRACE_S:.0f} s")
        for ref in done:
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                failed.append((runs[ref], e))
                continue
            if runs[ref] == 0:
                summary = result
        if failed and not done:
            break  # the ranks still running are killed by the caller
    if not failed:
        return summary
    dead = [(rank, e) for rank, e in failed if isinstance(e, ray.exceptions.RayActorError)]
    if dead:
        rank, e = dead[0]
        ip, _, pid = places[rank]
        raise TrainerRankDied(f"trainer rank {rank} (Ray actor, pid {pid} on {ip}) died: {_first_line(e)}\nThe run "
                              f"is stopped; continue from its last checkpoint with `vcpo train --resume "
                              f"{cfg.output_dir or '<the run folder>'}` (on Ray again: the run's settings)")
    rank, e = failed[0]
    print(f"trainer rank {rank} failed:\n{e}", file=sys.stderr)
    raise e.cause if isinstance(e.cause, Exception) else e


def _signal_rank0(place: tuple[str, str, int]) -> None:
    """SIGTERM to rank 0's process: from here on its node, else from a task on its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _, node, pid = place
    if node == ray.get_runtime_context().get_node_id():
        return _kill(pid, signal.SIGTERM)
    kill = ray.remote(num_cpus=0)(_kill)
    ray.get(kill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        pid, signal.SIGTERM))


def _kill(pid: int, signum: int) -> None:
    os.kill(pid, signum)


def _as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _first_line(error: Exception) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
