"""Hooked models for the linear-attention family, their configuration and their cache."""
from recurscope.interp.models.cache import LayerCache, RecurrentCache
from recurscope.interp.models.config import ModelConfig
from recurscope.interp.models.decoder import RecurrentLM

__all__ = ["LayerCache", "ModelConfig", "RecurrentCache", "RecurrentLM"]
