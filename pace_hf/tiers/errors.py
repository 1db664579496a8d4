"""Errors of the tiered store.

``TierError`` is the one exception a caller has to know: ``strict=True`` stores raise it (or a subclass)
where a non-strict store counts the failure and carries on. ``TierUnavailable`` is what a tier raises when
its backend is down or too slow (the store then marks the tier unhealthy and backs off);
``LeaseHeld`` is what a second writer of one session gets; ``IntegrityError`` is what decoding raises for an entry that must not be loaded (corrupt, truncated,
foreign or stale). Its ``kind`` says which, and is also the key of the once-per-kind log line.
"""

from __future__ import annotations


class TierError(RuntimeError):
    """A tier operation failed (strict stores raise this; non-strict ones count it)."""


class TierUnavailable(TierError):
    """The tier's backend is down or did not answer within the request timeout."""


class WriterConflict(TierError):
    """A second writer of one session: it holds the session's lease, or saved since this one resumed."""


class LeaseHeld(WriterConflict):
    """Another writer holds the session's writer lease (or ours expired): one writer per session."""


class IntegrityError(TierError):
    """An entry failed verification and must not be loaded.

    ``kind`` is one of ``"corrupt"`` (bad magic, checksum mismatch, malformed header),
    ``"truncated"`` (fewer bytes than the header promises), ``"foreign"`` (another model's fingerprint)
    or ``"stale"`` (another format version, another session id or another key).
    """

    KINDS = ("corrupt", "truncated", "foreign", "stale")

    def __init__(self, kind: str, message: str):
        if kind not in self.KINDS:
            raise ValueError(f"unknown integrity failure kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind
