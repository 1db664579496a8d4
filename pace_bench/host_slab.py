"""The host's kernel slab, read from ``/proc/meminfo``: what a sandboxed run may grow on the host
(negative dentries, inodes) without owning it. The sandbox's tests and ``bench/sandbox_cost.py`` both
measure a run by it, before, at its peak while the run lasts, and after."""

from __future__ import annotations

import threading


SLAB = ("SReclaimable", "SUnreclaim")
KERNEL = SLAB + ("PageTables",)  # slab and page tables: what a run's mappings grow


def slab_mb(fields: tuple[str, ...] = SLAB) -> float:
    """The host's kernel slab (SReclaimable + SUnreclaim), in MB; or the sum of other ``/proc/meminfo``
    ``fields`` (:data:`KERNEL` adds the page tables)."""
    with open("/proc/meminfo") as f:
        found = dict(line.split(":", 1) for line in f)
    return sum(int(found[k].split()[0]) for k in fields) / 1024



class SlabPeak:
    """``with SlabPeak() as slab: ...``: ``slab.before`` on entry, and ``slab.peak``, the highest reading
    while the block ran (of the slab, or of the ``fields`` that :func:`slab_mb` sums), sampled every
    ``interval`` seconds by a thread (a run's growth can be freed before it ends, so the reading after
    would miss it)."""

    def __init__(self, interval: float = 0.02, fields: tuple[str, ...] = SLAB):
        self.interval, self.fields = interval, fields
        self.before = self.peak = 0.0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, slab_mb(self.fields))
            self._stop.wait(self.interval)

    def __enter__(self) -> SlabPeak:
        self.before = self.peak = slab_mb(self.fields)
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()
        self.peak = max(self.peak, slab_mb(self.fields))

    @property
    def peak_growth(self) -> float:
        """MB the slab rose above its reading on entry, at its highest."""
        return self.peak - self.before
