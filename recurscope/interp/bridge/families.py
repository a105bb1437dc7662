"""The registry of the transformers architectures the bridge loads: one adapter each, in `bridge/adapters/` (its
FamilySpec, model types, block layout, cache edits and torch-path entries; docs/adding_a_family.md)."""
from __future__ import annotations

from typing import Optional

from recurscope.interp.bridge.adapters import BridgeAdapter, adapters

__all__ = ["BridgeAdapter", "adapters", "adapter_for", "bridge_family", "render_markdown", "supported_model_types"]


def __getattr__(name: str):
    if name == "BRIDGE_FAMILIES":   # the earlier name of adapters()
        return adapters()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bridge_family(model_type) -> Optional[BridgeAdapter]:
    """The adapter of a config.json model_type, or None."""
    for adapter in adapters():
        if model_type in adapter.model_types:
            return adapter
    return None


def adapter_for(raw_config: dict) -> Optional[BridgeAdapter]:
    """The adapter that claims a config.json (BridgeAdapter.claims), or None."""
    for adapter in adapters():
        if adapter.claims(raw_config):
            return adapter
    return None


def supported_model_types() -> tuple:
    return tuple(t for adapter in adapters() for t in adapter.model_types)


def render_markdown() -> str:
    """The architecture table of docs/adding_a_family.md: one row per adapter."""
    rows = ["| model_type | architecture | adapter | mixer | q | k | x | g | a | hooks it lacks |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for adapter in adapters():
        s, k = adapter.spec, adapter.spec.kernel_inputs
        module = type(adapter).__module__.rsplit(".", 1)[-1]
        rows.append(f"| {', '.join(f'`{t}`' for t in adapter.model_types)} | {s.title} | "
                    f"`adapters/{module}.py` | `{s.mixer}` | {k['q']} | {k['k']} | {k['x']} | {k['g']} | {k['a']} | "
                    f"{', '.join(sorted(s.absent_hooks)) or '—'} |")
    return "\n".join(rows)
