"""OLMo 3: three sliding-window layers to one full layer, one RoPE per layer type."""

import transformers as tf
from hybrid import C, bounded, build, nothing_evicted


def olmo3():
    return build(tf.Olmo3Config(**C, sliding_window=48))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(olmo3())


def test_bounded_positions_keep_the_plan_and_the_window():
    cache = bounded(olmo3())
    assert cache.layout == ["sliding:48"] * 3 + ["full"]
