"""pace_hf: PACE KV-cache management for long agent sessions, as drop-in transformers caches."""

from .blueprint import Blueprint, Span
from .cache import EvictionCache, H2OCache, PACECache, SnapKVCache, StreamingLLMCache
from .scoring import CumulativeAttention, Foresight, ForesightBonus, ObservationWindow, Recency, ScoringPolicy

__all__ = [
    "Blueprint", "Span",
    "EvictionCache", "H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache",
    "ScoringPolicy", "CumulativeAttention", "ObservationWindow", "Recency", "Foresight", "ForesightBonus",
]
