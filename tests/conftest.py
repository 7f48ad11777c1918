import os

# Triton kernels (when present) run under the interpreter on this CPU-only machine; must precede imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
