"""The hook-point vocabulary: every name, its shape and what patching it means. One table, rendered in the docs.

`StateHookPoint` subclasses TransformerLens's HookPoint, and importing TransformerLens takes seconds (it loads
transformers and datasets), so the class is defined on first access (the module `__getattr__` below): the names,
the table and `hook_name` import with torch alone. It is defined once, so `isinstance` and pickling see one class.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class HookSpec:
    name: str        # template; {l} is the layer
    where: str       # "model", "block", "recurrent", "attention"
    shape: str
    meaning: str
    patch: str       # what replacing it does


HOOK_POINTS: tuple[HookSpec, ...] = (
    HookSpec("hook_embed", "model", "(B, T, D)", "token embeddings", "changes the residual stream from the start"),
    HookSpec("blocks.{l}.hook_resid_pre", "block", "(B, T, D)", "residual stream entering block l", "feeds the block"),
    HookSpec("blocks.{l}.hook_mixer_out", "block", "(B, T, D)", "token mixer output after o_proj", "changes what is added to the residual"),
    HookSpec("blocks.{l}.hook_resid_mid", "block", "(B, T, D)", "residual after the mixer", "feeds the MLP"),
    HookSpec("blocks.{l}.hook_mlp_out", "block", "(B, T, D)", "MLP output", "changes what is added to the residual"),
    HookSpec("blocks.{l}.hook_resid_post", "block", "(B, T, D)", "residual leaving block l", "feeds the next block"),
    HookSpec("blocks.{l}.mixer.hook_q", "recurrent", "(B, T, H_q, K)",
             "query after conv, activation and norm; one per query head (H_q = H, or m H where m query heads read "
             "each state)",
             "changes every readout o_t (and the QED erase, which is built from q)"),
    HookSpec("blocks.{l}.mixer.hook_k", "recurrent", "(B, T, H, K)", "key after conv, activation and norm",
             "changes erase and write directions (the erase vector is built after this hook)"),
    HookSpec("blocks.{l}.mixer.hook_v", "recurrent", "(B, T, H, V)", "value after conv and activation",
             "changes the write value x_t, which is built after this hook"),
    HookSpec("blocks.{l}.mixer.hook_decay", "recurrent", "(B, T, H) or (B, T, H, K)", "log decay g_t",
             "changes the transform T_t; carries forward"),
    HookSpec("blocks.{l}.mixer.hook_erase", "recurrent", "(B, T, H, K)", "erase vector a_t (absent in GLA)",
             "changes the erase factor I - k_t a_t^T; carries forward"),
    HookSpec("blocks.{l}.mixer.hook_erase_gate", "recurrent", "(B, T, H, K)",
             "erase gate b_t = sigmoid(b_proj x) (x2 with negative eigenvalues), GDN-2/QED and RWKV-7 (its iclr) only",
             "changes the erase vector a_t built from it (and QED's gated direction); carries forward"),
    HookSpec("blocks.{l}.mixer.hook_write_key", "recurrent", "(B, T, H, K)", "write direction u_t (= k_t)",
             "replaces only the write: the k_t x_t^T term becomes u_t x_t^T, the erase keeps k_t; carries forward"),
    HookSpec("blocks.{l}.mixer.hook_write_value", "recurrent", "(B, T, H, V)", "write value x_t, so W_t = u_t x_t^T",
             "replaces the written content; carries forward"),
    HookSpec("blocks.{l}.mixer.hook_write_scale", "recurrent", "(B, T, H)", "multiplier of the write (ones)",
             "0 blocks the write while decay and erase still act; carries forward"),
    HookSpec("blocks.{l}.mixer.hook_state", "recurrent", "(B, P, H, K, V)",
             "S_t after step t at the requested state_positions only",
             "replaces S_t of the (batch, head) entries it changes; o_t and every later step continue from it"),
    HookSpec("blocks.{l}.mixer.hook_head_out", "recurrent", "(B, T, H_q, V)",
             "query-time output o_t = scale S_t^T q_t, before norm and gate; query head h m + j reads state h",
             "changes only that readout; the state is untouched"),
    HookSpec("blocks.{l}.mixer.hook_z", "recurrent", "(B, T, H_q, V)", "readout after norm and gate, before o_proj, per query head",
             "changes only that readout"),
    HookSpec("blocks.{l}.mixer.hook_q", "attention", "(B, T, H, D)", "query after RoPE", "changes attention scores"),
    HookSpec("blocks.{l}.mixer.hook_k", "attention", "(B, T, Hkv, D)", "key after RoPE (new tokens)", "also changes the KV cache"),
    HookSpec("blocks.{l}.mixer.hook_v", "attention", "(B, T, Hkv, D)", "value (new tokens)", "also changes the KV cache"),
    HookSpec("blocks.{l}.mixer.hook_pattern", "attention", "(B, H, Tq, Tk)", "softmax attention weights", "changes the mix of values"),
    HookSpec("blocks.{l}.mixer.hook_head_out", "attention", "(B, T, H, D)", "per-head output before o_proj", "changes only that output"),
)


def _define_state_hook_point() -> type:
    from transformer_lens.hook_points import HookPoint

    class StateHookPoint(HookPoint):
        """`hook_state`: fires on S_t at the positions a run requested, and names them in `positions` while it
        fires, so that a hook can tell which slice of its (B, P, H, K, V) input holds which step."""

        def __init__(self):
            super().__init__()
            self.positions: tuple[int, ...] = ()

    StateHookPoint.__qualname__ = "StateHookPoint"   # pickle finds it as recurscope.hooks.points.StateHookPoint
    return StateHookPoint


_DEFINE_LOCK = threading.Lock()


def __getattr__(name: str):
    if name == "StateHookPoint":
        with _DEFINE_LOCK:   # two threads' first access must still give one class
            if "StateHookPoint" not in globals():
                globals()["StateHookPoint"] = _define_state_hook_point()
        return globals()["StateHookPoint"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: TransformerLens's names for points that exist here under another name: its patching sweeps and cache shorthands
#: (`get_act_patch_attn_out`, `cache["attn_out", l]`) read "blocks.{l}.hook_attn_out", the token mixer's output.
TL_ALIASES = {"hook_attn_out": "hook_mixer_out"}


def canonical_name(name: str) -> str:
    """The project's name for a hook name given in TransformerLens's vocabulary (TL_ALIASES); others unchanged."""
    head, _, last = name.rpartition(".")
    if last in TL_ALIASES and head.startswith("blocks.") and head.count(".") == 1:
        return f"{head}.{TL_ALIASES[last]}"
    return name


def is_intercepted(point: nn.Module) -> bool:
    """Whether anything can see or change what this hook point returns, or asks for its gradient: a forward hook
    (TransformerLens's hooks and caches, plain torch hooks), a backward hook (TransformerLens's dir="bwd",
    `run_with_cache(incl_bwd=True)`) or a replaced `forward` (nnsight installs its controller that way). A point
    nobody intercepts returns its input unchanged, so the model can skip looking for patches there."""
    module = nn.modules.module
    global_hooks = (getattr(module, "_global_forward_hooks", None)            # torch's register_module_forward_hook
                    or getattr(module, "_global_backward_hooks", None)
                    or getattr(module, "_global_backward_pre_hooks", None))
    return (bool(point._forward_hooks) or bool(point._backward_hooks) or bool(point._backward_pre_hooks)
            or "forward" in point.__dict__ or bool(global_hooks))


def hook_name(point: str, layer: int | None = None) -> str:
    """E.g. hook_name("hook_state", 3) -> "blocks.3.mixer.hook_state"; block hooks and hook_embed likewise."""
    for spec in HOOK_POINTS:
        if spec.name.rsplit(".", 1)[-1] == point:
            if "{l}" in spec.name:
                if layer is None:
                    raise ValueError(f"{point} is a per-layer hook: pass layer")
                return spec.name.format(l=layer)
            return spec.name
    raise ValueError(f"unknown hook point {point!r}; known: {sorted({s.name.rsplit('.', 1)[-1] for s in HOOK_POINTS})}")


def names_for(model) -> set[str]:
    """Every documented hook name this model should have, given which layers are recurrent."""
    out = set()
    recurrent = set(model.recurrent_layers)
    absent = set(model.family.absent_hooks)   # the family's spec says which points it lacks (GLA: no erase)
    for spec in HOOK_POINTS:
        if spec.where == "model":
            out.add(spec.name)
            continue
        for layer in range(model.cfg.num_hidden_layers):
            if spec.where == "block" or (spec.where == "recurrent" and layer in recurrent) or \
                    (spec.where == "attention" and layer not in recurrent):
                if spec.where in ("recurrent", "block") and spec.name.rsplit(".", 1)[-1] in absent:
                    continue
                out.add(spec.name.format(l=layer))
    return out


def render_markdown() -> str:
    rows = ["| hook | in | shape | what it holds | patching it |", "|---|---|---|---|---|"]
    for s in HOOK_POINTS:
        rows.append(f"| `{s.name}` | {s.where} | {s.shape} | {s.meaning} | {s.patch} |")
    return "\n".join(rows)
