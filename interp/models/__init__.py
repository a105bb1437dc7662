"""Hooked models for the linear-attention family, their configuration and their cache."""
from interp.models.cache import LayerCache, RecurrentCache
from interp.models.config import ModelConfig
from interp.models.decoder import RecurrentLM

__all__ = ["LayerCache", "ModelConfig", "RecurrentCache", "RecurrentLM"]
