"""Test-wide setup: Triton kernels run in the interpreter on a CPU (set before any triton.jit decorates a kernel)."""
import os

# setdefault so that a GPU run can override it with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")
