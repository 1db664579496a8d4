"""The score pass alone: pace_hf's attention + column sums against the torch reference and plain SDPA.

One process, arms alternated (A B C A B C ...), medians reported, ratios against SDPA, so the numbers
compare arms rather than machines. Default shape: one 4,096-token chunk on 2,048 resident tokens
(6,144 keys) with Qwen2.5-0.5B's 14/2 heads and d = 64, causal mask aligned to the end of the keys,
passed as the bool mask transformers builds. Usage:

    python bench/scoring_speed.py [--queries 4096] [--keys 6144] [--reps 3] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pace_hf import attention


def cpu_flags() -> list[str]:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return []
    return sorted({f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--keys", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: float32, plus bfloat16 where the CPU has avx512_bf16/amx")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference arm")
    args = ap.parse_args(argv)

    flags = cpu_flags()
    if args.dtype == "auto":
        dtypes = [torch.float32] + ([torch.bfloat16] if {"avx512_bf16", "amx_bf16"} & set(flags) else [])
    else:
        dtypes = [getattr(torch, args.dtype)]
    q_len, kv_len, d = args.queries, args.keys, args.dim
    scale = d ** -0.5
    causal = (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len))[None, None]
    report = {"shape": f"{q_len} queries x {kv_len} keys, {args.heads}/{args.kv_heads} heads, d={d}",
              "cpu_flags": flags, "threads": torch.get_num_threads(), "torch": torch.__version__, "runs": {}}
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, args.heads, q_len, d, generator=g).to(dtype)
        k = torch.randn(1, args.kv_heads, kv_len, d, generator=g).to(dtype)
        v = torch.randn(1, args.kv_heads, kv_len, d, generator=g).to(dtype)
        arms = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True),
            "fast_all_queries": lambda: attention.attention_with_column_sums(q, k, v, causal, scale, None),
            "fast_window_32": lambda: attention.attention_with_column_sums(q, k, v, causal, scale, 32),
            "fast_no_scores": lambda: attention.attention_with_column_sums(q, k, v, causal, scale, 0),
        }
        if not args.no_reference:
            arms["reference"] = lambda: attention.attention_with_column_sums_reference(q, k, v, causal, scale, None)
        # exactness at this shape, against the reference (the tests hold it on small ones)
        out, sums = arms["fast_all_queries"]()
        ref_out, ref_sums = attention.attention_with_column_sums_reference(q, k, v, causal, scale, None)
        exact = {"max_rel_err_sums": float(((sums - ref_sums).abs() / ref_sums.abs().clamp_min(1e-30)).max()),
                 "max_abs_err_out": float((out.float() - ref_out.float()).abs().max())}
        del out, sums, ref_out, ref_sums
        times = {name: [] for name in arms}
        for _ in range(args.reps):
            for name, fn in arms.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        run = {name: {"median_s": round(s, 3), "vs_sdpa": round(s / med["sdpa"], 2)} for name, s in med.items()}
        if "reference" in med:
            run["fast_all_queries"]["speedup_vs_reference"] = round(med["reference"] / med["fast_all_queries"], 2)
        run["exactness"] = exact
        report["runs"][str(dtype).removeprefix("torch.")] = run
        print(str(dtype), json.dumps(run), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
