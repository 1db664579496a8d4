"""Tier health: the per-tier counters and the backoff state of a tier that failed.

A tier that raises ``TierUnavailable`` is unhealthy until ``retry_at``; ``backoff_s`` is the wait after
its next failure (doubling, capped by the store). The store keeps one ``_TierState`` per tier.
"""

from __future__ import annotations

_TIER_COUNTERS = ("bytes_written", "bytes_read", "hits", "misses", "integrity_failures", "errors",
                  "write_seconds", "read_seconds", "evicted", "demoted", "promoted", "skipped")


class _TierState:
    def __init__(self, backoff_s: float):
        self.stats: dict[str, float | int] = {k: (0.0 if k.endswith("seconds") else 0) for k in _TIER_COUNTERS}
        self.healthy = True
        self.retry_at = 0.0
        self.backoff_s = backoff_s
        self.last_error: str | None = None
