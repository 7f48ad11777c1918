"""The processes a run starts, as a test sees them from outside (psutil, not vcpo's own process_guard): every
descendant of the run's main process, recorded by a thread that looks every 50 ms while the run lives, so that the
processes a hard kill leaves behind (reparented to init, out of the tree) are still known."""

import threading
import time

import psutil


class RunProcesses:
    def __init__(self, pid: int) -> None:
        self.main = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}
        self._thread = threading.Thread(target=self._record, daemon=True)
        self._thread.start()

    def _record(self) -> None:
        while True:
            try:
                children = self.main.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in children:
                self.seen.setdefault(p.pid, p)  # a psutil.Process knows its start time: a reused pid is not it
            time.sleep(0.05)

    def left_alive(self, within: float = 10.0) -> list[str]:
        """Once the main process is dead: the processes it started that are still alive `within` seconds later
        (none once they have ended; a zombie counts as ended), as "name (pid N)"."""
        self._thread.join(timeout=5)
        deadline = time.monotonic() + within
        while True:
            alive = [p for p in self.seen.values() if _alive(p)]
            if not alive or time.monotonic() > deadline:
                return [f"{_name(p)} (pid {p.pid})" for p in alive]
            time.sleep(0.1)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:80] or p.name()
    except psutil.Error:
        return "?"
