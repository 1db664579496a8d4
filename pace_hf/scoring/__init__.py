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


def describe(policy: ScoringPolicy) -> dict:
    """A JSON-able description of a policy (for ``cache.save()``); :func:`rebuild` inverts it."""
    import dataclasses

    if isinstance(policy, Foresight):
        if type(policy.bonus) is not ForesightBonus:
            raise ValueError("a custom foresight bonus cannot be saved: pass scoring= again when resuming")
        return {"type": "Foresight", "inner": describe(policy.inner), "blueprint": policy.blueprint.to_dicts(),
                "phi": policy.bonus.phi}
    if type(policy) not in _SAVABLE:
        raise ValueError(f"{type(policy).__name__} cannot be saved: pass scoring= again when resuming")
    return {"type": type(policy).__name__, **dataclasses.asdict(policy)}


def rebuild(description: dict) -> ScoringPolicy:
    from ..blueprint import Blueprint

    kind = description.get("type")
    if kind == "Foresight":
        return Foresight(rebuild(description["inner"]), Blueprint.from_dicts(description["blueprint"]),
                         ForesightBonus(description["phi"]))
    fields = {k: v for k, v in description.items() if k not in ("type", "needs_attention")}  # old saves held it
    return {c.__name__: c for c in _SAVABLE}[kind](**fields)


_SAVABLE = (CumulativeAttention, ObservationWindow, Recency)
