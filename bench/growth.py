"""What grows with a long session: seconds of this process's CPU per prefill chunk against position, with
a random-weight model so cheap that the cache's bookkeeping, not the model, is most of each chunk.

Why: the 1M-token session (``bench/run_1m.sh``) fell from 45.8 to 39.7 tokens per CPU-second between its
first and last 48K tokens while its resident cache stayed at 224 MiB, so something else grows with the
session. A real model at 1M tokens takes hours; this takes minutes and shows the same code path: a PACE
cache with the 1M run's B, H, L, the oracle blueprint's shape (three definition spans near the start, read
by the three probe steps at the end, the cache at the first probe's step while it prefills), every evicted
token spilled to a disk tier under the same spill cap (scaled to the same number of spilled tokens:
this model's KV is smaller), and a checkpoint every 8 chunks (``pace_bench.checkpoint``, as the 1M run
saves), prefilled by ``generate_reply`` as the runner does.

It writes, in ``--out``:
- ``chunks.jsonl``: the runner's own chunk log (``pace_bench.checkpoint.ChunkLog``), read as the 1M
  report reads it (``session_1m_report.flatness``): tokens per CPU-second, first 48K against last 48K;
- ``sizes.jsonl``: per chunk, the size of every structure the cache keeps across chunks, the main thread's
  CPU seconds (the rest of ``cpu_seconds`` is the store's writer), and, so far, user and system CPU,
  page faults and the seconds in Python's collector;
- ``counts.jsonl``: per chunk and per save, counts that do not depend on the machine's load: the bytes
  and calls of JSON that ``pace_hf.tiers.entry`` encodes (entry headers by key kind, digests), the bytes
  and files each chunk writes to, reads from and deletes in the disk tier (spill and the rest), the disk
  folder's entries and its directory's size, Python's tracked objects and allocated blocks, the RSS; a
  save's row adds its own CPU seconds and Python calls;
- ``profile_early.txt`` / ``profile_late.txt``: cProfile of the odd-numbered chunks of the first eighth
  (from chunk 2: chunk 1 pays the model's first forward) and of the last eighth, and ``calls.json``,
  every function's call count in each (the even-numbered chunks of the same eighths are the CPU figure,
  unslowed by the profiler); ``profile_saves_early.txt`` / ``_late``: the saves in each eighth, profiled
  and timed on their own (the chunk log leaves saves out of a chunk's CPU);
- ``growth.json``: the 48K ratio; per eighth, CPU per chunk (process, main thread, writer), Python calls
  per chunk, JSON bytes and tier bytes per chunk and per save, and their last/first ratios; the functions
  whose call count grew most, and whose own time per chunk grew most.

``--tracemalloc`` (a short run: tracing slows every allocation) adds ``tracemalloc.txt``: the lines whose
live allocations grew most between the middle of the first and of the last eighth.

``--spill-add`` only times ``SpillLog.add`` of one layer's eviction of a chunk with the 1M run's KV shapes.

    nice -n 10 .venv/bin/python bench/growth.py --tokens 1048576 --out bench/results/growth/before
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pace_bench.checkpoint import ChunkLog, PairCheckpoint  # noqa: E402
from pace_hf import Blueprint, PACECache, Span  # noqa: E402
from pace_hf.session import generate_reply  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore  # noqa: E402
from pace_hf.tiers import entry as tier_entry  # noqa: E402
from session_1m_report import flatness  # noqa: E402

# Qwen2.5-Coder-0.5B, the 1M run's model: its spilled bytes per token in fp32, over its 24 layers and 2 KV
# heads (reference key and value of head_dim 64, score, three int32 ledger fields).
QWEN_SPILLED_BYTES = 24 * 2 * (8 * 64 + 16)


def tiny_qwen(layers: int, kv_heads: int, head_dim: int, vocab: int) -> torch.nn.Module:
    """Qwen2's modeling code with the 1M model's layer count and KV heads, and a tiny width."""
    torch.manual_seed(0)
    width = kv_heads * head_dim
    config = tf.Qwen2Config(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                            num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                            max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def sizes(cache) -> dict:
    """The size of every structure the cache keeps from chunk to chunk (entries, not bytes), and the spill's
    writes so far (versions and bytes: their difference between chunks is each chunk's writes)."""
    spill = cache.spill
    return {"seen": cache.get_seq_length(),
            "spill_versions": sum(len(v) for layer in spill.pages for v in layer.values()),
            "spill_pages": sum(len(layer) for layer in spill.pages),
            "spill_recent": len(spill.recent), "spill_capped": len(spill.capped),
            "spill_buffered": sum(spill.buffered), "spill_unconfirmed": len(spill.unconfirmed),
            "spill_saved_keys": len(spill.saved_keys), "spill_held_bytes": spill.held_bytes,
            "versions_written": spill.stats["versions_written"], "bytes_written": spill.stats["bytes_written"],
            "restores_pending": len(cache.restores.pending), "blueprint_spans": len(cache.blueprint),
            "token_log": 0 if cache.tokens is None else cache.tokens.known}


def key_kind(key: str) -> str:
    """What an entry is, from its key: the manifest, the save's pending list, a spill version, a layer's
    state, or an attachment."""
    key = key.rsplit(":", 1)[-1]  # the store's session prefix
    if key in ("manifest", "save-pending"):
        return key
    if "/spill/" in key:
        return "spill"
    return "state" if "/state@" in key else "attachment"


class Counts:
    """Counters that do not depend on the machine's load, shared by the main thread and the store's writer."""

    def __init__(self):
        self.lock, self.now = threading.Lock(), Counter()

    def add(self, **counts) -> None:
        with self.lock:
            self.now.update(counts)

    def take(self) -> dict:
        with self.lock:
            out, self.now = dict(self.now), Counter()
        return out


class CountingJson:
    """``pace_hf.tiers.entry``'s ``json``, counting what it encodes (entry headers by the entry's kind, and
    digests): a document that grows with the session shows here whatever the load."""

    def __init__(self, counts: Counts):
        self.counts = counts

    def dumps(self, obj, *args, **kwargs) -> str:
        text = json.dumps(obj, *args, **kwargs)
        kind = f"header_{key_kind(obj['key'])}" if isinstance(obj, dict) and "key" in obj else "digest"
        self.counts.add(**{f"json_bytes_{kind}": len(text), f"json_calls_{kind}": 1})
        return text

    def __getattr__(self, name):
        return getattr(json, name)


class CountingDiskTier(DiskTier):
    """A disk tier that counts the files and bytes it writes, reads and deletes, spill and the rest."""

    def __init__(self, root, counts: Counts, **kwargs):
        super().__init__(root, **kwargs)
        self.counts = counts

    def put(self, key, data) -> None:
        super().put(key, data)
        kind = "spill" if key_kind(key) == "spill" else "other"
        self.counts.add(**{f"disk_put_files_{kind}": 1, f"disk_put_bytes_{kind}": memoryview(data).nbytes})

    def get(self, key):
        data = super().get(key)
        kind = "spill" if key_kind(key) == "spill" else "other"
        self.counts.add(**{f"disk_get_files_{kind}": 1, f"disk_get_bytes_{kind}": 0 if data is None else len(data)})
        return data

    def delete(self, key) -> None:
        super().delete(key)
        self.counts.add(**{f"disk_delete_files_{'spill' if key_kind(key) == 'spill' else 'other'}": 1})


def process_sizes(folder: str) -> dict:
    """Python's tracked objects and allocated blocks, the RSS, and the disk folder: its entries and its
    directory's own size (a directory that only grows would cost every lookup more)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        entries, dir_bytes = len(os.listdir(folder)), os.stat(folder).st_size
    except FileNotFoundError:
        entries = dir_bytes = 0
    return {"gc_objects": len(gc.get_objects()), "allocated_blocks": sys.getallocatedblocks(), "rss_bytes": rss,
            "disk_entries": entries, "disk_dir_bytes": dir_bytes}


def total_calls(profile: cProfile.Profile) -> int:
    """Every call a profile has counted so far (0 before its first)."""
    try:
        return sum(n for n, *_ in pstats.Stats(profile).stats.values())
    except TypeError:  # nothing profiled yet
        return 0


def full_collection_seconds(rows: list[dict]) -> list[float]:
    """The collector's seconds in each chunk with a full collection (what the full one cost, give or take
    the young collections of that chunk)."""
    return [r["gc_s"] - p["gc_s"] for p, r in zip([{"gc_s": 0.0, "gc_full": 0}] + rows, rows)
            if r["gc_full"] > p["gc_full"]]


def function_calls(profile: cProfile.Profile) -> dict[str, int]:
    """Each function's call count in a profile (none before its first call)."""
    if not total_calls(profile):
        return {}
    return {relative(f"{path}:{line}({fn})"): nc for (path, line, fn), (_, nc, *_r) in pstats.Stats(profile).stats.items()}


