"""Who is asking: API keys mapped to tenants, and the namespace each tenant's sessions live in.

A tenant's sessions are found only by that tenant. Session ids are scoped by tenant (``ada~s1``) in the
store and in memory, and the hash chain that finds a session by its messages is seeded with a secret
per tenant (an HMAC of the server's secret, kept in its store, over the tenant and the request's
``cache_salt``). So tenant B sending tenant A's exact messages lands in a session of B's own: it reuses
nothing of A's, its time to first token is a fresh prefill's, and ``usage.cached_tokens`` is 0.

vLLM's per-request ``cache_salt`` scopes what is found by messages: within a tenant, a conversation is
continued only by requests with its salt. It does not scope a named session: ``X-Session-Id`` names one
session of the tenant, whatever the salt (a client that names its sessions keeps those names apart).

Keys come from a file of ``TENANT KEY`` lines (``#`` comments and blank lines allowed). A key is compared
in constant time against every key the server knows, so the time of a refusal says nothing of how much of
a key was right, and after stripping ASCII whitespace only: a key with any other character around it
(U+00A0, a no-break space) is another key. ``/metrics`` counts every tenant's tokens, so a server with
keys serves it only to the operator's key (``read_key``, ``--metrics-key``).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from ..memory.namespace import TENANT_NAME

MIN_KEY_CHARS = 16
ASCII_SPACE = " \t\n\r\x0b\x0c"  # what str.strip() would strip of ASCII; it also strips U+00A0 and more


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
        digest = hashlib.sha256(key.strip(ASCII_SPACE).encode()).digest()
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known) and scheme.lower() == "bearer":
                found = tenant
        return found


def read_key(path: str | Path) -> str:
    """The one key a file holds (the operator's, for ``/metrics``): at least ``MIN_KEY_CHARS`` characters,
    no whitespace inside."""
    key = Path(path).read_text().strip(ASCII_SPACE)
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"{path}: expected one key of {MIN_KEY_CHARS} characters or more, without whitespace")
    return key


def chain_seed(secret: bytes, tenant: str | None, cache_salt: str | None) -> str:
    """The first link of a tenant's hash chain: "" for the keyless server with no salt (its index stays
    readable across versions), else an HMAC no other tenant can compute."""
    if tenant is None and cache_salt is None:
        return ""
    return hmac.new(secret, f"{tenant or ''}\0{cache_salt or ''}".encode(), hashlib.sha256).hexdigest()


__all__ = ["Tenants", "chain_seed", "read_key"]
