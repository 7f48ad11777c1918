"""Asynchronous rollouts with bounded staleness.

Policy version v = number of optimizer steps taken. Step j consumes rollout batch j and produces version j+1.
Batch j may start generating only once the engine holds version j - k or newer (k = max_staleness): admission
is paced, nothing is dropped, and every rollout carries the version of the weights it was sampled with, so its
lag j - version lies in [0, k]. k = 0 is synchronous on-policy training. With exact staleness the trainer also
waits for the engine: version v is published only once batch v - 1 + k has started on version v - 1, so every
batch from k on has lag exactly k, whichever of the two is faster (a sweep over k then compares rules at the same
lag, not at lags set by their step times).

Weights go into the engine between batches (engine: process or inprocess: each rollout has one version), or,
for an engine that takes them while it generates (engine: server), as soon as they are published: a rollout
then records the first and the last version of its tokens, and the bound applies to the first."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Rollout:
    batch: int  # the step that consumes it
    prompt_index: int  # index into the training problems
    response_index: int  # 0..n-1 within its prompt group
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logp: list[float]
    finish_reason: Optional[str]
    reward: float
    version: int  # policy version of the weights that sampled its first token
    correct: bool = False  # reward >= 1 (the accuracy metric; rewards.CORRECT_REWARD)
    last_version: Optional[int] = None  # of its last token, when weights changed during its generation
    server: Optional[str] = None  # engine: server: the URL that generated it
    reward_extras: dict = field(default_factory=dict)  # the extra fields of a dict-valued reward
    reward_error: Optional[str] = None  # the failure of its reward call (reward_errors: zero scored it 0)
    response: str = ""  # the response's text, special tokens skipped, as the reward scored it
    prompt: str = ""  # the prompt's text as the engine got it (chat template applied); on response 0 of a group
    answer: "str | int | float | None" = None  # the data's answer the reward compared against

    @property
    def uid(self) -> tuple[int, int, int]:
        return (self.batch, self.prompt_index, self.response_index)


@dataclass
class GeneratedBatch:
    index: int
    version: int  # the oldest version of its rollouts
    rollouts: list[Rollout]

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, s: dict) -> "GeneratedBatch":
        return cls(s["index"], s["version"], [Rollout(**r) for r in s["rollouts"]])


@dataclass
class EngineStats:
    """Accumulated by the producer thread, read by the trainer for metrics."""

    generate_seconds: float = 0.0
    sync_seconds: float = 0.0
    syncs: int = 0
    generated_tokens: int = 0
    eval_results: list = field(default_factory=list)  # (version, accuracy, mean reward)


class StalenessError(RuntimeError):
    pass


class RolloutProducer:
    """Runs the engine in a background thread: generates batch j once the engine's weights are at least version
    j - k, and appends it to `pending`. The newest published weights are loaded whenever the engine is between
    batches. With `concurrent_sync` (an engine that takes weights while it generates), a second thread loads
    them at once, and every admissible batch is generated at the same time as the others, each in a thread of
    its own (at most k + 1 batches are ahead of the trainer); batches are appended to `pending` in order."""

    def __init__(self, *, make_batch: Callable[[int, int], GeneratedBatch],
                 load_weights: Callable[[dict, int], None], max_staleness: int, version: int, next_batch: int,
                 end_batch: int, pending: list[GeneratedBatch] = (),
                 evaluate: Optional[Callable[[int], tuple]] = None, eval_every: int = 0,
                 concurrent_sync: bool = False, exact_staleness: bool = False) -> None:
        if exact_staleness and concurrent_sync:
            raise ValueError("exact staleness needs weights loaded between batches (not concurrent_sync)")
        self.make_batch, self.load_weights, self.k = make_batch, load_weights, max_staleness
        self.exact_staleness = exact_staleness
        self.concurrent_sync = concurrent_sync
        self.evaluate, self.eval_every = evaluate, eval_every
        self.version = version  # the trainer's latest published version
        self.engine_version = version  # the engine starts from the trainer's weights
        self.next_batch, self.end_batch = next_batch, end_batch  # next_batch: the next one to start
        self.pending: deque[GeneratedBatch] = deque(pending)
        self._generated = next_batch  # the batches before it are generated (consumed or pending)
        self._done: dict[int, GeneratedBatch] = {}  # generated ahead of an earlier batch still in flight
        self._in_flight, self._busy_since = 0, 0.0
        self._workers: list[threading.Thread] = []
        self.stats = EngineStats()
        self._weights: Optional[dict] = None
        self._cond = threading.Condition()
        self._stop = False
        self.error: Optional[BaseException] = None
        self._last_eval: Optional[int] = None
        self._evaluating = threading.Lock()  # an evaluation sees one version: no sync while it runs
        self._threads = [threading.Thread(target=self._guard, args=(self._run,), name="vcpo-rollouts", daemon=True)]
        if concurrent_sync:
            self._threads.append(threading.Thread(target=self._guard, args=(self._sync_loop,), name="vcpo-sync",
                                                  daemon=True))

    def start(self) -> "RolloutProducer":
        for thread in self._threads:
            thread.start()
        return self

    # -- trainer side ---------------------------------------------------------------------------------------
    def publish(self, version: int, weights: dict, should_stop: Callable[[], bool] = lambda: False) -> float:
        """The trainer's weights after its `version`-th step (tensors the trainer will not modify). Returns the
        seconds it waited: with exact staleness, until batch version - 1 + k has started on version - 1 (or
        should_stop() turned true)."""
        t0 = time.perf_counter()
        with self._cond:
            if self.exact_staleness:
                while (self.next_batch < min(version - 1 + self.k + 1, self.end_batch) and self.error is None
                       and not self._stop and not should_stop()):
                    self._cond.wait(timeout=0.2)
            self.version, self._weights = version, weights
            self._cond.notify_all()
        return time.perf_counter() - t0

    def take(self, index: int, should_stop: Callable[[], bool] = lambda: False) -> Optional[GeneratedBatch]:
        """Block until batch `index` is generated; None if should_stop() turns true first."""
        with self._cond:
            while not (self.pending and self.pending[0].index == index):
                if self.error is not None:
                    raise RuntimeError("the rollout thread failed") from self.error
                if self.pending and self.pending[0].index != index:
                    raise RuntimeError(f"rollout batches out of order: expected {index}, "
                                       f"got {self.pending[0].index}")
                if should_stop():
                    return None
                self._cond.wait(timeout=0.2)
            batch = self.pending.popleft()
            self._cond.notify_all()
        lag = index - batch.version
        if not 0 <= lag <= self.k:
            raise StalenessError(f"batch {index} was generated at version {batch.version}: lag {lag} outside "
                                 f"[0, {self.k}]")
        return batch

    def snapshot(self) -> tuple[int, list[GeneratedBatch]]:
        """(next batch to generate, generated batches not yet consumed): what a checkpoint must keep. A batch
        being generated now is not in it; it is generated again after a resume."""
        with self._cond:
            return self._generated, list(self.pending)

    def generation(self) -> tuple[float, int]:
        """(wall seconds with at least one batch in flight so far, the present stretch included; the response tokens
        of the batches generated): their ratio is the engine's throughput while it works, whatever the trainer did."""
        with self._cond:
            busy = time.perf_counter() - self._busy_since if self._in_flight else 0.0
            return self.stats.generate_seconds + busy, self.stats.generated_tokens

    @property
    def in_flight(self) -> int:
        """Batches being generated now."""
        with self._cond:
            return self._in_flight

    def stop(self, timeout: Optional[float] = None, abort: Optional[Callable[[], None]] = None) -> list[str]:
        """No batch is started from now on. `abort`: ends the generation in flight (its batch then never reaches
        `pending`: it is generated again after a resume). Waits for the threads, at most `timeout` seconds in all;
        returns the names of those still running (daemon threads: they do not keep the process alive)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if abort is not None:
            abort()
        deadline = None if timeout is None else time.perf_counter() + timeout
        for thread in self._threads + self._workers:
            if thread.is_alive():
                thread.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        return [t.name for t in self._threads + self._workers if t.is_alive()]

    def sync_and_evaluate(self) -> Optional[tuple]:
        """After stop(): load the last published weights and evaluate them (the final evaluation)."""
        self._sync(self._weights, self.version)
        if self.evaluate is None:
            return None
        result = (self.engine_version,) + tuple(self.evaluate(self.engine_version))
        self.stats.eval_results.append(result)
        return result

    # -- producer thread ------------------------------------------------------------------------------------
    def _admissible(self) -> bool:
        """Batch next_batch may be generated with the engine's current weights."""
        return self.next_batch < self.end_batch and self.engine_version >= self.next_batch - self.k

    def _eval_due(self) -> bool:
        return (self.evaluate is not None and self.eval_every > 0
                and (self._last_eval is None or self.engine_version >= self._last_eval + self.eval_every))

    def _sync(self, weights: Optional[dict], version: int) -> None:
        if weights is None or version == self.engine_version:
            return
        with self._evaluating:
            t0 = time.perf_counter()
            self.load_weights(weights, version)
            self.stats.sync_seconds += time.perf_counter() - t0
        with self._cond:
            self.stats.syncs += 1
            self.engine_version = version
            self._cond.notify_all()  # a batch may have become admissible

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:  # surfaced to the trainer by take()
            with self._cond:
                self.error = e
                self._stop = True
                self._cond.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._weights is not None):
                    self._cond.wait()
                if self._stop:
                    return
                weights, version, self._weights = self._weights, self.version, None
            self._sync(weights, version)

    def _run(self) -> None:
        between_batches = not self.concurrent_sync
        while True:
            with self._cond:
                while not (self._stop or (between_batches and self._weights is not None) or self._admissible()
                           or self._eval_due()):
                    self._cond.wait()
                if self._stop:
                    return
                weights, version = self._weights, self.version
                if between_batches:
                    self._weights = None
            if between_batches:
                self._sync(weights, version)  # new weights go in as soon as the engine is between batches
            if self._eval_due():
                with self._evaluating:
                    self._last_eval = self.engine_version
                    self.stats.eval_results.append((self.engine_version,) + tuple(self.evaluate(self.engine_version)))
            with self._cond:
                if self._stop:
                    return
                if (between_batches and self._weights is not None) or not self._admissible():
                    continue  # weights published meanwhile (say, during an evaluation) go in first
                index, version = self.next_batch, self.engine_version
                self.next_batch = index + 1
                self._cond.notify_all()  # an exact-staleness publish waits for this start
            if between_batches:
                self._generate(index, version)
            else:
                worker = threading.Thread(target=self._guard, args=(functools.partial(self._generate, index, version),),
                                          name=f"vcpo-batch-{index}", daemon=True)
                self._workers = [w for w in self._workers if w.is_alive()] + [worker]
                worker.start()

    def _generate(self, index: int, version: int) -> None:
        with self._cond:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        try:
            batch = self.make_batch(index, version)
        finally:  # an aborted batch is no longer in flight either
            with self._cond:
                self._in_flight -= 1
                if self._in_flight == 0:  # generate_seconds: wall time with at least one batch in flight
                    self.stats.generate_seconds += time.perf_counter() - self._busy_since
        with self._cond:
            self.stats.generated_tokens += sum(len(r.response_ids) for r in batch.rollouts)
            self._done[index] = batch
            while self._generated in self._done:
                self.pending.append(self._done.pop(self._generated))
                self._generated += 1
            self._cond.notify_all()


def pad_rollouts(rollouts: list[Rollout], pad_id: int):
    """Right-padded [B, T] tensors for vcpo.step: input ids, attention mask, loss mask (response tokens) and
    behaviour log-probs aligned with the tokens."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    b = len(rollouts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.long)
    mu = torch.zeros((b, width), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[i, :p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attn[i, :p + n] = 1
        loss_mask[i, p:p + n] = 1
        mu[i, p:p + n] = torch.tensor(r.behavior_logp, dtype=torch.float32)
    return ids, attn, loss_mask, mu
