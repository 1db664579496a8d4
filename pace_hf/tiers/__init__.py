"""Tiered, verified storage for evicted and saved KV: host memory, disk, Valkey.

::

    from pace_hf.tiers import HostTier, DiskTier, ValkeyTier, TieredStore
    store = TieredStore([HostTier(max_bytes=4 << 30), DiskTier("runs/kv"),
                         ValkeyTier("valkey://127.0.0.1:6379", ttl_s=None)], timeout_s=2.0)
    store.put("L3/spill/17", {"value": v, "ref_key": k}, {"layer": 3}, fingerprint=fp, session_id="agent-42")
    tensors, meta = store.get("L3/spill/17", fingerprint=fp, session_id="agent-42")

Modules: ``entry`` (the self-verifying byte format), ``store`` (background writes, ordered verified
reads, promotion, demotion, health), one module per tier (``host``, ``disk``, ``valkey_tier``),
``fingerprint`` (``model_fingerprint``). Each module's docstring says why it is built the way it is.

A tier is any object with ``name``, ``put(key, data)``, ``get(key) -> bytes-like | None``,
``delete(key)``, ``delete_prefix(prefix)`` and ``close()``; optional ``get_many(keys)`` (one batched read)
and ``set_timeout(seconds)`` (the store passes its request timeout); ``durable`` (False: the tier dies with the
process, so a save is not durable there); ``acquire_lease(name, token, ttl_s) -> bool``, ``renew_lease`` and
``release_lease(name, token)`` (the session's writer lease, see ``TieredStore.lease``). A tier raises ``TierUnavailable``
when its backend is down or too slow; any other exception is counted as an error of that request.
"""

from .disk import DiskTier
from .entry import FORMAT_VERSION, decode, encode
from .errors import IntegrityError, LeaseHeld, TierError, TierUnavailable, WriterConflict
from .fingerprint import model_fingerprint
from .host import HostTier
from .store import TieredStore, full_key
from .valkey_tier import ValkeyTier

__all__ = [
    "DiskTier", "FORMAT_VERSION", "HostTier", "IntegrityError", "LeaseHeld", "TierError", "TierUnavailable",
    "TieredStore", "ValkeyTier", "WriterConflict", "decode", "encode", "full_key", "model_fingerprint",
]
