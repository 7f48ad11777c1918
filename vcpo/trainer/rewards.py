"""Rewards (docs/trainer.md, "Rewards"): exact match, verifiable math answers (the response's final answer, or
math-verify's lenient extraction), or a user's function, called as fn(response, answer) or fn(response, answer,
example), sync or async, returning a float or a dict with `reward` and extra numeric fields.

RewardPool scores the samples of a batch concurrently, each call given a timeout. A sync function runs in worker
processes that the pool kills and replaces on timeout: a thread cannot be stopped, and a call that holds the
interpreter lock (math-verify on \\boxed{9^{9^{9}}}) froze a whole trainer, signals included. A worker loads this
file alone, not the vcpo package (whose import takes seconds and torch): it imports only the standard library at
module level."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import pickle
import re
import signal
import struct
import sys
import threading
import traceback
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
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


# -- math: the final answer ----------------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "#### 109" (GSM8K: a line that starts with "####" and then a number, not a markdown heading); "answer is",
# "answer:", "answer =", "final answer is", "the answer to <the question> is", in any case, "answer" maybe in bold
_ANSWER_MARK = re.compile(r"(?im)^[ \t]*#{4}(?=[ \t]*[-+$\\\d.])"
                          r"|\banswer\b(?:[ \t]+to\b[^\n]{0,80}?)?[ \t]*\**[ \t]*(?:\bis\b[ \t]*:?|:|=)")
_SENTENCE_END = re.compile(r"\.(?:\s|$)|,\s|;")  # a decimal point or a thousands comma is not one
_DELIMITERS = re.compile(r"\\?\$|\\[()\[\]]|\*\*")
_FORMAT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")  # unwrapped: the words stay
_IGNORED = re.compile(r"\\[!,;: ]|\\left|\\right|\\%|%|\^\s*\{?\\circ\}?|~")
_NUMERAL = re.compile(r"""\s*(?P<sign>[-+]?)\s*(?:
    \\[dt]?frac\s*(?:\{\s*(?P<p>\d+)\s*\}|(?P<p1>\d))\s*(?:\{\s*(?P<q>\d+)\s*\}|(?P<q1>\d))  # \frac{1}{2}, \frac12
    | (?P<a>\d+)\s*/\s*(?P<b>\d+)                                                         # 1/2
    | (?P<decimal>(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d{1,3})?)  # 1,000 109.0 .5 1e-07
    )(?:\s+[A-Za-z]+)*\s*""", re.X)  # then words: a unit ("109 apples")


def _last_box(text: str) -> Optional[str]:
    """The contents of the last \\boxed{...} of `text`; None when that box is left open (a cut-off response: its
    last answer was never given)."""
    start = list(_BOX.finditer(text))[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _last_answer_line(text: str) -> Optional[str]:
    """The text after the last final-answer mark (_ANSWER_MARK), to the end of its sentence; None without one."""
    marks = list(_ANSWER_MARK.finditer(text))
    if not marks:
        return None
    rest = text[marks[-1].end():].split("\n", 1)[0]
    return _SENTENCE_END.split(_DELIMITERS.sub("", rest), 1)[0]


def _answer_text(text: str) -> str:
    """An answer without math delimiters and markdown, and after its last "=" ("x = 5" is 5)."""
    return _DELIMITERS.sub("", text).rsplit("=", 1)[-1].strip()


def final_answer(text: str) -> Optional[str]:
    """The final answer of `text` (_answer_text): the contents of its last \\boxed{}, or, when it has no box, what
    follows its last final-answer mark ("The answer is 109.", "Answer: 109", "#### 109"); None when there is none
    (or the last box is left open)."""
    answer = _last_box(text) if _BOX.search(text) else _last_answer_line(text)
    return None if answer is None else _answer_text(answer) or None


def as_number(text: str, reduced: bool = True) -> Optional[Fraction]:
    """The value of `text` when it is a number as written, not an expression: an integer or decimal (thousands
    commas allowed: 1,000; an exponent as Python writes a float: 1e-07), or a fraction of integers (1/2,
    \\frac{1}{2}; in lowest terms when `reduced`), with a sign, and with units and formatting around it ($, %,
    \\text{...}, a trailing word); else None."""
    text = _IGNORED.sub("", _FORMAT.sub(r" \1 ", text.replace("{,}", ",").replace("\u2212", "-")))
    m = _NUMERAL.fullmatch(text)
    if m is None:
        return None
    sign = -1 if m["sign"] == "-" else 1
    try:
        if m["decimal"] is not None:
            return sign * Fraction(m["decimal"].replace(",", ""))
        p, q = int(m["p"] or m["p1"] or m["a"]), int(m["q"] or m["q1"] or m["b"])
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): no answer anyone gives
        return None
    if q == 0 or (reduced and (q == 1 or math.gcd(p, q) != 1)):  # 218/2 is a division left to do, not a number
        return None
    return sign * Fraction(p, q)


def _parse_latex(text: str):
    from math_verify import parse

    # a bare answer ("\frac{1}{2}", "2\sqrt{2}"): math-verify finds LaTeX between delimiters
    return parse(text if "$" in text or "\\boxed" in text else f"${text}$", parsing_timeout=None)


_parse_gold = functools.lru_cache(maxsize=65536)(_parse_latex)  # a data set's answers recur; responses do not


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer (final_answer: the last \\boxed{}, else a final-answer line) equals
    `answer`, else 0.0. When the gold answer is a number, the response's must be a number too (as_number: 109,
    109.0 and 1,000 are; 27 + 82 and \\frac{218}{2} are not), equal in value; otherwise the two are compared
    symbolically by math-verify (x^2+2x+1 = (x+1)^2). A gold answer with a box or a mark ("#### 18") is its final
    answer; without one, the whole of it."""
    answer = str(answer)  # a number in the data, as Python writes it (4.0, 1e-07)
    pred = final_answer(response)
    if pred is None:
        return 0.0
    gold = final_answer(answer) or _answer_text(answer)
    value = as_number(gold, reduced=False)
    if value is not None:
        return float(as_number(pred) == value)
    from math_verify import verify

    gold_parsed, pred_parsed = _parse_gold(gold), _parse_latex(pred)
    return float(bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_lenient_reward(response: str, answer: str) -> float:
    """math-verify as it comes: the response's \\boxed{} answer, else the last expression it parses anywhere (a
    restated question "27 + 82" scores as its value), equal to `answer` symbolically (1/2 = 0.5 = \\frac12)."""
    answer = str(answer)  # a number in the data, as Python writes it (4.0, 1e-07)
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    pred = parse(response, parsing_timeout=None)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None))


