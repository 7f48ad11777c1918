"""Rewards (docs/trainer.md, "Rewards"): --reward math (the final answer) and math-lenient on hand-written and
adversarial responses, the forms a reward function may take, and RewardPool's worker processes: the concurrency
bound, timeouts that kill a runaway call (the power tower), errors, workers that die, close() with nothing left
behind, with every sample kept in rollouts.jsonl. The pool's test functions: tests/support/reward_fns.py."""

import json
import logging
import os
import sys
import threading
import time
import uuid
from fractions import Fraction

import pytest

from support import reward_fns
from vcpo.trainer.rewards import (BUILTIN_REWARDS, RewardError, RewardJob, RewardPool, RewardPoolClosed, as_number,
                                  exact_match, final_answer, math_lenient_reward, math_reward, resolve_reward,
                                  reward_metrics, takes_example)
from vcpo.trainer.rollouts import Rollout
from vcpo.trainer.run_folder import RunFolder

pytest.importorskip("math_verify")
FNS = "support.reward_fns"

# (response, answer, strict: --reward math, lenient: --reward math-lenient): labelled by hand
MATH_CASES = [
    ("The answer is \\boxed{\\frac12}.", "0.5", True, True),
    ("so x = 1/2", "\\frac{1}{2}", False, True),  # no final answer: strict scores 0
    ("x = 0.5", "1/2", False, True),
    ("\\boxed{0.5}", "\\frac12", True, True),
    ("I think 7", "7", False, True),
    ("First 5, then 6, so \\boxed{6}", "6", True, True),  # the boxed answer, not the first number
    ("\\boxed{5} and later 6", "5", True, True),  # the boxed answer, wherever it is
    ("first 5, then 6", "6", False, True),  # lenient: no box, the last expression
    ("first 5, then 6", "5", False, False),
    ("answer: 6", "\\boxed{6}", True, True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True, True),  # a gold that is no number: compared symbolically
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True, True),
    ("\\boxed{3}", "4", False, False),
    ("x = 0.51", "1/2", False, False),
    ("\\boxed{x^2+1}", "(x+1)^2", False, False),
    ("no idea", "3", False, False),
    ("", "3", False, False),
]

# responses that try to pass without giving the answer, and the final-answer forms: (response, answer, strict,
# lenient), by hand
ADVERSARIAL = [
    # the question restated (the real run's greedy answers, cut at 32 tokens): lenient evaluates 27 + 82
    ("To calculate 27 + 82, we need to follow the order of operations: parentheses, exponents, addition, ...",
     "109", False, True),
    ("\\boxed{27 + 82}", "109", False, True),  # the expression boxed
    ("The answer is 27 + 82.", "109", False, True),
    ("\\boxed{\\frac{218}{2}}", "109", False, True),  # a division left to do
    ("\\boxed{2/4}", "1/2", False, True),  # a fraction not in lowest terms
    ("so 27 + 82 = 109", "109", False, True),  # no final answer
    ("\\boxed{27+82=109}", "109", True, True),  # after the last "="
    ("\\boxed{108} no, \\boxed{109}", "109", True, False),  # several boxes: the last counts
    ("\\boxed{109} no, \\boxed{108}", "109", False, False),
    ("The answer is 109. Wait, the answer is 108.", "109", False, False),  # an answer, then a different one
    ("The answer is 108. Wait, the answer is 109.", "109", True, True),
    ("\\boxed{109}. The answer is 108", "109", True, True),  # a box first, a line only without one
    ("I don't know.", "109", False, False),  # no answer
    ("The answer is \\boxed{10", "109", False, False),  # truncated: the last box left open
    ("\\boxed{108} then \\boxed{10", "109", False, False),
    ("27 + 82 = 1", "109", False, False),
    ("\\boxed{}", "1", False, False),
    ("#### Step 1\nadd them", "109", False, False),  # a markdown heading is no answer mark
    # the accepted forms
    ("\\boxed{109.0}", "109", True, True),
    ("\\boxed{1,000}", "1000", True, True),
    ("\\boxed{1\\,000}", "1000", True, False),
    ("\\boxed{109 \\text{ apples}}", "109", True, True),
    ("\\boxed{\\$18}", "18", True, True),
    ("\\boxed{50\\%}", "50", True, False),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True, True),
    ("\\boxed{\\dfrac12}", "0.5", True, True),
    ("\\boxed{x = 2\\sqrt{2}}", "\\sqrt{8}", True, True),
    ("#### 109", "109", True, True),
    ("Answer: $109$.", "109", True, True),
    ("**Answer:** 109", "109", True, True),
    ("The answer is: -3", "-3", True, True),
    ("The answer is 109, surely", "109", True, True),
    ("Final Answer: The final answer is $109$. I hope it is correct.", "109", True, True),
    ("The answer to 27 + 82 is 109.", "109", True, True),
    ("The sum is \\boxed{109}", "Adding gives 109.\n#### 109", True, True),  # a gold with a mark: its final answer
]


