"""The benchmark's arms: one registry of named, composed caches.

Each arm is the library's public cache classes with the run's B and L: a scoring policy (H2O's
cumulative attention, SnapKV's observation window or StreamingLLM's recency), with or without
foresight (a blueprint's bonus, ``PACECache``), with or without bounded positions (``limit``).
Everything else (the runner's ``--arms`` choices and help, the figures' colors and which arms are
the foresight family) reads this registry, and the cache's own constructor is the only check of the
settings (:func:`check_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from transformers import DynamicCache

from pace_hf import Blueprint, H2OCache, ObservationWindow, PACECache, SnapKVCache, StreamingLLMCache


@dataclass(frozen=True)
class ArmSettings:
    """What every evicting arm shares: B (resident tokens per layer and KV head), L (the rotary
    limit of the bounded arms) and, with a store, the most spilled bytes a session keeps there
    (``spill_cap_bytes``; None: all of it)."""

    budget: int = 2048
    limit: int = 8192
    spill_cap_bytes: int | None = None


@dataclass(frozen=True)
class Arm:
    """One arm: its name, what it is (for ``--help``), whether it plans ahead (``foresight``: it takes a
    blueprint) and keeps rotary positions below L (``bounded``), and how it builds its cache."""

    name: str
    summary: str
    foresight: bool
    bounded: bool
    build: Callable[..., object]  # (model or None, blueprint, ArmSettings, **cache kwargs) -> the cache


ARMS: dict[str, Arm] = {}  # in the order the runner plays them and the figures color them


def register(name: str, summary: str, *, foresight: bool = False, bounded: bool = False):
    """Add the decorated builder to :data:`ARMS` under ``name``."""
    def add(build):
        if name in ARMS:
            raise ValueError(f"arm {name!r} is registered twice")
        ARMS[name] = Arm(name, summary, foresight, bounded, build)
        return build

    return add


@register("full", "no eviction (transformers' DynamicCache)")
def _full(model, blueprint, s, **_):
    return DynamicCache(config=model.config if model is not None else None)


@register("h2o", "H2O: cumulative attention")
def _h2o(model, blueprint, s, **kw):
    return H2OCache(model, budget=s.budget, **kw)


@register("snapkv", "SnapKV: the observation window")
def _snapkv(model, blueprint, s, **kw):
    return SnapKVCache(model, budget=s.budget, **kw)


@register("streaming", "StreamingLLM: sinks and the most recent tokens")
def _streaming(model, blueprint, s, **kw):
    return StreamingLLMCache(model, budget=s.budget, **kw)


@register("positions_only", "h2o + L", bounded=True)
def _positions_only(model, blueprint, s, **kw):
    return H2OCache(model, budget=s.budget, limit=s.limit, **kw)


@register("retention_only", "h2o + foresight", foresight=True)
def _retention_only(model, blueprint, s, **kw):
    return PACECache(model, blueprint, budget=s.budget, limit=None, **kw)


@register("pace", "h2o + foresight + L", foresight=True, bounded=True)
def _pace(model, blueprint, s, **kw):
    return PACECache(model, blueprint, budget=s.budget, limit=s.limit, **kw)


@register("snapkv_foresight", "snapkv + foresight", foresight=True)
def _snapkv_foresight(model, blueprint, s, **kw):
    return PACECache(model, blueprint, budget=s.budget, limit=None, scorer=ObservationWindow(), **kw)


@register("streaming_bounded", "streaming + L", bounded=True)
def _streaming_bounded(model, blueprint, s, **kw):
    return StreamingLLMCache(model, budget=s.budget, limit=s.limit, **kw)


@register("snapkv_bounded", "snapkv + L", bounded=True)
def _snapkv_bounded(model, blueprint, s, **kw):
    return SnapKVCache(model, budget=s.budget, limit=s.limit, **kw)


FORESIGHT_ARMS = tuple(a.name for a in ARMS.values() if a.foresight)  # the PACE family: arms that plan ahead
BOUNDED_ARMS = tuple(a.name for a in ARMS.values() if a.bounded)


def make_cache(arm: str, model, blueprint: Blueprint, s: ArmSettings, store=None, session_id: str | None = None):
    """The cache of one arm; every evicting arm shares budget, sinks, recent and schedule. With a
    ``store`` (``pace_hf.tiers.TieredStore``) its evicted tokens are spilled there under ``session_id``."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    kwargs = ({"store": store, "session_id": session_id, "spill_cap_bytes": s.spill_cap_bytes}
              if store is not None else {})
    return ARMS[arm].build(model, blueprint, s, **kwargs)


def check_settings(arm: str, s: ArmSettings) -> str | None:
    """Why the cache of ``arm`` refuses the settings ``s`` (its own constructor's error), or None."""
    try:
        make_cache(arm, None, Blueprint(), s)
    except (ValueError, TypeError) as e:
        return str(e)
    return None