def _quiet_math_verify() -> None:
    # it warns once that its timeouts (SIGALRM) are off: RewardPool's timeout replaces them
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


# every built-in reward, by the name --reward takes
BUILTIN_REWARDS = {"exact": exact_match, "math": math_reward, "math-lenient": math_lenient_reward}


def resolve_reward(spec: Optional[str]) -> Callable:
    """None -> exact_match; a BUILTIN_REWARDS name -> that function; "module:function" -> that function (the
    current directory is searched after the installed modules: `vcpo`, a console script, does not search it)."""
    if spec is None:
        return exact_match
    if not isinstance(spec, str):
        raise TypeError(f"reward must be a name or 'module:function' (workers import it), got {spec!r}")
    if spec in BUILTIN_REWARDS:
        if spec.startswith("math"):
            if importlib.util.find_spec("math_verify") is None:
                raise ValueError(f"reward {spec} needs the math-verify package: pip install 'vcpo[train]'")
            _quiet_math_verify()
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward must be {', '.join(BUILTIN_REWARDS)} or 'module:function', got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
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


def is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


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


# a response is correct when its reward is at least this: the full score of the exact-match and math rewards
CORRECT_REWARD = 1.0


class RewardError(RuntimeError):
    """A reward call failed with reward_errors: raise, or the reward's workers could not start."""


class RewardPoolClosed(RuntimeError):
    """score() on a closed pool, or a score() in flight when the pool was closed (a run that stops)."""


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


# -- the worker processes ------------------------------------------------------------------------------------------
# A worker runs `python -c _BOOT <this file> <the pool's pid>`, then answers messages on its stdin: first (reward
# spec, sys.path) -> ("ready", None) or ("failed", traceback); then each call's arguments -> ("ok", reward,
# extras) or ("error", traceback). A message is a 4-byte length and a pickle.
_BOOT = ("import importlib.util, sys; "
         "spec = importlib.util.spec_from_file_location('vcpo_reward_worker', sys.argv[1]); "
         "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
         "module._serve(int(sys.argv[2]))")
_LENGTH = struct.Struct("<I")
WORKER_START_S = 120.0  # for a worker to import the reward (math-verify: seconds on a busy machine)
CLOSE_GRACE_S = 1.0  # for idle workers to exit by themselves at close (a function's atexit hooks run)


def _send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(_LENGTH.size)
    return pickle.loads(stream.read(_LENGTH.unpack(head)[0])) if len(head) == _LENGTH.size else None


