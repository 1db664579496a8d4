"""Who is asking: API keys mapped to tenants, and the namespace each tenant's sessions live in.

A tenant's sessions are found only by that tenant. Session ids are scoped by tenant (``ada~s1``) in the
store and in memory, and the hash chain that finds a session by its messages is seeded with a secret
per tenant (an HMAC of the server's secret, kept in its store, over the tenant and the request's
``cache_salt``). So tenant B sending tenant A's exact messages lands in a session of B's own: it reuses
nothing of A's, its time to first token is a fresh prefill's, and ``usage.cached_tokens`` is 0. vLLM's
per-request ``cache_salt`` isolates further inside a tenant.

Keys come from a file of ``TENANT KEY`` lines (``#`` comments and blank lines allowed). A key is compared
in constant time against every key the server knows, so the time of a refusal says nothing of how much of
a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from ..memory.namespace import TENANT_NAME

MIN_KEY_CHARS = 16


class Tenants:
    """``{key: tenant}``, checked as the file is read: a short key, a key given twice or a bad tenant name
    is refused, naming its line."""

    def __init__(self, keys: dict[str, str]):
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]
        self.names = sorted(set(keys.values()))

    @classmethod
    def from_file(cls, path: str | Path) -> "Tenants":
        keys: dict[str, str] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'TENANT KEY', got {len(parts)} fields")
            tenant, key = parts
            if not TENANT_NAME.match(tenant):
                raise ValueError(f"{path}:{n}: tenant names are 1-32 of A-Z a-z 0-9 _ . -, got {tenant!r}")
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"{path}:{n}: tenant {tenant!r}'s key is shorter than {MIN_KEY_CHARS} characters")
            if key in keys:
                raise ValueError(f"{path}:{n}: this key is also tenant {keys[key]!r}'s: one key, one tenant")
            keys[key] = tenant
        if not keys:
            raise ValueError(f"{path}: no 'TENANT KEY' line")
        return cls(keys)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant whose key an ``Authorization: Bearer KEY`` header carries, or None. Every known key is
        compared, each in constant time, whatever matched before."""
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known) and scheme.lower() == "bearer":
                found = tenant
        return found


def chain_seed(secret: bytes, tenant: str | None, cache_salt: str | None) -> str:
    """The first link of a tenant's hash chain: "" for the keyless server with no salt (its index stays
    readable across versions), else an HMAC no other tenant can compute."""
    if tenant is None and cache_salt is None:
        return ""
    return hmac.new(secret, f"{tenant or ''}\0{cache_salt or ''}".encode(), hashlib.sha256).hexdigest()


__all__ = ["Tenants", "chain_seed"]
