"""Prefill throughput of DynamicCache, H2OCache and PACECache on a real model, in one run.

Reported as tokens/s and as ratios against DynamicCache measured in the same process, so the
numbers compare arms, not machines. Usage:

    python bench/prefill_overhead.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch
from transformers import DynamicCache

from pace_hf import Blueprint, H2OCache, PACECache, Span
from pace_hf.bench.models import load_model, preferred_dtype


def stdlib_tokens(tokenizer, n: int) -> torch.Tensor:
    """Real text to prefill: Python standard-library source, read from the local install."""
    import collections
    import json as json_mod
    import typing

    text = "".join(inspect.getsource(m) for m in (typing, collections, json_mod.decoder, inspect))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise ValueError(f"only {ids.shape[1]} tokens of filler available")
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    dtype = preferred_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    ids = stdlib_tokens(tokenizer, args.tokens)
    arms = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "h2o": lambda: H2OCache(model, budget=args.budget),
        "pace": lambda: PACECache(Blueprint([Span(0, 256, [1])]), model=model, budget=args.budget, limit=args.limit),
    }
    results = {}
    for name, make in arms.items():
        cache = make()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False, past_key_values=cache, prefill_chunk_size=args.chunk)
        seconds = time.perf_counter() - start
        results[name] = {"seconds": round(seconds, 2), "tokens_per_s": round(args.tokens / seconds, 1)}
        print(name, results[name], flush=True)
    base = results["dynamic"]["tokens_per_s"]
    for r in results.values():
        r["ratio_vs_dynamic"] = round(r["tokens_per_s"] / base, 3)
    report = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "budget": args.budget,
              "limit": args.limit, "dtype": str(dtype), "threads": torch.get_num_threads(), "arms": results}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
