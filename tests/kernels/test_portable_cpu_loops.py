"""The portable (non-AVX2) build of the per-token loops, forced with VCPO_CPU_ISA=generic in a subprocess
(the choice is made once per process), against the reference on a representative subset of the cases."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.backend_check import COMPILED_BACKENDS

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # pytest in a subprocess, 80 s


@pytest.mark.skipif(not COMPILED_BACKENDS, reason="the C++ extension is not built")
def test_generic_loops_match_reference():
    env = {**os.environ, "VCPO_CPU_ISA": "generic"}
    selection = "default or token or ppo or half or large or masked or extreme or prompt_response"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", selection,
         str(HERE / "test_backends_vs_reference.py"), str(HERE / "test_edge_cases.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.skipif(not COMPILED_BACKENDS, reason="the C++ extension is not built")
def test_generic_logit_rows_match_reference():
    env = {**os.environ, "VCPO_CPU_ISA": "generic"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "cpu",
         str(HERE / "test_linear_logprobs.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
