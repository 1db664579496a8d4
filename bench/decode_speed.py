"""Decode tokens/s: DynamicCache against H2OCache and PACECache in one process, and their kept sets.

What it measures (ratios against DynamicCache, arms alternated round by round, medians):
1. At ``--tokens`` (8K) resident tokens: DynamicCache, H2O and PACE (budget = tokens, so every step
   evicts one token per layer and head, as in steady state), and H2O on ``CompactingLayer``, the
   plain ``torch.cat``-and-gather layer that decode used before in-place eviction.
2. PACE at ``--budget`` (2,048) resident tokens against DynamicCache holding ``--full`` tokens (48K,
   192K). Those full caches are built directly from random KV of that length, since their prefill
   would take hours; decode cost depends on the length, not on the values. PACE's decode cost
   depends on its budget, not on how much it has seen.
3. Where the time goes: bytes read per token (weights, and KV read by attention and by the score
   pass) against this CPU's memory bandwidth, measured with a plain copy.
4. Kept sets (``--check-steps`` decode steps, H2O and PACE): each in-place layer carries a
   ``CompactingLayer`` twin fed the same keys and scores; before every eviction both must hold the
   same ledger and scores (so ``keep_index`` chooses the same tokens), after it the same kept set,
   and at the end the same keys. ``tests/test_cache.py`` holds the two end to end on tiny models.

One real prefill (``--tokens`` of standard-library source, chunks of ``--chunk``) feeds every arm:
each round rebuilds its caches from that state, so every round starts at the same length. Usage:

    python bench/decode_speed.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--steps 8] [--rounds 3]
        [--budget 2048] [--limit 8192] [--full 49152,196608] [--check-steps 256] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

from pace_hf import Blueprint, H2OCache, PACECache, Span
from pace_hf.cache import DEFAULT_RECENT, DEFAULT_SINKS, CompactingLayer, EvictingLayer, keep_index

from pace_bench.models import load_model, resolve_dtype

from prefill_overhead import stdlib_tokens


def copy_bandwidth(gib: float = 0.5, reps: int = 5) -> float:
    """GB/s of a plain tensor copy (bytes read plus bytes written), best of ``reps``."""
    src = torch.ones(int(gib * (1 << 30)) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


class ShadowedLayer(EvictingLayer):
    """An ``EvictingLayer`` whose every change is applied to a ``CompactingLayer`` twin too, with
    the tokens compared before and after each eviction (see the module doc, point 4)."""

    def __init__(self, keep_reference: bool, budget: int):
        super().__init__(keep_reference, budget)
        self.twin = CompactingLayer(keep_reference, budget)
        self.checks = self.mismatches = self.moved_total = self.evictions = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.twin.update(key_states, value_states, *args, **kwargs)
        return super().update(key_states, value_states, *args, **kwargs)

    def record_scores(self, fresh, policy):
        self.twin.record_scores(fresh, policy)
        super().record_scores(fresh, policy)

    def load(self, tensors, seen):
        self.twin.load(tensors, seen)
        super().load(tensors, seen)

    def renumber(self, params, physical):
        self.twin.renumber(params, physical)
        super().renumber(params, physical)

    def _same(self, names) -> bool:
        return all(torch.equal(getattr(self, n), getattr(self.twin, n)) for n in names)

    def keep(self, index, collect=True):
        before = self._same(("logical", "physical", "scores"))  # keep_index's inputs
        self.twin.keep(index, collect)
        evicted = super().keep(index, collect)
        self.checks += 1
        self.mismatches += not (before and self._same(("logical", "scores")))
        self.evictions += 1
        self.moved_total += self.moved
        return evicted

    def same_keys(self) -> bool:
        return self._same(self._buffers)


def prefill_state(model, ids, chunk):
    """Prefill ``ids`` once into an H2O cache that evicts nothing; its layers' tensors and the next
    token are the starting point of every arm."""
    cache = H2OCache(model, budget=ids.shape[1])
    with torch.no_grad():
        for part in ids.split(chunk, dim=1):
            logits = model(part, cache=cache).logits
    state = [layer.tensors() for layer in cache.layers]
    cache.unbind()
    return state, logits[:, -1:].argmax(-1)


def trimmed(state, budget):
    """``state`` cut to the ``budget`` tokens of highest score per head (what H2O would keep)."""
    out = []
    for layer in state:
        index = keep_index(layer["scores"], budget, DEFAULT_SINKS, DEFAULT_RECENT)
        out.append({name: t.gather(-2, index[None, :, :, None].expand(-1, -1, -1, t.shape[-1])) if t.dim() == 4
                    else t.gather(1, index) for name, t in layer.items()})
    return out


def full_cache(config, state=None, tokens=0, dtype=torch.float32):
    """A DynamicCache holding the prefilled ``state`` or ``tokens`` random tokens per layer."""
    cache = DynamicCache(config=config)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(state or [None] * config.num_hidden_layers):
        if layer is not None:
            keys, values = layer["keys"], layer["values"]
        else:
            heads = config.num_key_value_heads
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            keys = torch.randn(1, heads, tokens, dim, generator=g).to(dtype)
            values = torch.randn(1, heads, tokens, dim, generator=g).to(dtype)
        cache.update(keys, values, i)
    return cache


def evicting_cache(model, kind, state, budget, layer_class=EvictingLayer, seen=None, limit=None):
    """H2O or PACE (one planned span) holding ``state``, on ``layer_class`` layers. PACE's ``limit``
    defaults to room for the decode steps of a round before a renumber."""
    n = state[0]["keys"].shape[-2]
    if kind == "h2o":
        cache = H2OCache(budget=budget)
    else:
        cache = PACECache(blueprint=Blueprint([Span(0, 256, [1])]), budget=budget, limit=limit or n + 2048 + 64)
    cache.layer_class = layer_class
    cache.bind(model)
    for layer, tensors in zip(cache.layers, state):
        if layer.keep_reference:
            tensors = {**tensors, "ref_keys": tensors["keys"], "ref_pos": tensors["physical"]}
        layer.load(tensors, seen or n)
    cache.next_physical = int(state[0]["physical"].max()) + 1
    return cache


def decode(model, cache, token, steps):
    """Greedy decode ``steps`` tokens from ``token``; seconds per token."""
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps, token


def timed_rounds(model, builders, token, steps, rounds):
    """Per arm, the median seconds per token over ``rounds``; each round builds a fresh cache and
    decodes one warm-up step (PACE's first step at a smaller budget evicts down to it) first."""
    times = {name: [] for name in builders}
    for r in range(rounds):
        for name, build in builders.items():
            cache = build()
            decode(model, cache, token, 1)
            seconds, _ = decode(model, cache, token, steps)
            times[name].append(seconds)
            print(f"round {r}: {name} {1 / seconds:.2f} tok/s", flush=True)
            if hasattr(cache, "unbind"):
                cache.unbind()
            del cache
            gc.collect()
    return {name: statistics.median(ts) for name, ts in times.items()}


def kv_bytes(config, tokens, dtype):
    """Bytes of KV that one decode step reads: keys and values once. An evicting cache's scores come out
    of the same pass (``pace_hf.attention``: decode is one pass in every dtype)."""
    heads, layers = config.num_key_value_heads, config.num_hidden_layers
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_tensor = layers * heads * tokens * dim * torch.tensor([], dtype=dtype).element_size()
    return per_tensor * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192, help="PACE's limit at --budget (the length study's L)")
    ap.add_argument("--full", default="49152,196608", help="full-cache lengths (comma-separated; empty: none)")
    ap.add_argument("--full-steps", type=int, default=4)
    ap.add_argument("--full-rounds", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for decode (0: torch's default)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", help="folder to write the report to (decode.json)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    dtype = resolve_dtype(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    config = model.config
    n = args.tokens
    report = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "resident_tokens": n, "steps_per_round": args.steps, "rounds": args.rounds,
              "caveat": "timings share the CPU with whatever else runs on it; compare ratios, not tok/s"}
    report["copy_bandwidth_GBps"] = round(copy_bandwidth(), 2)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    report["weights_bytes"] = weights

    start = time.perf_counter()
    state, token = prefill_state(model, stdlib_tokens(tokenizer, n), args.chunk)
    report["prefill_s"] = round(time.perf_counter() - start, 1)
    print(f"prefilled {n} tokens in {report['prefill_s']} s", flush=True)
    if args.threads:  # decode only: on a shared CPU one thread avoids stalls at every parallel op
        torch.set_num_threads(args.threads)
    report["threads"] = torch.get_num_threads()

    # 1. at n resident tokens
    med = timed_rounds(model, {
        "dynamic": lambda: full_cache(config, state),
        "h2o": lambda: evicting_cache(model, "h2o", state, n),
        "pace": lambda: evicting_cache(model, "pace", state, n),
        "h2o_compacting": lambda: evicting_cache(model, "h2o", state, n, CompactingLayer),
    }, token, args.steps, args.rounds)
    arms = {}
    for name, seconds in med.items():
        read = weights + kv_bytes(config, n, dtype)
        arms[name] = {"tokens_per_s": round(1 / seconds, 3), "vs_dynamic": round(med["dynamic"] / seconds, 3),
                      "bytes_read_per_token": read,
                      "bandwidth_bound_tokens_per_s": round(report["copy_bandwidth_GBps"] * 1e9 / read, 3)}
    arms["h2o"]["vs_h2o_compacting"] = round(med["h2o_compacting"] / med["h2o"], 3)
    report["at_resident_tokens"] = arms

    # 2. PACE at the budget against full caches of --full tokens, built from random KV
    full, budget_state = {}, trimmed(state, args.budget)
    for length in [int(x) for x in args.full.split(",") if x]:
        print(f"full cache of {length} tokens: built from random KV (its prefill would take hours)", flush=True)
        med = timed_rounds(model, {
            "dynamic_full": lambda: full_cache(config, tokens=length, dtype=dtype),
            "pace_budget": lambda: evicting_cache(model, "pace", budget_state, args.budget, seen=length, limit=args.limit),
        }, token, args.full_steps, args.full_rounds)
        full[str(length)] = {
            "dynamic_tokens_per_s": round(1 / med["dynamic_full"], 3),
            "pace_tokens_per_s": round(1 / med["pace_budget"], 3),
            "pace_vs_dynamic": round(med["dynamic_full"] / med["pace_budget"], 3),
            "dynamic_bytes_read_per_token": weights + kv_bytes(config, length, dtype),
            "pace_bytes_read_per_token": weights + kv_bytes(config, args.budget, dtype),
        }
    if full:
        report["full_caches"] = {"note": "DynamicCache built directly from random KV of that length (a real "
                                 f"prefill would take hours); PACE holds budget={args.budget}", **full}

    # 3. kept sets against plain compaction
    if args.check_steps:
        checks = {}
        for kind in ("h2o", "pace"):
            cache = evicting_cache(model, kind, state, n, ShadowedLayer)
            decode(model, cache, token, args.check_steps)
            layers = cache.layers
            heads_tokens = layers[0].logical.numel()
            checks[kind] = {
                "steps": args.check_steps, "evictions": sum(layer.evictions for layer in layers),
                "mismatched_evictions": sum(layer.mismatches for layer in layers),
                "keys_values_scores_equal_at_end": all(layer.same_keys() for layer in layers),
                "moved_fraction_per_eviction": round(sum(layer.moved_total for layer in layers)
                                                     / max(1, sum(layer.evictions for layer in layers)) / heads_tokens, 4),
            }
            print(kind, json.dumps(checks[kind]), flush=True)
            cache.unbind()
        report["kept_sets_vs_compacting"] = checks

    print(json.dumps(report, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
