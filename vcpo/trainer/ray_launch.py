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
import os
import signal
import socket
import sys
import time
from typing import Optional, Union

from .config import TrainConfig
from .engines.ray_servers import bundle_options, bundle_shape
from .errors import RunStopped, TrainerRankDied
from .net import free_port
from .placement.devices import local_server_count
from .run import train

LOCAL = ("local", "")  # --ray with no address: a Ray cluster on this machine, shut down at the end
STOP_GRACE_S = 120.0  # after a Ctrl-C / SIGTERM: time for rank 0 to finish its step and checkpoint
FAILED_GRACE_S = 30.0  # after rank 0 failed: time for the other ranks to take its stop message and return


class _Rank:
    """One trainer rank (a Ray actor): `train()` in its own process, with torchrun's environment."""

    def where(self) -> tuple[str, str, int]:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def master_port(self) -> int:
        import ray

        return free_port(ray.util.get_node_ip_address())

    def train(self, cfg: TrainConfig, resume: bool, env: dict) -> Union[dict, RunStopped, None]:
        os.environ.update(env)
        try:
            return train(cfg, resume=resume, progress=False)
        except RunStopped as stop:  # returned, not raised: Ray takes a BaseException for its actor's death
            return stop


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
        bundle = bundle_shape(ray.cluster_resources().get("GPU", 0) > 0)
        pg = placement_group([bundle] * (cfg.trainer_ranks + servers), strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=cfg.engine_timeout)
        if not ready:
            raise ValueError(f"ray: the cluster cannot place {cfg.trainer_ranks} trainer rank(s) and {servers} "
                             f"server(s), {bundle} each, within {cfg.engine_timeout:.0f} s (engine_timeout); it has "
                             f"{ray.available_resources()} free")
        actors = [ray.remote(_Rank).options(**bundle_options(bundle, pg, r)).remote()
                  for r in range(cfg.trainer_ranks)]
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
    checkpoints and stops the others); a second one, or no end within STOP_GRACE_S, ends the ranks at once; a rank
    stopped before its steps (RunStopped: rank 0 during its engine's start-up) ends the run at once. A rank
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
            if isinstance(result, RunStopped):  # the others wait for it at their start-up: the caller ends them
                raise result
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
