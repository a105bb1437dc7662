"""recurscope: mechanistic interpretability for linear-attention recurrent language models.

    import recurscope as rs
    model = rs.load_model("tiny-gla")
    pairs = rs.build_pairs(model.tokenizer, split="heldout", n_sources=8)
    result = rs.state_swap(model, pairs, heads=[(0, 0)])

The code lives in the repository's `kernels/`, `hooks/` and `interp/` folders and is imported as
`recurscope.kernels`, `recurscope.hooks` and `recurscope.interp` (pyproject maps the folders into this package).
The names below are the ones a user needs first; everything else is in those modules.
"""
from __future__ import annotations

from pathlib import Path as _Path

# In a source checkout (editable install, or a second work tree of the repository) the three folders sit beside
# this one rather than inside it; adding the checkout's root to __path__ makes `recurscope.kernels` resolve to
# the checkout's own `kernels/`. A wheel installs them inside this package, so there is nothing to add.
_here = _Path(__file__).resolve().parent
_root = _here.parent
if not (_here / "interp").is_dir() and (_root / "interp" / "checkpoints").is_dir() and (_root / "pyproject.toml").is_file():
    __path__.append(str(_root))  # noqa: F821 - the package's own __path__

from recurscope import hooks, interp, kernels  # noqa: E402
from recurscope.interp.confirm import run_confirm  # noqa: E402
from recurscope.interp.data import build_pairs  # noqa: E402
from recurscope.interp.interventions import (  # noqa: E402
    donor_write, output_patch, output_restore, state_swap, write_block,
)
from recurscope.interp.loading import load_model  # noqa: E402
from recurscope.interp.scan import run_scan  # noqa: E402
from recurscope.kernels import recurrence  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    "hooks", "interp", "kernels", "build_pairs", "donor_write", "load_model", "output_patch", "output_restore", "recurrence", "run_confirm",
    "run_scan", "state_swap", "write_block",
]
