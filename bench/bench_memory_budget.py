"""vcpo.MicroBatchFit on a real model: SmolLM2-135M-Instruct, the batch of bench_real_model.py (16 sequences x 256
tokens in 4 groups of 4, fp32, VCPO with exact norms, AdamW). For each budget, in a process of its own, five steps
through the fit: the micro-batch size of each, its peak resident set (VmHWM after the fit's own reset), the fit
(fixed part, cost per padded token) and whether the fitted steps kept within the budget.

    .venv/bin/python bench/bench_memory_budget.py --budgets 6,9,14
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

STEPS = 5


def run_budget(budget: float) -> dict:
    import torch

    import vcpo
    from bench_real_model import build
    from vcpo.memory import GIB, peak_bytes, peak_reset

    model, batch = build(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    fit = vcpo.MicroBatchFit(budget_gib=budget)
    rows = []
    for _ in range(STEPS):
        peak_reset(torch.device("cpu"))
        fit.step(model, optimizer, batch)
        rows.append({"size": fit.size, "peak_gib": peak_bytes(torch.device("cpu")) / GIB})
    return {"budget": budget, "steps": rows, "fit": fit.describe()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="6,9,14", help="GiB, comma-separated")
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)  # one budget, in a child process
    args = parser.parse_args()
    if args.budget is not None:
        print(json.dumps(run_budget(args.budget)))
        return
    print(f"vcpo.MicroBatchFit on SmolLM2-135M-Instruct, 16 x 256 in groups of 4, fp32 VCPO, {STEPS} steps a budget")
    print(f"{'budget GiB':>10s}  {'size by step (None: whole batch)':34s} {'peak GiB by step':28s} fitted within")
    for budget in (float(b) for b in args.budgets.split(",")):
        out = subprocess.run([sys.executable, __file__, "--budget", str(budget)], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"budget {budget} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        sizes = ", ".join(str(s["size"]) for s in r["steps"])
        peaks = ", ".join(f"{s['peak_gib']:.2f}" for s in r["steps"])
        within = all(s["peak_gib"] <= budget for s in r["steps"][3:])
        print(f"{budget:10.1f}  {sizes:34s} {peaks:28s} {within}")
        print(f"{'':10s}  {r['fit']}", flush=True)


if __name__ == "__main__":
    main()
