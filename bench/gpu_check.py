"""GPU checks (run by bench/gpu_check.sh on a CUDA machine; the tests never need a GPU).

1. The Triton re-rotation kernel equals the torch reference on the GPU (bf16 and fp32 reference
   keys, partial rotary, both layouts).
2. The kernel's effective bandwidth for a Qwen3-8B-shaped renumber: 2,048 tokens x 36 layers x 8 KV
   heads x 128 dims, bf16 reference keys in, bf16 keys out.
3. One 64K-token session through generate on a random-weight Qwen3-8B-shaped model with B = 2,048,
   H = 4,096 and L = 8,192: tokens/s for DynamicCache, H2OCache and PACECache, and peak memory.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pace_hf.kernels import rerotate_triton
from pace_hf.rope import RotaryParams, rerotate_reference


def check_kernel() -> dict:
    out = {}
    for head_dim, rotary_dim, layout in [(128, 128, "half"), (128, 64, "half"), (64, 32, "interleaved")]:
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        p = RotaryParams(inv_freq=inv_freq, head_dim=head_dim, layout=layout)
        for in_dtype in (torch.float32, torch.bfloat16):
            keys = torch.randn(8, 4096, head_dim, device="cuda").to(in_dtype)
            src = torch.randint(0, 100_000, (8, 4096), device="cuda")
            dst = torch.randint(0, 8192, (8, 4096), device="cuda")
            want = rerotate_reference(keys, src, dst, p, torch.float32)
            got = rerotate_triton(keys, src, dst, p, torch.float32)
            err = (got - want).abs().max().item()
            out[f"{layout}_r{rotary_dim}_d{head_dim}_{str(in_dtype)[6:]}"] = err
            assert err < 5e-5, f"kernel differs from reference by {err}"
    return out


def kernel_bandwidth() -> dict:
    layers, heads, tokens, dim = 36, 8, 2048, 128
    p = RotaryParams(inv_freq=1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), head_dim=dim)
    keys = torch.randn(layers * heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    src = torch.randint(0, 1_000_000, (layers * heads, tokens), device="cuda")
    dst = torch.arange(tokens, device="cuda").expand(layers * heads, tokens)
    for _ in range(3):
        rerotate_triton(keys, src, dst, p, torch.bfloat16)
    torch.cuda.synchronize()
    reps = 50
    start = time.perf_counter()
    for _ in range(reps):
        rerotate_triton(keys, src, dst, p, torch.bfloat16)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    moved = keys.numel() * 2 * 2 + src.numel() * 8 * 2  # keys in and out, two position arrays
    return {"ms_per_renumber": round(seconds * 1e3, 3), "GB_per_s": round(moved / seconds / 1e9, 1)}


def session_throughput(tokens: int) -> dict:
    import transformers as tf

    from pace_hf import Blueprint, H2OCache, PACECache, Span

    config = tf.Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
    arms = {
        "dynamic": lambda: tf.DynamicCache(config=model.config),
        "h2o": lambda: H2OCache(model, budget=2048),
        "pace": lambda: PACECache(Blueprint([Span(0, 512, [1])]), model=model, budget=2048, limit=8192),
    }
    out = {}
    for name, make in arms.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cache = make()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, past_key_values=cache, prefill_chunk_size=4096)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out[name] = {"tokens_per_s": round(tokens / seconds, 1), "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        print(name, out[name], flush=True)
        del cache
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--session-tokens", type=int, default=65536)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["kernel_max_err"] = check_kernel()
    report["kernel_bandwidth"] = kernel_bandwidth()
    print(json.dumps(report, indent=2), flush=True)
    report["session"] = session_throughput(args.session_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
