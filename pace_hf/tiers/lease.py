"""The writer lease: one writer per session across every tier that keeps leases.

``TieredStore.lease(session_id)`` takes the session's writer lease on every tier that keeps leases (a flock'd
file on disk, ``SET NX PX`` in Valkey, a table in host memory) and raises ``LeaseHeld`` when another writer
holds one: two writers never interleave the entries of one save.

The lease is taken and released on the tiers directly, beside the store's queued writes; the store only
keeps what a tier failed to release and counts a tier's failure to take it.
"""

from __future__ import annotations

import logging
import secrets

from .errors import LeaseHeld, TierError

log = logging.getLogger("pace_hf.tiers")


class Lease:
    """A session's writer lease on every tier that keeps leases (see ``TieredStore.lease``).

    ``unreleased``: ``{(tier name, lease name): token}`` of this store's leases that a tier failed to
    release (it was down): they are released before the lease is taken again, else the writer that held
    them would find its own lease held by "another writer" until it expires.

    ``count_error(tier name)``: called when a tier fails to take the lease (not when another writer
    holds it). The store counts it in the tier's ``errors``, as any failed request: a save that sees the
    count grow rewrites its spill entries to every durable tier, since a tier that failed may have come
    back without them (``pace_hf.memory.persist``)."""

    def __init__(self, tiers: list, name: str, ttl_s: float, unreleased: dict, count_error):
        self.name, self.ttl_s, self.token = name, ttl_s, secrets.token_hex(8)
        self._held: list = []
        self._unreleased = unreleased
        for tier in tiers:
            stale = unreleased.pop((tier.name, name), None)
            if stale is not None:
                self._release_on(tier, stale)
            try:
                ok = tier.acquire_lease(name, self.token, ttl_s)
            except BaseException as e:
                self.release()
                if isinstance(e, Exception):
                    count_error(tier.name)
                if isinstance(e, TierError) or not isinstance(e, Exception):
                    raise
                raise TierError(f"{name}: tier {tier.name} cannot take the lease: {e!r}") from e
            if not ok:
                self.release()
                raise LeaseHeld(f"{name}: another writer holds this session's lease on tier {tier.name}; "
                                "one writer per session (wait for its save, or use another session id)")
            self._held.append(tier)

    def renew(self) -> None:
        """Extend the lease; raise ``LeaseHeld`` if a tier no longer holds it for us (it expired)."""
        for tier in self._held:
            if not tier.renew_lease(self.name, self.token, self.ttl_s):
                raise LeaseHeld(f"{self.name}: the lease on tier {tier.name} expired and may be another "
                                f"writer's now (a save took longer than its {self.ttl_s} s)")

    def release(self) -> None:
        held, self._held = self._held, []
        for tier in reversed(held):
            self._release_on(tier, self.token)

    def _release_on(self, tier, token: str) -> None:
        try:
            tier.release_lease(self.name, token)
        except Exception:  # noqa: BLE001 - released at the next lease, or it expires with its TTL
            self._unreleased[(tier.name, self.name)] = token
            log.warning("pace_hf.tiers: could not release lease %s on tier %s", self.name, tier.name)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
