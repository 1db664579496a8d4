"""The memory wing: what a session keeps beside its resident cache.

The cache evicts; the memory keeps what was evicted and brings it back. Modules: ``wing`` (``KVMemory``,
one session's memory, which a cache tells what it evicts), ``spill`` (evicted
tokens by layer and logical page, written to the store's tiers), ``restore`` (planned spans fetched
ahead and merged back into the layers), ``retrieval`` (evicted pages found by what a new turn asks),
``persist`` (save and resume, all or nothing, and the manifest format), and the command line of the
stored sessions (``python -m pace_hf.memory list|inspect|delete --store SPEC``).
"""

from . import wing  # noqa: E402,F401  (registers KVMemory as the memory a cache builds for itself)
