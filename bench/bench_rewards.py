"""The cost of a reward call through RewardPool's worker processes (vcpo/trainer/rewards.py) against the thread
per call it replaced (the pool as of BASELINE, read from git), in the same run, rounds interleaved: the median time
of score() on one sample and, per sample, on a batch of 64, with exact match (about 1 us of work itself, so the
times are the pools' own cost); then the start-up of a worker (exact, math) and the time of the math rewards
themselves, for scale.

    python bench/bench_rewards.py                    # 2000 single calls and 200 batches of 64 per pool
    python bench/bench_rewards.py --calls 500 --batches 50
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "218edae"  # the last commit whose RewardPool runs a sync function in a thread per call


def load(name: str, path: str):
    """rewards.py by its path: it imports only the standard library (not the vcpo package, which takes seconds)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="single-sample score() calls per pool")
    p.add_argument("--batches", type=int, default=200, help="batches of --batch samples per pool")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=4, help="reward_workers (the default)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds the calls are split into")
    args = p.parse_args()

    new = load("rewards_processes", os.path.join(ROOT, "vcpo", "trainer", "rewards.py"))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{BASELINE}:vcpo/trainer/rewards.py"], check=True,
                               capture_output=True, text=True).stdout)
    old = load("rewards_threads", f.name)
    os.unlink(f.name)

    pools = {"thread per call": old.RewardPool(old.exact_match, workers=args.workers, timeout=30),
             "worker processes": new.RewardPool("exact", workers=args.workers, timeout=30)}
    one = [new.RewardJob(0, "42", "42", {})]
    batch = [new.RewardJob(i, str(i), str(i), {"id": i}) for i in range(args.batch)]
    single = {k: [] for k in pools}
    per_sample = {k: [] for k in pools}
    for pool in pools.values():  # started, and warm
        pool.score(batch)
        time.sleep(1.0)  # every worker up
        pool.score(batch)
    for _ in range(args.rounds):
        for name, pool in pools.items():
            single[name] += timed(lambda: pool.score(one), args.calls // args.rounds)
            per_sample[name] += [t / args.batch for t in timed(lambda: pool.score(batch), args.batches // args.rounds)]
    for pool in pools.values():
        pool.close()

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"reward_workers {args.workers}, exact match\n")
    print("| pool | score() of 1 sample: median (p90) | per sample in a batch of "
          f"{args.batch}: median (p90) |\n|---|---|---|")
    for name in pools:
        s, b = sorted(single[name]), sorted(per_sample[name])
        print(f"| {name} | {1e6 * statistics.median(s):.0f} us ({1e6 * s[int(0.9 * len(s))]:.0f}) | "
              f"{1e6 * statistics.median(b):.1f} us ({1e6 * b[int(0.9 * len(b))]:.1f}) |")
    threads, processes = pools
    gap_single = statistics.median(single[processes]) - statistics.median(single[threads])
    gap_batch = statistics.median(per_sample[processes]) - statistics.median(per_sample[threads])
    print(f"\nworker processes - thread per call, medians: {1e6 * gap_single:+.0f} us per 1-sample call, "
          f"{1e6 * gap_batch:+.1f} us per sample of a batch")

    print("\nworker start-up (the first score() of one sample, 1 worker):")
    for spec in ("exact", "math"):
        t0 = time.perf_counter()
        with new.RewardPool(spec, workers=1) as pool:
            pool.score(one)
            print(f"  {spec}: {time.perf_counter() - t0:.2f} s")

    print("\nthe math rewards themselves (direct calls, median of 200, after a warm-up, parses not cached):")
    new._quiet_math_verify()
    cases = [("Adding the tens and the units, 27 + 82 = \\boxed{109}.", "109"), ("\\boxed{\\frac{1}{2}}", "0.5"),
             ("\\boxed{x^2+2x+1}", "(x+1)^2")]
    for fn in (new.math_reward, new.math_lenient_reward):
        for response, answer in cases:
            fn(response, answer)
            t = statistics.median(timed(lambda: (new._parse_gold.cache_clear(), fn(response, answer)), 200))
            print(f"  {fn.__name__}({response!r}, {answer!r}): {1e6 * t:.0f} us")


if __name__ == "__main__":
    main()
