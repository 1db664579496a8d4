"""Gemma 3 (5 sliding-window layers to 1 full, one RoPE per layer type): the hybrid pace_hf is proven on."""

import subprocess
import sys
from pathlib import Path

import torch
import transformers as tf
from conftest import prefill, random_ids
from hybrid import C, bounded, build, nothing_evicted

from pace_hf import Blueprint, PACECache, Span
from pace_hf.rope import RotaryParams, rerotate
from pace_hf.tiers import DiskTier, TieredStore

PROBE = 42
# As the real model: local layers theta 1e4; global layers theta 1e6 with linear scaling 8.
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}


def gemma3():
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    return build(tf.Gemma3TextConfig(**{**C, "num_hidden_layers": 6}, head_dim=16, sliding_window=64,
                                     layer_types=layers, rope_parameters=ROPE))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(gemma3())


def test_bounded_positions_keep_the_plan_and_the_window():
    model = gemma3()
    cache = bounded(model)
    assert cache.layout == ["sliding:64"] * 5 + ["full"]
    # the global and local layers re-rotate with their own RoPE
    assert cache.rotary[0].inv_freq[1] != cache.rotary[5].inv_freq[1]


def test_only_the_full_layers_pay_the_score_pass():
    model = gemma3()
    cache = PACECache(model, budget=48, limit=160, recent=16)
    scored = []
    record = cache.record_attention
    cache.record_attention = lambda i, sums: (scored.append(i), record(i, sums))
    model.generate(random_ids(100), cache=cache, max_new_tokens=5, do_sample=False, prefill_chunk_size=32)
    assert set(scored) == {5} and len(scored) == 4 + 4  # 4 prefill chunks, then 4 decode steps (the last token is not fed back)


def test_window_keys_are_the_models_own_keys_after_renumbering():
    """Layer 0 is a sliding layer whose keys depend only on the token and its position: after every
    renumber, its stored keys are exactly the model's keys at their new physical positions."""
    model = gemma3()
    cache = PACECache(model, Blueprint([Span(10, 30, [1])]), budget=48, limit=160, recent=16)
    ids = random_ids(400, seed=3)
    log = []
    handle = model.model.register_forward_hook(
        lambda m, a, k, o: log.append((cache.layers[0].keys[0].clone(), cache.layers[0].physical.clone(),
                                       cache.get_seq_length())), with_kwargs=True)
    prefill(model, cache, ids, 24)
    handle.remove()
    assert cache.renumbers >= 3
    full = tf.DynamicCache()
    with torch.no_grad():
        model(ids, cache=full)
    own = full.layers[0].keys[0]  # [kv_heads, 400, d] at logical positions 0..399
    params = RotaryParams.from_config(model.config, layer_type="sliding_attention")
    for keys, physical, seen in log:
        n = keys.shape[1]
        logical = torch.arange(seen - n, seen)
        expected = rerotate(own[:, logical], logical[None], physical[None], params)
        assert (keys - expected).abs().max() <= 1e-5 * own.abs().max()


def test_save_and_resume_in_another_process_give_bit_equal_logits(tmp_path):
    model = gemma3()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    cache = PACECache(model, Blueprint([Span(10, 30, [1])]), budget=48, limit=160, recent=16, store=store,
                      session_id="hybrid")
    model.generate(random_ids(300, seed=2), cache=cache, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                   prefill_chunk_size=32)
    assert cache.renumbers >= 1 and cache.tier_stats["spilled_tokens"] > 0
    cache.save()
    layers = {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}
    with torch.no_grad():
        logits = model(torch.tensor([[PROBE]]), cache=cache).logits[0, -1]
    store.close()
    out = tmp_path / "resumed.pt"
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "hybrid_worker.py"), str(tmp_path / "kv"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(out)
    assert resumed["layout"] == cache.layout
    assert resumed["layers"].keys() == layers.keys() and any("/ref_keys" in k for k in layers)
    for key, tensor in layers.items():
        assert torch.equal(resumed["layers"][key], tensor), key
    assert torch.equal(resumed["logits"], logits)


def test_a_session_of_another_layout_is_refused(tmp_path):
    model = gemma3()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    cache = PACECache(model, budget=48, limit=160, recent=16, store=store, session_id="hybrid")
    prefill(model, cache, random_ids(100), 50)
    cache.save()
    cache.unbind()
    other = build(tf.Gemma3TextConfig(**{**C, "num_hidden_layers": 6}, head_dim=16, sliding_window=32,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"], rope_parameters=ROPE))
    try:
        PACECache.resume("hybrid", store=store, model=other)
    except ValueError as e:
        assert "another model" in str(e) or "layers" in str(e)
    else:
        raise AssertionError("a session of another layout resumed")
    store.close()


def test_an_agent_session_on_a_hybrid_plans_restores_and_resumes(tmp_path):
    """PACESession on Gemma 3: a planned definition is evicted from the full layer, restored from the
    disk tier when its step comes, and a resumed session continues exactly as the uninterrupted one."""
    from pace_bench.models import load_tokenizer
    from pace_hf.session import PACESession

    tokenizer = load_tokenizer("smollm2-135m")
    model = build(tf.Gemma3TextConfig(**{**C, "num_hidden_layers": 6, "vocab_size": len(tokenizer)}, head_dim=16,
                                      sliding_window=64, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                      rope_parameters=ROPE))

    def play(session, text):
        session.add("user", text)
        return session.generate(max_new_tokens=8, min_new_tokens=8)

    turns = ["Define VAULT_CODE = 4471 and the class Ledger.", "Notes about trains and the weather. " * 20,
             "More notes on lunch and rivers. " * 20, "Now return VAULT_CODE."]
    replies = {}
    for interrupted in (False, True):
        store = TieredStore([DiskTier(tmp_path / f"kv{interrupted}")])
        session = PACESession(model, tokenizer, budget=48, limit=200, recent=8, store=store, session_id="s", chunk=32)
        play(session, turns[0])
        play(session, turns[1])
        play(session, turns[2])
        first = session.messages[1]  # the first reply: evicted by H2O (the definition itself stays, a heavy hitter)
        assert session.cache.residency(range(first.start, first.end)) < 1.0  # evicted from the full layer
        session.plan(first, readers=[session.step + 1])  # the next turn reads it: restored when it starts
        if interrupted:
            session.save()
            store.close()
            store = TieredStore([DiskTier(tmp_path / f"kv{interrupted}")])
            session = PACESession.resume("s", model, tokenizer, store=store)
        replies[interrupted] = play(session, turns[3])
        assert session.cache.tier_stats["restores"] >= 1 and session.cache.tier_stats["restored_tokens"] > 0
        assert session.cache.residency(range(first.start, first.end)) == 1.0
        store.close()
    assert replies[True] == replies[False]


def test_the_ledger_reads_every_layer_kind():
    model = gemma3()
    cache = PACECache(model, budget=48, limit=160, recent=16)
    prefill(model, cache, random_ids(200), 40)
    logical, physical = cache.ledger(0)  # a window: the last 63 tokens, at the positions before the next query
    assert torch.equal(logical[0], torch.arange(200 - 63, 200)) and logical.shape == physical.shape
    assert int(physical.max()) == cache.next_physical - 1
    logical, physical = cache.ledger(5)  # the full layer: its budget
    assert logical.shape == (model.config.num_key_value_heads, 48)
