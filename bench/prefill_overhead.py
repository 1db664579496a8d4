"""Prefill throughput of DynamicCache, H2OCache and PACECache on a real model, in one run.

Arms are alternated (dynamic, h2o, pace, dynamic, h2o, pace, ...) and each arm's median time is
reported, with the time ratios H2O / DynamicCache and PACE / H2O measured in the same process, so
the numbers compare arms, not machines (the CPUs here are shared and noisy). The dtype is the one
the project picks on this machine (``preferred_dtype``). Usage:

    python bench/prefill_overhead.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--chunk 2048] [--rounds 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
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
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds over the arms; medians reported")
    ap.add_argument("--check-kept", action="store_true",
                    help="also prefill H2O with the reference score pass and compare the kept sets")
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
    with torch.no_grad():  # warm-up outside the timings: first calls pay one-off costs
        model.generate(ids[:, :256], max_new_tokens=1, do_sample=False, cache=DynamicCache(config=model.config))
    times = {name: [] for name in arms}
    for round_ in range(args.rounds):
        for name, make in arms.items():
            cache = make()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=1, do_sample=False, cache=cache, prefill_chunk_size=args.chunk)
            times[name].append(time.perf_counter() - start)
            print(f"round {round_}: {name} {times[name][-1]:.2f} s", flush=True)
            del cache
    med = {name: statistics.median(ts) for name, ts in times.items()}
    results = {name: {"median_s": round(s, 2), "tokens_per_s": round(args.tokens / s, 1),
                      "all_s": [round(t, 2) for t in times[name]]} for name, s in med.items()}
    ratios = {"h2o_over_dynamic_time": round(med["h2o"] / med["dynamic"], 3),
              "pace_over_h2o_time": round(med["pace"] / med["h2o"], 3),
              "pace_over_dynamic_time": round(med["pace"] / med["dynamic"], 3)}
    ratios["h2o_over_dynamic_per_round"] = [round(h / d, 3) for h, d in zip(times["h2o"], times["dynamic"])]
    ratios["pace_over_h2o_per_round"] = [round(p / h, 3) for p, h in zip(times["pace"], times["h2o"])]
    report = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "budget": args.budget,
              "limit": args.limit, "dtype": str(dtype), "threads": torch.get_num_threads(),
              "rounds": args.rounds, "arms": results, "ratios": ratios}
    if args.check_kept:
        report["kept_set_vs_reference"] = kept_set_agreement(model, ids, args)
    print(json.dumps(report, indent=2))


def kept_set_agreement(model, ids, args) -> dict:
    """Prefill H2OCache with the fast score pass and with the torch reference; compare what each
    keeps (per layer and KV head: the share of the kept tokens both keep, and exact matches)."""
    from pace_hf import attention

    kept = {}
    fast = attention.attention_with_column_sums
    for name, fn in (("fast", fast), ("reference", attention.attention_with_column_sums_reference)):
        attention.attention_with_column_sums = fn
        try:
            cache = H2OCache(model, budget=args.budget)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=1, do_sample=False, cache=cache, prefill_chunk_size=args.chunk)
            kept[name] = [cache.ledger(i)[0].clone() for i in range(len(cache.layers))]
        finally:
            attention.attention_with_column_sums = fast
    overlaps, exact = [], 0
    for a, b in zip(kept["fast"], kept["reference"]):
        for ha, hb in zip(a, b):
            common = len(set(ha.tolist()) & set(hb.tolist()))
            overlaps.append(common / max(1, len(hb)))
            exact += int(torch.equal(ha, hb))
    return {"layer_heads": len(overlaps), "identical": exact, "min_overlap": round(min(overlaps), 4),
            "mean_overlap": round(sum(overlaps) / len(overlaps), 5)}


if __name__ == "__main__":
    main()
