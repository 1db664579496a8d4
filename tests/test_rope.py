"""pace_hf.rope against the models' own rotary embeddings (tiny random-weight models, CPU)."""

import pytest
import torch
import transformers as tf
from tiny_models import tiny_config, tiny_model

from pace_hf.rope import RotaryParams, rerotate

POSITION_PAIRS = [(0, 5000), (7000, 13), (123, 30000), (31999, 2), (4096, 4097), (60000, 1234)]


def own_key(model, layer_idx: int, position: int, token: int = 7) -> torch.Tensor:
    """The model's own post-RoPE key of ``token`` alone at ``position``: [kv_heads, head_dim].

    A lone token attends only to itself, so its keys at every layer depend on position only via RoPE.
    """
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache)
    return cache.layers[layer_idx].keys[0, :, 0]


CASES = [  # (model kind, layer index, layer type for per-layer-type RoPE)
    ("llama", 0, None), ("llama3", 0, None), ("linear", 0, None), ("legacy_linear", 0, None),
    ("qwen2_yarn", 0, None), ("qwen3", 1, None), ("phi", 0, None), ("gpt_neox", 0, None),
    ("cohere", 0, None), ("glm", 0, None),
    ("gemma3", 0, "sliding_attention"), ("gemma3", 1, "full_attention"),
]


@pytest.mark.parametrize("kind,layer,layer_type", CASES)
def test_rerotate_matches_the_models_own_keys(kind, layer, layer_type):
    model = tiny_model(kind)
    params = RotaryParams.from_config(model.config, layer_type=layer_type)
    for p, q in POSITION_PAIRS:
        k_p, k_q = own_key(model, layer, p), own_key(model, layer, q)
        moved = rerotate(k_p, torch.tensor(p), torch.tensor(q), params)
        tol = (1e-5 + 6e-8 * max(p, q)) * k_q.abs().max()
        err = (moved - k_q).abs().max()
        assert err <= tol, f"{kind} layer {layer} {p}->{q}: err {err:.3e} > tol {tol:.3e}"
        # bf16 out: the fp32 result rounded once
        moved_bf16 = rerotate(k_p, torch.tensor(p), torch.tensor(q), params, out_dtype=torch.bfloat16)
        assert moved_bf16.dtype == torch.bfloat16
        assert torch.equal(moved_bf16, moved.to(torch.bfloat16))


def test_yarn_attention_scaling_is_applied_once():
    model = tiny_model("qwen2_yarn")
    params = RotaryParams.from_config(model.config)
    assert params.attention_scaling > 1.0  # yarn's mscale is real here
    k0, k9 = own_key(model, 0, 0), own_key(model, 0, 9000)
    moved = rerotate(k0, torch.tensor(0), torch.tensor(9000), params)
    # the norm of each rotated pair is preserved: the scale already in the key is not applied again
    assert torch.allclose(moved.norm(dim=-1), k0.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(moved, k9, atol=1e-5 * k9.abs().max().item())


def test_round_trip_and_identity():
    params = RotaryParams.from_config(tiny_config("llama"))
    keys = torch.randn(2, 4, 50, 16)
    src = torch.randint(0, 8192, (2, 4, 50))
    dst = torch.randint(0, 8192, (50,))
    assert torch.allclose(rerotate(keys, src, src, params), keys, atol=1e-6)
    back = rerotate(rerotate(keys, src, dst, params), dst, src, params)
    assert torch.allclose(back, keys, atol=1e-5)


def unit_keys(n=256, head_dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, head_dim, generator=g)
    return k / k.abs().amax(dim=-1, keepdim=True)


def test_no_compounding_over_1000_renumbers():
    params = RotaryParams(inv_freq=1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128)), head_dim=128)
    ref = unit_keys().to(torch.bfloat16)  # the reference copy, as the cache stores it
    ref_pos = torch.randint(0, 8192, (ref.shape[0],), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    naive, naive_pos = ref.clone(), ref_pos.clone()
    for _ in range(1000):
        new_pos = torch.randint(0, 8192, ref_pos.shape, generator=g)
        from_ref = rerotate(ref, ref_pos, new_pos, params, out_dtype=torch.bfloat16)
        naive = rerotate(naive, naive_pos, new_pos, params, out_dtype=torch.bfloat16)  # rounds every time
        naive_pos = new_pos
    direct = rerotate(ref, ref_pos, new_pos, params, out_dtype=torch.bfloat16)
    assert torch.equal(from_ref, direct)
    exact = rerotate(ref, ref_pos, new_pos, params, out_dtype=torch.float32)
    one_rounding = (direct.float() - exact).abs().max()
    drift = (naive.float() - exact).abs().max()
    assert one_rounding <= 2 ** -8  # half a bf16 ulp at magnitude < 1... within one rounding
    assert drift > 10 * one_rounding, f"naive chained bf16 should drift: {drift} vs {one_rounding}"


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 4096},
])
def test_non_static_rope_is_refused_by_name(rope):
    config = tf.LlamaConfig(**{**dict(hidden_size=64, num_attention_heads=4), "rope_parameters": rope})
    with pytest.raises(ValueError, match=rope["rope_type"]):
        RotaryParams.from_config(config)


def test_per_layer_type_rope_needs_a_layer_type():
    config = tiny_config("gemma3")
    with pytest.raises(ValueError, match="layer_type"):
        RotaryParams.from_config(config)
    with pytest.raises(ValueError, match="nonsense"):
        RotaryParams.from_config(config, layer_type="nonsense")


def test_bad_shapes_and_positions_raise_clear_errors():
    params = RotaryParams.from_config(tiny_config("llama"))
    keys = torch.randn(2, 4, 10, 16)
    with pytest.raises(ValueError, match="head_dim"):
        rerotate(torch.randn(2, 4, 10, 32), torch.tensor(0), torch.tensor(1), params)
    with pytest.raises(ValueError, match="src_positions"):
        rerotate(keys, torch.arange(7), torch.tensor(1), params)
    with pytest.raises(ValueError, match="dst_positions"):
        rerotate(keys, torch.tensor(0), torch.zeros(3, 10, dtype=torch.long), params)
    with pytest.raises(TypeError, match="integer"):
        rerotate(keys, torch.tensor(0.5), torch.tensor(1), params)
    with pytest.raises(ValueError, match="broadcast the keys"):
        rerotate(keys[0, 0], torch.zeros(4, 10, dtype=torch.long), torch.tensor(1), params)


def test_legacy_rope_theta_and_scaling_attributes():
    class OldConfig:  # a config that predates rope_parameters
        model_type = "llama"
        hidden_size, num_attention_heads, head_dim = 64, 4, 16
        rope_theta = 1e4
        rope_scaling = {"type": "linear", "factor": 2.0}

    params = RotaryParams.from_config(OldConfig())
    assert params.rope_type == "linear"
    expected = RotaryParams.from_config(tiny_config("linear"))
    assert torch.allclose(params.inv_freq, expected.inv_freq)
