"""A run's folder (docs/trainer.md, "Outputs"): config.json (the resolved settings), metrics.jsonl (one line per
step), rollouts.jsonl (every consumed sample, once), checkpoints/step-NNNNNN (model, tokenizer, optimizer,
trainer_state.pt), curves.png and summary.json.

A checkpoint is written to a .tmp folder and renamed into place, so a run stopped at any moment leaves the
previous checkpoint whole; a resume drops the metrics and rollouts lines of the steps after it."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Optional

from .plot import plot_run
from .report import Reporters, parse_report_to


def _truncate_jsonl(path: str, max_step: int) -> None:
    """Drop the lines of steps after `max_step`: they will be done again."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= max_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _checkpoints(path: str) -> list[str]:
    root = os.path.join(path, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))


class RunFolder:
    def __init__(self, path: Optional[str], *, resume: bool, report_to: str = "none") -> None:
        """The folder of a new run (`path` absent or empty; default runs/vcpo-<date>-<time>) or, with resume, of
        a run that has a checkpoint. `report_to`: where else log_step sends the metrics (vcpo/trainer/report.py)."""
        self.path = path or os.path.join("runs", time.strftime("vcpo-%Y%m%d-%H%M%S"))
        if resume and not self.checkpoints():
            raise ValueError(f"resume: {self.path!r} has no checkpoint")
        if not resume and os.path.isdir(self.path) and os.listdir(self.path):
            raise ValueError(f"output_dir {self.path!r} exists and is not empty: resume it with --resume or pick "
                             "another")
        os.makedirs(self.path, exist_ok=True)
        self._metrics = self._rollouts = None
        self.report_to, self.first_step, self._reporters = parse_report_to(report_to), 1, None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def checkpoints(self) -> list[str]:
        return _checkpoints(self.path)

    @staticmethod
    def latest_checkpoint(path: str) -> str:
        """The newest checkpoint of the run in `path` (read-only: what a trainer rank > 0 resumes from)."""
        return _checkpoints(path)[-1]

    def rewind(self, step: int) -> None:
        """Resuming at `step`: the logged steps after it are forgotten."""
        self.first_step = step + 1
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            _truncate_jsonl(self.file(name), step)

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
        """metrics.jsonl gets `row`; rollouts.jsonl one line per consumed sample, tagged with the step."""
        self._metrics.write(json.dumps(row) + "\n")
        self.report(row, row["step"])
        for r in rollouts:
            extra = {"last_version": r.last_version} if r.last_version is not None else {}
            if r.server is not None:
                extra["server"] = r.server
            if r.reward_extras:
                extra["reward_extras"] = r.reward_extras
            if r.reward_error is not None:
                extra["reward_error"] = r.reward_error
            self._rollouts.write(json.dumps({"step": row["step"], "uid": list(r.uid), "version": r.version,
                                             "response_ids": r.response_ids, "reward": r.reward,
                                             "finish_reason": r.finish_reason, **extra}) + "\n")

    # -- checkpoints --------------------------------------------------------------------------------------------
    def new_checkpoint(self, step: int) -> str:
        """An empty folder to write step `step`'s checkpoint into; commit_checkpoint puts it in place."""
        tmp = self.file(os.path.join("checkpoints", f"step-{step:06d}.tmp"))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    def commit_checkpoint(self, tmp: str, keep: int) -> None:
        """The logs flushed first (a checkpoint in place never lacks the log lines of its steps), then the
        written checkpoint in place of any older one of its step, the oldest beyond `keep` removed and the
        curves redrawn."""
        for f in (self._metrics, self._rollouts):
            if f is not None:
                f.flush()
        folder = tmp[:-len(".tmp")]
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        plot_run(self.path)
