"""Eviction scoring policies, one per file. Each turns attention probabilities into per-token scores.

A policy is a small dataclass with:
- ``needs_attention``: whether the attention pass must compute probabilities at all;
- ``query_window(q_len)``: how many of the chunk's last queries to score with (None = all);
- ``update(old, fresh, n_new)``: the new per-token scores, given the old scores of the stored tokens
  (``[..., n_old]``) and the fresh column sums over all ``n_old + n_new`` keys of this forward;
- ``static_scores(logical)``: for policies that need no attention, scores from positions only.
"""

from .cumulative import CumulativeAttention
from .observation_window import ObservationWindow
from .recency import Recency

__all__ = ["CumulativeAttention", "ObservationWindow", "Recency"]
