"""A subprocess for tests/test_session.py: one part of a PACESession, in its own process.

    python session_worker.py first|resume|whole STORE_KIND STORE_ARG OUT_DIR
first: play turn 1, save, write the tokens and the cache's tensors; resume: resume and play turn 2;
whole: play both turns without interruption.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import tiny_model  # noqa: E402

from pace_bench.models import load_tokenizer  # noqa: E402
from pace_hf.session import PACESession  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore, ValkeyTier  # noqa: E402

TURN1 = "Define the constant VAULT_CODE = 4471 and the class Ledger with fields owner and balance."
FILLER = "Some unrelated notes about the weather, trains and lunch. " * 12
TURN2 = "Now write a function that returns VAULT_CODE."


def session_model():
    tokenizer = load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    return model, tokenizer


def main(mode, kind, arg, out):
    out = Path(out)
    store = TieredStore([DiskTier(arg) if kind == "disk" else ValkeyTier(arg)])
    model, tokenizer = session_model()
    if mode == "resume":
        session = PACESession.resume("agent-42", model, tokenizer, store=store)
        layers = {f"{i}/{k}": v for i, layer in enumerate(session.cache.layers) for k, v in layer.tensors().items()}
        torch.save(layers, out / "resumed.pt")
    else:
        session = PACESession(model, tokenizer, budget=48, limit=160, recent=8, store=store,
                              session_id="agent-42", chunk=32)
        defs = session.add("user", TURN1)
        session.plan(defs, readers=[3])
        session.generate(max_new_tokens=16, min_new_tokens=16)
        session.add("user", FILLER)
        session.generate(max_new_tokens=16, min_new_tokens=16)
        if mode == "first":
            session.save()
            layers = {f"{i}/{k}": v for i, layer in enumerate(session.cache.layers) for k, v in layer.tensors().items()}
            torch.save(layers, out / "saved.pt")
            store.close()
            return
    session.add("user", TURN2)
    session.generate(max_new_tokens=32, min_new_tokens=32)
    (out / f"{mode}.json").write_text(json.dumps({"ids": session.ids, "stats": session.cache.tier_stats["restores"]}))
    store.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