@pytest.mark.parametrize("response, answer, strict, lenient", MATH_CASES + ADVERSARIAL)
def test_math_rewards_on_hand_written_responses(response, answer, strict, lenient):
    assert math_reward(response, answer) == float(strict)
    assert math_lenient_reward(response, answer) == float(lenient)


def test_reward_names():
    assert resolve_reward("math") is math_reward and resolve_reward("math-lenient") is math_lenient_reward
    assert resolve_reward("exact") is exact_match and resolve_reward(None) is exact_match
    assert set(BUILTIN_REWARDS) == {"exact", "math", "math-lenient"}
    with pytest.raises(ValueError, match="exact, math, math-lenient or 'module:function', got 'maths'"):
        resolve_reward("maths")


@pytest.mark.parametrize("text, value", [
    ("109", 109), ("-3", -3), ("+3", 3), ("109.0", 109), (".5", 0.5), ("1,000", 1000), ("1{,}000", 1000),
    ("\\frac{1}{2}", 0.5), ("\\dfrac12", 0.5), ("-\\frac{3}{4}", -0.75), ("3/4", 0.75), ("\\text{109}", 109),
    ("18 \\text{ dollars}", 18), ("109 apples", 109), ("90^\\circ", 90), ("\u22125", -5),
    ("27 + 82", None), ("9^{9^{9}}", None), ("\\frac{218}{2}", None), ("4/2", None), ("3/1", None), ("1/0", None),
    ("1e-07", Fraction(1, 10 ** 7)), ("2.5E3", 2500), ("1e1000", None), ("10^{5}", None),  # as Python writes a float; no 10**1000
    ("109x", None), ("1,5", None), ("109 (27 + 82)", None), ("x", None), ("", None),
])
def test_as_number_takes_numbers_not_expressions(text, value):
    assert as_number(text) == value
    if value is None and "/" in text and "0" not in text:
        assert as_number(text, reduced=False) is not None  # a gold answer may be written unreduced


def test_final_answer_is_the_last_box_or_answer_line():
    assert final_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"  # nested braces
    assert final_answer("\\boxed{1} \\fbox{2}") == "2"
    assert final_answer("Answer: 5\nAnswer: 6\n") == "6"
    assert final_answer("The ANSWER IS $x = 7$.") == "7"
    assert final_answer("To answer this, add 27 and 82") is None  # "answer" without is/:/= marks nothing
    assert final_answer("the answer") is None
    huge = "1" * 5000  # more digits than Python converts to an int: no number, not a failed call
    assert final_answer(f"\\boxed{{{huge}}}") == huge and as_number(huge) is None
    assert math_reward(f"\\boxed{{{huge}}}", "109") == 0.0
    assert math_reward("\\boxed{1e999999999}", "109") == 0.0  # no 10**999999999 computed
    assert math_reward("\\boxed{0.0000001}", str(1e-07)) == 1.0  # a float answer as Python writes it


