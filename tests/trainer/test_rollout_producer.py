"""The staleness-bounded rollout producer (vcpo/trainer/rollouts.py) driven by a fake engine with random delays:
bounded and exact staleness, nothing dropped, weights loaded during generation and evaluation, resume with
pending batches, failures reported."""

import random
import threading
import time

import pytest

from vcpo.trainer.rollouts import GeneratedBatch, Rollout, RolloutProducer, StalenessError


def _drive(k: int, steps: int, gen_s: float, train_s: float, seed: int = 0, stop_at: int | None = None,
           pending=(), next_batch=0, version=0, eval_s: float | None = None, exact: bool = False):
    """Run a producer against a trainer loop with random delays; returns (consumed batches, producer)."""
    rng = random.Random(seed)
    engine = {"version": version, "loads": []}
    lock = threading.Lock()

    def make_batch(index, v):
        assert v == engine["version"]
        time.sleep(rng.uniform(0, gen_s))
        return GeneratedBatch(index, v, [Rollout(index, index, 0, [1], [2], [0.0], None, 0.0, v)])

    def load(weights, v):
        assert v == weights["v"]
        with lock:
            engine["version"] = weights["v"]
            engine["loads"].append(weights["v"])

    def evaluate(v):  # evaluations interleave with generation, as in the trainer
        time.sleep(rng.uniform(0, gen_s) if eval_s is None else eval_s)
        return (0.0, 0.0)

    prod = RolloutProducer(make_batch=make_batch, load_weights=load, max_staleness=k, version=version,
                           next_batch=next_batch, end_batch=steps, pending=list(pending), evaluate=evaluate,
                           eval_every=2, exact_staleness=exact).start()
    consumed = []
    try:
        for step in range(version, steps if stop_at is None else stop_at):
            batch = prod.take(step)
            consumed.append(batch)
            time.sleep(rng.uniform(0, train_s))
            prod.publish(step + 1, {"v": step + 1})
    finally:
        prod.stop()
    return consumed, prod


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("fast", ["generation", "training"])
def test_producer_bounds_staleness_and_drops_nothing(k, fast):
    gen_s, train_s = (0.001, 0.01) if fast == "generation" else (0.01, 0.001)
    consumed, prod = _drive(k, steps=40, gen_s=gen_s, train_s=train_s, seed=k)
    assert [b.index for b in consumed] == list(range(40))
    lags = [b.index - b.version for b in consumed]
    assert all(0 <= lag <= k for lag in lags)
    if fast == "generation":  # pacing lets the engine run ahead by exactly k, no more and no less
        assert max(lags) == k
    if k == 0:
        assert lags == [0] * 40


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("fast", ["generation", "training"])
def test_exact_staleness_gives_every_batch_lag_k_whichever_side_is_faster(k, fast):
    gen_s, train_s = (0.001, 0.01) if fast == "generation" else (0.01, 0.001)
    consumed, _ = _drive(k, steps=30, gen_s=gen_s, train_s=train_s, seed=k, exact=True)
    assert [b.index for b in consumed] == list(range(30))
    assert [b.index - b.version for b in consumed] == [min(j, k) for j in range(30)]


def test_exact_staleness_refuses_concurrent_sync():
    with pytest.raises(ValueError, match="exact staleness"):
        RolloutProducer(make_batch=None, load_weights=None, max_staleness=2, version=0, next_batch=0, end_batch=4,
                        concurrent_sync=True, exact_staleness=True)


def test_producer_loads_weights_while_a_batch_is_generated():
    """concurrent_sync (engine: server): weights published during a batch go in at once, from the sync thread;
    the admissible batches are generated at the same time; a rollout records its first and last version and the
    bound holds for the first."""
    engine = {"version": 0, "in_flight": 0, "most": 0}
    spans = []
    lock = threading.Lock()

    def make_batch(index, admitted):
        first = engine["version"]
        assert first >= admitted
        with lock:
            engine["in_flight"] += 1
            engine["most"] = max(engine["most"], engine["in_flight"])
        time.sleep(0.02)
        with lock:
            engine["in_flight"] -= 1
        last = engine["version"]
        spans.append((first, last))
        return GeneratedBatch(index, first, [Rollout(index, index, 0, [1], [2], [0.0], None, 0.0, first,
                                                     last_version=last if last != first else None)])

    def load(weights, v):
        time.sleep(0.003)
        engine["version"] = v

    prod = RolloutProducer(make_batch=make_batch, load_weights=load, max_staleness=2, version=0, next_batch=0,
                           end_batch=30, concurrent_sync=True).start()
    try:
        for step in range(30):
            batch = prod.take(step)
            assert 0 <= step - batch.version <= 2
            prod.publish(step + 1, {"v": step + 1})
    finally:
        prod.stop()
    assert any(first != last for first, last in spans)  # weights changed while a batch was being generated
    assert engine["most"] > 1  # several batches were in flight at once