def _serve(pool_pid: int) -> None:
    """A worker's life: import the reward, then answer calls until the pool closes its stdin."""
    if sys.platform.startswith("linux"):  # killed when the pool's thread (and so its process) ends, even by SIGKILL
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != pool_pid:  # the pool's process ended before that
        os._exit(1)
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr, not into the replies
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    spec, sys.path[:] = _receive(requests)
    try:
        fn = resolve_reward(spec)
        if spec in BUILTIN_REWARDS:  # its imports now, not in the first call's time
            fn("\\boxed{(x+1)^2}", "x^2+2x+1")
    except BaseException:
        _send(replies, ("failed", traceback.format_exc()))
        return
    _send(replies, ("ready", None))
    while (args := _receive(requests)) is not None:
        try:
            reply = ("ok", *_check_value(fn(*args)))
        except Exception:
            reply = ("error", traceback.format_exc())
        _send(replies, reply)


class _WorkerDied(RuntimeError):
    pass


def _exit_reason(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
    return f"exit code {code}"


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def request(self, message):
        """Send a message, await the reply; _WorkerDied if the worker ends first."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(_LENGTH.pack(len(data)) + data)
            await self.proc.stdin.drain()
            size, = _LENGTH.unpack(await self.proc.stdout.readexactly(_LENGTH.size))
            return pickle.loads(await self.proc.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise _WorkerDied(f"the reward worker process ended during the call "
                              f"({_exit_reason(await self.proc.wait())})") from None


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


class RewardPool:
    """Scores samples with the reward `spec` (resolve_reward): at most `workers` calls at once, each given `timeout`
    seconds. A sync function runs in `workers` worker processes, started at the first score() and kept: a call
    over its timeout is a failed call, and its worker is killed (it may hold the interpreter lock: a thread could
    not be stopped) and replaced. An async function runs on the pool's event loop in this process, where it shares
    the loop's connections and costs no process (it must await, not block: its timeout cancels it at an await). A
    failed call (exception, timeout, a worker that died, a value that is not a finite number or a dict with
    `reward`) is logged with the sample's uid and, with errors "zero", scores 0; with "raise", score() raises
    RewardError with the first failure's traceback. close() stops everything, at once."""

    def __init__(self, spec: Optional[str] = None, *, workers: int = 4, timeout: float = 30.0,
                 errors: str = "raise") -> None:
        if errors not in REWARD_ERRORS:
            raise ValueError(f"reward_errors must be one of {list(REWARD_ERRORS)}, got {errors!r}")
        self.fn = resolve_reward(spec)  # here too: a bad spec or signature is an error now, not in a worker
        self.spec = "exact" if spec is None else spec
        self.workers, self.timeout, self.errors = workers, timeout, errors
        self.with_example = takes_example(self.fn)
        self.is_async = is_async(self.fn)
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._scoring: set[concurrent.futures.Future] = set()  # score() calls in flight
        self._procs: set[asyncio.subprocess.Process] = set()  # every worker process not yet reaped
        self._failure: Optional[str] = None  # why a worker could not start

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, jobs: Sequence[RewardJob]) -> list[RewardResult]:
        """The results of `jobs`, in order (blocks; callable from any thread but the pool's own)."""
        if not jobs:
            return []
        with self._lock:
            loop = self._started_loop()
            future = asyncio.run_coroutine_threadsafe(self._score_all(jobs), loop)
            self._scoring.add(future)
        try:
            results = future.result()
        except concurrent.futures.CancelledError:
            raise RewardPoolClosed("the reward pool was closed while it scored a batch") from None
        finally:
            with self._lock:
                self._scoring.discard(future)
        for job, r in zip(jobs, results):
            if r.error is not None:
                if self.errors == "raise":
                    raise RewardError(f"the reward of sample {job.uid} failed (reward_errors: raise; 'zero' scores "
                                      f"it 0 instead):\n{r.error}")
                logger.warning("reward of sample %s failed, scored 0: %s", job.uid, r.error.strip().splitlines()[-1])
        return results

    def close(self) -> None:
        """Kill the workers (a call in flight is not waited for; idle ones get CLOSE_GRACE_S to exit by
        themselves), reap them and end the pool's thread; a score() in flight raises RewardPoolClosed. Idempotent,
        from any thread."""
        with self._lock:
            self._closed = True
            loop, self._loop = self._loop, None
            scoring = list(self._scoring)
        if loop is None:
            return
        for future in scoring:
            future.cancel()
        asyncio.run_coroutine_threadsafe(self._stop_workers(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join()
        loop.close()

    # -- the pool's thread ---------------------------------------------------------------------------------------
    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The pool's event loop, in a thread of its own, with the workers starting (under self._lock)."""
        if self._closed:
            raise RewardPoolClosed("the reward pool is closed")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="vcpo-rewards", daemon=True)
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()
        return self._loop

    async def _open(self) -> None:
        self._slots = asyncio.Semaphore(self.workers)  # async calls in flight
        self._idle: asyncio.Queue = asyncio.Queue()  # started workers waiting for a call; None: they cannot start
        if not self.is_async:
            for _ in range(self.workers):
                self._launch()

    def _launch(self) -> None:
        """Start a worker in the background: it joins the idle ones once it has imported the reward."""
        asyncio.ensure_future(self._start_worker()).add_done_callback(self._started)

    async def _start_worker(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _BOOT, __file__, str(os.getpid()),
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    start_new_session=True)  # the terminal's Ctrl-C is the pool's
        self._procs.add(proc)
        if self._closed:  # started while the pool closed: _stop_workers may have looked already
            _kill(proc)
        worker = _Worker(proc)
        try:
            status, detail = await asyncio.wait_for(worker.request((self.spec, sys.path)), WORKER_START_S)
        except asyncio.TimeoutError:
            status, detail = "failed", f"it did not import the reward in {WORKER_START_S} s"
        except _WorkerDied as e:
            status, detail = "failed", str(e)
        if status != "ready":
            self._retire(worker)
            raise RewardError(f"a worker process of reward {self.spec!r} could not start:\n{detail}")
        return worker

    def _started(self, task: asyncio.Task) -> None:
        error = None if task.cancelled() else task.exception()
        if self._closed or task.cancelled():
            return
        if error is None:
            self._idle.put_nowait(task.result())
        else:
            self._failure = str(error)
            self._idle.put_nowait(None)

    async def _idle_worker(self) -> _Worker:
        worker = await self._idle.get()
        if worker is None:  # a worker could not start: this call and every other one fails with why
            self._idle.put_nowait(None)
            raise RewardError(self._failure)
        return worker

    async def _score_all(self, jobs: Sequence[RewardJob]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self._score_one(j) for j in jobs)))

    async def _score_one(self, job: RewardJob) -> RewardResult:
        args = (job.response, job.answer, job.example) if self.with_example else (job.response, job.answer)
        try:
            if not self.is_async:
                return await self._in_worker(args)
            async with self._slots:
                reward, extras = _check_value(await asyncio.wait_for(self.fn(*args), self.timeout))
            return RewardResult(reward, extras)
        except asyncio.TimeoutError:
            return RewardResult(0.0, error=f"TimeoutError: the reward call took more than {self.timeout} s "
                                           "(reward_timeout)" + ("" if self.is_async else "; its worker was killed"))
        except _WorkerDied as e:
            return RewardResult(0.0, error=f"RewardWorkerDied: {e}")
        except RewardError:  # the workers cannot start: not one sample's failure
            raise
        except Exception:
            return RewardResult(0.0, error=traceback.format_exc())

    async def _in_worker(self, args: tuple) -> RewardResult:
        worker = await self._idle_worker()
        try:
            reply = await asyncio.wait_for(worker.request(args), self.timeout)
        except BaseException:  # timed out, died, or the pool closes: a worker in an unknown state
            self._retire(worker)
            if not self._closed:
                self._launch()
            raise
        self._idle.put_nowait(worker)
        status, *rest = reply
        return RewardResult(*rest) if status == "ok" else RewardResult(0.0, error=rest[0])

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker now and reap it in the background."""
        _kill(worker.proc)
        asyncio.ensure_future(worker.proc.wait()).add_done_callback(lambda _: self._procs.discard(worker.proc))

    async def _stop_workers(self) -> None:
        idle = set()
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                worker.proc.stdin.close()  # an idle worker exits at the end of its input (its atexit hooks run)
                idle.add(worker.proc)
        for proc in self._procs - idle:  # in a call or starting: killed, not waited for
            _kill(proc)
        procs = list(self._procs)
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=CLOSE_GRACE_S)
            for proc in procs:
                _kill(proc)
        # the calls close() cancelled, the starts and the reaping end now, before the loop stops
        await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)


def reward_metrics(rollouts: Sequence) -> dict:
    """metrics.jsonl fields of a batch's rewards: reward_errors (failed calls) and the mean of each extra field
    of dict-valued rewards, as reward_<field> (over the samples that have it)."""
    sums: dict[str, list[float]] = {}
    for r in rollouts:
        for k, v in r.reward_extras.items():
            sums.setdefault(k, []).append(v)
    return {"reward_errors": sum(r.reward_error is not None for r in rollouts),
            **{f"reward_{k}": sum(v) / len(v) for k, v in sums.items()}}
