"""Prints, after pytest-benchmark's tables, one ratio table per layout from the same run's medians, and how much
CPU other processes used meanwhile (on 2 cores, any other work makes the medians meaningless)."""

import math
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile in-process: its CPU time counts as ours

import pytest  # noqa: E402
import torch  # noqa: E402

from common import cpu_seconds, other_cpu_seconds  # noqa: E402

# (label, numerator case, denominator case, target, "met" test on the ratio)
RATIOS = [
    ("eager / fused", "eager", "fused", ">= 8x", lambda r: r >= 8),
    ("compile / fused", "compile", "fused", ">= 2x", lambda r: r >= 2),
    ("fused / copy floor", "fused", "copy floor", "<= 3x", lambda r: r <= 3),
    ("verl / fused", "verl", "fused", "-", None),  # peers: no target, the speed-up users would see
    ("verl loss / fused", "verl loss", "fused", "-", None),
    ("vcpo / grpo", "vcpo", "grpo", "<= 1.05x", lambda r: r <= 1.05),  # bench_real_model_step.py
]

_START = cpu_seconds()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    medians, mins = {}, {}
    for bench in getattr(getattr(config, "_benchmarksession", None), "benchmarks", []):
        info = bench.extra_info
        if "case" in info and bench.stats is not None:
            medians.setdefault(info["layout"], {})[info["case"]] = bench.stats.median
            mins.setdefault(info["layout"], {})[info["case"]] = bench.stats.min
    if not medians:
        return
    write = terminalreporter.write_line
    foreign = other_cpu_seconds(_START, cpu_seconds())  # CPU time of other processes during the run
    if not math.isnan(foreign):  # /proc/stat was there to read (Linux)
        terminalreporter.section("VCPO benchmarks: ratio tables", sep="=")
        write(f"torch threads {torch.get_num_threads()}; other processes used {foreign:.1f} CPU-s during the run"
              + ("  ** CONTENDED: numbers unreliable, rerun on an idle machine **" if foreign > 2 else ""))
    for layout, cases in medians.items():
        terminalreporter.section(f"{layout}", sep="-")
        write(f"  {'case':<12} {'median ms':>10} {'min ms':>8}")
        for case, t in cases.items():
            write(f"  {case:<12} {t * 1e3:10.2f} {mins[layout][case] * 1e3:8.2f}")
        for label, num, den, target, met in RATIOS:
            if num in cases and den in cases:
                r = cases[num] / cases[den]
                # The targets are for the 1M-token layouts; "latency" shows the fixed cost of a call.
                verdict = f"target {target:<6} {'MET' if met(r) else 'MISSED'}" \
                    if layout != "latency" and met is not None else ""
                write(f"  {label:<20} {r:7.2f}x   {verdict}")
