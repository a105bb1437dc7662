"""Test-wide setup: Triton kernels run in the interpreter on a CPU (set before any triton.jit decorates a kernel),
and torch uses one thread: the tests use tiny shapes, where a second OpenMP thread only adds contention."""
import os

# setdefault so that a GPU run can override it with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
