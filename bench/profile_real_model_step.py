"""Where a VCPO step's extra time goes on SmolLM2 (the setup of bench_real_model.py): in its own process per rule,
a warm-up step, one timed step, then one step under torch.profiler; the ops by self CPU time, VCPO minus GRPO,
largest first. With --gemms, both rules in one process instead (a GRPO step, then a VCPO step, on one model,
each under the profiler), and the model's matrix products (`aten::mm`) compared by operand shapes: whether the
same GEMMs run slower in a VCPO step, with no second process or minute of machine load between the two.

    .venv/bin/python bench/profile_real_model_step.py                          # whole batch, by op
    OMP_NUM_THREADS=1 .venv/bin/python bench/profile_real_model_step.py --gemms --micro-batch-size 4
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time

RULES = ("grpo", "vcpo")  # cases of bench_real_model.CASES


def profiled_step(model, optimizer, batch, config, shapes: bool = False):
    """(seconds of one vcpo.step under torch.profiler, the profile's key averages)."""
    from torch.profiler import ProfilerActivity, profile

    import vcpo

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        vcpo.step(model, optimizer, batch, config)
    return time.perf_counter() - start, prof.key_averages(group_by_input_shape=shapes)


def profile_case(case: str) -> dict:
    import torch

    import vcpo
    from bench_real_model import CASES, build

    options, micro, checkpointing = CASES[case]
    model, batch = build(checkpointing)
    config = vcpo.VCPOConfig(micro_batch_size=micro, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    vcpo.step(model, optimizer, batch, config)  # warm-up (and AdamW's state)
    start = time.perf_counter()
    vcpo.step(model, optimizer, batch, config)
    seconds = time.perf_counter() - start
    _, events = profiled_step(model, optimizer, batch, config)
    return {"case": case, "seconds": seconds, "ops": {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in events}}


def by_op() -> None:
    results = {}
    for case in RULES:
        out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True, check=True)
        results[case] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case}: {results[case]['seconds']:.2f} s a step unprofiled; self CPU time profiled "
              f"{sum(s for s, _ in results[case]['ops'].values()):.2f} s", flush=True)
    grpo, ours = results["grpo"]["ops"], results["vcpo"]["ops"]
    none = (0.0, 0)
    rows = sorted(((ours.get(k, none)[0] - grpo.get(k, none)[0], k) for k in set(grpo) | set(ours)), reverse=True)
    print(f"{'op':48s} {'GRPO s':>8s} {'VCPO s':>8s} {'VCPO-GRPO':>10s}  calls GRPO/VCPO")
    for diff, key in rows[:18]:
        print(f"{key[:48]:48s} {grpo.get(key, none)[0]:8.2f} {ours.get(key, none)[0]:8.2f} {diff:10.2f}  "
              f"{grpo.get(key, none)[1]}/{ours.get(key, none)[1]}")


def gemms(micro: int | None) -> None:
    import torch

    import vcpo
    from bench_real_model import build
    from common import GRPO

    model, batch = build(False)
    configs = {"grpo": vcpo.VCPOConfig(micro_batch_size=micro, **GRPO),
               "vcpo": vcpo.VCPOConfig(micro_batch_size=micro)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    for config in configs.values():  # warm-up: AdamW's state, each rule's first-step work
        vcpo.step(model, optimizer, batch, config)
    mm = {}
    for rule, config in configs.items():
        seconds, events = profiled_step(model, optimizer, batch, config, shapes=True)
        mm[rule] = collections.defaultdict(lambda: [0.0, 0])
        for e in events:
            if e.key == "aten::mm":
                mm[rule][str(e.input_shapes)][0] += e.self_cpu_time_total / 1e6
                mm[rule][str(e.input_shapes)][1] += e.count
        total = sum(s for s, _ in mm[rule].values()), sum(n for _, n in mm[rule].values())
        print(f"{rule}: step {seconds:.2f} s profiled; aten::mm {total[0]:.2f} s in {total[1]} calls", flush=True)
    grpo, ours = mm["grpo"], mm["vcpo"]
    print(f"{'aten::mm operand shapes':52s} {'GRPO s':>7s} {'calls':>5s} {'VCPO s':>7s} {'calls':>5s} "
          f"{'VCPO/GRPO a call':>16s}")
    for key in sorted(set(grpo) | set(ours), key=lambda k: -ours.get(k, [0.0])[0])[:30]:
        (a, n), (b, m) = grpo.get(key, [0.0, 0]), ours.get(key, [0.0, 0])
        ratio = f"{(b / m) / (a / n):16.2f}" if n and m and a else f"{'-':>16s}"
        print(f"{key[:52]:52s} {a:7.2f} {n:5d} {b:7.2f} {m:5d} {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemms", action="store_true", help="both rules in one process, mm by operand shapes")
    parser.add_argument("--micro-batch-size", type=int, help="with --gemms (default: the whole batch)")
    parser.add_argument("--case", choices=RULES, help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(profile_case(args.case)))
    elif args.gemms:
        gemms(args.micro_batch_size)
    else:
        by_op()


if __name__ == "__main__":
    main()
