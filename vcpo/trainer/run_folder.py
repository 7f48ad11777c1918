"""A run's folder (docs/trainer.md, "Outputs"): config.json (the resolved settings), metrics.jsonl (one line per
step), rollouts.jsonl (every consumed sample, once), checkpoints/step-NNNNNN (model, tokenizer, optimizer,
trainer_state.pt), curves.png and summary.json.

A checkpoint is written to a .tmp folder, synced to disk and renamed into place, so a run stopped at any moment
(SIGKILL, a dead machine) leaves the previous checkpoint whole. A resume removes the stale .tmp folders, drops the
metrics and rollouts lines of the steps after its checkpoint (and a partial last line: a kill while writing it), and
falls back to the previous checkpoint when the newest does not read back (docs/trainer.md, "Interrupt and resume").

The process that writes the folder holds a lock on its `.lock` file for as long as it lives (a POSIX record lock:
the kernel releases it when the process dies, however it dies), so a second run on the same folder is refused while
the first one lives. The file names that process and its runtime folder (vcpo/trainer/process_guard.py): a resume
ends whatever that process left running and removes its runtime folder, should its watchdog not have."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from safetensors import SafetensorError

from .errors import CheckpointError
from .plot import plot_run
from .process_guard import end_processes, read_processes, runtime_dir
from .report import Reporters, parse_report_to


def _truncate_jsonl(path: str, key: str, last_kept: int, log: Callable[[str], None]) -> None:
    """Drop the lines whose `key` (step or version) is after `last_kept` (they will be done again) and a partial
    last line (the process was killed while writing it: its step is after the checkpoint, whose lines were on disk
    before it was); any other line that is not a JSON row with that key is an error naming the file and line."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    keep = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            value = row[key]
            if not isinstance(value, int):
                raise TypeError(f"{key} {value!r} is not an integer")
        except (ValueError, KeyError, TypeError) as e:
            if i == last:
                log(f"warning: {path}: dropped its partial last line (line {i + 1}, {len(line)} bytes: the run was "
                    "stopped while writing it)")
                continue
            raise ValueError(f"{path}, line {i + 1}: not a JSON row with a {key} ({type(e).__name__}: {e}); the "
                             "lines after a checkpoint are dropped on resume, but this one is not the last") from None
        if value <= last_kept:
            keep.append(line + b"\n")
    with open(path + ".tmp", "wb") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    """A folder's entries (a rename, a new file) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Every file under `root`, then every folder, on disk."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(folder)


_CHECKPOINT = re.compile(r"step-(\d+)")


def committed_checkpoints(path: str) -> list[str]:
    """The committed checkpoints of the run in `path`, oldest first (not the .tmp ones being written, nor those
    set aside as .corrupt)."""
    root = os.path.join(path, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := _CHECKPOINT.fullmatch(d)))
    return [os.path.join(root, d) for _, d in steps]


def unreadable(folder: str) -> Optional[str]:
    """Why a checkpoint does not read back (its file named), or None. trainer_state.pt is loaded whole (it is small);
    optimizer.pt only as far as its archive's index (at the end of the file: a truncated file has none), the
    safetensors files as far as their header, which must cover the file's length; the JSON files parse."""
    import torch
    from safetensors import safe_open

    names = sorted(os.listdir(folder))
    missing = [n for n in ("trainer_state.pt", "optimizer.pt") if n not in names]
    if missing or not any(n.endswith(".safetensors") for n in names):
        return f"no {', '.join(missing) or 'safetensors weights'}"
    for name in names:
        path = os.path.join(folder, name)
        try:
            if name == "trainer_state.pt":
                torch.load(path, weights_only=True)
            elif name.endswith(".pt"):
                torch.load(path, weights_only=True, mmap=True)
            elif name.endswith(".safetensors"):
                with safe_open(path, "pt"):
                    pass
            elif name.endswith(".json"):
                with open(path) as f:
                    json.load(f)
        except Exception as e:  # noqa: BLE001 - any failure to read is the answer
            return f"{name}: {type(e).__name__}: {e}"
    return None


LOCK = ".lock"
_HELD: dict[str, int] = {}  # the lock files this process holds: real path -> descriptor


def _read_record(fd: int) -> dict:
    """The JSON record of a lock file (empty when it has none: a new file, or one cut short)."""
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


