"""transformers' own PyTorch path for the linear-attention families.

transformers dispatches `torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, ... to fla's (Triton) or the
causal-conv1d package's kernels whenever those import. Parity tests compare against transformers' torch functions,
and a CPU needs them anyway; `torch_reference_path()` swaps the dispatching wrappers back to the functions they wrap.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager

def dispatched() -> dict:
    """{modeling module: the kernel functions it dispatches}, from every architecture's adapter (`dispatched`)."""
    from recurscope.interp.bridge.families import adapters

    return {module: names for adapter in adapters() for module, names in adapter.dispatched.items()}


def __getattr__(name: str):
    if name == "DISPATCHED":   # the earlier table, now each adapter's own entry
        return dispatched()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_functions(module):
    out = {}
    for name in dispatched()[module.__name__]:
        fn = getattr(module, name, None)
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None:
            out[name] = (fn, inner)
    return out


def use_torch_path(module_names=None) -> dict:
    """Permanently points the named modeling modules (default: all known) at transformers' torch functions;
    returns {(module, name): dispatching function} so that `restore` can undo it. Without names, a family this
    transformers version lacks is skipped; a named module must import."""
    saved = {}
    for module_name in module_names or dispatched():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if module_names:
                raise
            continue
        for name, (wrapper, inner) in _torch_functions(module).items():
            saved[(module, name)] = wrapper
            setattr(module, name, inner)
    return saved


def restore(saved: dict) -> None:
    for (module, name), fn in saved.items():
        setattr(module, name, fn)


@contextmanager
def torch_reference_path(module_names=None):
    """Within the block, transformers' linear-attention families run their own PyTorch functions."""
    saved = use_torch_path(module_names)
    try:
        yield
    finally:
        restore(saved)


@contextmanager
def torch_reference():
    """transformers' own forward of every architecture the bridge knows (each adapter's `dispatched`) on its PyTorch
    functions, on any device, within the block: the baseline against which the bridge is
    checked.
    Without it transformers hands the recurrence and the short convolution to fla's Triton kernels or the
    causal-conv1d package whenever those import, which fails on a CPU. Public as `recurscope.torch_reference()`.

        with rs.torch_reference():
            logits = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)(input_ids=tokens).logits
    """
    with torch_reference_path():
        yield
