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
- ``profile_early.txt`` / ``profile_late.txt``: cProfile of ``--window`` chunks just after the first
  48K and just before the last 48K (outside the ratio's windows, which the profiler would slow);
- ``growth.json``: the ratio, the main thread's and the writer's CPU per chunk over the first and last
  48K, and the functions whose own time per chunk grew most between the windows.

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
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pace_bench.checkpoint import ChunkLog, PairCheckpoint  # noqa: E402
from pace_hf import Blueprint, PACECache, Span  # noqa: E402
from pace_hf.session import generate_reply  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore  # noqa: E402
from session_1m_report import WINDOW, flatness  # noqa: E402

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


class Watch:
    """The cache's progress: passes each chunk to the chunk log, logs the sizes, and runs cProfile over
    the chunks of the two windows (``{name: (first chunk, last chunk)}``, 1-based)."""

    def __init__(self, log: ChunkLog, cache, sizes_path: Path, windows: dict):
        self.log, self.cache, self.sizes_path, self.windows = log, cache, sizes_path, windows
        self.chunk, self.profiles, self.active = 0, {}, None
        self.gc_seconds, self.gc_full, self._gc_started = 0.0, 0, 0.0
        gc.callbacks.append(self._gc)
        self.mark()

    def _gc(self, phase: str, info: dict) -> None:
        """Python's collector, timed: a pause lands in whatever allocated, and costs what is alive."""
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            self.gc_seconds += time.thread_time() - self._gc_started
            self.gc_full += info["generation"] == 2

    def mark(self) -> None:
        """Time the next chunk from now, in the chunk log and on this thread's clock."""
        self.log.mark()
        self.main_cpu = time.thread_time()

    def update(self, n: int) -> None:
        self.log.update(n)
        main_cpu = time.thread_time() - self.main_cpu  # the chunk log's cpu_seconds less this is the writer's
        self.chunk += 1
        usage = resource.getrusage(resource.RUSAGE_SELF)  # so far: user and system CPU, page faults
        with open(self.sizes_path, "a") as f:
            f.write(json.dumps({"chunk": self.chunk, "main_cpu_seconds": round(main_cpu, 4),
                                "user_s": usage.ru_utime, "system_s": usage.ru_stime, "minor_faults": usage.ru_minflt,
                                "gc_s": round(self.gc_seconds, 4), "gc_full": self.gc_full,
                                **sizes(self.cache)}) + "\n")
        if self.active is not None and self.chunk >= self.windows[self.active][1]:
            self.profiles[self.active].disable()
            self.active = None
        for name, (first, last) in self.windows.items():
            if self.chunk + 1 == first:  # the next chunk is the window's first
                self.active = name
                # this thread's CPU: the store's writer thread runs meanwhile, and process CPU would be
                # charged to whatever this thread was in (the writer's share is main_cpu against cpu_seconds)
                self.profiles[name] = cProfile.Profile(time.thread_time)
                self.profiles[name].enable()
        self.mark()  # the bookkeeping above is the profiler's, not the chunk's


# a file's path up to the package it is in (this machine's folders stay out of the results)
_FOLDERS = re.compile(r"/\S*?/(?:site-packages|python3\.\d+|bench/\.\.)/|/\S*?/(?=bench/)")


def relative(text: str) -> str:
    return _FOLDERS.sub("", text)


def own_time_per_chunk(profile: cProfile.Profile, chunks: int) -> dict[str, float]:
    """Each function's own (exclusive) seconds per chunk."""
    stats = pstats.Stats(profile).stats
    return {relative(f"{path}:{line}({name})"): tt / chunks for (path, line, name), (_, _, tt, _, _) in stats.items()}


def threads(out: Path, per_window: int) -> dict:
    """CPU seconds per chunk of the main thread and of the rest (the store's writer and readers), over the
    first and the last ``per_window`` chunks (whole chunks after a chunk, as the ratio reads them)."""
    from pace_bench.checkpoint import read_chunk_log

    main = [json.loads(line)["main_cpu_seconds"] for line in (out / "sizes.jsonl").read_text().splitlines()]
    rows = [(c["cpu_seconds"], m) for c, m in zip(read_chunk_log(out / "chunks.jsonl"), main)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    first, last = rows[:per_window], rows[-per_window:]
    return {f"{name}_{window}_cpu_s_per_chunk": mean([pick(r) for r in rows_])
            for window, rows_ in (("first", first), ("last", last))
            for name, pick in (("main", lambda r: r[1]), ("background", lambda r: r[0] - r[1]))}


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
    ap.add_argument("--window", type=int, default=8, help="chunks in each profiled window")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds other load barely moves)")
    ap.add_argument("--store-path", default=None, help="the disk tier's folder (default: a temporary one)")
    ap.add_argument("--spill-add", action="store_true",
                    help="only time SpillLog.add of one layer's eviction of a chunk with the 1M run's KV shapes")
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
    for name in ("chunks.jsonl", "sizes.jsonl"):
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
    store = TieredStore([DiskTier(folder)])
    cache = PACECache(model, blueprint=blueprint, budget=args.budget, limit=args.limit, store=store,
                      session_id="growth", spill_cap_bytes=cap)
    cache.step = probes[0]
    n_chunks = (args.tokens - 1) // args.chunk
    per_window = WINDOW // args.chunk
    windows = {"early": (per_window + 1, per_window + args.window),
               "late": (n_chunks - per_window - args.window + 1, n_chunks - per_window)}
    log = ChunkLog(args.out / "chunks.jsonl", cache, {"arm": "pace", "session_id": "growth"}, 0)
    watch = cache.progress = Watch(log, cache, args.out / "sizes.jsonl", windows)
    saver = PairCheckpoint(store, "growth", args.checkpoint_every, {"tokens": args.tokens})
    started, cpu = time.perf_counter(), time.process_time()
    try:
        state = lambda: {"probe": 0, "phase": "probe", "ids": ids, "records": [], "restored": None,  # noqa: E731
                         "peak_bytes": None, "seconds": time.perf_counter() - started}
        generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=[0], chunk=args.chunk,
                       checkpoint_every=args.checkpoint_every, checkpoint=saver.saver(cache, state, after=watch.mark))
    finally:
        store.close()
        if args.store_path is None:
            shutil.rmtree(folder, ignore_errors=True)
    from pace_bench.checkpoint import read_chunk_log

    flat = flatness(read_chunk_log(args.out / "chunks.jsonl"))
    early, late = (own_time_per_chunk(watch.profiles[w], args.window) for w in ("early", "late"))
    grew = sorted(((late.get(f, 0.0) - early.get(f, 0.0), f) for f in set(early) | set(late)), reverse=True)
    for name in ("early", "late"):
        (args.out / f"profile_{name}.txt").write_text(profile_text(watch.profiles[name]))
    summary = {"tokens": args.tokens, "chunks": watch.chunk, "saves": saver.saves,
               "first_tok_cpu_s": flat["first_tok_cpu_s"], "last_tok_cpu_s": flat["last_tok_cpu_s"],
               "tok_cpu_s_ratio": flat["tok_cpu_s_ratio"], **threads(args.out, per_window),
               "early_cpu_s_per_chunk": sum(early.values()), "late_cpu_s_per_chunk": sum(late.values()),
               "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
               "grew_most": [{"function": f, "early_s_per_chunk": early.get(f, 0.0),
                              "late_s_per_chunk": late.get(f, 0.0), "grew_s_per_chunk": d} for d, f in grew[:15]],
               "windows": windows, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    (args.out / "growth.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"tokens per CPU-second: {flat['first_tok_cpu_s']:.1f} over the first 48K, {flat['last_tok_cpu_s']:.1f} "
          f"over the last 48K: {flat['tok_cpu_s_ratio']:.3f}x")
    for row in summary["grew_most"][:10]:
        print(f"  {row['grew_s_per_chunk'] * 1e3:+8.1f} ms/chunk  {row['function']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
