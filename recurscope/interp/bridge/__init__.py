"""The transformers bridge: Qwen3.5 (dense, MoE, multimodal layout), Qwen3-Next, OLMo-hybrid, Kimi-Linear, Mamba-2 and
its hybrids (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Zamba2) checkpoints in transformers' format, on recurscope's
hooks, cache edits, interventions and CLI. `load_model` sends a transformers checkpoint here (see loader.py)."""
from recurscope.interp.bridge.families import BRIDGE_FAMILIES, bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgeConfig, BridgedLM, TransformersBridge

__all__ = ["BRIDGE_FAMILIES", "BridgeConfig", "BridgedLM", "TransformersBridge", "bridge_family", "load_transformers",
           "supported_model_types"]


def load_transformers(*args, **kwargs):
    from recurscope.interp.bridge.loader import load_transformers as load

    return load(*args, **kwargs)
