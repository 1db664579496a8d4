"""Retention: a store that holds many sessions stays under a byte cap and an age, whole sessions at a time.

A store keeps what it is given until it is deleted, and a session's save is large (the resident
cache with its fp32 reference keys, plus every evicted token it spilled): 20 one-shot pace-serve
requests of 3.9K tokens on SmolLM2 left 2.5 GB on disk. ``retain`` deletes whole sessions, the least
recently saved first (the manifest records when, ``saved_at``), until the store holds at most
``max_bytes`` and no session's last save is older than ``max_age_s``. A session is deleted under its
writer lease, as ``python -m pace_hf.memory delete`` does: a session being saved by a live writer, and
the ones named in ``keep`` (being served), are never touched, and neither is one whose manifest fails
verification (its age cannot be read, and deleting it would destroy what a repair restores). Deleting part of a session would leave a
save that no longer resumes, so it is never done; a session that is alone larger than the cap is
deleted whole too, unless kept.
"""

from __future__ import annotations

import time

from ..tiers.errors import TierError, WriterConflict
from .persist import MANIFEST_FINGERPRINT, MANIFEST_KEY

RETAIN_IDLE_S, RETAIN_BUSY_S = 5.0, 60.0  # how often a server's retention may scan the store: idle, and between turns


def session_sizes(store) -> dict[str, int]:
    """Bytes per session: what its largest tier holds (a tier below holds a copy, not more)."""
    return {sid: max(row["bytes"] for row in tiers.values()) for sid, tiers in store.usage().items()}


def saved_at(store, session_id: str) -> float | None:
    """When the session's current save was made (0: it has none, or it predates the stamp; None: its
    manifest fails verification)."""
    damaged = {}
    try:
        got = store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=session_id, damaged=damaged)
    except TierError:
        got = None
    if got is None:
        return None if damaged else 0.0
    return float(got[1].get("saved_at", 0.0))


def retain(store, *, max_bytes: int | None = None, max_age_s: float | None = None, keep=(),
           now: float | None = None) -> list[str]:
    """Delete whole sessions, least recently saved first, until ``store`` holds at most ``max_bytes`` and
    none was last saved more than ``max_age_s`` ago; never those in ``keep`` or under a live writer's
    lease. Returns the deleted session ids, in the order deleted."""
    if max_bytes is not None and max_bytes < 0 or max_age_s is not None and max_age_s < 0:
        raise ValueError(f"max_bytes and max_age_s must be >= 0 or None, got max_bytes={max_bytes}, "
                         f"max_age_s={max_age_s}")
    if max_bytes is None and max_age_s is None:
        return []
    now = time.time() if now is None else now
    sizes = session_sizes(store)
    total = sum(sizes.values())
    kept = set(keep)
    dated = {sid: saved_at(store, sid) for sid in sizes if sid not in kept}
    order = sorted((when, sid) for sid, when in dated.items() if when is not None)
    deleted = []
    for when, sid in order:
        too_old = max_age_s is not None and now - when > max_age_s
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            if max_age_s is None:
                break  # the rest are newer and the store is under its cap
            continue
        try:
            with store.lease(sid):
                store.delete_session(sid)
        except WriterConflict:  # a live writer: its session stays
            continue
        total -= sizes[sid]
        deleted.append(sid)
    return deleted


__all__ = ["retain", "saved_at", "session_sizes"]
