"""One spelling of a store on a command line: ``host:BYTES,disk:PATH,valkey://HOST:PORT/DB``.

The server (``pace-serve --store``) and the cleanup command (``python -m pace_hf.memory --store``) both
read it here, so a store named for one is named the same way for the other.
"""

from __future__ import annotations

from collections import Counter

from .base import Tier
from .disk import DiskTier
from .host import HostTier
from .store import TieredStore

SPELLINGS = "host[:BYTES], disk:PATH or valkey://HOST:PORT/DB (also valkeys://, redis://, rediss://, unix://PATH)"
VALKEY_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")


def parse_tiers(spec: str) -> list[Tier]:
    """The tiers ``spec`` names, fastest first (comma-separated parts); a second tier of one kind is
    named ``disk2`` and so on. Raises ``ValueError`` naming the part it cannot read."""
    tiers: list[Tier] = []
    seen: Counter[str] = Counter()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
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
