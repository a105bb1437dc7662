"""Hooked models for the linear-attention family, their configuration and their cache."""
from recurscope.interp.models.cache import LayerCache, RecurrentCache
from recurscope.interp.models.config import ModelConfig
from recurscope.interp.models.decoder import RecurrentLM
from recurscope.interp.models.mixers import qed_strength

__all__ = ["LayerCache", "ModelConfig", "RecurrentCache", "RecurrentLM", "qed_strength"]
