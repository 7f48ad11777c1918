"""Rewards (docs/trainer.md, "Rewards"): --reward math on hand-written responses, the forms a reward function may
take, and RewardPool's concurrency bound, timeouts and errors, with every sample kept in rollouts.jsonl."""

import asyncio
import json
import logging
import threading
import time

import pytest

from vcpo.trainer.rewards import (RewardError, RewardJob, RewardPool, exact_match, math_reward, resolve_reward,
                                  reward_metrics, takes_example)
from vcpo.trainer.rollouts import Rollout
from vcpo.trainer.run_folder import RunFolder

pytest.importorskip("math_verify")

# (response, answer, correct?): labelled by hand
MATH_CASES = [
    ("The answer is \\boxed{\\frac12}.", "0.5", True),
    ("so x = 1/2", "\\frac{1}{2}", True),
    ("x = 0.5", "1/2", True),
    ("\\boxed{0.5}", "\\frac12", True),
    ("I think 7", "7", True),
    ("First 5, then 6, so \\boxed{6}", "6", True),  # the boxed answer, not the first number
    ("\\boxed{5} and later 6", "5", True),  # the boxed answer first, wherever it is
    ("first 5, then 6", "6", True),  # no box: the last expression
    ("first 5, then 6", "5", False),
    ("answer: 6", "\\boxed{6}", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{3}", "4", False),
    ("x = 0.51", "1/2", False),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("no idea", "3", False),
    ("", "3", False),
]


@pytest.mark.parametrize("response, answer, correct", MATH_CASES)
def test_math_reward_on_hand_written_responses(response, answer, correct):
    assert resolve_reward("math") is math_reward
    assert math_reward(response, answer) == float(correct)


def test_math_reward_runs_in_worker_threads():
    """math-verify's own timeouts (SIGALRM) fail outside the main thread: the pool's threads must work."""
    pool = RewardPool(math_reward, workers=4, timeout=30)
    jobs = [RewardJob(i, r, a, {}) for i, (r, a, _) in enumerate(MATH_CASES)]
    results = pool.score(jobs)
    pool.close()
    assert [r.reward for r in results] == [float(c) for _, _, c in MATH_CASES]
    assert all(r.error is None for r in results)


def test_reward_function_forms():
    def two(response, answer):
        return 1.0

    def three(response, answer, example):
        return 1.0

    assert not takes_example(two) and takes_example(three)
    assert takes_example(lambda r, a, example=None: 0) and takes_example(lambda *args: 0)
    assert not takes_example(lambda r, a, *, scale=2.0: 0)  # keyword-only parameters are not positions
    assert not takes_example(exact_match)
    for bad in (lambda r: 0, lambda r, a, b, c: 0):
        with pytest.raises(ValueError, match=r"must take \(response, answer\) or \(response, answer, example\)"):
            RewardPool(bad)
    with pytest.raises(ValueError, match="reward_errors must be one of"):
        RewardPool(two, errors="ignore")
    with pytest.raises(ValueError, match="exact, math or 'module:function'"):
        resolve_reward("maths")
    assert resolve_reward("exact") is exact_match


def _jobs(n):
    return [RewardJob((0, i, 0), f"r{i}", str(i), {"id": i, "level": i % 3}) for i in range(n)]


def test_three_argument_dict_and_async_functions():
    def graded(response, answer, example):  # the whole data row as the third argument
        return {"reward": example["id"] / 10, "level": example["level"], "short": len(response) < 3}

    async def slow_match(response, answer):
        await asyncio.sleep(0.01)
        return float(response == f"r{answer}")

    class Judge:  # an object whose __call__ is async
        async def __call__(self, response, answer):
            return 0.25

    assert [r.reward for r in RewardPool(Judge()).score(_jobs(2))] == [0.25, 0.25]
    import numpy as np

    assert RewardPool(lambda r, a: {"reward": np.float32(0.5), "n": np.int64(3)}).score(_jobs(1))[0].extras == {"n": 3}
    results = RewardPool(graded).score(_jobs(6))
    assert [r.reward for r in results] == [i / 10 for i in range(6)]
    assert [r.extras for r in results] == [{"level": float(i % 3), "short": 1.0} for i in range(6)]
    assert [r.reward for r in RewardPool(slow_match).score(_jobs(4))] == [1.0] * 4


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_concurrency_is_bounded_by_workers(kind):
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def enter():
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])

    def leave():
        with lock:
            state["now"] -= 1

    def sync_fn(response, answer):
        enter()
        time.sleep(0.05)
        leave()
        return 1.0

    async def async_fn(response, answer):
        enter()
        await asyncio.sleep(0.05)
        leave()
        return 1.0

    pool = RewardPool(sync_fn if kind == "sync" else async_fn, workers=3, timeout=10)
    t0 = time.perf_counter()
    assert [r.reward for r in pool.score(_jobs(12))] == [1.0] * 12
    assert state["most"] == 3  # concurrent, never more than the bound
    assert time.perf_counter() - t0 < 12 * 0.05  # faster than one at a time


def flaky(response, answer):
    if int(answer) % 3 == 1:
        raise KeyError(f"cannot grade {answer}")
    return 1.0


