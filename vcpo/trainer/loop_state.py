"""The training loop's state and surroundings: where it stands (LoopState, what a checkpoint keeps besides the
model and optimizer), its wall clock across resumes, how a signal stops it, and its progress bar."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .errors import RunStopped
from .rollouts import GeneratedBatch


@dataclass
class LoopState:
    """Where the loop stands: what a checkpoint keeps besides the model and optimizer (trainer_state.pt)."""

    step: int = 0  # optimizer steps taken = the policy version
    elapsed: float = 0.0  # training wall seconds before this process (engine start excluded)
    next_batch: int = 0  # the next rollout batch to generate
    pending: list = field(default_factory=list)  # generated batches not yet consumed
    lag_hist: Counter = field(default_factory=Counter)
    evals_seen: int = 0  # evaluations already written to metrics.jsonl (this process)
    last_eval: Optional[float] = None  # the latest held-out accuracy, for the progress bar

    @classmethod
    def fresh(cls, seed: int) -> "LoopState":
        torch.manual_seed(seed)
        random.seed(seed)
        return cls()

    @classmethod
    def load(cls, checkpoint: str) -> "LoopState":
        s = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)
        random.setstate(s["rng"]["python"])
        torch.set_rng_state(s["rng"]["torch"])
        return cls(step=s["step"], elapsed=s["elapsed"], next_batch=s["next_batch"],
                   pending=[GeneratedBatch.from_state(b) for b in s["pending"]],
                   lag_hist=Counter({int(k): v for k, v in s["lag_hist"].items()}))

    def save(self, folder: str) -> None:
        torch.save({"step": self.step, "next_batch": self.next_batch, "pending": [b.to_state() for b in self.pending],
                    "elapsed": self.elapsed, "lag_hist": dict(self.lag_hist),
                    "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}},
                   os.path.join(folder, "trainer_state.pt"))


class Clock:
    """Training wall time across resumes (engine start excluded)."""

    def __init__(self, elapsed: float) -> None:
        self.start = time.perf_counter() - elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Interrupt:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's stop, `kill`): during the steps, the first one lets the current
    step finish (its batch is consumed and its weights are the checkpoint's), then the run checkpoints, aborts the
    generation in flight and exits; before them (loading, engine start-up) or the second time, RunStopped at
    once, which still stops the servers and engine this run started. A signal within REPEAT_S of the first is the
    same stop (the terminal and a launcher such as torchrun both deliver it)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 2.0

    def __init__(self) -> None:
        self.requested = False
        self.during_steps = False
        self._first = 0.0
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        if self.during_steps and not self.requested:
            self.requested, self._first = True, time.monotonic()
            return
        if self.during_steps and time.monotonic() - self._first < self.REPEAT_S:
            return
        raise RunStopped(signum)

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


class progress_bar:
    """tqdm's bar over the steps (its write() then prints the log lines above it), or None."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.enabled, self.total, self.initial, self.bar = enabled, total, initial, None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc="vcpo train", unit="step",
                            dynamic_ncols=True)
        return self.bar

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
