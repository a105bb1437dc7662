"""recurscope: mechanistic interpretability for linear-attention recurrent language models.

    import recurscope as rs
    model = rs.load_model("tiny-gla")
    pairs = rs.build_pairs(model.tokenizer, split="heldout", n_sources=8)
    result = rs.state_swap(model, pairs, heads=[(0, 0)])

The code lives in `recurscope/kernels`, `recurscope/hooks` and `recurscope/interp` (the repository's top-level
`kernels/`, `hooks/` and `interp/` are plain folders of links to their files).
The names below are the ones a user needs first; everything else is in those modules. Each is imported on first
use (a module `__getattr__`), so `import recurscope` costs nothing until a name is used, and
`import recurscope.kernels` loads torch and the kernels only.
"""
from __future__ import annotations

import importlib

__version__ = "0.2.0"

# name -> the module that defines it; a name equal to its module's last part is that module itself
_NAMES = {
    "hooks": "recurscope.hooks",
    "interp": "recurscope.interp",
    "kernels": "recurscope.kernels",
    "build_pairs": "recurscope.interp.data",
    "donor_write": "recurscope.interp.interventions",
    "load_model": "recurscope.interp.loading",
    "output_patch": "recurscope.interp.interventions",
    "output_restore": "recurscope.interp.interventions",
    "recurrence": "recurscope.kernels",
    "run_confirm": "recurscope.interp.confirm",
    "run_scan": "recurscope.interp.scan",
    "state_swap": "recurscope.interp.interventions",
    "torch_reference": "recurscope.interp.bridge.torch_path",
    "write_block": "recurscope.interp.interventions",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module_name = _NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'recurscope' has no attribute {name!r}; the facade's names are {__all__}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value   # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
