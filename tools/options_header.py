"""Writes csrc/options.h, the option codes of vcpo_kernels/options.py as C++ enums, to standard output."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vcpo_kernels.options import cpp_header  # noqa: E402

sys.stdout.write(cpp_header())
