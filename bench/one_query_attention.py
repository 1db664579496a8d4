"""One query's attention on the CPU, as transformers' SDPA runs it and as ``pace_attention`` runs it outside
its own caches (a DynamicCache under ``pace_attention``, a layer a cache does not score).

With no mask (one sequence decoding), transformers asks torch's SDPA for ``enable_gqa``; ``pace_attention``
packs each KV head's query heads as that head's queries instead (what transformers itself does when a mask is
given). Both are the same attention; this measures what each costs, per layer, at Qwen2.5-0.5B's shape (14
query heads over 2 KV heads of 64) by default, one thread, both orders alternating within each round, and
with ``--model`` a real decode step of the model over a DynamicCache of each length, under each attention.

    python bench/one_query_attention.py --lengths 2048,8192,32768,65536 --dtypes bfloat16,float32 \
        [--model qwen2.5-coder-0.5b] --out bench/results/one_query_attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pace_hf import attention


def timed(fn, repeats: int) -> float:
    """Median ms of ``repeats`` calls (after one warm-up)."""
    fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs)


def layer_row(n: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, args) -> dict:
    g = torch.Generator().manual_seed(n)
    query = torch.randn(1, heads, 1, dim, generator=g).to(dtype)
    key, value = (torch.randn(1, kv_heads, n, dim, generator=g).to(dtype) for _ in range(2))
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    arms = {
        "transformers": lambda: sdpa_attention_forward(module, query, key, value, None, scaling=dim ** -0.5),
        "pace_attention": lambda: attention.attend(None, module, 0, query, key, value, None, 0.0, dim ** -0.5,
                                                   None, None, {}),
    }
    got = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else reversed(list(arms))):
            got[arm].append(timed(arms[arm], args.repeats))
    ms = {arm: statistics.median(v) for arm, v in got.items()}
    return {"kind": "layer", "tokens": n, "dtype": str(dtype).removeprefix("torch."), **{f"{a} ms": round(v, 3) for a, v in ms.items()},
            "transformers / pace_attention": round(ms["transformers"] / ms["pace_attention"], 2)}


def model_rows(args, lengths, dtypes) -> list[dict]:
    """One decode step of ``--model`` over a DynamicCache of ``n`` random keys per layer, under the model's
    SDPA and under ``pace_attention`` (the same weights, the same cache)."""
    from transformers import DynamicCache

    from pace_bench.models import load_model

    rows = []
    for dtype in dtypes:
        model = load_model(args.model, dtype=dtype)[0]
        text = model.config.get_text_config()
        dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        token = torch.tensor([[100]])
        for n in lengths:
            cache = DynamicCache(config=model.config)
            g = torch.Generator().manual_seed(n)
            for layer in range(text.num_hidden_layers):
                k, v = (torch.randn(1, text.num_key_value_heads, n, dim, generator=g).to(dtype) for _ in range(2))
                cache.update(k, v, layer)

            def step(model=model, token=token, cache=cache):
                with torch.no_grad():
                    model(token, cache=cache)
                cache.crop(-1)

            got = {"sdpa": [], attention.ATTN_NAME: []}
            for r in range(args.rounds):
                for name in (got if r % 2 == 0 else reversed(list(got))):
                    model.set_attn_implementation(attention.register() if name != "sdpa" else "sdpa")
                    got[name].append(timed(step, max(1, args.repeats // 4)))
            model.set_attn_implementation("sdpa")
            ms = {name: statistics.median(v) for name, v in got.items()}
            rows.append({"kind": f"{args.model} step", "tokens": n, "dtype": str(dtype).removeprefix("torch."),
                         "transformers ms": round(ms["sdpa"], 1), "pace_attention ms": round(ms[attention.ATTN_NAME], 1),
                         "transformers / pace_attention": round(ms["sdpa"] / ms[attention.ATTN_NAME], 2)})
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    lines = [(f"One query's attention on the CPU, {torch.get_num_threads()} thread(s), medians of {args.rounds} rounds "
              f"(orders alternating); a layer: {args.heads} query heads over {args.kv_heads} KV heads of {args.dim}."), "",
             "| what | keys | dtype | transformers' SDPA (enable_gqa) ms | pace_attention (packed) ms | ratio |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['tokens']:,} | {r['dtype']} | {r['transformers ms']} | {r['pace_attention ms']} "
                     f"| **{r['transformers / pace_attention']}** |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192,32768,65536")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="also time one decode step of this model (pace_bench.models)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows = []
    for dtype in dtypes:
        for n in lengths:
            rows.append(layer_row(n, dtype, args.heads, args.kv_heads, args.dim, args))
            print(rows[-1], flush=True)
    if args.model:
        rows += model_rows(args, lengths, dtypes)
    print(table(rows, args))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(table(rows, args))


if __name__ == "__main__":
    main()
