"""recurscope installs under one namespace, so Hugging Face's `kernels` package and ours live side by side.

The checks run in a subprocess started outside the repository: inside it the checkout's own `kernels/` folder is
on the module search path (as any folder of the working directory is) and would shadow an installed `kernels` by design.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import recurscope
from recurscope import kernels as our_kernels

OURS = os.path.dirname(os.path.abspath(our_kernels.__file__))


def _run(code: str, cwd) -> dict:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)


@pytest.mark.slow
def test_both_kernels_packages_import_in_one_process(tmp_path):
    pytest.importorskip("kernels")  # Hugging Face's, in the test extra
    out = _run(
        "import os, kernels, recurscope\n"
        "from recurscope import kernels as ours\n"
        "print('HF:', os.path.dirname(os.path.abspath(kernels.__file__)))\n"
        "print('OURS:', os.path.dirname(os.path.abspath(ours.__file__)))\n"
        "print('HF_HAS_RECURRENCE:', hasattr(kernels, 'recurrence'))\n"
        "print('OURS_HAS_RECURRENCE:', hasattr(ours, 'recurrence'))\n",
        tmp_path,
    )
    # OURS is compared by folder name only: a second work tree of the repository imports its own copy in-process.
    assert out["HF"] != out["OURS"] and os.path.basename(out["OURS"]) == "kernels"
    assert out["HF_HAS_RECURRENCE"] == "False" and out["OURS_HAS_RECURRENCE"] == "True"


@pytest.mark.slow
def test_transformers_finds_hugging_faces_kernels(tmp_path):
    pytest.importorskip("kernels")
    out = _run(
        "import importlib.metadata, importlib.util, os\n"
        "import recurscope\n"
        "import transformers.modeling_utils\n"
        "from transformers.utils.import_utils import _is_package_available\n"
        "found, version = _is_package_available('kernels', return_version=True)\n"
        "print('FOUND:', found)\n"
        "print('VERSION:', version)\n"
        "print('DIST:', importlib.metadata.version('kernels'))\n"
        "print('ORIGIN:', os.path.dirname(importlib.util.find_spec('kernels').origin))\n",
        tmp_path,
    )
    assert out["FOUND"] == "True" and out["VERSION"] == out["DIST"]
    assert out["ORIGIN"] != OURS


def test_facade_names():
    for name in ("load_model", "build_pairs", "write_block", "donor_write", "state_swap", "output_patch",
                 "output_restore", "run_scan", "run_confirm", "recurrence"):
        assert callable(getattr(recurscope, name)), name
    assert recurscope.recurrence is our_kernels.recurrence
