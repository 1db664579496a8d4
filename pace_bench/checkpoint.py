"""Checkpoints of a running (arm, session) pair, so that a long prefill survives a kill.

A 1M-token session prefills for hours. With ``pace-bench --checkpoint-every N`` the pair's cache and
the runner's place in the session are saved every ``N`` prefill chunks, as ONE save
(``pace_hf.memory.persist``: the runner's state is an attachment of the cache's generation, so a kill can
never leave a cache of one save with the runner state of another). ``--resume`` continues the pair
from its last save instead of from scratch.

The runner's state: the probe being played and its phase (``history``: the context before a
rehydrating probe; ``probe``: the probe's own prefill), the token ids fed so far, the records of the
probes already answered, the tokens rehydrated for this probe, the seconds it had run and the peak
cache bytes so far. Generation is greedy and the saves land on the uninterrupted run's chunk
boundaries (``pace_hf.session.prefill_checkpointed``), so a resumed pair gives exactly its tokens.
What a resumed record does not carry over: the cache's restore counters (``tier.restores``,
``restored_tokens``, ``stall_seconds`` start again at the resume) and the store's byte counters.

:class:`ChunkLog` writes each prefill chunk's tokens/s and cache bytes (``--chunk-log``), the
per-chunk figure of a long run (``bench/session_1m_report.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import torch

from pace_hf.cache import cache_nbytes
from pace_hf.memory import persist
from pace_hf.tiers import TierUnavailable

from .records import pair_key

STATE_KEY = "bench"  # the runner's state: an attachment of the cache's save


def store_session_id(arm: str, row) -> str:
    """The pair's session in the store: arm, session and distance (a sweep builds s0-0 once per D, and
    one D's checkpoint must never resume another's)."""
    return "-".join(str(part) for part in pair_key(arm, row) if part is not None)


def pair_settings(row, settings, chunk: int, max_new_tokens, rehydrate: bool, blueprint) -> dict:
    """What a checkpoint must match to be continued: the session's tokens and every knob that changes
    them (the model and dtype are the save's fingerprint, which ``persist.resume`` checks)."""
    context = hashlib.blake2b(torch.tensor(row["context_ids"], dtype=torch.long).numpy().tobytes(),
                              digest_size=8).hexdigest()
    return {"context": context, "context_len": len(row["context_ids"]), "budget": settings.budget,
            "limit": settings.limit, "chunk": chunk, "max_new_tokens": max_new_tokens, "rehydrate": bool(rehydrate),
            "blueprint": blueprint.to_dicts() if blueprint is not None else None}


class PairCheckpoint:
    """Saves and resumes one pair through its cache's store (which must be durable: disk or valkey)."""

    def __init__(self, store, session_id: str, every: int, expected: dict):
        self.store, self.session_id, self.every, self.expected = store, session_id, every, expected
        self.saves, self.failed_saves, self.save_seconds = 0, 0, 0.0

    def resume(self, cls, model):
        """``(cache, state)`` of the pair's last save, or None when it has none. A save made with other
        settings is refused, naming them (nothing is deleted)."""
        try:
            cache, attachments = persist.resume(cls, self.session_id, store=self.store, model=model)
        except KeyError:
            return None
        except TierUnavailable as e:  # starting the pair over would delete a save that may be whole
            raise SystemExit(f"pace-bench: --resume: {e}") from e
        if STATE_KEY not in attachments:
            cache.unbind()
            raise SystemExit(f"pace-bench: --resume: the store's save of {self.session_id!r} holds no runner state "
                             "(it is not a pace-bench checkpoint); use another --out or --store-path")
        tensors, state = attachments[STATE_KEY]
        differ = sorted(k for k in self.expected if state["settings"].get(k) != self.expected[k])
        if differ:
            cache.unbind()
            raise SystemExit(f"pace-bench: --resume: the checkpoint of {self.session_id!r} was made with other "
                             f"{', '.join(differ)}; resume with the same settings, or run without --resume to "
                             "start the pair over")
        return cache, dict(state, ids=tensors["ids"].tolist())

    def start_over(self) -> None:
        """A pair played from scratch: an older save of it must not be continued (or block the new one)."""
        self.store.delete_session(self.session_id)
        self.store.flush()

    def saver(self, cache, state, after=None):
        """A ``save()`` for ``generate_reply(checkpoint=...)``: ``state()`` gives the runner's state now;
        ``after()`` runs once it is saved."""
        def save():
            started = time.perf_counter()
            now = state()
            ids = torch.tensor(now.pop("ids"), dtype=torch.long)
            try:
                persist.save(cache, {STATE_KEY: ({"ids": ids}, dict(now, settings=self.expected))})
            except persist.SaveFailed as e:  # the last checkpoint stands whole; a long run goes on
                self.failed_saves += 1
                warnings.warn(f"pace-bench: checkpoint of {self.session_id!r} not saved, the previous one stands "
                              f"and the next one tries again: {e}", stacklevel=2)
                return
            self.saves += 1
            self.save_seconds += time.perf_counter() - started
            if after is not None:
                after()
        return save

    def done(self) -> None:
        """The pair is complete: its checkpoint (and spilled KV) goes."""
        self.start_over()


class ChunkLog:
    """Appends one JSON line per prefilled chunk to ``path``: the tokens the cache has seen after it,
    the chunk's size and tokens/s, the bytes the cache holds then (before the forward's eviction: each
    forward's peak), what the full cache would hold (``full_bytes_per_token`` times the tokens seen) and
    the host's load average and this process's CPU seconds (all its threads): a chunk that shared the
    CPU is slow in wall time for that reason alone, while its CPU seconds per token barely change.
    Passes every update on to ``inner`` (a progress bar). A resumed run appends; readers keep the last
    line for each ``seen`` (the chunks redone after a kill)."""

    def __init__(self, path: Path, cache, labels: dict, full_bytes_per_token: int, inner=None):
        self.path, self.cache, self.labels, self.inner = Path(path), cache, labels, inner
        self.full_bytes_per_token = full_bytes_per_token
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size:
            with open(self.path, "a") as f:  # a kill cut the last line short: it stays alone on its line
                f.write("\n")
        self.mark()

    def mark(self) -> None:
        """Time the next chunk from now (after a save, or when a phase starts)."""
        self.last, self.last_cpu = time.perf_counter(), time.process_time()

    def update(self, n: int) -> None:
        if self.inner is not None:
            self.inner.update(n)
        now, cpu = time.perf_counter(), time.process_time()
        seconds, cpu_seconds, self.last, self.last_cpu = now - self.last, cpu - self.last_cpu, now, cpu
        seen = self.cache.get_seq_length()
        line = {**self.labels, "seen": seen, "tokens": n, "seconds": round(seconds, 4),
                "tokens_per_s": round(n / seconds, 2) if seconds > 0 else None, "cpu_seconds": round(cpu_seconds, 4),
                "cache_bytes": cache_nbytes(self.cache), "full_cache_bytes": self.full_bytes_per_token * seen,
                "time": round(time.time(), 1), "load1": round(os.getloadavg()[0], 2)}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def read_chunk_log(path) -> list[dict]:
    """The lines of a chunk log, one per (labels, seen), the last written winning, in order of ``seen``
    (a line a kill cut short is skipped)."""
    last: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and "seen" in r:
            last[(r.get("arm"), r.get("session_id"), r.get("distance"), r["seen"])] = r
    return sorted(last.values(), key=lambda r: (str(r.get("arm")), str(r.get("session_id")), r["seen"]))
