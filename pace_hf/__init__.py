"""pace_hf: PACE KV-cache management for long agent sessions, as drop-in transformers caches."""

from .blueprint import Blueprint, ForesightBonus, Span
from .cache import EvictionCache, H2OCache, PACECache, SnapKVCache, StreamingLLMCache

__all__ = [
    "Blueprint", "Span", "ForesightBonus",
    "EvictionCache", "H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache",
]
