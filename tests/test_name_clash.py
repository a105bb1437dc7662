"""recurscope installs under one namespace, so Hugging Face's `kernels` package and ours live side by side.

The checks run in subprocesses, both outside the repository and from its root. At the root the working directory is
first on the module search path, so the design card's top-level `kernels/`, `hooks/` and `interp/` must not be regular
packages there: they are plain folders of links (docs/architecture.md, "Layout"), and an installed `kernels` wins.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import recurscope
from recurscope import kernels as our_kernels

OURS = os.path.dirname(os.path.abspath(our_kernels.__file__))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.slow
def test_transformers_fla_and_the_bridge_work_from_the_repository_root():
    """The README's commands run from the root, where the checkout is first on the module path (issue 39)."""
    out = _run(
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print('KERNELS_AVAILABLE:', is_kernels_available())\n"
        "import importlib.util, os\n"
        "print('KERNELS_ORIGIN:', os.path.dirname(importlib.util.find_spec('kernels').origin))\n"
        "import transformers.modeling_utils, fla\n"
        "import torch, recurscope as rs\n"
        "model = rs.load_model('tiny-qwen35')\n"
        "tokens = model.to_tokens('the cat sat on the mat')\n"
        "with torch.no_grad():\n"
        "    logits = model(tokens)\n"
        "print('KIND:', type(model).__name__)\n"
        "print('FINITE:', bool(torch.isfinite(logits).all()))\n",
        ROOT,
    )
    # Not vacuous: transformers must see an installed `kernels` it accepts, so that it imports it on its own.
    assert out["KERNELS_AVAILABLE"] == "True", "the test extra must install a `kernels` that transformers accepts"
    assert out["KERNELS_ORIGIN"] != OURS and not out["KERNELS_ORIGIN"].startswith(ROOT)
    assert out["KIND"] == "BridgedLM" and out["FINITE"] == "True"
    res = subprocess.run([sys.executable, "-m", "experiments.bench.transformers_run", "--help"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and "usage" in res.stdout, res.stderr[-3000:]


def test_facade_names():
    for name in ("load_model", "build_pairs", "write_block", "donor_write", "state_swap", "output_patch",
                 "output_restore", "run_scan", "run_confirm", "recurrence"):
        assert callable(getattr(recurscope, name)), name
    assert recurscope.recurrence is our_kernels.recurrence