@pytest.mark.slow  # a math-verify worker takes 3-5 s to start on the 2-core machine
@pytest.mark.parametrize("name, tower", [
    ("math-lenient", RewardJob("tower", "\\boxed{9^{9^{9}}}", "109", {})),  # the frozen run of issue 24
    ("math", RewardJob("tower", "\\boxed{1}", "9^{9^{9}}", {})),  # strict: a gold that is no number
])
def test_the_power_tower_times_out_and_the_process_stays_responsive(name, tower):
    """math-verify on 9^{9^{9}} computes a huge integer while holding the interpreter lock: in `vcpo train` that
    froze the process, SIGTERM included. In a worker process it is a timed-out call and its worker is killed,
    while this process keeps running (a thread here ticks all along), and the other calls of the batch give what
    direct calls give. Nothing here bounds the wall time from above (the machine may be loaded): that the call was
    cut short is its TimeoutError and the killed worker, that this process kept running is the ticker."""
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.01)

    cases = MATH_CASES + ADVERSARIAL
    with RewardPool(name, workers=2, timeout=2.0, errors="zero") as pool:
        _start(pool)  # what follows is the calls alone
        ticker = threading.Thread(target=tick)
        ticker.start()
        t0 = time.perf_counter()
        results = pool.score([tower] + [RewardJob(i, r, a, {}) for i, (r, a, _, _) in enumerate(cases)])
        elapsed = time.perf_counter() - t0
        stop.set()
        ticker.join()
        assert results[0].reward == 0.0 and "TimeoutError" in results[0].error
        assert "worker was killed" in results[0].error
        assert [r.reward for r in results[1:]] == [BUILTIN_REWARDS[name](r, a) for r, a, _, _ in cases]
        assert all(r.error is None for r in results[1:])
        assert elapsed >= 2.0  # the tower call ran until its timeout (a lower bound the timeout guarantees)
        # The ticker ran all along: frozen by the computation, it would stop for the whole call (elapsed >= 2 s).
        during = [t0] + [t for t in ticks if t0 <= t <= t0 + elapsed] + [t0 + elapsed]
        assert max(b - a for a, b in zip(during, during[1:])) < elapsed / 2
        assert pool.score([RewardJob(0, "\\boxed{7}", "7", {})] * 2)[0].reward == 1.0  # the replacement answers
    assert math_reward("\\boxed{9^{9^{9}}}", "109") == 0.0  # strict, a number as gold: no math-verify at all


def _start(pool):
    """Start the pool's workers, wait until every one is idle (and a killed one reaped): their pids."""
    pool.score([RewardJob(0, "", "1", {})])
    deadline = time.monotonic() + 60
    while (pool._idle.qsize(), len(pool._procs)) != (pool.workers, pool.workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {p.pid for p in pool._procs}


def _jobs(n):
    return [RewardJob((0, i, 0), f"r{i}", str(i), {"id": i, "level": i % 3}) for i in range(n)]


def _gone(pid):
    """Not running and reaped (a zombie is still in /proc)."""
    return not os.path.exists(f"/proc/{pid}")


def test_reward_function_forms():
    assert not takes_example(reward_fns.one) and takes_example(reward_fns.with_example)
    assert takes_example(lambda r, a, example=None: 0) and takes_example(lambda *args: 0)
    assert not takes_example(lambda r, a, *, scale=2.0: 0)  # keyword-only parameters are not positions
    assert not takes_example(exact_match)
    for bad in ("one_arg", "four_args"):
        with pytest.raises(ValueError, match=r"must take \(response, answer\) or \(response, answer, example\)"):
            RewardPool(f"{FNS}:{bad}")
    with pytest.raises(ValueError, match="reward_errors must be one of"):
        RewardPool(f"{FNS}:one", errors="ignore")
    with pytest.raises(TypeError, match="a name or 'module:function'"):
        RewardPool(reward_fns.one)
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        RewardPool(f"{FNS}:nothing")


def test_three_argument_dict_and_async_functions():
    with RewardPool(f"{FNS}:judge") as pool:  # an object whose __call__ is async
        assert pool.is_async and [r.reward for r in pool.score(_jobs(2))] == [0.25, 0.25]
    with RewardPool(f"{FNS}:numpy_values") as pool:
        assert pool.score(_jobs(1))[0].extras == {"n": 3}
    with RewardPool(f"{FNS}:graded") as pool:
        results = pool.score(_jobs(6))
    assert [r.reward for r in results] == [i / 10 for i in range(6)]
    assert [r.extras for r in results] == [{"level": float(i % 3), "short": 1.0} for i in range(6)]
    with RewardPool(f"{FNS}:slow_match") as pool:
        assert [r.reward for r in pool.score(_jobs(4))] == [1.0] * 4


def test_concurrency_is_bounded_by_workers_and_workers_start_once():
    with RewardPool(f"{FNS}:timed", workers=3, timeout=10) as pool:
        _start(pool)
        results = pool.score(_jobs(12))
        again = pool.score(_jobs(6))
    assert [r.reward for r in results] == [1.0] * 12
    spans = [(r.extras["start"], r.extras["end"]) for r in results]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)  # calls running at each call's start
    assert most == 3  # concurrent (so faster than one at a time), never more than the bound
    assert len({r.extras["pid"] for r in results + again}) == 3  # the same 3 processes throughout
    assert os.getpid() not in {r.extras["pid"] for r in results}


