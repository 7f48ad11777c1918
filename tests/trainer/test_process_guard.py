"""The watchdog of vcpo/trainer/process_guard.py, on plain processes (no vLLM): a guarded process SIGKILLed leaves
nothing running (children, grandchildren in a session of their own, a forked copy of itself and its child), its
runtime folder is removed, and the watchdog says what it ended; a trainer rank whose launcher is SIGKILLed is ended
with its tree. Processes are found by the test from outside (support/processes.py)."""

import os
import signal
import subprocess
import sys
import time

from support.processes import RunProcesses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUARDED = f"""
import multiprocessing, os, subprocess, sys, time
sys.path.insert(0, {ROOT!r})
from vcpo.trainer.process_guard import guard
runtime = guard()
open(os.path.join(runtime, "socket-of-the-engine"), "w").close()
subprocess.Popen(["sleep", "300"])
subprocess.Popen(["bash", "-c", "sleep 301 & sleep 302; wait"], start_new_session=True)

def forked():
    subprocess.Popen(["sleep", "303"])
    time.sleep(300)

multiprocessing.get_context("fork").Process(target=forked).start()
time.sleep(1.0)
print(runtime, flush=True)
time.sleep(300)
"""


def test_a_sigkilled_process_leaves_nothing_running():
    proc = subprocess.Popen([sys.executable, "-c", GUARDED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes = RunProcesses(proc.pid)
    runtime = proc.stdout.readline().strip()
    time.sleep(1.0)  # the watchdog has looked at the tree since
    assert os.path.isfile(os.path.join(runtime, "socket-of-the-engine")) and len(processes.seen) >= 7
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate(timeout=30)[1]
    assert not processes.left_alive(within=10.0)
    assert not os.path.exists(runtime)
    assert f"vcpo: process {proc.pid} of the run ended; its watchdog ended 6 process(es)" in err, err
    assert "sleep 303" in err and "sleep 301" in err


LAUNCHER = f"""
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", {GUARDED!r}], env={{**os.environ, "TORCHELASTIC_RUN_ID": "x"}},
                        stdout=subprocess.PIPE, text=True)
print(rank.pid, rank.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def test_a_rank_whose_launcher_is_sigkilled_is_ended_with_its_tree():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    processes = RunProcesses(launcher.pid)
    rank, runtime = launcher.stdout.readline().split()
    time.sleep(1.0)
    assert int(rank) in processes.seen
    launcher.send_signal(signal.SIGKILL)
    launcher.communicate(timeout=30)
    assert not processes.left_alive(within=10.0)  # the rank too
    assert not os.path.exists(runtime)
