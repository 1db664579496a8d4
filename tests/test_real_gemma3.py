"""The real Gemma 3 270M (base; 5 sliding-window layers of 512 to 1 full), loaded offline by name, under a
bounded PACECache: a planned fact 3K tokens back survives in the full layers and the model recalls it."""

import inspect
import json

import pytest
import torch

from pace_hf import Blueprint, PACECache, Span

pytestmark = pytest.mark.slow

FACT = "Remember this: the vault code is 4471.\n\n"


@pytest.fixture(scope="module")
def gemma3():
    from pace_bench.models import load_model

    return load_model("gemma3-270m")


def test_gemma3_loads_by_name_as_a_hybrid(gemma3):
    model, tokenizer = gemma3
    assert model.config.model_type == "gemma3_text" and model.config.num_hidden_layers == 18
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512
    assert tokenizer.chat_template  # a base model: the packaged plain template


def test_a_planned_fact_survives_and_is_recalled_under_bounded_positions(gemma3):
    model, tokenizer = gemma3
    fact = tokenizer(FACT, return_tensors="pt").input_ids
    filler = tokenizer(inspect.getsource(json.decoder) + inspect.getsource(json.encoder), return_tensors="pt",
                       add_special_tokens=False).input_ids[:, :3000]
    question = tokenizer("\n\nThe vault code is", return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([fact, filler, question], 1)
    cache = PACECache(model, Blueprint([Span(0, fact.shape[1], readers=[1])]), budget=256, limit=1200)
    cache.step = 1
    positions = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: positions.append(int(kwargs.get("position_ids", args[1]).max())), with_kwargs=True)
    try:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, cache=cache, prefill_chunk_size=512)
    finally:
        hook.remove()
    assert max(positions) < 1200 and cache.renumbers >= 1
    assert cache.layout.count("full") == 3 and cache.resident_count() == 256
    assert cache.residency(range(fact.shape[1])) == 1.0
    assert "4471" in tokenizer.decode(out[0, ids.shape[1]:])
