"""Nothing a run starts outlives it, however its main process dies (SIGKILL included): docs/trainer.md, "Resume".

`guard()`, called first by every `vcpo train` process (each trainer rank too), starts a watchdog: this file run as
a script by the same Python (standard library only, so it starts in a fraction of a second and holds about 10 MB),
in a session of its own (a signal to the run's process group or terminal does not reach it). The watchdog follows
the guarded process's tree: every SCAN_S it records each descendant (pid and start time, so a reused pid is never
taken for one of the run's), and writes the list to `processes` in the run's runtime folder. Once the guarded process
has ended (or, for a rank under torchrun, its launcher has) it gives them GRACE_S to end by themselves (vLLM servers
and reward workers have parent-death signals of their own), then stops and SIGKILLs every recorded process still
alive, every process whose environment carries the run's token (a child started in the last moment, before a scan
saw it) and every descendant of those, until none is left; then it removes the runtime folder and exits. Stopping
first (SIGSTOP) keeps a process from starting a child that would escape between the look and the kill.

The runtime folder (`runtime_dir()`, in the temporary directory) holds what vLLM and the local servers leave on
disk while they run (zmq sockets, a server's Unix socket and temporary files), so that nothing of the run is left in
the temporary directory either. Nothing here needs the dead process's cooperation: no exit handler, no signal
handler of its own. A watchdog killed as well (`kill -9` of every process of the user) leaves its `processes` file:
a resume reads it (end_leftovers) and ends whatever of it is still alive."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

TOKEN_ENV = "VCPO_RUN_TOKENS"  # ':'-separated tokens of the guarded processes above this one
RUNTIME_ENV = "VCPO_RUNTIME_DIR"  # the runtime folder of the nearest guarded process
RPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM puts its zmq sockets (default: the temporary directory)
PROCESSES = "processes"  # in the runtime folder: "pid start_time" per recorded process
SCAN_S = 0.5  # between two looks at the process tree
GRACE_S = 3.0  # for the run's processes to end by themselves once it has ended, before they are killed
_guarded: Optional[str] = None  # this process's runtime folder, once guarded


def guard() -> str:
    """Start this process's watchdog (once per process) and return its runtime folder. A trainer rank under
    torchrun is guarded against its launcher's death too."""
    global _guarded
    if _guarded is not None:
        return _guarded
    runtime = tempfile.mkdtemp(prefix=f"vcpo-run-{os.getpid()}-")  # mode 0700
    token = os.path.basename(runtime)
    if os.environ.get(RPC_ENV) in (None, os.environ.get(RUNTIME_ENV)):  # not the user's own choice
        os.environ[RPC_ENV] = runtime
    os.environ[RUNTIME_ENV] = runtime
    os.environ[TOKEN_ENV] = ":".join(filter(None, [os.environ.get(TOKEN_ENV), token]))
    anchors = [os.getpid()] + ([os.getppid()] if "TORCHELASTIC_RUN_ID" in os.environ else [])
    subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), runtime, token, *map(str, anchors)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    _guarded = runtime
    return runtime


def runtime_dir() -> Optional[str]:
    """The runtime folder of the run this process belongs to (None outside a guarded run)."""
    return os.environ.get(RUNTIME_ENV)


# -- the process table, from /proc -----------------------------------------------------------------------------------
def _stat(pid: int) -> Optional[tuple[int, int, str]]:
    """(parent pid, start time in clock ticks since boot, state letter) of `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces and parentheses
    return int(fields[1]), int(fields[19]), fields[0]


def _running(pid: int, start: int) -> bool:
    """Whether `pid` is alive (not a zombie) and is the process that started at `start`."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[2] != "Z"


def _table() -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, start time, state); zombies left out (they hold nothing but a pid)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[2] != "Z":
            table[int(entry)] = stat
    return table