def test_errors_zero_scores_failures_0_and_logs_their_uids(caplog):
    caplog.set_level(logging.WARNING, logger="vcpo.trainer.rewards")
    results = RewardPool(flaky, errors="zero").score(_jobs(7))
    failed = [i for i in range(7) if i % 3 == 1]
    assert [r.reward for r in results] == [0.0 if i in failed else 1.0 for i in range(7)]
    for i, r in enumerate(results):
        assert (r.error is not None) == (i in failed)
        if i in failed:
            assert "Traceback" in r.error and f"KeyError: 'cannot grade {i}'" in r.error
    logged = [rec.getMessage() for rec in caplog.records]
    assert len(logged) == len(failed)
    for i, line in zip(failed, logged):
        assert f"sample (0, {i}, 0)" in line and "KeyError" in line


def test_errors_raise_stops_with_the_first_traceback():
    with pytest.raises(RewardError, match=r"(?s)sample \(0, 1, 0\) failed.*Traceback.*KeyError: 'cannot grade 1'"):
        RewardPool(flaky).score(_jobs(7))


@pytest.mark.parametrize("value, message", [(float("nan"), "must be a finite number"), ("1", "must be a finite"),
                                            ({"score": 1}, "without 'reward'"),
                                            ({"reward": 1, "note": "x"}, "note = 'x'"), (None, "finite number")])
def test_a_bad_value_is_a_failed_call(value, message):
    result = RewardPool(lambda r, a: value, errors="zero").score(_jobs(1))[0]
    assert result.reward == 0.0 and message in result.error


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_that_hangs_times_out_and_frees_its_slot(kind):
    release = threading.Event()

    def sync_fn(response, answer):
        if answer == "0":
            release.wait()  # never returns on its own
        return 1.0

    async def async_fn(response, answer):
        if answer == "0":
            await asyncio.sleep(3600)
        return 1.0

    pool = RewardPool(sync_fn if kind == "sync" else async_fn, workers=1, timeout=0.3, errors="zero")
    t0 = time.perf_counter()
    results = pool.score(_jobs(5))
    elapsed = time.perf_counter() - t0
    release.set()
    assert [r.reward for r in results] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert "TimeoutError" in results[0].error and "0.3 s" in results[0].error
    assert 0.3 <= elapsed < 2.0  # one timeout, then the other calls in the freed slot
    assert [r.reward for r in pool.score(_jobs(3)[1:])] == [1.0, 1.0]  # the pool still works
    with pytest.raises(RewardError, match="TimeoutError"):
        RewardPool(async_fn, timeout=0.2).score(_jobs(1))


def test_reward_metrics_and_rollouts_keep_every_sample(tmp_path):
    """Per-step means of the extra fields over the samples that have them, the failed calls counted, and each
    sample's reward, extras and error in rollouts.jsonl."""
    def graded(response, answer, example):
        if example["id"] == 4:
            raise ValueError("bad row")
        return {"reward": 1.0, "format": example["id"] % 2} if example["id"] % 3 else 0.5

    jobs = _jobs(8)
    results = RewardPool(graded, errors="zero").score(jobs)
    rollouts = [Rollout(0, j.uid[1], 0, [1], [5, 6], [-0.1, -0.2], "stop", s.reward, 0, False, None, None, s.extras,
                        s.error) for j, s in zip(jobs, results)]
    with_format = [i for i in range(8) if i % 3 and i != 4]
    m = reward_metrics(rollouts)
    assert m == {"reward_errors": 1, "reward_format": sum(i % 2 for i in with_format) / len(with_format)}
    run = RunFolder(str(tmp_path / "run"), resume=False)
    with run:
        run.log_step({"step": 1, **m}, rollouts)
    lines = [json.loads(line) for line in open(tmp_path / "run" / "rollouts.jsonl")]
    assert [tuple(r["uid"]) for r in lines] == [(0, i, 0) for i in range(8)]
    for i, r in enumerate(lines):
        assert r["reward"] == (0.0 if i == 4 else 1.0 if i % 3 else 0.5)
        assert r.get("reward_extras") == ({"format": float(i % 2)} if i in with_format else None)
        assert ("bad row" in r["reward_error"]) if i == 4 else "reward_error" not in r


def test_a_failed_reward_in_the_loop_checkpoints_then_stops_the_run():
    """reward_errors raise in the rollout thread: the trainer's loop writes a checkpoint, then stops with the
    traceback and how to continue."""
    import types

    from vcpo.trainer.rollouts import RolloutProducer
    from vcpo.trainer.run import _take

    pool = RewardPool(flaky)
    producer = RolloutProducer(make_batch=lambda index, version: pool.score(_jobs(3)),
                               load_weights=lambda weights, version: None, max_staleness=0, version=0, next_batch=0,
                               end_batch=1).start()
    saved = []
    with pytest.raises(RewardError, match=r"(?s)sample \(0, 1, 0\) failed.*KeyError.*Checkpoint written at step 0.*"
                                          r"--resume runs/x"):
        _take(producer, 0, types.SimpleNamespace(requested=False), lambda: saved.append("checkpoint"), "runs/x")
    producer.stop()
    assert saved == ["checkpoint"]


@pytest.mark.parametrize("setting, value", [("reward_workers", 0), ("reward_workers", 1.5), ("reward_timeout", 0),
                                            ("reward_timeout", float("inf")), ("reward_errors", "skip")])
def test_bad_reward_settings_name_the_setting(setting, value):
    from vcpo.trainer import make_config

    with pytest.raises(ValueError, match=setting):
        make_config(**{setting: value})
