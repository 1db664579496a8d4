"""Spill by logical page against spill by time of eviction: bytes read per restored byte, bytes written
per evicted token, and page sizes.

The session: a random-weight model with SmolLM2-135M's attention shape (hidden 576, 9 heads, 3 KV heads,
head_dim 64, fp32) but ``--layers`` layers (every ratio here is per layer), H2O under PACE's foresight
(no plan), ``--budget`` tokens, prefilled in chunks of 256 and then decoded one token at a time, so that
H2O evicts both the newest unprotected tokens and old heavy hitters: scattered evictions. Every evicted
token is spilled to a disk tier. Then spans are restored one after another (each planned at its own
step): ``--spans`` spans of 128 positions (the retriever's page) and as many of 32.

New (``pace_hf.memory.spill``): measured, for each page size in ``--pages``: the disk tier's own byte counters
(headers included) around each restore, and around the whole session for writes.

Old (the log before issue 25): evicted tokens grouped by time, one entry per layer per 256 tokens per KV
head, int64 ledger, indexed by [min, max] logical position. It is computed from the same session's
eviction trace (recorded at each ``add``): a restore read every entry whose range meets the span. Its
header size is that of a real encoded entry.

"Full set each version" (the alternative to merging versions at read): each page version would rewrite
every token the page had evicted before it; its bytes are computed from the versions the run wrote
before any restore.

    .venv/bin/python bench/spill_pages.py [--tokens 3072] [--decode 256] [--pages 32,64,128,256]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers as tf  # noqa: E402

from pace_hf import PACECache  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore  # noqa: E402
from pace_hf.tiers.entry import encode  # noqa: E402

HEAD_DIM, KV_HEADS = 64, 3
OLD_ENTRY_TOKENS = 256


def model_of(layers: int):
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                            num_attention_heads=9, num_key_value_heads=KV_HEADS, max_position_embeddings=65536)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def header_bytes() -> int:
    """An encoded entry's bytes beyond its payload (JSON header, alignment), for the old layout."""
    n = 3 * OLD_ENTRY_TOKENS
    tensors = {"head": torch.zeros(n, dtype=torch.long), "logical": torch.zeros(n, dtype=torch.long),
               "ref_pos": torch.zeros(n, dtype=torch.long), "score": torch.zeros(n),
               "ref_key": torch.zeros(n, HEAD_DIM), "value": torch.zeros(n, HEAD_DIM)}
    data = encode(tensors, {"layer": 11, "low": 123456, "high": 234567}, key="pace:bench:L11/spill/abcd1234-1234",
                  fingerprint="f" * 32, session_id="bench")
    return len(data) - sum(t.nbytes for t in tensors.values())


class OldLog:
    """The time-grouped layout's entries, rebuilt from the eviction trace: [low, high, tokens] per entry."""

    def __init__(self, layers: int):
        self.entries: list[list] = []
        self.open = [[None, None, 0] for _ in range(layers)]

    def add(self, layer_idx: int, logical: torch.Tensor) -> None:
        lo, hi, n = self.open[layer_idx]
        lo = int(logical.min()) if lo is None else min(lo, int(logical.min()))
        hi = int(logical.max()) if hi is None else max(hi, int(logical.max()))
        n += logical.numel()
        if n >= OLD_ENTRY_TOKENS * KV_HEADS:
            self.entries.append([lo, hi, n])
            lo, hi, n = None, None, 0
        self.open[layer_idx] = [lo, hi, n]

    def read_tokens(self, start: int, end: int) -> tuple[int, int]:
        """(tokens, entries) a restore of [start, end) read from the store (the open buffers are in memory)."""
        hit = [n for lo, hi, n in self.entries if lo < end and hi >= start]
        return sum(hit), len(hit)


