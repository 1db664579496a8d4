"""A subprocess for tests/test_tiers.py's exit test (issue 71): a session on a host + disk store that
returns from ``main`` without closing anything, as scripts do; and a second process that reads back every
entry the first one's store acknowledged.

    python exit_worker.py run ROOT ACKED.json TOKENS CHUNK ROWS
    python exit_worker.py read ROOT ACKED.json

``run`` prefills TOKENS tokens in CHUNK-token steps (ROWS > 1: a batch, every row with its store), with
planned spans that are evicted, restored at their reader step and, for the last step, still being fetched
when ``main`` returns; before returning it writes each spill log's index (the versions its store took) to
ACKED.json. ``read`` opens ROOT in a new store and exits 1 unless every one of them verifies.
"""

import json
import sys

import torch
import transformers as tf

from pace_hf import Blueprint, DiskTier, HostTier, PACECache, Span, TieredStore


def run(root: str, acked: str, tokens: int, chunk: int, rows: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens + chunk)
    model = tf.LlamaForCausalLM(config).eval()
    steps = tokens // chunk
    # a slice of every chunk is read four steps later and at the end: evicted meanwhile, then restored
    plan = Blueprint([Span(s * chunk, s * chunk + chunk // 8, readers=(s + 4, steps)) for s in range(steps)])
    store = TieredStore([HostTier(max_bytes=1 << 20), DiskTier(root)])
    cache = PACECache(model, plan if rows == 1 else [plan] * rows, budget=chunk // 2, limit=2 * chunk,
                      store=store, session_id="exit")
    ids = torch.randint(3, 1024, (rows, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for step, piece in enumerate(ids.split(chunk, dim=1)):
            cache.step = step
            model(input_ids=piece, cache=cache)
    cache.step = steps  # the last reader's spans are fetched in the background; nobody waits for them
    logs = [cache.spill] if rows == 1 else [row.spill for row in cache.rows]
    with open(acked, "w") as f:
        json.dump([{"session": log.session_id, "fingerprint": log.fingerprint,
                    "keys": [v[0] for layer in log.pages for versions in layer.values() for v in versions]}
                   for log in logs], f)
    restores = sum(c.restores.stats["restores"] for c in ([cache] if rows == 1 else cache.rows))
    print(f"puts {store.stats['puts']} pending {store.stats['pending']} restores {restores}", flush=True)


def read(root: str, acked: str) -> None:
    store = TieredStore([DiskTier(root)])
    missing = 0
    with open(acked) as f:
        for log in json.load(f):
            got = store.get_many(log["keys"], fingerprint=log["fingerprint"], session_id=log["session"])
            missing += sum(g is None for g in got)
            print(log["session"], len(got) - sum(g is None for g in got), "of", len(got), "readable")
    store.close()
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
    else:
        read(sys.argv[2], sys.argv[3])
