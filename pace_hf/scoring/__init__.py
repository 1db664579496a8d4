"""Eviction scoring policies, one per file, behind the ``ScoringPolicy`` contract (``base.py``).

- ``CumulativeAttention``: H2O, attention received from every query so far.
- ``ObservationWindow``: SnapKV, attention of each forward's last queries, max-pooled.
- ``Recency``: StreamingLLM, newest first.
- ``Foresight(inner, blueprint)``: PACE's bonus for planned spans, around any of the above.
"""

from .base import ScoringPolicy
from .cumulative import CumulativeAttention
from .foresight import Foresight, ForesightBonus
from .observation_window import ObservationWindow
from .recency import Recency

__all__ = ["ScoringPolicy", "CumulativeAttention", "ObservationWindow", "Recency", "Foresight", "ForesightBonus"]
