"""recurscope: mechanistic interpretability for linear-attention recurrent language models.

    import recurscope as rs
    model = rs.load_model("tiny-gla")
    pairs = rs.build_pairs(model.tokenizer, split="heldout", n_sources=8)
    result = rs.state_swap(model, pairs, heads=[(0, 0)])

The code lives in `recurscope/kernels`, `recurscope/hooks` and `recurscope/interp` (the repository's top-level
`kernels/`, `hooks/` and `interp/` are links to them).
The names below are the ones a user needs first; everything else is in those modules.
"""
from __future__ import annotations

from recurscope import hooks, interp, kernels
from recurscope.interp.confirm import run_confirm
from recurscope.interp.bridge.torch_path import torch_reference
from recurscope.interp.data import build_pairs
from recurscope.interp.interventions import (
    donor_write, output_patch, output_restore, state_swap, write_block,
)
from recurscope.interp.loading import load_model
from recurscope.interp.scan import run_scan
from recurscope.kernels import recurrence

__version__ = "0.2.0"

__all__ = [
    "hooks", "interp", "kernels", "build_pairs", "donor_write", "load_model", "output_patch", "output_restore", "recurrence", "run_confirm",
    "run_scan", "state_swap", "torch_reference", "write_block",
]