def test_producer_resumes_with_pending_batches():
    # an interrupted run: stop after 10 steps, keep (next batch, pending), continue in a new producer
    first, prod = _drive(3, steps=30, gen_s=0.001, train_s=0.01, stop_at=10)
    next_batch, pending = prod.snapshot()
    assert [b.index for b in pending] == list(range(10, next_batch))
    rest, _ = _drive(3, steps=30, gen_s=0.001, train_s=0.01, pending=pending, next_batch=next_batch, version=10)
    assert [b.index for b in first + rest] == list(range(30))
    assert rest[:len(pending)] == pending  # the pending batches are consumed as they were, not regenerated
    assert all(0 <= b.index - b.version <= 3 for b in rest)


def test_producer_loads_weights_published_during_an_evaluation():
    # resumed synchronous run: the engine evaluates its first version while the trainer consumes the pending
    # batch and publishes new weights; the next batch must be generated with those, not the evaluated ones
    pending = [GeneratedBatch(10, 10, [])]
    rest, prod = _drive(0, steps=14, gen_s=0.001, train_s=0.0, pending=pending, next_batch=11, version=10,
                        eval_s=0.05)
    assert [(b.index, b.version) for b in rest] == [(j, j) for j in range(10, 14)]


def test_producer_reports_its_failures_and_out_of_bounds_lag():
    def broken(index, version):
        raise OSError("engine died")

    prod = RolloutProducer(make_batch=broken, load_weights=lambda w, v: None, max_staleness=1, version=0,
                           next_batch=0, end_batch=3).start()
    with pytest.raises(RuntimeError, match="rollout thread failed") as info:
        prod.take(0)
    assert isinstance(info.value.__cause__, OSError)
    prod.stop()
    stale = GeneratedBatch(5, 0, [])
    prod = RolloutProducer(make_batch=broken, load_weights=lambda w, v: None, max_staleness=2, version=5,
                           next_batch=6, end_batch=6, pending=[stale])
    with pytest.raises(StalenessError, match="lag 5"):
        prod.take(5)


@pytest.mark.parametrize("concurrent", [False, True])
def test_stop_aborts_the_generation_in_flight_and_waits_a_bounded_time(concurrent):
    """stop(timeout, abort): the generation in flight is aborted (its batch never reaches pending, so no checkpoint
    holds it), the threads end within the timeout, and a thread that ignores the abort is left behind, named."""
    release = threading.Event()
    started = threading.Event()

    def make_batch(index, version):
        if index == 1:
            started.set()
            if not release.wait(30):
                raise AssertionError("never aborted")
            raise RuntimeError("aborted")
        return GeneratedBatch(index, version, [])

    prod = RolloutProducer(make_batch=make_batch, load_weights=lambda w, v: None, max_staleness=1, version=0,
                           next_batch=0, end_batch=5, concurrent_sync=concurrent).start()
    assert prod.take(0).index == 0
    assert started.wait(10) and prod.in_flight == 1
    t0 = time.perf_counter()
    assert prod.stop(timeout=5, abort=release.set) == []
    assert time.perf_counter() - t0 < 2 and prod.in_flight == 0
    assert prod.snapshot() == (1, [])  # batch 1 was in flight: generated again after a resume

    stuck = threading.Event()
    prod = RolloutProducer(make_batch=lambda i, v: stuck.wait(30), load_weights=lambda w, v: None, max_staleness=0,
                           version=0, next_batch=0, end_batch=1).start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    assert prod.stop(timeout=0.5, abort=lambda: None) == ["vcpo-rollouts"]
    assert time.perf_counter() - t0 < 1.5
    stuck.set()


def test_generation_seconds_count_the_batch_in_flight_and_give_the_engines_rate():
    """The throughput metric's parts: the seconds grow while a batch is being generated (an engine that is never idle
    between steps still reports time, and a rate that is not 0), and tokens / seconds is the rate while busy."""
    release = threading.Event()

    def make_batch(index, v):
        if index < 3:
            time.sleep(0.05)
        else:
            release.wait(10)
        return GeneratedBatch(index, v, [Rollout(index, index, 0, [1], [2] * 10, [0.0] * 10, None, 0.0, v)])

    prod = RolloutProducer(make_batch=make_batch, load_weights=lambda weights, v: None, max_staleness=8, version=0,
                           next_batch=0, end_batch=4).start()
    try:
        for step in range(3):
            prod.take(step)
        time.sleep(0.1)  # batch 3 in flight
        seconds, tokens = prod.generation()
        time.sleep(0.2)
        later, same = prod.generation()
        assert tokens == same == 30 and 0.15 <= seconds and later - seconds >= 0.2
        release.set()
        prod.take(3)
        final, tokens = prod.generation()
        assert tokens == 40 and final >= later and prod.in_flight == 0
        assert final == pytest.approx(prod.stats.generate_seconds)
    finally:
        release.set()
        prod.stop()
