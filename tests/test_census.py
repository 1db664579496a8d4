"""Every decoder-only causal LM family of the installed transformers: supported, or refused by name.

``census.check`` does the work (see tests/census.py); ``docs/concepts/families.md`` holds its table, and each
family's row there must say what the check finds now.
"""

import functools
import re
from pathlib import Path

import census
import pytest
import torch
import transformers as tf
from census import families, renumbered_keys_are_the_models_own, tiny_config

from pace_hf import H2OCache, PACECache

DOCS = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "families.md"
# A family's verdict is deterministic (seeded): found once per run, read by every test that asks (a hybrid's
# check takes half a minute)
check = functools.cache(census.check)


def documented() -> dict[str, str]:
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", DOCS.read_text(), flags=re.M)
    return dict(rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_family_is_right_or_refused_by_name(family):
    status, detail = check(family)
    if status == "refused":
        assert "this model" in detail, detail  # every refusal names the model type and what it lacks
    assert documented().get(family) == status, f"docs/concepts/families.md says {documented().get(family)!r} for {family}: " \
                                                f"regenerate it with `python tests/census.py --write`"


@pytest.mark.parametrize("family", ["exaone_moe", "cohere2_moe", "granitemoehybrid", "afmoe"])
def test_rope_free_global_layers_are_found_from_the_model(family):
    """These families' global layers skip RoPE in their attention code, under no config field pace_hf
    knew: found by the probe, they keep no reference keys and renumbering leaves them as the model's own."""
    assert check(family)[0] == "supported"
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    cache = PACECache(model, budget=48, limit=96, recent=16)
    nope = [i for i, kind in enumerate(cache.layout) if kind.endswith(":nope")]
    assert nope and all(cache.rotary[i] is None for i in nope)
    cache.unbind()


def test_per_layer_theta_and_theta_zero():
    """Granite's per-layer ``layer_rope_theta``: each layer is re-rotated with its own theta, and 0 is no RoPE."""
    config = tiny_config("granite_swa")
    config.layer_rope_theta = [1e4, 0, 1e6, 5e5]
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cache = PACECache(model, budget=48, limit=96, recent=16)
    assert cache.rotary[1] is None and cache.layout[1].endswith(":nope")
    thetas = [1 / float(cache.rotary[i].inv_freq[1]) ** (1 / (2 / cache.rotary[i].rotary_dim)) for i in (0, 2, 3)]
    assert [round(t, -2) for t in thetas] == [1e4, 1e6, 5e5]
    cache.unbind()
    renumbered_keys_are_the_models_own(model)


@pytest.mark.parametrize("family, named", [("minimax", "own cache")])
def test_own_caches_are_refused_at_bind(family, named):
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    for make in (lambda: H2OCache(model, budget=64, recent=16), lambda: PACECache(model, budget=64, recent=16, limit=512)):
        with pytest.raises(NotImplementedError, match=re.escape(named)):
            make()
    assert model.config._attn_implementation != "pace_attention"  # a refused bind leaves the model as it was


def test_a_rotation_the_config_does_not_describe_is_refused_under_limit():
    """A model whose rotary embedding was built from another theta than its config now says: the probe sees
    keys that do not move as the config's RoPE would move them, and refuses rather than re-rotating wrongly."""
    config = tiny_config("llama")
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 37.0}
    with pytest.raises(ValueError, match="does not reproduce"):
        PACECache(model, budget=64, recent=16, limit=512)
    H2OCache(model, budget=64, recent=16).unbind()  # unbounded, nothing is re-rotated: taken
