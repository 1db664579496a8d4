"""Gemma 2: sliding and full layers alternating, attention logits soft-capped (eager attention only)."""

import torch
import transformers as tf
from hybrid import C, bounded, build, nothing_evicted

from pace_hf import attention


def gemma2():
    model = build(tf.Gemma2Config(**C, head_dim=16, sliding_window=48), attn="eager")
    assert model.config.attn_logit_softcapping is not None
    return model


def test_nothing_evicted_equals_dynamic_cache_with_eager_soft_capping():
    nothing_evicted(gemma2())


def test_bounded_positions_keep_the_plan_and_the_window():
    cache = bounded(gemma2())
    assert cache.layout == ["sliding:48", "full"] * 2


def test_soft_capped_column_sums_are_the_capped_probabilities():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 16) * 4, torch.randn(1, 2, 9, 16) * 4, torch.randn(1, 2, 9, 16)
    out, sums = attention.attention_with_column_sums(q, k, v, None, 0.25, None, softcap=5.0)
    logits = (q * 0.25) @ k.repeat_interleave(2, 1).transpose(-1, -2)
    logits = 5.0 * torch.tanh(logits / 5.0)
    causal = torch.arange(9)[None, :] <= torch.arange(6)[:, None] + 3
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (probs @ v.repeat_interleave(2, 1)).transpose(1, 2))
    torch.testing.assert_close(sums, probs.sum(2).view(1, 2, 2, 9).mean(2))