# What a failed write raises: os and file objects OSError, torch.save RuntimeError ("unexpected pos", "file write
# failed"), safetensors SafetensorError ("I/O error").
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


class RunFolder:
    def __init__(self, path: Optional[str], *, resume: bool, report_to: str = "none",
                 log: Callable[[str], None] = print) -> None:
        """The folder of a new run (`path` absent or empty; default runs/vcpo-<date>-<time>) or, with resume, of
        a run that has a checkpoint (its stale .tmp folders removed). `report_to`: where else log_step sends the
        metrics (vcpo/trainer/report.py); `log`: the warnings of a resume."""
        self.path = path or os.path.join("runs", time.strftime("vcpo-%Y%m%d-%H%M%S"))
        self.log = log
        if resume and not self.checkpoints():
            raise ValueError(f"resume: {self.path!r} has no checkpoint")
        if not resume and os.path.isdir(self.path) and os.listdir(self.path):
            raise ValueError(f"output_dir {self.path!r} exists and is not empty: resume it with --resume or pick "
                             "another")
        os.makedirs(self.path, exist_ok=True)
        previous = self._lock()
        if resume:
            self._clean_up_after(previous)
        self._metrics = self._rollouts = None
        self.report_to, self.first_step, self._reporters = parse_report_to(report_to), 1, None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _lock(self) -> dict:
        """Take the folder's lock for the rest of this process's life (refused while another process holds it) and
        record this process in it; returns the record of the process that held it before (empty if none)."""
        path = os.path.realpath(self.file(LOCK))
        if path not in _HELD:  # one descriptor per process: closing any other would release the lock (POSIX)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_record(fd)
                os.close(fd)
                raise ValueError(f"output_dir {self.path!r} is in use by another vcpo train (pid "
                                 f"{holder.get('pid', '?')} on {holder.get('host', '?')}): wait for it to end or "
                                 "stop it first") from None
            _HELD[path] = fd
        fd = _HELD[path]
        previous = _read_record(fd)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "runtime_dir": runtime_dir()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        return previous

    def _clean_up_after(self, previous: dict) -> None:
        """A resume: end what the run's previous process left running and remove its runtime folder (its watchdog
        does both, unless it was killed too), the checkpoints and weight files that were being written."""
        runtime, pid = previous.get("runtime_dir"), previous.get("pid")
        if runtime and pid != os.getpid() and previous.get("host") == socket.gethostname():
            ended = end_processes(read_processes(runtime), token=os.path.basename(runtime))
            if ended:
                self.log(f"resume: the run's previous process (pid {pid}) had left {len(ended)} process(es) "
                         f"running: ended {', '.join(ended)}")
            if os.path.isdir(runtime):
                shutil.rmtree(runtime, ignore_errors=True)
                self.log(f"resume: removed {runtime}, the runtime folder (sockets, temporary files) the run's "
                         f"previous process (pid {pid}) left")
        for folder, what in (("checkpoints", "a checkpoint"), (".weights", "a weight file")):
            root = self.file(folder)
            for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
                if name.endswith(".tmp"):
                    path = os.path.join(root, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.remove(path)
                    self.log(f"removed {path}: {what} that was being written when the run stopped")

    def checkpoints(self) -> list[str]:
        return committed_checkpoints(self.path)

    @staticmethod
    def latest_checkpoint(path: str) -> str:
        """The newest checkpoint of the run in `path` (read-only: what a trainer rank > 0 resumes from, once rank 0's
        resume_checkpoint has set aside any that does not read back)."""
        return committed_checkpoints(path)[-1]

    def resume_checkpoint(self) -> str:
        """The newest checkpoint that reads back (`unreadable`). Newer ones that do not (a file cut short: a full
        disk, a machine that died before the data reached the disk) are renamed <name>.corrupt, so that every rank,
        `vcpo eval` and the rotation see the one the run resumes from; the warning names both."""
        bad = []
        for folder in reversed(self.checkpoints()):
            problem = unreadable(folder)
            if problem is None:
                break
            bad.append((folder, problem))
        else:
            raise ValueError(f"resume: no checkpoint of {self.path!r} reads back: "
                             + "; ".join(f"{f}: {p}" for f, p in bad))
        for corrupt, problem in bad:
            aside = corrupt + ".corrupt"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(corrupt, aside)
            self.log(f"warning: checkpoint {corrupt} does not read back ({problem}); resuming from {folder} "
                     f"instead (the unreadable one is kept as {aside})")
        return folder

    def rewind(self, step: int) -> None:
        """Resuming at `step`: the logged steps after it are forgotten, and the evaluations of its version and after
        (the resumed engine evaluates the checkpoint's version first)."""
        self.first_step = step + 1
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            _truncate_jsonl(self.file(name), "step", step, self.log)
        _truncate_jsonl(self.file("evals.jsonl"), "version", step - 1, self.log)

    def write_json(self, name: str, value: dict) -> None:
        with open(self.file(name), "w") as f:
            json.dump(value, f, indent=2, default=str)

    # -- the step logs ----------------------------------------------------------------------------------------
    def __enter__(self) -> "RunFolder":
        self._metrics = open(self.file("metrics.jsonl"), "a")
        self._rollouts = open(self.file("rollouts.jsonl"), "a")
        if self.report_to:
            try:
                with open(self.file("config.json")) as f:
                    config = json.load(f)
                self._reporters = Reporters(self.path, self.report_to, config, self.first_step)
            except BaseException:  # a reporter that cannot start: no log file left open
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        for f in (self._metrics, self._rollouts):
            if f is not None:
                f.close()
        self._metrics = self._rollouts = None
        if self._reporters is not None:
            self._reporters.close()
            self._reporters = None

    def report(self, row: dict, step: int) -> None:
        """`row`'s numeric fields to the reporters (--report-to), at `step`."""
        if self._reporters is not None:
            self._reporters.log(row, step)

    def log_step(self, row: dict, rollouts: list) -> None:
        """metrics.jsonl gets `row`, in the file when this returns (a reader polling it, `tail -f`, sees each step
        as it ends); rollouts.jsonl one line per consumed sample, tagged with the step (buffered: on disk at the
        checkpoint, which is what a resume reads)."""
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self.report(row, row["step"])
        for r in rollouts:
            extra = {"last_version": r.last_version} if r.last_version is not None else {}
            if r.server is not None:
                extra["server"] = r.server
            if r.reward_extras:
                extra["reward_extras"] = r.reward_extras
            if r.reward_error is not None:
                extra["reward_error"] = r.reward_error
            if r.prompt:  # once per prompt group: the text is long and the same for every response
                extra["prompt"] = r.prompt
            self._rollouts.write(json.dumps({"step": row["step"], "uid": list(r.uid), "version": r.version,
                                             "answer": r.answer, "response": r.response,
                                             "response_ids": r.response_ids,
                                             "reward": r.reward,
                                             "finish_reason": r.finish_reason, **extra}) + "\n")

    # -- checkpoints --------------------------------------------------------------------------------------------
    @contextmanager
    def checkpoint(self, step: int, keep: int) -> Iterator[str]:
        """An empty folder to write step `step`'s checkpoint into, committed (commit_checkpoint) when the block ends.
        A write that fails (a full disk, a quota, a file size limit, a read-only file system) removes what was
        written and raises CheckpointError naming the newest whole checkpoint, which stays as it was."""
        tmp = self.new_checkpoint(step)
        try:
            yield tmp
            self.commit_checkpoint(tmp, keep)
        except WRITE_ERRORS as e:
            shutil.rmtree(tmp, ignore_errors=True)
            whole = self.checkpoints()
            raise CheckpointError(
                f"writing the checkpoint of step {step} failed ({type(e).__name__}: {e}); "
                + (f"the newest whole checkpoint is {whole[-1]}, untouched; once the cause is gone (a full disk: make "
                   f"room), continue with "
                   f"`vcpo train --resume {self.path}`" if whole else "the run has no checkpoint yet")) from e

    def new_checkpoint(self, step: int) -> str:
        """An empty folder to write step `step`'s checkpoint into; commit_checkpoint puts it in place."""
        tmp = self.file(os.path.join("checkpoints", f"step-{step:06d}.tmp"))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    def commit_checkpoint(self, tmp: str, keep: int) -> None:
        """The logs on disk first (a checkpoint in place never lacks the log lines of its steps), then the written
        checkpoint, on disk, in place of any older one of its step; once the rename is on disk, the oldest beyond
        `keep` are removed (never the new one) and the curves redrawn."""
        for f in (self._metrics, self._rollouts):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
        _fsync_tree(tmp)
        folder = tmp[:-len(".tmp")]
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        _fsync_dir(os.path.dirname(folder))
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        plot_run(self.path)
