"""Where a VCPO step's extra time goes on SmolLM2 (whole batch, the setup of bench_real_model.py): in its own
process per rule, a warm-up step, one timed step, then one step under torch.profiler; the ops by self CPU time,
VCPO minus GRPO, largest first.

    .venv/bin/python bench/profile_real_model_step.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

RULES = ("grpo", "vcpo")  # cases of bench_real_model.CASES


def profile_case(case: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

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
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        vcpo.step(model, optimizer, batch, config)
    ops = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
    return {"case": case, "seconds": seconds, "ops": ops}


def main() -> None:
    if len(sys.argv) > 1:  # one case, in a child process
        print(json.dumps(profile_case(sys.argv[1])))
        return
    results = {}
    for case in RULES:
        out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, check=True)
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


if __name__ == "__main__":
    main()
