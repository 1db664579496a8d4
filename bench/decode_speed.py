"""Decode tokens/s with 8K resident tokens: DynamicCache against H2OCache and PACECache, one process.

Each arm is prefilled once with the same ``--tokens`` (budget = tokens, so H2O and PACE keep all of
them resident and then score, and evict one token per step, as in steady state). Then rounds of
``--steps`` greedy decode steps alternate over the arms (dynamic, h2o, pace, dynamic, ...); the
full cache is cropped back after each round so every round starts from the same length. Medians
and ratios against DynamicCache are reported. Usage:

    python bench/decode_speed.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

from pace_hf import Blueprint, H2OCache, PACECache, Span

from pace_bench.models import load_model, preferred_dtype

from prefill_overhead import stdlib_tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", help="folder to write the report to (decode.json)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    dtype = preferred_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    ids = stdlib_tokens(tokenizer, args.tokens)
    n = args.tokens
    caches = {
        "dynamic": DynamicCache(config=model.config),
        "h2o": H2OCache(model, budget=n),
        # limit leaves room for the decode steps of every round before a renumber
        "pace": PACECache(Blueprint([Span(0, 256, [1])]), model=model, budget=n, limit=n + args.chunk + 64),
    }
    prefill, text = {}, {}
    for name, cache in caches.items():
        start = time.perf_counter()
        with torch.no_grad():  # the cache holds n tokens; the one generated is fed by the first round
            text[name] = model.generate(ids, max_new_tokens=1, do_sample=False, cache=cache,
                                        prefill_chunk_size=args.chunk)
        prefill[name] = round(time.perf_counter() - start, 1)
        print(f"prefilled {name} in {prefill[name]} s", flush=True)

    times = {name: [] for name in caches}
    for round_ in range(args.rounds):
        for name, cache in caches.items():
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(text[name], max_new_tokens=args.steps, min_new_tokens=args.steps,
                                     do_sample=False, cache=cache)
            times[name].append(time.perf_counter() - start)
            text[name] = out
            if name == "dynamic":  # back to the same resident length for the next round
                cache.crop(n - cache.get_seq_length())  # 5.24 takes minus the count to drop
                text[name] = out[:, : n + 1]
            print(f"round {round_}: {name} {args.steps / times[name][-1]:.2f} tok/s", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    results = {name: {"tokens_per_s": round(args.steps / s, 2), "prefill_s": prefill[name]} for name, s in med.items()}
    for name in results:
        results[name]["vs_dynamic"] = round(med["dynamic"] / med[name], 3)
    report = {"model": args.model, "resident_tokens": n, "steps_per_round": args.steps, "rounds": args.rounds,
              "dtype": str(dtype), "threads": torch.get_num_threads(), "arms": results}
    print(json.dumps(report, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
