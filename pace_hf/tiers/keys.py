"""The key scheme: the key a tier sees for a caller's key and session, and back.

Callers pass short keys ("L3/spill/17") and a session id; the store namespaces them as
``pace:{quote(session_id)}:{key}`` (``full_key``) before any tier sees them, so sessions never collide and
``delete_session`` drops one with a prefix delete. (``quote`` escapes ``:`` and ``%`` so the session id
cannot leak into the key part.) Keys must not contain NUL (the Valkey tier names its chunks with it).

``split_key`` reads a full key back into ``(session_id, key)``; ``generation_of`` finds the save
generation a key belongs to (``@g17-3fa2c1``) and ``generation_order`` sorts generations, for the size
report (``TieredStore.usage``). A key is all a
tier sees of the store, so the scheme is written once, here, apart from the store that uses it.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

KEY_PREFIX = "pace"


def full_key(key: str, session_id: str) -> str:
    """The key the tiers see: ``pace:{quote(session_id)}:{key}``."""
    if not isinstance(key, str) or not isinstance(session_id, str):
        raise TypeError(f"key and session_id are str, got {type(key).__name__} {key!r} and "
                        f"{type(session_id).__name__} {session_id!r}")
    if "\x00" in key or "\x00" in session_id:
        raise ValueError("keys and session ids must not contain NUL")
    return f"{KEY_PREFIX}:{quote(session_id, safe='')}:{key}"


def split_key(fk: str) -> tuple[str, str] | None:
    """``(session_id, key)`` of a full key, or ``None`` for a key the store did not make."""
    head, sep, rest = fk.partition(":")
    quoted, sep2, key = rest.partition(":")
    if head != KEY_PREFIX or not sep or not sep2:
        return None
    return unquote(quoted), key


def generation_of(key: str) -> str | None:
    """The save generation a key belongs to (``L3/state@g17-3fa2c1`` -> ``g17-3fa2c1``), if any."""
    name, sep, gen = key.rpartition("@")
    return gen if sep and name else None


def generation_order(gen: str) -> tuple:
    """Sort key of generations ``g<serial>-<tag>``: by serial number."""
    head = gen.split("-", 1)[0]
    return (0, int(head[1:]), gen) if head[:1] == "g" and head[1:].isdigit() else (1, 0, gen)
