"""Rewards (docs/trainer.md, "Rewards"): exact match, verifiable math answers (math-verify), or a user's
function, called as fn(response, answer) or fn(response, answer, example), sync or async, returning a float or a
dict with `reward` and extra numeric fields. RewardPool scores the samples of a batch concurrently (a bounded
number of calls at once, a timeout per call) in its own thread, so that a slow reward never blocks the trainer."""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import threading
import traceback
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)
REWARD_ERRORS = ("raise", "zero")


def normalise_answer(text: str) -> str:
    return " ".join(text.strip().split())


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def exact_match(response: str, answer: "str | int | float") -> float:
    """1.0 when the response, stripped of surrounding and repeated whitespace, equals the answer, else 0.0. A
    numeric answer (an int or float in the data: docs/trainer.md, "Data and prompts") is compared as a number: the
    response must be a plain decimal number equal to it (an integer answer exactly, a float one as the nearest
    double)."""
    text = normalise_answer(response)
    if isinstance(answer, str):
        return float(text == normalise_answer(answer))
    if not _DECIMAL.fullmatch(text):
        return 0.0
    number = Decimal(text)
    return float(number == answer if isinstance(answer, numbers.Integral) else float(number) == answer)


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str):
    from math_verify import parse

    # a data set's answer is bare LaTeX ("\frac{1}{2}", "2\sqrt{2}"): math-verify finds LaTeX between delimiters
    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return parse(text, parsing_timeout=None)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer (\\boxed{} first, else the last expression math-verify parses)
    equals `answer` symbolically (1/2 = 0.5 = \\frac12), else 0.0. math-verify's own timeouts use SIGALRM, which
    only works in the main thread: they are off here, and RewardPool's per-call timeout bounds the call."""
    from math_verify import parse, verify

    gold = _parse_gold(str(answer))  # a number in the data, as Python writes it (4.0, 1e-07)
    pred = parse(response, parsing_timeout=None)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None))


def _quiet_math_verify() -> None:
    # it warns once that its timeouts are off: RewardPool's timeout replaces them
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


BUILTIN_REWARDS = {"exact": exact_match, "math": math_reward}


def resolve_reward(spec: Optional[str]) -> Callable:
    """None or "exact" -> exact_match; "math" -> math_reward; "module:function" -> that function."""
    if spec is None:
        return exact_match
    if spec in BUILTIN_REWARDS:
        if spec == "math":
            if importlib.util.find_spec("math_verify") is None:
                raise ValueError("reward math needs the math-verify package: pip install 'vcpo[train]'")
            _quiet_math_verify()
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward must be exact, math or 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward: {module_name!r} has no function {attr!r}")
    return fn


def takes_example(fn: Callable) -> bool:
    """Whether fn is called with the data row as a third argument: it takes three positional arguments (or
    *args); two is (response, answer); anything else is refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(positional) >= 3 and len(required) <= 3:
        return True
    if len(positional) >= 2 and len(required) <= 2:
        return False
    raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} must take (response, answer) or "
                     f"(response, answer, example), got {inspect.signature(fn)}")


@dataclass
class RewardJob:
    uid: Any  # the sample's (batch, prompt index, response index), or its evaluation position
    response: str
    answer: str
    example: dict  # the whole data row


@dataclass
class RewardResult:
    reward: float
    extras: dict = field(default_factory=dict)  # the extra numeric fields of a dict-valued reward
    error: Optional[str] = None  # the traceback (or timeout) of a failed call, scored 0


class RewardError(RuntimeError):
    """A reward call failed with reward_errors: raise."""


def _check_value(value) -> tuple[float, dict]:
    """A reward function's value as (reward, extras), or a TypeError/ValueError saying what is wrong with it."""
    def number(name: str, v) -> float:  # any real number (numpy's too); a bool counts as 0 or 1
        if not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"reward function returned {name} = {v!r}: must be a finite number")
        return float(v)

    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward function returned a dict without 'reward': {sorted(value)}")
        return number("reward", value["reward"]), {k: number(k, v) for k, v in value.items() if k != "reward"}
    return number("the reward", value), {}


