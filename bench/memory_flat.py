"""Peak KV memory of a session against its length: PACE stays flat, the full cache grows.

Prefills sessions of 16K and 48K tokens (4,096-token chunks) on a random-weight model with
Qwen2.5-Coder-0.5B's KV shape per layer (2 KV heads, head_dim 64; fewer layers and a narrow hidden
size, so that the run takes seconds: KV bytes scale with the layer count, the ratios do not), and
records after every forward the bytes the cache holds: keys, values, reference keys and the ledger for
PACE; keys and values for DynamicCache. Reports the peak per length and the 48K / 16K ratio.

    python bench/memory_flat.py [--layers 4] [--budget 2048] [--limit 8192] [--chunk 4096]
"""

from __future__ import annotations

import argparse

import torch
import transformers as tf

from pace_hf import PACECache
from pace_hf.cache import cache_nbytes


def peak_bytes(model, make_cache, tokens: int, chunk: int) -> int:
    cache = make_cache()
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    peak = 0
    with torch.no_grad():
        for piece in ids.split(chunk, dim=1):
            model(piece, cache=cache)
            peak = max(peak, cache_nbytes(cache))
    if hasattr(cache, "unbind"):
        cache.unbind()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=4096)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    arms = {
        "DynamicCache": lambda: tf.DynamicCache(config=model.config),
        "PACECache": lambda: PACECache(model, budget=args.budget, limit=args.limit),
    }
    print(f"| cache | peak KV at 16K | peak KV at 48K | 48K / 16K |  ({args.layers} layers, 2 KV heads, d 64, fp32)")
    print("|---|---|---|---|")
    for name, make in arms.items():
        small, large = (peak_bytes(model, make, n, args.chunk) for n in (16384, 49152))
        print(f"| {name} | {small / 2**20:.1f} MiB | {large / 2**20:.1f} MiB | {large / small:.2f} |")


if __name__ == "__main__":
    main()
