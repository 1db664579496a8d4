"""A subprocess for tests/test_hybrid_gemma3.py: resume a saved Gemma 3 session in a new process.

    python hybrid_worker.py STORE_DIR OUT.pt

It rebuilds the same tiny random Gemma 3 (same seed), resumes session ``hybrid`` from the disk store,
and writes the next-token logits after the probe token, with every layer's tensors.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_hybrid_gemma3 import PROBE, gemma3  # noqa: E402

from pace_hf import PACECache  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore  # noqa: E402


def main(root: str, out: str) -> None:
    model = gemma3()
    store = TieredStore([DiskTier(root)])
    cache = PACECache.resume("hybrid", store=store, model=model)
    layers = {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}
    with torch.no_grad():
        logits = model(torch.tensor([[PROBE]]), cache=cache).logits[0, -1]
    torch.save({"logits": logits, "layers": layers, "layout": cache.layout}, out)
    store.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
