"""One spelling of a store on a command line: ``host:BYTES,disk:PATH,valkey://HOST:PORT/DB``.

A Valkey Cluster is ``valkey+cluster://HOST:PORT,HOST:PORT,...``: the ``HOST:PORT`` parts that follow it
are its nodes (so a node must not be spelled ``host:N`` or ``disk:...``; put such a node first).

The server (``pace-serve --store``) and the cleanup command (``python -m pace_hf.memory --store``) both
read it here, so a store named for one is named the same way for the other.
"""

from __future__ import annotations

from collections import Counter

from .base import Tier
from .disk import DiskTier
from .host import HostTier
from .store import TieredStore

SPELLINGS = ("host[:BYTES], disk:PATH, valkey://HOST:PORT/DB (also valkeys://, redis://, rediss://, unix://PATH) "
             "or valkey+cluster://HOST:PORT,HOST:PORT,...")
VALKEY_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix", "valkey+cluster")


def _parts(spec: str) -> list[str]:
    """The comma-separated parts, a cluster URL's further ``HOST:PORT`` nodes joined back to it."""
    parts: list[str] = []
    for p in (p.strip() for p in spec.split(",") if p.strip()):
        kind, _, arg = p.partition(":")
        if (parts and parts[-1].startswith("valkey+cluster://") and arg.isdigit()
                and kind not in ("host", "disk") and "/" not in kind):
            parts[-1] += "," + p
        else:
            parts.append(p)
    return parts


def parse_tiers(spec: str) -> list[Tier]:
    """The tiers ``spec`` names, fastest first (comma-separated parts); a second tier of one kind is
    named ``disk2`` and so on. Raises ``ValueError`` naming the part it cannot read."""
    tiers: list[Tier] = []
    seen: Counter[str] = Counter()
    for part in _parts(spec):
        kind, _, arg = part.partition(":")
        family = "valkey" if kind in VALKEY_SCHEMES else kind
        seen[family] += 1
        name = {"name": f"{family}{seen[family]}"} if seen[family] > 1 else {}
        if kind == "disk" and arg:
            tiers.append(DiskTier(arg, **name))
        elif kind == "host" and (not arg or arg.isdigit()):
            tiers.append(HostTier(max_bytes=int(arg), **name) if arg else HostTier(**name))
        elif kind in VALKEY_SCHEMES and arg.startswith("//"):
            from .valkey_tier import ValkeyTier  # needs pace_hf[valkey]

            tiers.append(ValkeyTier(part, **name))
        else:
            raise ValueError(f"bad store part {part!r}: give {SPELLINGS}")
    if not tiers:
        raise ValueError(f"the store {spec!r} names no tier: give {SPELLINGS}")
    return tiers


def parse_store(spec: str, **store_kwargs) -> TieredStore:
    """A ``TieredStore`` over the tiers ``spec`` names; ``store_kwargs`` go to ``TieredStore``."""
    return TieredStore(parse_tiers(spec), **store_kwargs)