def session(model, page: int, args, spans):
    root = tempfile.mkdtemp(prefix="spill-pages-")
    store = TieredStore([DiskTier(root)])
    cache = PACECache(model, budget=args.budget, limit=args.budget + 2 * 256, recent=32,
                      store=store, session_id="bench", spill_tokens=page)
    old = OldLog(len(cache.layers))
    add = cache.spill.add

    def traced(layer_idx, tokens):
        old.add(layer_idx, tokens["logical"])
        add(layer_idx, tokens)

    cache.spill.add = traced
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 2048, (1, args.tokens + args.decode), generator=gen)
    started = time.perf_counter()
    with torch.no_grad():
        for s in range(0, args.tokens, 256):
            model(ids[:, s:s + 256], cache=cache)
        for s in range(args.tokens, args.tokens + args.decode):
            model(ids[:, s:s + 1], cache=cache)
    cache.spill.flush()
    store.flush()
    run_s = time.perf_counter() - started
    disk = lambda: store.stats["disk"]  # noqa: E731
    spilled = cache.spill.spilled_tokens
    written = {"disk": disk()["bytes_written"], "payload": cache.spill.stats["bytes_written"]}
    full_set = 0  # bytes the "full set each version" layout would have written
    for layer in cache.spill.pages:
        for versions in layer.values():
            total = 0
            for v in versions:
                total += v[4]
                full_set += total
    per_token = 3 * 4 + 4 + 2 * HEAD_DIM * 4
    old_per_token = 3 * 8 + 4 + 2 * HEAD_DIM * 4
    reads = []
    for step, (start, end) in enumerate(spans, start=1):
        cache.step = step
        old_tokens, old_entries = old.read_tokens(start, end)
        before, returned, versions = disk()["bytes_read"], cache.spill.stats["bytes_returned"], \
            cache.spill.stats["versions_read"]
        t0 = time.perf_counter()
        cache.restore(start, end)
        seconds = time.perf_counter() - t0
        store.flush()
        back = (cache.spill.stats["bytes_returned"] - returned) // per_token  # tokens the restore returned
        reads.append({"span": end - start, "read": disk()["bytes_read"] - before, "returned": back * per_token,
                      "entries": cache.spill.stats["versions_read"] - versions, "seconds": seconds,
                      "old_read": old_tokens * old_per_token + old_entries * HEADER,
                      "old_returned": back * old_per_token, "old_entries": old_entries})
    after_restores = disk()["bytes_written"] - written["disk"]
    store.close()
    old_written = sum(n * old_per_token + HEADER for _, _, n in old.entries)
    old_tokens = sum(n for _, _, n in old.entries)
    return {"page": page, "spilled": spilled, "run_s": run_s, "written": written, "full_set": full_set,
            "old_written_per_token": old_written / max(old_tokens, 1), "restore_writes": after_restores,
            "reads": reads, "per_token": per_token, "old_per_token": old_per_token}


def ratio(rows, read, returned, span):
    rows = [r for r in rows if r["span"] == span and r[returned]]
    return sum(r[read] for r in rows) / max(sum(r[returned] for r in rows), 1), \
        sum(r["old_entries" if read == "old_read" else "entries"] for r in rows) / max(len(rows), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3072, help="prefilled tokens (chunks of 256)")
    ap.add_argument("--decode", type=int, default=256, help="tokens decoded one at a time after the prefill")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", default="32,64,128,256", help="page sizes (logical positions) to measure")
    ap.add_argument("--spans", type=int, default=6, help="spans of 128 and of 32 positions restored")
    args = ap.parse_args()
    global HEADER
    HEADER = header_bytes()
    model = model_of(args.layers)
    rng = random.Random(0)
    seen = args.tokens + args.decode
    spans = [(s, s + 128) for s in rng.sample(range(64, seen - 512), args.spans)]
    spans += [(s, s + 32) for s in rng.sample(range(64, seen - 512), args.spans)]
    print(f"session: {args.tokens} prefilled + {args.decode} decoded tokens, budget {args.budget}, {args.layers} "
          f"layers x {KV_HEADS} KV heads x head_dim {HEAD_DIM} (fp32); entry header {HEADER} B")
    print("layout          bytes read / restored byte   entries read / restore   written / evicted token (B)   "
          "full-set-each-version / written")
    print("                span 128    span 32          span 128   span 32")
    old_row = None
    for page in [int(p) for p in args.pages.split(",")]:
        r = session(model, page, args, spans)
        if old_row is None:
            (o128, e128), (o32, e32) = (ratio(r["reads"], "old_read", "old_returned", s) for s in (128, 32))
            old_row = (f"time, {OLD_ENTRY_TOKENS}/entry  {o128:8.1f}    {o32:8.1f}          {e128:8.1f}   {e32:7.1f}"
                       f"          {r['old_written_per_token']:8.0f} ({r['old_written_per_token'] / r['old_per_token']:.2f}"
                       " x payload)")
            print(old_row)
        (n128, e128), (n32, e32) = (ratio(r["reads"], "read", "returned", s) for s in (128, 32))
        per = r["written"]["disk"] / r["spilled"]
        with_restores = (r["written"]["disk"] + r["restore_writes"]) / r["spilled"]
        print(f"page {page:4d}       {n128:8.2f}    {n32:8.2f}          {e128:8.1f}   {e32:7.1f}          {per:8.0f} "
              f"({per / r['per_token']:.2f} x payload; {with_restores / r['per_token']:.2f} with the restores' "
              f"rewrites)   {r['full_set'] / r['written']['payload']:.1f}x   [{r['run_s']:.0f} s]")


if __name__ == "__main__":
    main()
