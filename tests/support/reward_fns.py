"""Reward functions for tests/trainer/test_rewards.py, imported by name ("support.reward_fns:flaky") in the reward
pool's worker processes: they import nothing from vcpo (its import takes seconds)."""

import asyncio
import os
import signal
import sys
import time


def one(response, answer):
    return 1.0


def one_arg(response):
    return 0.0


def four_args(response, answer, example, extra):
    return 0.0


def with_example(response, answer, example):
    return 1.0


def graded(response, answer, example):  # the whole data row as the third argument
    return {"reward": example["id"] / 10, "level": example["level"], "short": len(response) < 3}


def numpy_values(response, answer):
    import numpy as np

    return {"reward": np.float32(0.5), "n": np.int64(3)}


def flaky(response, answer):
    if int(answer) % 3 == 1:
        raise KeyError(f"cannot grade {answer}")
    return 1.0


def graded_or_fails(response, answer, example):
    if example["id"] == 4:
        raise ValueError("bad row")
    return {"reward": 1.0, "format": example["id"] % 2} if example["id"] % 3 else 0.5


BAD_VALUES = {"nan": float("nan"), "text": "1", "no reward": {"score": 1}, "text extra": {"reward": 1, "note": "x"},
              "none": None}


def bad_value(response, answer):
    return BAD_VALUES[answer]


def timed(response, answer):
    """Sleeps 0.05 s; its extras say when and where it ran (for the concurrency bound)."""
    start = time.time()
    time.sleep(0.05)
    return {"reward": 1.0, "start": start, "end": time.time(), "pid": os.getpid()}


def pid(response, answer):
    return {"reward": 1.0, "pid": os.getpid()}


def runaway(response, answer, example):
    """Answer "0": computes 9^(9^9) while holding the interpreter lock (as math-verify did on a power tower), after
    writing its pid to the file example["marker"] (if any); other answers score 1."""
    if answer == "0":
        if example.get("marker"):
            with open(example["marker"] + ".tmp", "w") as f:  # renamed once whole: a reader never sees it empty
                f.write(str(os.getpid()))
            os.replace(example["marker"] + ".tmp", example["marker"])
        return float(9 ** (9 ** 9) > 0)
    return 1.0


def hangs(response, answer):
    if answer == "0":
        time.sleep(3600)
    return 1.0


def dies(response, answer):
    if answer == "0":
        os._exit(3)
    if answer == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def prints(response, answer):
    print("a reward that prints: stdout is not the pool's channel")
    sys.stdout.flush()
    return 1.0


if "vcpo_reward_worker" not in sys.modules:  # only in the pool's own process: its workers cannot find it
    def missing_in_workers(response, answer):
        return 1.0


# async functions run on the pool's event loop, in the test's process: their state is visible to the test
STATE = {"now": 0, "most": 0}


async def slow_match(response, answer):
    await asyncio.sleep(0.01)
    return float(response == f"r{answer}")


async def counted(response, answer):
    STATE["now"] += 1
    STATE["most"] = max(STATE["most"], STATE["now"])
    await asyncio.sleep(0.05)
    STATE["now"] -= 1
    return 1.0


async def sleeps_on_0(response, answer):
    if answer == "0":
        await asyncio.sleep(3600)
    return 1.0


class Judge:  # an object whose __call__ is async
    async def __call__(self, response, answer):
        return 0.25


judge = Judge()


def faulty(response, answer):
    """A graded reward that, on about 2% of responses each (by the response's CRC, so the same after a resume),
    hangs, computes 9^(9^9) holding the interpreter lock, or raises; else (CRC mod 7) / 6."""
    import zlib

    crc = zlib.crc32(response.encode())
    if crc % 50 == 0:
        time.sleep(3600)
    if crc % 50 == 1:
        return float(9 ** (9 ** 9) > 0)
    if crc % 50 == 2:
        raise ValueError(f"cannot grade {response!r}")
    return crc % 7 / 6


def token_parity(response, answer):  # differs between a prompt's responses: advantages that are not all 0
    return float(sum(map(ord, response)) % 2)
