"""A stand-in for the rollout engine, for trainer tests that are about the loop, not about vLLM: response tokens
drawn from each request's sampling seed (so a resumed run draws the same), each with behaviour log-prob -1."""

import math
import os
from contextlib import contextmanager
import random
import signal
import threading
import time

from vcpo.trainer.engines.interface import Completion, Engine, GenerationAborted


class FakeEngine(Engine):
    """`poison`: True, every response's first token gets a behaviour log-prob of -inf (every step is then
    non-finite); an int P > 0, only the responses of prompts whose sampling seed is a multiple of P (a rare bad
    sample, the same after a resume). `block_from`: the generate call with that index (= the batch, one batch at a
    time) and the later ones block until abort(), after sending this process SIGTERM (a scheduler's stop while a
    batch is in flight). `seconds`: each call's duration (generation that takes time)."""

    def __init__(self, poison=False, block_from=None, on_abort=lambda: None, seconds=0.0):
        self.poison, self.block_from, self.on_abort, self.seconds = poison, block_from, on_abort, seconds
        self.calls, self.aborted, self.signalled = 0, threading.Event(), None

    def _poisoned(self, seed: int) -> bool:
        return self.poison is True or (self.poison is not False and seed % self.poison == 0)

    def generate(self, prompts, *, n, max_tokens, temperature, top_k=-1, top_p=1.0, seeds=None, stop_token_ids=()):
        if top_k > 0 or top_p < 1:
            raise NotImplementedError("the fake engine's log-probs are made up: it samples no truncated distribution")
        call, self.calls = self.calls, self.calls + 1
        if self.block_from is not None and call >= self.block_from:
            self.signalled = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)
            self.aborted.wait(60)
            raise GenerationAborted("aborted")
        if self.aborted.wait(self.seconds):
            raise GenerationAborted("aborted")
        out = []
        for seed in seeds:
            rng = random.Random(seed)
            out.append([Completion(ids := [rng.randrange(4, 20) for _ in range(max_tokens)],
                                   [-math.inf if self._poisoned(seed) and t == 0 else -1.0 for t in range(len(ids))],
                                   "length") for _ in range(n)])
        return out

    def load_weights(self, state, version):
        pass

    def abort(self):
        self.on_abort()
        self.aborted.set()

    def close(self):
        pass


def serve(monkeypatch, *engines: Engine) -> None:
    """Make `vcpo train` (vcpo.trainer.run.start_engine) use these engines, one per start in order and the last one
    for any start after; none given: a new FakeEngine at each start."""
    from vcpo.trainer import run as run_module

    starts = iter(range(len(engines)))

    @contextmanager
    def start_engine(cfg, **kwargs):
        yield (engines[next(starts, len(engines) - 1)] if engines else FakeEngine()), 0.0

    monkeypatch.setattr(run_module, "start_engine", start_engine)
