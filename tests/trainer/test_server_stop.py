"""LocalServers.stop on stand-in servers: a process-group leader that, like vLLM's HTTP server after the pool
aborted its requests, never exits on SIGTERM, but stops its engine process (titled as vLLM titles them). The stop
ends when the engine is down, not after its whole grace, and leaves nothing running and no temporary folder."""

import os
import subprocess
import sys
import time

import pytest

from vcpo.trainer.engines.servers import LocalServers, engine_down, engine_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LEADER = r"""
import signal, subprocess, sys, time
engine = subprocess.Popen(["bash", "-c", 'exec -a "$0" sleep 600', sys.argv[1]])
signal.signal(signal.SIGTERM, lambda *_: engine.terminate())  # the engine stops; the server itself hangs on
print(engine.pid, flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def stand_in_server():
    """start(title) -> (leader Popen, its engine's pid): the leader in its own session, as LocalServers starts a
    server; whatever a failed test leaves is killed."""
    started = []

    def start(title):
        proc = subprocess.Popen([sys.executable, "-c", LEADER, title], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        started.append(proc)
        return proc, int(proc.stdout.readline())

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def servers_with(proc, tmp_path):
    servers = LocalServers("model", 1, log_dir=str(tmp_path), dtype="float32", max_model_len=64, kv_cache_gib=1,
                           seed=0, log=lambda line: None)
    tmp = tmp_path / "server-tmp"
    tmp.mkdir()
    servers.procs, servers.tmp_dirs = [proc], [str(tmp)]
    return servers, tmp


def test_engine_processes_are_the_vllm_titled_ones_of_the_group(stand_in_server):
    proc, engine = stand_in_server("VLLM::EngineCore")
    other, not_engine = stand_in_server("python-worker")
    deadline = time.time() + 10
    while engine not in engine_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.05)  # until bash has exec'ed
    assert engine_processes(proc.pid) == {engine}
    assert engine_processes(other.pid) == set() and not_engine not in engine_processes(proc.pid)
    assert not engine_down(proc.pid, {engine}) and not engine_down(other.pid, set())
    os.kill(engine, 15)
    deadline = time.time() + 10
    while not engine_down(proc.pid, {engine}) and time.time() < deadline:
        time.sleep(0.05)
    assert engine_down(proc.pid, {engine})  # a zombie (its parent has not reaped it) counts as ended


def test_stop_ends_once_the_engine_is_down_not_after_the_grace(stand_in_server, tmp_path):
    proc, engine = stand_in_server("VLLM::EngineCore")
    deadline = time.time() + 10
    while engine not in engine_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    servers, tmp = servers_with(proc, tmp_path)
    start = time.perf_counter()
    servers.stop(grace=60.0)
    assert time.perf_counter() - start < 20  # the engine ends at once; the leader would wait the whole 60 s
    assert proc.returncode == -9 and not alive(engine) and not tmp.exists() and servers.procs == []


def test_stop_waits_the_grace_when_it_sees_no_engine_process(stand_in_server, tmp_path):
    proc, engine = stand_in_server("python-worker")  # an engine vLLM did not title: nothing tells it is down
    servers, tmp = servers_with(proc, tmp_path)
    start = time.perf_counter()
    servers.stop(grace=1.5)
    assert time.perf_counter() - start >= 1.5
    assert proc.returncode == -9 and not alive(engine) and not tmp.exists()
