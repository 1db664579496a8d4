"""Tiered, verified storage for evicted and saved KV: host memory, disk, Valkey.

::

    from pace_hf.tiers import HostTier, DiskTier, ValkeyTier, TieredStore
    store = TieredStore([HostTier(max_bytes=4 << 30), DiskTier("runs/kv"),
                         ValkeyTier("valkey://127.0.0.1:6379", ttl_s=None)], timeout_s=2.0)
    store.put("L3/spill/17", {"value": v, "ref_key": k}, {"layer": 3}, fingerprint=fp, session_id="agent-42")
    tensors, meta = store.get("L3/spill/17", fingerprint=fp, session_id="agent-42")

Modules: ``base`` (``Tier``: what a backend implements, and the capabilities the store reads instead
of its class), ``entry`` (the self-verifying byte format), ``store`` (``TieredStore``: ordered verified
reads, the size report), ``writer`` (the background writer: writes, backpressure, demotion, promotion),
``health`` (a tier's counters and backoff), ``keys`` (the key scheme: a session's namespace), ``lease``
(one writer per session), one module per tier (``host``, ``disk``, ``valkey_tier``), ``spec`` (a store
spelled on a command line, as ``pace-serve --store`` and ``python -m pace_hf.memory`` take it),
``fingerprint`` (``model_fingerprint``). Each module's docstring says why it is built the way it is.

A store keeps what it is given until it is deleted: ``TieredStore.usage()`` reports entries, bytes and
save generations per session and tier, and ``python -m pace_hf.memory list|inspect|delete --store SPEC``
is the same report, and the cleanup, from a shell.
"""

from .base import Tier
from .disk import DiskTier
from .entry import FORMAT_VERSION, decode, encode
from .errors import IntegrityError, LeaseHeld, TierError, TierUnavailable, WriterConflict
from .fingerprint import model_fingerprint
from .host import HostTier
from .keys import full_key
from .spelling import parse_store
from .store import TieredStore
from .valkey_tier import ValkeyTier

__all__ = [
    "DiskTier", "FORMAT_VERSION", "HostTier", "IntegrityError", "LeaseHeld", "Tier", "TierError", "TierUnavailable",
    "TieredStore", "ValkeyTier", "WriterConflict", "decode", "encode", "full_key", "model_fingerprint", "parse_store",
]
