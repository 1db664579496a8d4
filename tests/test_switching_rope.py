"""``longrope`` (Phi-3) and ``dynamic`` NTK under ``limit``: static below their switch length, so exact there.

transformers switches them on max(position_ids) + 1: longrope to its long factor past
original_max_position_embeddings, dynamic to a grown base past max_position_embeddings. A bounded cache
keeps every position below ``limit``, so with ``limit`` at or below the switch the model only ever uses the
short-factor (base) frequencies, and re-rotation with them reproduces its keys. One past it is refused by name.
"""

import pytest
import torch
import transformers as tf
from test_rope import own_key

from pace_hf import H2OCache, PACECache, StreamingLLMCache
from pace_hf.rope import RotaryParams, rerotate

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SWITCH = 64


def longrope_model():
    """Phi-3 with longrope: short factor up to 64 positions, long factor (and the same attention factor) past it."""
    config = tf.Phi3Config(**SMALL, max_position_embeddings=4 * SWITCH, original_max_position_embeddings=SWITCH,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
                                            "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                            "long_factor": [2.0 + 0.5 * i for i in range(8)]})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def dynamic_model():
    """Llama with dynamic NTK: base frequencies up to 64 positions, a grown base past them."""
    config = tf.LlamaConfig(**SMALL, max_position_embeddings=SWITCH,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


MODELS = {"longrope": longrope_model, "dynamic": dynamic_model}


def prompt(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rope", MODELS)
def test_rerotation_below_the_switch_is_the_models_own(rope):
    """The params read at limit=switch move a key exactly as the model rotates it, anywhere below the switch;
    past the switch the model's keys are another rotation (so the check could tell)."""
    model = MODELS[rope]()
    params = RotaryParams.from_config(model.config, limit=SWITCH)
    for p, q in [(0, SWITCH - 1), (50, 3), (17, 40)]:
        k_p, k_q = own_key(model, 0, p), own_key(model, 0, q)
        torch.testing.assert_close(rerotate(k_p, torch.tensor(p), torch.tensor(q), params), k_q, atol=1e-5, rtol=0)
    far = own_key(model, 0, 3 * SWITCH)  # past the switch: the long factor / grown base
    assert (rerotate(own_key(model, 0, 0), torch.tensor(0), torch.tensor(3 * SWITCH), params) - far).abs().max() > 1e-3


@pytest.mark.parametrize("limit", [SWITCH, "auto"])
@pytest.mark.parametrize("rope", MODELS)
def test_bounded_cache_at_the_switch_holds_the_models_own_keys(rope, limit):
    """PACE with limit at the switch, several renumbers: positions reaching RoPE stay below it, and layer 0's
    resident keys (they depend on the token and its position alone) equal a plain forward's keys of the same
    tokens at their new positions. PACECache's default limit ("auto") is the switch."""
    model = MODELS[rope]()
    cache = PACECache(model, budget=24, limit=limit, recent=8)
    assert cache.limit == SWITCH
    seen = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    out = model.generate(prompt(150, seed=1), max_new_tokens=20, min_new_tokens=20, do_sample=False, cache=cache,
                         prefill_chunk_size=16, pad_token_id=0)
    hook.remove()
    assert cache.renumbers >= 3 and max(seen) < SWITCH
    logical, physical = cache.ledger(0)
    keys = cache.layers[0].keys[0]  # [kv_heads, n, head_dim]
    for h in range(keys.shape[0]):
        own = tf.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=out[:, logical[h]], position_ids=physical[h][None], cache=own)
        torch.testing.assert_close(keys[h], own.layers[0].keys[0, h], atol=1e-5, rtol=0)
    cache.unbind()


@pytest.mark.parametrize("rope, field", [("longrope", "original_max_position_embeddings"),
                                         ("dynamic", "max_position_embeddings")])
def test_one_past_the_switch_is_refused_naming_the_limit_that_works(rope, field):
    model = MODELS[rope]()
    for make in (lambda: PACECache(model, budget=24, limit=SWITCH + 1, recent=8),
                 lambda: StreamingLLMCache(model, budget=24, limit=SWITCH + 1)):
        with pytest.raises(ValueError, match=f"{rope}.*{field}={SWITCH}.*limit <= {SWITCH}"):
            make()
    assert model.config._attn_implementation != "pace_attention"  # a refused bind leaves the model as it was
    H2OCache(model, budget=24, recent=8).unbind()  # limit unset: taken, as before


def test_the_bind_probe_stays_below_limit():
    """The probe that reads each layer's RoPE at bind runs the model at shifted positions: under ``limit``
    they stay below it (the README says no position at or past ``limit`` reaches the model)."""
    config = tf.LlamaConfig(**SMALL, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    seen = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    cache = PACECache(model, budget=48, limit=96, recent=16)
    assert seen and max(seen) < 96
    assert [r is not None for r in cache.rotary] == [True, True]  # the shorter shift still finds the rotation
    cache.unbind()
    hook.remove()
