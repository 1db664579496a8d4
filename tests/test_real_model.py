"""The real SmolLM2-135M (from its wheel, no hub) through plain generate with PACECache."""

import inspect
import json

import pytest
import torch

from pace_hf import Blueprint, PACECache, Span

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    from pace_bench.models import load_model

    return load_model("smollm2-135m")


def test_smollm2_generates_under_a_bounded_pace_cache(smollm):
    model, tokenizer = smollm
    text = "Facts: the vault code is 4471.\n" + inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :3000]
    assert ids.shape[1] == 3000
    cache = PACECache(model, Blueprint([Span(0, 12, readers=[1])]), budget=512, limit=1024)
    cache.step = 1
    positions = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: positions.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    try:
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, cache=cache, prefill_chunk_size=512)
    finally:
        hook.remove()
    assert out.shape[1] == 3008
    assert max(positions) < 1024
    assert cache.renumbers >= 1 and cache.resident_count() == 512
    logical, _ = cache.ledger(0)
    assert (logical[:, :12] == torch.arange(12)).all()  # the planned span is resident
    assert tokenizer.decode(out[0, 3000:]).strip() != ""
