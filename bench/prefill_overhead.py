"""Prefill throughput of DynamicCache, H2OCache and PACECache on a real model, in one run.

Arms are alternated (dynamic, h2o, pace, dynamic, h2o, pace, ...) and each arm's median time is
reported, with the time ratios H2O / DynamicCache and PACE / H2O measured in the same process, so
the numbers compare arms, not machines (the CPUs here are shared and noisy). The dtype is the one
the project picks on this machine (``preferred_dtype``). Every chunk's forward is timed too, so a
long prefill shows the full cache slowing down as it grows while a bounded cache stays flat
(``--out`` writes the report and that per-chunk curve as a PNG). Usage:

    python bench/prefill_overhead.py [--model qwen2.5-coder-0.5b] [--tokens 8192] [--chunk 2048] [--rounds 2]
    python bench/prefill_overhead.py --tokens 49152 --chunk 4096 --rounds 1 --arms dynamic,pace --out DIR
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

from pace_hf import Blueprint, H2OCache, PACECache, Span
from pace_bench.models import load_model, resolve_dtype


def stdlib_tokens(tokenizer, n: int) -> torch.Tensor:
    """Real text to prefill: Python standard-library source, read from the local install (four
    modules first, then the benchmark's filler files for long runs)."""
    import collections
    import json as json_mod
    import typing

    from pace_bench.filler import stdlib_files

    parts = [inspect.getsource(m) for m in (typing, collections, json_mod.decoder, inspect)]
    files = iter(stdlib_files())
    while True:
        ids = tokenizer("".join(parts), return_tensors="pt").input_ids
        if ids.shape[1] >= n:
            return ids[:, :n]
        more = [f.read() for f, _ in zip(files, range(16))]
        if not more:
            raise ValueError(f"only {ids.shape[1]} tokens of filler available")
        parts += more


class ChunkTimer:
    """Times every forward of ``model`` (one per prefill chunk) through a forward hook."""

    def __init__(self, model):
        self.marks: list[float] = []
        self._handle = model.register_forward_hook(lambda *_: self.marks.append(time.perf_counter()))

    def seconds(self, start: float) -> list[float]:
        ends = self.marks
        return [round(b - a, 3) for a, b in zip([start] + ends[:-1], ends)]

    def close(self):
        self._handle.remove()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds over the arms; medians reported")
    ap.add_argument("--arms", default="dynamic,h2o,pace",
                    help="comma-separated, from dynamic, h2o, pace (ratios need the arms they name)")
    ap.add_argument("--check-kept", action="store_true",
                    help="also prefill H2O with the reference score pass and compare the kept sets")
    ap.add_argument("--out", help="folder for prefill.json and the per-chunk curve (prefill_chunks.png)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    dtype = resolve_dtype(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    ids = stdlib_tokens(tokenizer, args.tokens)
    makers = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "h2o": lambda: H2OCache(model, budget=args.budget),
        "pace": lambda: PACECache(model, Blueprint([Span(0, 256, [1])]), budget=args.budget, limit=args.limit),
    }
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(names) - set(makers))
    if unknown or not names:
        ap.error(f"--arms: unknown {unknown}; choose from {sorted(makers)}")
    arms = {name: makers[name] for name in names}
    with torch.no_grad():  # warm-up outside the timings: first calls pay one-off costs
        model.generate(ids[:, :256], max_new_tokens=1, do_sample=False, cache=DynamicCache(config=model.config))
    times = {name: [] for name in arms}
    chunks = {name: [] for name in arms}  # per round: seconds of each chunk's forward
    for round_ in range(args.rounds):
        for name, make in arms.items():
            cache = make()
            timer = ChunkTimer(model)
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=1, do_sample=False, cache=cache, prefill_chunk_size=args.chunk)
            times[name].append(time.perf_counter() - start)
            chunks[name].append(timer.seconds(start))
            timer.close()
            print(f"round {round_}: {name} {times[name][-1]:.2f} s; chunks {chunks[name][-1]}", flush=True)
            del cache
    med = {name: statistics.median(ts) for name, ts in times.items()}
    results = {name: {"median_s": round(s, 2), "tokens_per_s": round(args.tokens / s, 1),
                      "all_s": [round(t, 2) for t in times[name]],
                      "chunk_s": [round(statistics.median(c), 3) for c in zip(*chunks[name])]}
               for name, s in med.items()}
    ratios = {}
    for a, b in (("h2o", "dynamic"), ("pace", "h2o"), ("pace", "dynamic")):
        if a in times and b in times:
            ratios[f"{a}_over_{b}_time"] = round(med[a] / med[b], 3)
            ratios[f"{a}_over_{b}_per_round"] = [round(x / y, 3) for x, y in zip(times[a], times[b])]
            ratios[f"{a}_over_{b}_last_chunk"] = round(results[a]["chunk_s"][-1] / results[b]["chunk_s"][-1], 3)
    report = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "budget": args.budget,
              "limit": args.limit, "dtype": str(dtype), "threads": torch.get_num_threads(),
              "rounds": args.rounds, "arms": results, "ratios": ratios}
    if args.check_kept:
        report["kept_set_vs_reference"] = kept_set_agreement(model, ids, args)
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(report, args.out)


def write_report(report: dict, out: str) -> None:
    """``prefill.json`` and ``prefill_chunks.png``: each arm's tokens/s per chunk against the
    tokens already in context, so a growing cache's slowdown is visible at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "prefill.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = [f"{report['model']} ({report['dtype'].removeprefix('torch.')}), {report['tokens']:,} tokens in chunks of "
             f"{report['chunk']:,}, B={report['budget']:,}, L={report['limit']:,}, {report['threads']} threads, "
             f"median of {report['rounds']} alternated rounds", "", "| arm | seconds | tokens/s |", "|---|---|---|"]
    lines += [f"| {name} | {arm['median_s']:.2f} | {arm['tokens_per_s']:.0f} |" for name, arm in report["arms"].items()]
    lines += ["", "| ratio | time | last chunk |", "|---|---|---|"]
    lines += [f"| {key.removesuffix('_time').replace('_over_', ' / ')} | {value:.3f} | "
              f"{report['ratios'][key.removesuffix('_time') + '_last_chunk']:.3f} |"
              for key, value in report["ratios"].items() if key.endswith("_time")]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    h = report["chunk"]
    for name, arm in report["arms"].items():
        xs = [h * (i + 1) for i in range(len(arm["chunk_s"]))]
        ax.plot(xs, [h / s for s in arm["chunk_s"]], marker="o",
                label=f"{name} ({arm['tokens_per_s']:.0f} tok/s overall)")
    ax.set_xlabel("context tokens after the chunk")
    ax.set_ylabel("prefill tokens/s of the chunk")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report['model']} ({report['dtype'].removeprefix('torch.')}), H={h:,}, "
                 f"B={report['budget']:,}, L={report['limit']:,}, {report['threads']} threads", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "prefill_chunks.png"), dpi=120)
    plt.close(fig)


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
            kept[name] = [cache.ledger(i)[0].clone() for i, _ in cache.evicting_layers]
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
