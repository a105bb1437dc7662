"""The transformers bridge: Qwen3.5 (dense, MoE, multimodal layout), Qwen3-Next, OLMo-hybrid, Kimi-Linear, Mamba-2 and
its hybrids (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Zamba2), MiniMax and xLSTM checkpoints in transformers'
format, on recurscope's hooks, cache edits, interventions and CLI; one adapter per architecture (`adapters/`).
`load_model` sends a transformers checkpoint here (see loader.py)."""
from recurscope.interp.bridge.families import adapters, bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgeConfig, BridgedLM, TransformersBridge

__all__ = ["BRIDGE_FAMILIES", "BridgeConfig", "BridgedLM", "TransformersBridge", "adapters", "bridge_family",
           "load_transformers", "supported_model_types"]


def __getattr__(name: str):
    if name == "BRIDGE_FAMILIES":   # the earlier name of adapters()
        return adapters()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_transformers(*args, **kwargs):
    from recurscope.interp.bridge.loader import load_transformers as load

    return load(*args, **kwargs)
