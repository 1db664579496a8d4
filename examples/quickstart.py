"""PACE in ten lines: a tiny random model, a blueprint, plain ``generate``.

Runs in seconds on a CPU; tests/test_examples.py runs it in CI.
"""

import torch
import transformers as tf

from pace_hf import Blueprint, PACECache, Span

torch.manual_seed(0)
config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
model = tf.AutoModelForCausalLM.from_config(config).eval()

ids = torch.randint(0, 256, (1, 3000))
blueprint = Blueprint([Span(start=0, end=40, readers=[2])])  # step 2 will read tokens 0..39
with PACECache(blueprint=blueprint, budget=256, limit=768).bound_to(model) as cache:  # unbinds on exit
    cache.step = 1
    out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False, prefill_chunk_size=256)

logical, physical = cache.ledger()
print(f"seen {cache.get_seq_length()} tokens, resident {cache.resident_count()}, renumbers {cache.renumbers}")
print(f"planned span resident: {cache.residency(range(40)) == 1.0}, rotary gap {cache.rotary_gap(range(40))}")
print(f"largest rotary position {int(physical.max())} < limit 768; largest logical {int(logical.max())}")
