"""Mistral with ``sliding_window`` set and no ``layer_types``: every layer slides."""

import transformers as tf
from conftest import random_ids
from hybrid import C, assert_same_decoding, build, greedy, rotary_positions

from pace_hf import PACECache


def mistral():
    model = build(tf.MistralConfig(**C, sliding_window=32))
    assert getattr(model.config, "layer_types", None) is None
    return model


def test_an_all_sliding_model_under_bounded_positions_equals_dynamic_cache_over_300_tokens():
    """A sliding layer reads only relative distances: re-rotating its window exactly changes nothing."""
    model = mistral()
    ids = random_ids(40, seed=4)
    ref = greedy(model, ids, tf.DynamicCache(config=model.config), 300, 16)
    cache = PACECache(model, budget=48, limit=96, recent=16)
    seen, handles = rotary_positions(model)
    out = greedy(model, ids, cache, 300, 16)
    for handle in handles:
        handle.remove()
    assert cache.layout == ["sliding:32"] * 4 and not cache.evicting_layers
    assert cache.renumbers >= 4 and max(seen) < 96
    assert_same_decoding(out, ref)
