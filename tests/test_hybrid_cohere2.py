"""Cohere2: sliding layers with RoPE (pairs interleaved), a full layer every few with no positional embedding."""

import transformers as tf
from hybrid import C, bounded, build, nothing_evicted

LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


def cohere2():
    return build(tf.Cohere2Config(**C, sliding_window=48, layer_types=LAYERS))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(cohere2())


def test_bounded_positions_move_no_nope_key():
    cache = bounded(cohere2())
    assert cache.layout == ["sliding:48"] * 3 + ["full:nope"]
    full = cache.layers[3]
    assert cache.rotary[3] is None and full.ref_keys is None  # nothing to re-rotate: no reference kept
    assert cache.rotary[0].layout == "interleaved"
