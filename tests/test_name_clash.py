"""Our top-level `kernels` package shares its name with Hugging Face's `kernels`; transformers must not import ours."""
from __future__ import annotations

import os
import subprocess
import sys

import kernels

OURS = os.path.dirname(os.path.abspath(kernels.__file__))


def test_transformers_does_not_import_our_kernels():
    code = (
        "import os, sys\n"
        "import transformers.modeling_utils\n"
        "mod = sys.modules.get('kernels')\n"
        "path = getattr(mod, '__file__', None) if mod is not None else None\n"
        "print('KERNELS_FILE:', None if path is None else os.path.dirname(os.path.abspath(path)))\n"
        "print('LOADED:', mod is not None)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)
    if lines["LOADED"] == "True":
        assert lines["KERNELS_FILE"] != OURS, "transformers.modeling_utils imported recurscope's kernels package"


def test_kernels_has_no_version():
    # transformers decides whether Hugging Face's `kernels` is installed partly from kernels.__version__.
    assert not hasattr(kernels, "__version__")
