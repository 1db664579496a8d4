"""pace_hf: PACE KV-cache management for long agent sessions, as drop-in transformers caches.

The caches (``PACECache`` and the baselines), their scoring policies and the blueprint are here, and so
are the agent session (``PACESession``), the tiered store that evicted and saved KV goes to
(``TieredStore`` over ``HostTier``, ``DiskTier``, ``ValkeyTier``) and the planner that finds a session's
blueprint in its text (``SymbolPlanner``).
"""

from importlib.metadata import PackageNotFoundError, version

from .blueprint import Blueprint, Span
from .cache import EvictionCache, H2OCache, PACECache, SnapKVCache, StreamingLLMCache
from . import memory  # noqa: F401  (the memory a cache with store= builds; see pace_hf.memory.wing)
from .planner import SymbolPlanner
from .scoring import CumulativeAttention, Foresight, ForesightBonus, ObservationWindow, Recency, ScoringPolicy
from .session import PACESession
from .tiers import DiskTier, HostTier, TieredStore, ValkeyTier

try:
    __version__ = version("pace_hf")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "Blueprint", "Span",
    "EvictionCache", "H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache",
    "ScoringPolicy", "CumulativeAttention", "ObservationWindow", "Recency", "Foresight", "ForesightBonus",
    "PACESession", "SymbolPlanner",
    "TieredStore", "HostTier", "DiskTier", "ValkeyTier",
]