def test_async_concurrency_is_bounded_by_workers():
    reward_fns.STATE.update(now=0, most=0)
    with RewardPool(f"{FNS}:counted", workers=3, timeout=10) as pool:
        assert [r.reward for r in pool.score(_jobs(12))] == [1.0] * 12
    assert reward_fns.STATE["most"] == 3  # 3 calls at once (so faster than one at a time), never more


def test_errors_zero_scores_failures_0_and_logs_their_uids(caplog):
    caplog.set_level(logging.WARNING, logger="vcpo.trainer.rewards")
    with RewardPool(f"{FNS}:flaky", errors="zero") as pool:
        results = pool.score(_jobs(7))
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
    with RewardPool(f"{FNS}:flaky") as pool, \
            pytest.raises(RewardError, match=r"(?s)sample \(0, 1, 0\) failed.*Traceback.*KeyError: 'cannot grade 1'"):
        pool.score(_jobs(7))


@pytest.mark.parametrize("answer, message", [("nan", "must be a finite number"), ("text", "must be a finite"),
                                             ("no reward", "without 'reward'"), ("text extra", "note = 'x'"),
                                             ("none", "finite number")])
def test_a_bad_value_is_a_failed_call(answer, message):
    with RewardPool(f"{FNS}:bad_value", errors="zero") as pool:
        result = pool.score([RewardJob(0, "", answer, {})])[0]
    assert result.reward == 0.0 and message in result.error


