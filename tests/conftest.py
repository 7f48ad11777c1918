"""The two tiers (docs/development.md, "Tests"). `pytest tests` runs the fast tier; `pytest tests --full` runs every test.
A test is `slow` when it starts a vLLM engine or server, spawns processes or ranks (mp.spawn, torchrun, accelerate,
Ray), loads a real pretrained model, runs a learning run, or takes more than FAST_LIMIT_SECONDS by itself on the
2-core machine (a cold torch.compile, a long run under the Triton interpreter); `gpu` when it needs a GPU (it skips
without one). An explicit `-m` expression selects by itself (`-m slow`: the slow tier alone).

The guard against a slow test hiding in the fast tier: the summary lists every fast-tier test that took more than
FAST_LIMIT_SECONDS (setup, call and teardown together)."""

import os
import shutil
import tempfile
from collections import defaultdict

import pytest

# Triton kernels (when present) run under the interpreter on this CPU-only machine; must precede imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
# tests/ on the path of every process a test starts (torchrun, accelerate, scripts), for `support`
TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)

# One cache of built tiny models (vcpo/trainer/tiny.py) for the session: every `vcpo train` a test starts reuses
# the warm-started models the first one built, and the user's own cache is not touched.
_OWN_CACHE = None if "VCPO_CACHE" in os.environ else tempfile.mkdtemp(prefix="vcpo-test-cache-")
if _OWN_CACHE is not None:
    os.environ["VCPO_CACHE"] = _OWN_CACHE

FAST_LIMIT_SECONDS = 15.0
_fast_seconds: dict = defaultdict(float)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the slow tier too: every test (what CI runs)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if item.get_closest_marker("slow") is None:
        _fast_seconds[item.nodeid] += call.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _fast_seconds.items() if s > FAST_LIMIT_SECONDS), reverse=True)
    if over:
        terminalreporter.section(f"fast-tier tests over {FAST_LIMIT_SECONDS:.0f} s (mark them slow or make them faster)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
