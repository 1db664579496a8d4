"""Batched decode: aggregate tokens/s of N sessions decoded together against the same N one at a time.

Each session is a PACE cache at ``--budget`` resident tokens (of ``--tokens`` seen: one real prefill of
standard-library source, kept by H2O's scores and loaded into every session, so every session decodes
at the same length). Per N in ``--sessions`` and per round, the same sessions decode ``--steps`` greedy
tokens:
- one at a time: each session's own forward, in turn (what pace-serve did);
- together: one forward of ``CacheRows`` over the N sessions (``pace_hf.cache.batch``), their tokens packed
  as one sequence, as pace-serve's step runs them.
A DynamicCache holding the same resident tokens, batched the same way, is the overhead baseline (PACE's
decode against a cache that evicts nothing, at batch 1 and batch N). Arms alternate within each round;
the table reports medians. The model's weights are read once per forward: that is what batching saves.

``--chunks 64,128,...`` also measures pace-serve's mixed step at ``--chunk-rows`` sessions: their decode
tokens beside one chunk of a prompt (another session at the same budget), packed as one sequence
(``CacheRows(..., packed=...)``) against left-padded rows (each decoding row padded to the chunk's width,
its pads dropped by the cache but run through every projection), with the decode step alone and the
chunk alone as references. What a chunk costs the decoding rows is the packed step less the decode
step; what it buys is its tokens prefilled (``chunks.md``).

    python bench/batch_decode.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--budget 2048]
        [--limit 8192] [--sessions 1,2,4,8] [--steps 8] [--rounds 3] [--chunks 64,128,256,512]
        [--chunk-rows 8] [--chunk-steps 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

from pace_bench.models import load_model, preferred_dtype
from pace_hf.cache import CacheRows, cache_nbytes

from decode_speed import evicting_cache, prefill_state, trimmed
from prefill_overhead import stdlib_tokens


def dynamic_batch(state, n: int) -> DynamicCache:
    """A DynamicCache of ``n`` rows, each holding the resident tokens of ``state``."""
    cache = DynamicCache()
    for i, layer in enumerate(state):
        cache.update(layer["keys"].expand(n, -1, -1, -1).contiguous(), layer["values"].expand(n, -1, -1, -1).contiguous(), i)
    return cache


def chunk_steps(model, state, token, ids, args) -> list[dict]:
    """Per chunk size: ms per step of ``--chunk-rows`` decoding sessions alone, beside one prompt chunk packed,
    beside it left-padded, and of the chunk alone (medians over rounds; every arm prefills its own copy
    of the prompting session, which evicts back to the budget at each chunk's end as a session does)."""
    n = args.chunk_rows
    make = lambda: evicting_cache(model, "pace", state, args.budget, seen=args.tokens, limit=args.limit)  # noqa: E731
    rows = []
    for size in [int(c) for c in args.chunks.split(",")]:
        sessions = [make() for _ in range(n)]
        prompting = {arm: make() for arm in ("packed", "padded", "alone")}
        at = {arm: 0 for arm in prompting}

        def chunk(arm):
            part = ids[0, at[arm] % (ids.shape[1] - size):][:size]
            at[arm] += size
            return part

        def decode():
            model(token.expand(1, n), cache=CacheRows(sessions, packed=[1] * n))

        def packed():
            model(torch.cat([chunk("packed"), token.view(1).expand(n)])[None],
                  cache=CacheRows([prompting["packed"], *sessions], packed=[size] + [1] * n))

        def padded():
            x = torch.cat([chunk("padded")[None], token.view(1, 1).expand(n, size)])
            mask = torch.zeros_like(x)
            mask[0], mask[1:, -1] = 1, 1
            model(x, attention_mask=mask, cache=CacheRows([prompting["padded"], *sessions]))

        def alone():
            model(chunk("alone")[None], cache=prompting["alone"])

        arms = {"decode step": decode, "packed step": packed, "padded step": padded, "chunk alone": alone}
        times = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, fn in arms.items():
                timed(fn, 1)
                times[name].append(timed(fn, args.chunk_steps) / args.chunk_steps * 1000)
            print(f"chunk {size} round {r}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in times.items()), flush=True)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append({"chunk": size, **{f"{k} ms": round(v, 1) for k, v in ms.items()},
                     "padded / packed": round(ms["padded step"] / ms["packed step"], 2),
                     "decode rows delayed by (ms)": round(ms["packed step"] - ms["decode step"], 1),
                     "prompt tok/s, packed": round(size / (ms["packed step"] - ms["decode step"]) * 1000, 1),
                     "prompt tok/s, alone": round(size / ms["chunk alone"] * 1000, 1)})
        for cache in [*sessions, *prompting.values()]:
            cache.unbind()
    return rows


