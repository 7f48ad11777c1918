"""Prints, after pytest-benchmark's tables, one ratio table per layout from the same run's medians."""

import os

import pytest
import torch

# (label, numerator case, denominator case, target, "met" test on the ratio)
RATIOS = [
    ("eager / fused", "eager", "fused", ">= 8x", lambda r: r >= 8),
    ("compile / fused", "compile", "fused", ">= 2x", lambda r: r >= 2),
    ("fused / copy floor", "fused", "copy floor", "<= 3x", lambda r: r <= 3),
]
_LOAD_AT_START = os.getloadavg()[0]  # other work on a 2-core machine skews every number


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    medians = {}
    for bench in getattr(getattr(config, "_benchmarksession", None), "benchmarks", []):
        info = bench.extra_info
        if "case" in info and bench.stats is not None:
            medians.setdefault(info["layout"], {})[info["case"]] = bench.stats.median
    write = terminalreporter.write_line
    for layout, cases in medians.items():
        terminalreporter.section(f"VCPO policy_loss fwd+bwd, {layout} layout (medians)", sep="-")
        write(f"  torch threads {torch.get_num_threads()}, 1-min load average at start {_LOAD_AT_START:.2f}")
        for case, t in cases.items():
            write(f"  {case:<12} {t * 1e3:9.2f} ms")
        for label, num, den, target, met in RATIOS:
            if num in cases and den in cases:
                r = cases[num] / cases[den]
                write(f"  {label:<20} {r:7.2f}x   target {target:<6} {'MET' if met(r) else 'MISSED'}")
