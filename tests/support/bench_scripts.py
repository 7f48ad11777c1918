"""The scripts of bench/ as modules for their tests: each loaded once, under its own name (the scripts import one
another by name, as they find each other beside themselves, and dataclasses look their module up in sys.modules)."""

import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def bench_module(name: str):
    """bench/NAME.py as the module NAME, loaded the first time it is asked for."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]
