"""``Quotas``: what a cache's token budget is split into, derived in one place.

Every layer that evicts keeps ``budget`` tokens per KV head after each forward; of them the first
``sinks`` and the last ``recent`` are never evicted. A turn's planned restores (the planner's) and its
retrieved pages (``pace_hf.memory.retrieval``) each take at most a share of the budget, so that what a
turn brings back never pushes out the rest of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..blueprint import as_index

DEFAULT_SINKS = 4
DEFAULT_RECENT = 128


@dataclass(frozen=True)
class Quotas:
    budget: int = 2048
    sinks: int = DEFAULT_SINKS
    recent: int = DEFAULT_RECENT

    def __post_init__(self):
        budget, sinks, recent = (as_index(v, n) for v, n in ((self.budget, "budget"), (self.sinks, "sinks"),
                                                              (self.recent, "recent")))
        if budget <= 0 or sinks < 0 or recent < 0:
            raise ValueError(f"budget must be > 0, and sinks and recent >= 0 (got budget={budget}, sinks={sinks}, "
                             f"recent={recent})")
        if budget < sinks + recent:
            raise ValueError(f"budget={budget} cannot hold the protected sinks + recent = {sinks} + {recent} = "
                             f"{sinks + recent} tokens: pass a smaller recent= (the default is {DEFAULT_RECENT}), e.g. "
                             f"recent={max(0, budget // 4)}, or budget >= {sinks + recent}")
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "sinks", sinks)
        object.__setattr__(self, "recent", recent)

    @property
    def planned_restore(self) -> int:
        """The most tokens per KV head a planner restores for one turn: half the budget."""
        return self.budget // 2

    @property
    def retrieval_share(self) -> int:
        """The most tokens per KV head one turn's retrieval restores: a quarter of the budget."""
        return max(1, self.budget // 4)


__all__ = ["DEFAULT_RECENT", "DEFAULT_SINKS", "Quotas"]
