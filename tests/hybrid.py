"""The checks every hybrid-attention family's test file runs on its tiny random model (fp32, CPU).

Each family has one file (``test_hybrid_<family>.py``) with its config and the checks of its own
(sinks, NoPE layers, linear states, ...); what they share is here:
- ``nothing_evicted``: with a budget larger than the session, greedy decoding's tokens and scores
  equal DynamicCache's (atol 1e-4), with the prefill chunked the same way;
- ``bounded``: with eviction and bounded positions, every position that reaches any rotary embedding is
  below ``limit``, a planned span stays resident in every full layer and KV head, and every sliding
  layer holds exactly the model's window.
"""

import torch
import transformers as tf
from conftest import random_ids

from pace_hf import Blueprint, H2OCache, PACECache, Span

C = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=65536)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(config, attn: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()


def greedy(model, ids, cache, new: int, chunk: int):
    return model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          prefill_chunk_size=chunk, output_scores=True, return_dict_in_generate=True)


def assert_same_decoding(out, ref, atol: float = 1e-4) -> None:
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.scores, ref.scores)):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"step {step}: {m}")  # -inf alike


def nothing_evicted(model, n: int = 300, new: int = 24, chunk: int = 64) -> None:
    ids = random_ids(n)
    ref = greedy(model, ids, tf.DynamicCache(config=model.config), new, chunk)
    for cache in (PACECache(model, Blueprint([Span(0, 20, [1])]), budget=1024, limit=2048),
                  H2OCache(model, budget=1024)):
        out = greedy(model, ids, cache, new, chunk)
        assert_same_decoding(out, ref)
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        cache.unbind()


def rotary_positions(model) -> tuple[list, list]:
    """Hooks on every rotary embedding of ``model``: the largest position each call received."""
    seen, handles = [], []

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(int(positions.max()))

    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    assert handles, "the model has no rotary embedding to watch"
    return seen, handles


def bounded(model, limit: int = 160, budget: int = 48, n: int = 400, new: int = 100, chunk: int = 32):
    """Evict and renumber; returns the cache (still bound) for the family's own checks."""
    planned = range(10, 30)
    cache = PACECache(model, Blueprint([Span(planned.start, planned.stop, [1])]), budget=budget, limit=limit,
                      recent=16)
    seen, handles = rotary_positions(model)
    try:
        model.generate(random_ids(n, seed=1), cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       prefill_chunk_size=chunk)
    finally:
        for handle in handles:
            handle.remove()
    total = n + new - 1
    assert cache.get_seq_length() == total
    assert max(seen) < limit and cache.renumbers >= 2
    assert cache.evicting_layers, "a hybrid model has full-attention layers"
    for i, layer in cache.evicting_layers:
        assert layer.resident_count == budget
        held = torch.isin(torch.tensor(planned), layer.logical).all() and all(
            torch.isin(torch.tensor(planned), head).all() for head in layer.logical)
        assert held, f"the planned span left full layer {i}"
        assert int(layer.physical.max()) < limit
    # the positions a model computes come from get_seq_length() of layer 0 (sliding in Gemma 3 and gpt-oss,
    # linear in Qwen3-Next), the mask sizes from the first layer of each kind: all must count tokens seen
    assert all(cache.get_seq_length(i) == total for i in range(len(cache.layers)))
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "cumulative_length"):
            held = layer.resident_count
            assert cache.get_mask_sizes(1, i) == (held + 1, total - held)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            assert layer.resident_count == min(total, layer.sliding_window - 1)
            assert int(layer.physical.max()) == cache.next_physical - 1  # the window ends right before the next query
    assert cache.residency(planned) == 1.0
    return cache
