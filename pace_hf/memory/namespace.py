"""Whose session an id names: a tenant's sessions are stored as ``TENANT~NAME``.

pace-serve scopes every session id by the tenant whose key asked for it (``pace_hf.serve.tenants``), and
the store command (``python -m pace_hf.memory --tenant``) reads and deletes within one tenant the same
way, so both spell a tenant's namespace from here.
"""

from __future__ import annotations

import re

TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
SERVE_INDEX = "pace-serve-index"  # pace-serve's conversation index and secret: stored as a session, but none
SCOPE = "~"  # between a tenant and its session's name (a tenant name never holds it)


def scoped(tenant: str | None, name: str) -> str:
    """The store's id of a tenant's session ``name`` (unscoped for the keyless server's one namespace)."""
    return name if tenant is None else f"{tenant}{SCOPE}{name}"


def unscoped(tenant: str | None, session_id: str) -> str:
    """What the tenant calls its session (the ``X-Session-Id`` it sent or gets back)."""
    return session_id if tenant is None else session_id.removeprefix(f"{tenant}{SCOPE}")


def belongs_to(tenant: str, session_id: str) -> bool:
    return session_id.startswith(f"{tenant}{SCOPE}")