class Watch:
    """The cache's progress: passes each chunk to the chunk log, logs the sizes and the counts, runs
    cProfile over the odd-numbered chunks of the two eighths (``profiled``: chunk -> window name), and
    profiles and times every save on its own (the chunk log leaves saves out of a chunk's CPU)."""

    def __init__(self, log: ChunkLog, cache, out: Path, profiled: dict, counts: Counts, folder: str,
                 snapshots: dict | None = None):
        self.log, self.cache, self.out, self.profiled, self.counts = log, cache, out, profiled, counts
        self.folder, self.snapshots = folder, snapshots
        self.chunk, self.saves = 0, 0
        self.profiles = {name: cProfile.Profile(time.thread_time) for name in set(profiled.values())}
        # the saves after the last chunk before each eighth's profiled chunks, together per eighth
        self.save_profiles = {name: cProfile.Profile(time.thread_time) for name in set(profiled.values())}
        self.active = self.save_profile = None
        self.gc_seconds, self.gc_full, self._gc_started, self.full_in = 0.0, 0, 0.0, []
        gc.callbacks.append(self._gc)
        self.mark()

    def _gc(self, phase: str, info: dict) -> None:
        """Python's collector, timed: a pause lands in whatever allocated, and costs what is alive."""
        if phase == "start":
            self._gc_started = time.thread_time()
            if info["generation"] == 2:  # where a full collection fires: a profile charges its pause there
                try:
                    frame = sys._getframe(1)
                    where = relative(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
                except ValueError:  # a thread with no Python frame (its start or end)
                    where = "(no Python frame)"
                self.full_in.append([self.chunk + 1, where])
        else:
            self.gc_seconds += time.thread_time() - self._gc_started
            self.gc_full += info["generation"] == 2

    def mark(self) -> None:
        """Time the next chunk from now, in the chunk log and on this thread's clock (after a save too:
        then the save's profile and counts are written first)."""
        if self.save_profile is not None:
            self.save_profile.disable()
            calls = total_calls(self.save_profile) - self.save_calls_before
            self.save_profile = None
            self._write("counts.jsonl", {"save": self.saves, "after_chunk": self.chunk, "seen": self.cache.get_seq_length(),
                                         "save_cpu_s": round(time.process_time() - self.save_cpu, 4),
                                         "save_main_cpu_s": round(time.thread_time() - self.save_main_cpu, 4),
                                         "save_calls": calls, **self.counts.take()})
        self.counts.take()  # what the bookkeeping between chunks wrote is not the next chunk's
        self.log.mark()
        self.main_cpu = time.thread_time()
        self.active = self.profiled.get(self.chunk + 1)
        if self.active is not None:
            self.profiles[self.active].enable()

    def before_save(self) -> None:
        """A save starts: profiled and timed on its own."""
        if self.active is not None:  # one profiler at a time: the chunk's resumes after the save
            self.profiles[self.active].disable()
        self.saves += 1
        self.save_cpu, self.save_main_cpu = time.process_time(), time.thread_time()
        self.counts.take()
        window = self.profiled.get(self.chunk + 1)
        self.save_profile = self.save_profiles[window] if window else cProfile.Profile(time.thread_time)
        self.save_calls_before = total_calls(self.save_profile) if window else 0
        self.save_profile.enable()

    def _write(self, name: str, row: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(row) + "\n")

    def update(self, n: int) -> None:
        if self.active is not None:
            self.profiles[self.active].disable()
        self.log.update(n)
        main_cpu = time.thread_time() - self.main_cpu  # the chunk log's cpu_seconds less this is the writer's
        self.chunk += 1
        chunk_counts = self.counts.take()
        usage = resource.getrusage(resource.RUSAGE_SELF)  # so far: user and system CPU, page faults
        self._write("sizes.jsonl", {"chunk": self.chunk, "main_cpu_seconds": round(main_cpu, 4),
                                    "profiled": self.active, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
                                    "minor_faults": usage.ru_minflt, "gc_s": round(self.gc_seconds, 4),
                                    "gc_full": self.gc_full, **sizes(self.cache)})
        self._write("counts.jsonl", {"chunk": self.chunk, "seen": self.cache.get_seq_length(), **chunk_counts,
                                     **process_sizes(self.folder)})
        if self.snapshots is not None and self.chunk in self.snapshots:
            self.snapshots[self.chunk] = tracemalloc.take_snapshot()
        self.active = None
        self.mark()  # the bookkeeping above is the profiler's, not the chunk's


# a file's path up to the package it is in (this machine's folders stay out of the results)
_FOLDERS = re.compile(r"/\S*?/(?:site-packages|python3\.\d+|bench/\.\.)/|/\S*?/(?=bench/)")


def relative(text: str) -> str:
    return _FOLDERS.sub("", text)


def own_time_per_chunk(profile: cProfile.Profile, chunks: int) -> dict[str, float]:
    """Each function's own (exclusive) seconds per chunk."""
    stats = pstats.Stats(profile).stats
    return {relative(f"{path}:{line}({name})"): tt / chunks for (path, line, name), (_, _, tt, _, _) in stats.items()}


def read_rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def eighths(out: Path, first: range, last: range) -> dict:
    """Per chunk over the first and the last eighth: CPU seconds (the process's, the main thread's and the
    rest: the store's writer) over the chunks the profiler left alone, and the load-independent counts over
    every chunk of the eighth; per save in each eighth, its CPU, its Python calls and its counts. Each with
    its last/first ratio."""
    from pace_bench.checkpoint import read_chunk_log

    sizes_rows = {r["chunk"]: r for r in read_rows(out, "sizes.jsonl")}
    counts = read_rows(out, "counts.jsonl")
    chunk_counts = {r["chunk"]: r for r in counts if "chunk" in r}
    log = {i + 1: c for i, c in enumerate(read_chunk_log(out / "chunks.jsonl"))}
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    result: dict = {}
    for name, chunks in (("first", first), ("last", last)):
        timed = [c for c in chunks if sizes_rows[c]["profiled"] is None]
        row = {"chunks": [chunks.start, chunks.stop - 1], "timed_chunks": len(timed),
               "cpu_s": mean([log[c]["cpu_seconds"] for c in timed]),
               "main_cpu_s": mean([sizes_rows[c]["main_cpu_seconds"] for c in timed])}
        row["writer_cpu_s"] = row["cpu_s"] - row["main_cpu_s"]
        keys = sorted({k for c in chunks for k in chunk_counts[c] if k not in ("chunk", "seen")})
        row.update({k: mean([chunk_counts[c].get(k, 0) for c in chunks]) for k in keys})
        saves = [r for r in counts if "save" in r and r["after_chunk"] + 1 in chunks]
        save_keys = sorted({k for r in saves for k in r if k not in ("save", "after_chunk", "seen")})
        row["saves"] = len(saves)
        row.update({f"per_save_{k}": mean([r.get(k, 0) for r in saves]) for k in save_keys})
        result[name] = row
    calls = json.loads((out / "calls.json").read_text())
    for name in ("first", "last"):
        result[name]["calls_per_chunk"] = sum(calls[name].values()) / calls[f"{name}_chunks"]
    result["ratio"] = {k: result["last"][k] / result["first"][k] for k in result["first"]
                       if isinstance(result["first"][k], (int, float)) and result["first"][k]
                       and k not in ("timed_chunks", "saves")}
    return result


def profile_text(profile: cProfile.Profile, top: int = 40) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return relative(out.getvalue())


def spill_add_seconds(adds: int = 20, chunk: int = 4096, kv_heads: int = 2, head_dim: int = 64) -> float:
    """CPU seconds of this process (its store's writer included) per ``SpillLog.add`` of one layer's eviction of
    a prefill chunk with the 1M run's KV shapes (every token of ``chunk`` in every KV head, fp32)."""
    from pace_hf.memory.spill import SpillLog
    from pace_hf.tiers import HostTier

    store = TieredStore([HostTier()])
    log = SpillLog(store, "spill-add", "fp", 1)
    evictions = []
    for k in range(adds):
        logical = torch.arange(k * chunk, (k + 1) * chunk).repeat(kv_heads)
        evictions.append({"head": torch.arange(kv_heads).repeat_interleave(chunk), "logical": logical,
                          "ref_pos": logical % 8192, "score": torch.rand(kv_heads * chunk),
                          "ref_key": torch.randn(kv_heads * chunk, head_dim),
                          "value": torch.randn(kv_heads * chunk, head_dim)})
    started = time.process_time()
    for tokens in evictions:
        log.add(0, tokens)
    store.flush()
    seconds = (time.process_time() - started) / adds
    store.close()
    return seconds


def profiled_save(save, watch: Watch):
    """``save``, profiled and timed on its own (see ``Watch``)."""
    def run():
        watch.before_save()
        save()
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24, help="the 1M model's 24 (fewer: a quicker run, the same growth)")
    ap.add_argument("--kv-heads", type=int, default=2, help="the 1M model's 2")
    ap.add_argument("--head-dim", type=int, default=16, help="the 1M model's is 64; smaller keeps the forward cheap")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--spill-cap-mb", type=int, default=1024,
                    help="the 1M run's cap, scaled to this model's bytes per token (the same spilled tokens)")
    ap.add_argument("--checkpoint-every", type=int, default=8, help="chunks between saves (the 1M run's 8)")
    ap.add_argument("--skip", type=int, default=1,
                    help="chunks at the start left out of the first eighth (the first pays the model's first forward)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds other load barely moves)")
    ap.add_argument("--store-path", default=None, help="the disk tier's folder (default: a temporary one)")
    ap.add_argument("--spill-add", action="store_true",
                    help="only time SpillLog.add of one layer's eviction of a chunk with the 1M run's KV shapes")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="trace allocations (slow: a short run) and write the lines that grew between the eighths")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.spill_add:
        print(f"SpillLog.add, one layer's eviction of a {args.chunk}-token chunk (2 KV heads, head_dim 64, fp32): "
              f"{spill_add_seconds(chunk=args.chunk):.3f} CPU s")
        return 0
    if args.out is None:
        ap.error("--out is needed (unless --spill-add)")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("chunks.jsonl", "sizes.jsonl", "counts.jsonl", "tracemalloc.txt"):
        (args.out / name).unlink(missing_ok=True)

    model = tiny_qwen(args.layers, args.kv_heads, args.head_dim, args.vocab)
    cap = (args.spill_cap_mb << 20) * args.layers * args.kv_heads * (8 * args.head_dim + 16) // QWEN_SPILLED_BYTES
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.tokens,), generator=g).tolist()
    steps = args.tokens // 2048  # a turn per ~2K tokens, as the filler's
    probes = [steps, steps + 1, steps + 2]
    # the three definitions after the system prompt; fee_for reads 1 and 3, settle 1-3, the module all
    blueprint = Blueprint([Span(40, 330, probes), Span(330, 610, probes[1:]), Span(610, 820, probes)])
    folder = args.store_path or tempfile.mkdtemp(prefix="pace-growth-")
    counts = Counts()
    tier_entry.json = CountingJson(counts)  # what the entries' headers and digests encode, counted
    store = TieredStore([CountingDiskTier(folder, counts)])
    cache = PACECache(model, blueprint=blueprint, budget=args.budget, limit=args.limit, store=store,
                      session_id="growth", spill_cap_bytes=cap)
    cache.step = probes[0]
    n_chunks = (args.tokens - 1) // args.chunk  # whole chunks (the last, shorter one is left out)
    eighth = max(2, n_chunks // 8)
    first, last = range(1 + args.skip, 1 + args.skip + eighth), range(n_chunks - eighth + 1, n_chunks + 1)
    # cProfile counts the odd-numbered chunks of each eighth; the even ones are the CPU figure, unslowed
    profiled = {c: name for name, chunks in (("first", first), ("last", last)) for c in chunks if c % 2}
    snapshots = None
    if args.tracemalloc:
        tracemalloc.start(1)
        snapshots = {first[len(first) // 2]: None, last[len(last) // 2]: None}
    log = ChunkLog(args.out / "chunks.jsonl", cache, {"arm": "pace", "session_id": "growth"}, 0)
    watch = cache.progress = Watch(log, cache, args.out, profiled, counts, folder, snapshots)
    saver = PairCheckpoint(store, "growth", args.checkpoint_every, {"tokens": args.tokens})
    started, cpu = time.perf_counter(), time.process_time()
    try:
        state = lambda: {"probe": 0, "phase": "probe", "ids": ids, "records": [], "restored": None,  # noqa: E731
                         "peak_bytes": None, "seconds": time.perf_counter() - started}
        generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=[0], chunk=args.chunk,
                       checkpoint_every=args.checkpoint_every, checkpoint=profiled_save(saver.saver(cache, state, after=watch.mark), watch))
    finally:
        store.close()
        if args.store_path is None:
            shutil.rmtree(folder, ignore_errors=True)
    from pace_bench.checkpoint import read_chunk_log

    sizes_rows = read_rows(args.out, "sizes.jsonl")
    unprofiled = [c for c, r in zip(read_chunk_log(args.out / "chunks.jsonl"), sizes_rows) if r["profiled"] is None]
    flat = flatness(unprofiled)  # the 1M report's 48K windows, over the chunks the profiler left alone
    for name in ("first", "last"):
        for kind, profiles in (("", watch.profiles), ("saves_", watch.save_profiles)):
            if total_calls(profiles[name]):
                (args.out / f"profile_{kind}{'early' if name == 'first' else 'late'}.txt").write_text(
                    profile_text(profiles[name]))
    n_profiled = {name: sum(1 for w in profiled.values() if w == name) for name in ("first", "last")}
    calls = {f"{kind}{name}": function_calls(profiles[name])
             for kind, profiles in (("", watch.profiles), ("saves_", watch.save_profiles)) for name in ("first", "last")}
    calls.update({f"{name}_chunks": n for name, n in n_profiled.items()})
    (args.out / "calls.json").write_text(json.dumps(calls, indent=0, sort_keys=True) + "\n")
    grew_calls = sorted(((calls["last"].get(f, 0) / n_profiled["last"] - calls["first"].get(f, 0) / n_profiled["first"], f)
                         for f in set(calls["first"]) | set(calls["last"])), reverse=True)
    early, late = (own_time_per_chunk(watch.profiles[w], n_profiled[w]) for w in ("first", "last"))
    grew = sorted(((late.get(f, 0.0) - early.get(f, 0.0), f) for f in set(early) | set(late)), reverse=True)
    if snapshots is not None:
        a, b = (snapshots[c] for c in sorted(snapshots))
        lines = [relative(str(d)) for d in b.compare_to(a, "lineno")[:40]]
        (args.out / "tracemalloc.txt").write_text(f"chunks {sorted(snapshots)}: live allocations that grew most\n"
                                                  + "\n".join(lines) + "\n")
    per_eighth = eighths(args.out, first, last)
    summary = {"tokens": args.tokens, "chunks": watch.chunk, "saves": saver.saves,
               "first_tok_cpu_s": flat["first_tok_cpu_s"], "last_tok_cpu_s": flat["last_tok_cpu_s"],
               "tok_cpu_s_ratio": flat["tok_cpu_s_ratio"], "eighths": per_eighth,
               "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
               "full_collections": [[c, where, round(seconds, 3)] for (c, where), seconds
                                    in zip(watch.full_in, full_collection_seconds(sizes_rows))],
               "calls_grew_most": [{"function": f, "calls_per_chunk_first": calls["first"].get(f, 0) / n_profiled["first"],
                                    "calls_per_chunk_last": calls["last"].get(f, 0) / n_profiled["last"]}
                                   for d, f in grew_calls[:15] if d > 0],
               "time_grew_most": [{"function": f, "first_s_per_chunk": early.get(f, 0.0),
                                   "last_s_per_chunk": late.get(f, 0.0), "grew_s_per_chunk": d} for d, f in grew[:15]],
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    (args.out / "growth.json").write_text(json.dumps(summary, indent=1) + "\n")
    r = per_eighth["ratio"]
    print(f"tokens per CPU-second: {flat['first_tok_cpu_s']:.1f} over the first 48K, {flat['last_tok_cpu_s']:.1f} "
          f"over the last 48K: {flat['tok_cpu_s_ratio']:.3f}x")
    print(f"last eighth / first: CPU per chunk {r['cpu_s']:.3f}x (main thread {r['main_cpu_s']:.3f}x), Python calls "
          f"per chunk {r['calls_per_chunk']:.3f}x")
    for k in sorted(r):
        if abs(r[k] - 1) > 0.03:
            print(f"  {k}: {per_eighth['first'][k]:.4g} -> {per_eighth['last'][k]:.4g} ({r[k]:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
