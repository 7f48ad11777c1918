"""`--report-to`: the metrics.jsonl rows of a run also sent to TensorBoard and/or Weights & Biases (docs/trainer.md,
"Logging"). Only the process that writes the run folder (rank 0) reports.

- tensorboard: event files in <run>/tensorboard, one scalar per numeric metric, at the row's step. A resumed run
  writes to the same folder with `purge_step` = the first step it redoes, so TensorBoard drops the steps that the
  interrupted process logged after its last checkpoint (they are done again).
- wandb: a W&B run whose files are in <run>/wandb, its id kept in <run>/wandb/vcpo-run-id so that a resumed run
  continues it. Offline (files only, upload later with `wandb sync`) unless WANDB_MODE says otherwise or
  WANDB_API_KEY is set."""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from typing import Optional

REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # name -> the package it needs


def parse_report_to(spec: Optional[str]) -> list[str]:
    """"none" or None -> []; "tensorboard,wandb" -> both, each once."""
    if spec is None or str(spec).strip() == "none":
        return []
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not names or len(set(names)) != len(names) or not set(names) <= set(REPORTERS):
        raise ValueError(f"report_to must be none or a comma-separated list of {sorted(REPORTERS)}, each once, "
                         f"got {spec!r}")
    for name in names:
        if importlib.util.find_spec(REPORTERS[name]) is None:
            raise ValueError(f"report_to {name} needs the {REPORTERS[name]!r} package: pip install 'vcpo[train]'")
    return names


def scalars(row: dict) -> dict[str, float]:
    """The numeric metrics of a metrics.jsonl row (the step itself is the x axis)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class _TensorBoard:
    def __init__(self, run_dir: str, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of steps >= first_step in earlier files are the interrupted process's, done again
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                    purge_step=first_step if first_step > 1 else None)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: str, settings: dict) -> None:
        import wandb

        folder = os.path.join(run_dir, "wandb")
        os.makedirs(folder, exist_ok=True)
        id_file = os.path.join(folder, "vcpo-run-id")
        if os.path.isfile(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        # no network and no key: offline files; a run without a key would otherwise stop to ask for a login
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vcpo"), dir=run_dir, id=run_id,
                              resume="allow", name=os.path.basename(os.path.normpath(run_dir)), config=settings,
                              settings=wandb.Settings(mode=mode, silent=True, console="off"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Reporters:
    """The reporters named by `report_to` (parse_report_to) for the run in `run_dir`, whose next logged step is
    `first_step`; `settings` (the run's config) goes to W&B's run config."""

    def __init__(self, run_dir: str, names: list[str], settings: dict, first_step: int) -> None:
        self.reporters: list = []
        try:
            for name in names:
                self.reporters.append(_TensorBoard(run_dir, first_step) if name == "tensorboard"
                                      else _WandB(run_dir, settings))
        except BaseException:
            self.close()
            raise

    def log(self, row: dict, step: int) -> None:
        values = scalars(row)
        for reporter in self.reporters:
            reporter.log(values, step)

    def close(self) -> None:
        reporters, self.reporters = self.reporters, []
        for reporter in reporters:
            reporter.close()