def _carries(pid: int, token: str) -> bool:
    """Whether `pid`'s environment names `token` among its run tokens."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    prefix = TOKEN_ENV.encode() + b"="
    return any(token.encode() in e[len(prefix):].split(b":") for e in env if e.startswith(prefix))


def _descendants(table: dict, roots: set[int]) -> set[int]:
    found, frontier = set(), set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def read_processes(runtime: str) -> dict[int, int]:
    """The processes a watchdog recorded in `runtime` (pid -> start time); empty when there is no record."""
    try:
        with open(os.path.join(runtime, PROCESSES)) as f:
            return {int(pid): int(start) for pid, start in (line.split() for line in f if line.strip())}
    except (OSError, ValueError):
        return {}


def end_processes(recorded: dict[int, int], token: Optional[str] = None, spare: frozenset = frozenset()) -> list[str]:
    """Stop, then SIGKILL, every process of `recorded` still alive with its recorded start time, every process
    whose environment carries `token`, and every descendant of those (never this process, nor `spare`); returns
    what was ended, as "name (pid N)"."""
    stopped: dict[int, str] = {}
    for _ in range(100):  # each round stops what the last one let start; ends when a look finds nothing new
        table = _table()
        roots = {pid for pid, start in recorded.items() if pid in table and table[pid][1] == start}
        if token is not None:
            roots |= {pid for pid in table if _carries(pid, token)}
        targets = (roots | _descendants(table, roots | set(stopped))) - {os.getpid(), *spare} - set(stopped)
        if not targets:
            break
        for pid in targets:
            stopped[pid] = _name(pid)
            _signal(pid, signal.SIGSTOP)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    return [f"{name} (pid {pid})" for pid, name in sorted(stopped.items())]


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        return " ".join(w.decode(errors="replace") for w in words[:3] if w)[:80] or "?"
    except OSError:
        return "?"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- the watchdog ----------------------------------------------------------------------------------------------------
def _watch(runtime: str, token: str, anchors: list[int]) -> None:
    """Record the tree of anchors[0] until any anchor ends, then end what it left and remove `runtime`."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it must outlive the run to clean up after it
        signal.signal(sig, signal.SIG_IGN)
    table = _table()
    starts, handles = {}, []  # an anchor already gone has neither: the loop below ends at once
    for pid in anchors:
        try:
            handles.append(os.pidfd_open(pid))  # readable once the process has ended
            starts[pid] = table[pid][1]
        except (ProcessLookupError, KeyError):
            pass
    recorded: dict[int, int] = {}
    while len(starts) == len(anchors) and not select.select(handles, [], [], SCAN_S)[0]:
        table = _table()
        seen = {pid: table[pid][1] for pid in _descendants(table, {anchors[0]}) if pid != os.getpid()}
        still = {pid: start for pid, start in recorded.items() if pid in table and table[pid][1] == start}
        if (now := {**still, **seen}) != recorded:  # a recorded process reparented (its parent ended) stays
            recorded = now
            _write_processes(runtime, recorded)
    deadline = time.monotonic() + GRACE_S  # those that end by themselves (a parent-death signal, a closed pipe)
    while time.monotonic() < deadline and any(_running(pid, start) for pid, start in recorded.items()):
        time.sleep(0.05)
    main_pid = anchors[0]  # a rank whose launcher ended is ended too
    ended = end_processes({**recorded, **{p: s for p, s in starts.items() if p == main_pid}}, token,
                          spare=_watchdogs())
    shutil.rmtree(runtime, ignore_errors=True)
    if ended:
        _say(f"vcpo: process {main_pid} of the run ended; its watchdog ended {len(ended)} process(es) it had left "
             f"running: {', '.join(ended)}")


def _watchdogs() -> frozenset:
    """The pids of every watchdog (this file run as a script): each ends its own run's processes and removes its own
    runtime folder, so another spares it."""
    found = set()
    for pid in _table():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[2] == os.fsencode(os.path.abspath(__file__)):
            found.add(pid)
    return frozenset(found)


def _write_processes(runtime: str, alive: dict[int, int]) -> None:
    path = os.path.join(runtime, PROCESSES)
    try:
        with open(path + ".tmp", "w") as f:
            f.writelines(f"{pid} {start}\n" for pid, start in sorted(alive.items()))
        os.replace(path + ".tmp", path)
    except OSError:  # the folder is gone: the run is ending
        pass


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:  # nobody reads the run's stderr any more
        pass


if __name__ == "__main__":
    _watch(sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]])