class RewardPool:
    """Calls `fn` on many samples at once: at most `workers` calls in flight, each given `timeout` seconds. An
    async fn runs on the pool's event loop (it must await, not block); a sync fn runs in a thread of its own, so
    that a call that never returns is abandoned at its timeout (Python cannot stop a thread: it keeps running,
    a daemon, while its slot goes to the next call). A failed call (exception, timeout, a value that is not a
    finite number or a dict with `reward`) is logged with the sample's uid and, with errors "zero", scores 0;
    with "raise", score() raises RewardError with the first failure's traceback."""

    def __init__(self, fn: Callable, *, workers: int = 4, timeout: float = 30.0, errors: str = "raise") -> None:
        if errors not in REWARD_ERRORS:
            raise ValueError(f"reward_errors must be one of {list(REWARD_ERRORS)}, got {errors!r}")
        self.fn, self.workers, self.timeout, self.errors = fn, workers, timeout, errors
        self.with_example = takes_example(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._slots: Optional[asyncio.Semaphore] = None
        self._start = threading.Lock()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    self._slots = asyncio.Semaphore(self.workers)  # shared by every batch scored at once
                    ready.set()
                    loop.run_forever()

                threading.Thread(target=run, name="vcpo-rewards", daemon=True).start()
                ready.wait()
                self._loop = loop
        return self._loop

    def score(self, jobs: Sequence[RewardJob]) -> list[RewardResult]:
        """The results of `jobs`, in order (blocks; callable from any thread but the pool's own)."""
        if not jobs:
            return []
        loop = self._ensure_loop()
        results = asyncio.run_coroutine_threadsafe(self._score_all(jobs), loop).result()
        for job, r in zip(jobs, results):
            if r.error is not None:
                if self.errors == "raise":
                    raise RewardError(f"the reward of sample {job.uid} failed (reward_errors: raise; 'zero' scores "
                                      f"it 0 instead):\n{r.error}")
                logger.warning("reward of sample %s failed, scored 0: %s", job.uid, r.error.strip().splitlines()[-1])
        return results

    def close(self) -> None:
        with self._start:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None

    async def _score_all(self, jobs: Sequence[RewardJob]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self._score_one(j) for j in jobs)))

    async def _score_one(self, job: RewardJob) -> RewardResult:
        args = (job.response, job.answer, job.example) if self.with_example else (job.response, job.answer)
        async with self._slots:
            try:
                value = await asyncio.wait_for(self._call(args), self.timeout)
                reward, extras = _check_value(value)
                return RewardResult(reward, extras)
            except asyncio.TimeoutError:
                return RewardResult(0.0, error=f"TimeoutError: the reward call took more than {self.timeout} s "
                                               "(reward_timeout)")
            except Exception:
                return RewardResult(0.0, error=traceback.format_exc())

    async def _call(self, args: tuple):
        value = await (self.fn(*args) if self.is_async else self._in_thread(args))
        return await value if inspect.isawaitable(value) else value  # an object whose __call__ is async

    def _in_thread(self, args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value, error) -> None:
            if not future.done():  # not after its timeout
                future.set_exception(error) if error is not None else future.set_result(value)

        def call() -> None:
            try:
                value, error = self.fn(*args), None
            except BaseException as e:
                value, error = None, e
            loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=call, name="vcpo-reward-call", daemon=True).start()
        return future


def reward_metrics(rollouts: Sequence) -> dict:
    """metrics.jsonl fields of a batch's rewards: reward_errors (failed calls) and the mean of each extra field
    of dict-valued rewards, as reward_<field> (over the samples that have it)."""
    sums: dict[str, list[float]] = {}
    for r in rollouts:
        for k, v in r.reward_extras.items():
            sums.setdefault(k, []).append(v)
    return {"reward_errors": sum(r.reward_error is not None for r in rollouts),
            **{f"reward_{k}": sum(v) / len(v) for k, v in sums.items()}}