def table(title: str, rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]) + "\n"


def timed(fn, steps: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            fn()
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--sessions", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="", help="prompt chunk sizes for the mixed step (none: skipped)")
    ap.add_argument("--chunk-rows", type=int, default=8, help="decoding sessions beside each chunk")
    ap.add_argument("--chunk-steps", type=int, default=2, help="timed steps per arm and round of the mixed step")
    ap.add_argument("--out", default="bench/results/batch_decode")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    dtype = next(model.parameters()).dtype
    ids = stdlib_tokens(tokenizer, args.tokens)
    t0 = time.perf_counter()
    state, token = prefill_state(model, ids, args.chunk)
    print(f"prefilled {args.tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    state = trimmed(state, args.budget)
    counts = [int(n) for n in args.sessions.split(",") if n]
    rows = []
    for n in counts:
        sessions = [evicting_cache(model, "pace", state, args.budget, seen=args.tokens, limit=args.limit)
                    for _ in range(n)]
        dense = dynamic_batch([{k: layer[k] for k in ("keys", "values")} for layer in state], n)
        one = token.expand(1, 1)
        many = token.expand(n, 1).contiguous()
        packed = token.expand(1, n).contiguous()
        dense_one = [dynamic_batch([{k: layer[k] for k in ("keys", "values")} for layer in state], 1) for _ in range(n)]

        def alone():
            for cache in sessions:
                model(one, cache=cache)

        def together():  # as pace-serve's step: the rows' tokens packed as one sequence
            model(packed, cache=CacheRows(sessions, packed=[1] * n))

        def dense_alone():
            for cache in dense_one:
                model(one, cache=cache)

        def dense_together():
            model(many, cache=dense)

        arms = {"pace one at a time": alone, "pace batched": together,
                "dynamic one at a time": dense_alone, "dynamic batched": dense_together}
        times = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, fn in arms.items():
                timed(fn, 1)  # warm-up step
                seconds = timed(fn, args.steps)
                times[name].append(seconds)
                print(f"N={n} round {r}: {name} {n * args.steps / seconds:.2f} tok/s", flush=True)
        rate = {name: n * args.steps / statistics.median(ts) for name, ts in times.items()}
        rows.append({"sessions": n, **{f"{k} tok/s": round(v, 2) for k, v in rate.items()},
                     "batched / one at a time": round(rate["pace batched"] / rate["pace one at a time"], 2),
                     "pace / dynamic, one at a time": round(rate["pace one at a time"] / rate["dynamic one at a time"], 3),
                     "pace / dynamic, batched": round(rate["pace batched"] / rate["dynamic batched"], 3),
                     "cache MiB per session": round(cache_nbytes(sessions[0]) / 2**20, 1)})
        for cache in sessions:
            cache.unbind()

    os.makedirs(args.out, exist_ok=True)
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "tokens seen": args.tokens,
            "budget": args.budget, "limit": args.limit, "steps": args.steps, "rounds": args.rounds,
            "threads": torch.get_num_threads(), "preferred dtype": str(preferred_dtype()).removeprefix("torch.")}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"settings": meta, "rows": rows}, f, indent=1)
    text = ""
    if rows:
        text = table(f"Batched decode, {args.model} ({meta['dtype']}), PACE at {args.budget} resident of {args.tokens} "
                     f"seen, {args.steps} steps x {args.rounds} rounds (medians), {meta['threads']} threads.", rows)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text)
    if args.chunks:
        mixed = chunk_steps(model, state, token, ids, args)
        with open(os.path.join(args.out, "chunks.json"), "w") as f:
            json.dump({"settings": meta, "chunk rows": args.chunk_rows, "rows": mixed}, f, indent=1)
        mixed_text = table(f"Mixed step, {args.chunk_rows} decoding sessions and one prompt chunk, {args.model} "
                           f"({meta['dtype']}), {args.chunk_steps} steps x {args.rounds} rounds (medians), "
                           f"{meta['threads']} threads.", mixed)
        with open(os.path.join(args.out, "chunks.md"), "w") as f:
            f.write(mixed_text)
        text += "\n" + mixed_text
    print(text)

if __name__ == "__main__":
    main()
