"""transformers' own PyTorch path for the linear-attention families.

transformers dispatches `torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, ... to fla's (Triton) or the
causal-conv1d package's kernels whenever those import. Parity tests compare against transformers' torch functions,
and a CPU needs them anyway; `torch_reference_path()` swaps the dispatching wrappers back to the functions they wrap.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager

#: modeling modules of the families the bridge knows, and the kernel functions each dispatches.
DISPATCHED = {
    "transformers.models.qwen3_5.modeling_qwen3_5": ("causal_conv1d_update", "causal_conv1d_fn",
                                                      "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": ("causal_conv1d_update", "causal_conv1d_fn",
                                                              "torch_chunk_gated_delta_rule",
                                                              "torch_recurrent_gated_delta_rule"),
    "transformers.models.qwen3_next.modeling_qwen3_next": ("causal_conv1d_update", "causal_conv1d_fn",
                                                            "torch_chunk_gated_delta_rule",
                                                            "torch_recurrent_gated_delta_rule"),
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid": ("causal_conv1d_update", "causal_conv1d_fn",
                                                              "torch_chunk_gated_delta_rule",
                                                              "torch_recurrent_gated_delta_rule"),
    "transformers.models.kimi_linear.modeling_kimi_linear": ("causal_conv1d_update", "causal_conv1d_fn",
                                                              "recurrent_kimi_delta_attention",
                                                              "chunk_kimi_delta_attention"),
    "transformers.models.mamba2.modeling_mamba2": ("causal_conv1d_update", "causal_conv1d_fn",
                                                    "mamba2_split_conv1d_scan_combined",
                                                    "mamba2_selective_state_update", "mamba2_chunk_scan"),
    "transformers.models.bamba.modeling_bamba": ("causal_conv1d_update", "causal_conv1d_fn",
                                                  "mamba2_split_conv1d_scan_combined",
                                                  "mamba2_selective_state_update", "mamba2_chunk_scan"),
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": ("causal_conv1d_update", "causal_conv1d_fn",
                                                                        "mamba2_split_conv1d_scan_combined",
                                                                        "mamba2_selective_state_update",
                                                                        "mamba2_chunk_scan"),
    "transformers.models.falcon_h1.modeling_falcon_h1": ("causal_conv1d_update", "causal_conv1d_fn",
                                                          "mamba2_split_conv1d_scan_combined",
                                                          "mamba2_selective_state_update", "mamba2_chunk_scan"),
    "transformers.models.zamba2.modeling_zamba2": ("causal_conv1d_update", "causal_conv1d_fn",
                                                    "mamba2_split_conv1d_scan_combined",
                                                    "mamba2_selective_state_update", "mamba2_chunk_scan"),
    "transformers.models.nemotron_h.modeling_nemotron_h": ("causal_conv1d_update", "causal_conv1d_fn",
                                                            "mamba2_split_conv1d_scan_combined",
                                                            "mamba2_selective_state_update", "mamba2_chunk_scan"),
}


def _torch_functions(module):
    out = {}
    for name in DISPATCHED[module.__name__]:
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
    for module_name in module_names or DISPATCHED:
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
    """transformers' own forward of every family the bridge knows (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi-Linear,
    Mamba-2) on its PyTorch functions, on any device, within the block: the baseline against which the bridge is
    checked.
    Without it transformers hands the recurrence and the short convolution to fla's Triton kernels or the
    causal-conv1d package whenever those import, which fails on a CPU. Public as `recurscope.torch_reference()`.

        with rs.torch_reference():
            logits = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)(input_ids=tokens).logits
    """
    with torch_reference_path():
        yield