@pytest.mark.parametrize("fn", ["runaway", "hangs"])
def test_a_call_that_runs_away_is_killed_and_its_worker_replaced(fn):
    """A call over its timeout, holding the interpreter lock (9^(9^9) in one C call: what froze the trainer, without
    math-verify's start-up) or sleeping: a failed call, its worker killed and reaped, the next calls in the other
    worker and then in the replacement."""
    with RewardPool(f"{FNS}:{fn}", workers=2, timeout=0.5, errors="zero") as pool:
        before = _start(pool)
        t0 = time.perf_counter()
        results = pool.score(_jobs(5))
        elapsed = time.perf_counter() - t0
        assert [r.reward for r in results] == [0.0, 1.0, 1.0, 1.0, 1.0]
        assert "TimeoutError" in results[0].error and "0.5 s" in results[0].error
        assert 0.5 <= elapsed < 2.0  # one timeout; the other calls meanwhile in the other worker
        after = _start(pool)  # the replacement is up
        assert len(before) == len(after) == 2 and len(before - after) == 1
        killed = (before - after).pop()
        deadline = time.monotonic() + 5
        while not _gone(killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(killed)
        assert [r.reward for r in pool.score(_jobs(5)[1:])] == [1.0] * 4
    with RewardPool(f"{FNS}:sleeps_on_0", workers=1, timeout=0.3) as pool, \
            pytest.raises(RewardError, match="TimeoutError"):
        pool.score(_jobs(1))


def test_a_worker_that_dies_is_a_failed_call_and_is_replaced():
    with RewardPool(f"{FNS}:dies", workers=1, timeout=10, errors="zero") as pool:
        results = pool.score(_jobs(4))
    assert [r.reward for r in results] == [0.0, 0.0, 1.0, 1.0]
    assert "RewardWorkerDied" in results[0].error and "exit code 3" in results[0].error
    assert "killed by SIGKILL" in results[1].error


def test_a_reward_that_prints_does_not_break_the_replies():
    with RewardPool(f"{FNS}:prints", workers=1) as pool:
        assert [r.reward for r in pool.score(_jobs(3))] == [1.0] * 3


def test_workers_that_cannot_start_are_an_error_whatever_reward_errors_says():
    with RewardPool(f"{FNS}:missing_in_workers", errors="zero") as pool:
        for _ in range(2):  # every call, not only the first
            with pytest.raises(RewardError, match=r"(?s)could not start.*has no function 'missing_in_workers'"):
                pool.score(_jobs(3))


def test_close_kills_a_runaway_call_at_once_and_leaves_no_process(tmp_path):
    """What the trainer does on SIGTERM or Ctrl-C: close() while a call runs away in another thread. That score()
    raises RewardPoolClosed, and no worker is left, running or unreaped."""
    marker = tmp_path / "started"
    pool = RewardPool(f"{FNS}:runaway", workers=2, timeout=600)
    pids = _start(pool)
    outcome = []

    def score():
        try:
            pool.score([RewardJob(0, "", "0", {"marker": str(marker)})])
        except RewardPoolClosed as e:
            outcome.append(e)

    scorer = threading.Thread(target=score)
    scorer.start()
    while not marker.exists():
        time.sleep(0.01)
    assert int(marker.read_text()) in pids
    t0 = time.perf_counter()
    pool.close()
    scorer.join(5)
    assert not scorer.is_alive() and isinstance(outcome[0], RewardPoolClosed)
    assert time.perf_counter() - t0 < 3.0  # the runaway one killed, the idle one's exit not waited for long
    assert len(pids) == 2 and all(_gone(p) for p in pids)
    pool.close()  # idempotent
    with pytest.raises(RewardPoolClosed):
        pool.score(_jobs(1))


def test_a_module_in_the_current_directory(tmp_path, monkeypatch):
    """`--reward mymod:fn` finds mymod.py in the current directory, in this process (the `vcpo` console script
    does not search it) and in the workers."""
    name = f"cwd_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import os\n\ndef score(response, answer):\n"
                                         "    return {'reward': 1.0, 'pid': os.getpid()}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with RewardPool(f"{name}:score", workers=1) as pool:
        result = pool.score(_jobs(1))[0]
    assert result.reward == 1.0 and result.extras["pid"] != os.getpid()
    assert str(tmp_path) in sys.path


def test_reward_metrics_and_rollouts_keep_every_sample(tmp_path):
    """Per-step means of the extra fields over the samples that have them, the failed calls counted, and each
    sample's reward, extras and error in rollouts.jsonl."""
    jobs = _jobs(8)
    with RewardPool(f"{FNS}:graded_or_fails", errors="zero") as pool:
        results = pool.score(jobs)
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

    with RewardPool(f"{FNS}:flaky") as pool:
        producer = RolloutProducer(make_batch=lambda index, version: pool.score(_jobs(3)),
                                   load_weights=lambda weights, version: None, max_staleness=0, version=0,
                                   next_batch=0, end_batch=1).start()
        saved = []
        with pytest.raises(RewardError, match=r"(?s)sample \(0, 1, 0\) failed.*KeyError.*Checkpoint written at step "
                                              r"0.*--resume runs/x"):
            _take(producer, 0, types.SimpleNamespace(requested=False), lambda **_: saved.append("checkpoint"),
                  "runs/x")
        producer.stop()
    assert saved == ["checkpoint"]


@pytest.mark.parametrize("setting, value", [("reward_workers", 0), ("reward_workers", 1.5), ("reward_timeout", 0),
                                            ("reward_timeout", float("inf")), ("reward_errors", "skip")])
def test_bad_reward_settings_name_the_setting(setting, value):
    from vcpo.trainer import make_config

    with pytest.raises(ValueError, match=setting):
        make_config(**{setting: value})
