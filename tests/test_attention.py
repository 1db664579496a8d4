"""pace_attention's attention equals SDPA, and its column sums equal eager probabilities.

Three implementations are held equal: ``attention_with_column_sums_reference`` (the plain one-pass
torch twin), the CPU fast path ``attention_with_column_sums`` (torch's flash kernel plus a swapped
second pass) and, in test_kernels.py, the Triton kernels.
"""

import warnings

import pytest
import torch

from pace_hf import attention


def _eager(query, key, value, mask, scaling, last_queries):
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    if mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
        logits = logits.masked_fill(~causal, float("-inf"))
    elif mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask
    probs = logits.softmax(-1)
    out = (probs @ v).transpose(1, 2)
    rows = probs if last_queries is None else probs[:, :, probs.shape[2] - last_queries:]
    sums = rows.sum(2).view(query.shape[0], key.shape[1], group, -1).mean(2)
    return out, sums


def _inputs(q_len=23, kv_len=40, hq=6, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g).to(dtype)
                 for h, n in ((hq, q_len), (hkv, kv_len), (hkv, kv_len)))


def _masks(q_len, kv_len):
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    window = causal & (torch.arange(kv_len)[None, :] >= torch.arange(q_len)[:, None] + (kv_len - q_len) - 6)
    return {
        "none": None,
        "bool": causal[None, None],
        "float": torch.zeros(q_len, kv_len).masked_fill(~causal, float("-inf"))[None, None],
        "sliding_bool": window[None, None],  # not causal: takes the masked column pass
        "bias": torch.randn(q_len, kv_len, generator=torch.Generator().manual_seed(1))[None, None],
    }


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("last_queries", [None, 5, 0])
def test_reference_matches_eager_and_sdpa(monkeypatch, mask_kind, last_queries):
    monkeypatch.setattr(attention, "_BLOCK_ELEMS", 6 * 40 * 7)  # several query blocks, one straddling the window
    query, key, value = _inputs()
    mask = _masks(23, 40)[mask_kind]
    out, sums = attention.attention_with_column_sums_reference(query, key, value, mask, 0.25, last_queries)
    expected_out, expected_sums = _eager(query, key, value, mask, 0.25, last_queries)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums, expected_sums, atol=1e-5, rtol=1e-5)
    causal = _masks(23, 40)["bool"]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal, scale=0.25, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(23, 40), (40, 40), (1, 40), (1, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "sliding_bool", "bias"])
@pytest.mark.parametrize("last_queries", [None, 5, 1, 0])
@pytest.mark.parametrize("causal_pass", ["swapped", "blocked"])
def test_fast_path_equals_reference_fp32(monkeypatch, shape, mask_kind, last_queries, causal_pass):
    monkeypatch.setattr(attention, "_SCORE_BLOCK_ELEMS", 6 * 40 * 4)  # several blocks in the blocked pass
    monkeypatch.setattr(attention, "_DIRECT_ROWS", 0 if causal_pass == "swapped" else 64)
    q_len, kv_len = shape
    query, key, value = _inputs(q_len, kv_len)
    mask = _masks(q_len, kv_len)[mask_kind]
    out, sums = attention.attention_with_column_sums(query, key, value, mask, 0.25, last_queries)
    want_out, want_sums = attention.attention_with_column_sums_reference(query, key, value, mask, 0.25, last_queries)
    assert out.shape == want_out.shape and out.is_contiguous() and sums.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums, want_sums, atol=1e-7, rtol=1e-5)  # the bar: 1e-5 relative


def test_fast_path_bf16_keeps_dtypes_and_scores_in_fp32():
    query, key, value = _inputs(31, 50, dtype=torch.bfloat16)
    out, sums = attention.attention_with_column_sums(query, key, value, None, 0.25, None)
    want_out, want_sums = attention.attention_with_column_sums_reference(query, key, value, None, 0.25, None)
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)  # a bf16 rounding apart
    torch.testing.assert_close(sums, want_sums, atol=1e-4, rtol=1e-3)
    assert torch.allclose(sums.sum(-1), torch.full((1, 2), 31.0), rtol=1e-4)  # each query's row sums to 1


def test_bf16_output_keeps_the_query_dtype():
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    out, sums = attention.attention_with_column_sums_reference(q, k, v, None, 0.25, None)
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    assert torch.allclose(sums.sum(-1), torch.full((1, 4), 8.0), atol=1e-4)  # each query's row sums to 1


def test_causal_masks_are_recognised_and_others_kept():
    masks = _masks(5, 9)
    assert attention._causal_or_mask(masks["bool"], 5, 9) is None
    assert attention._causal_or_mask(masks["float"], 5, 9) is None
    wide = torch.cat((masks["bool"], torch.zeros(1, 1, 5, 3, dtype=torch.bool)), dim=-1)  # longer than kv_len
    assert attention._causal_or_mask(wide, 5, 9) is None
    kept = attention._causal_or_mask(masks["sliding_bool"], 5, 9)
    assert kept is not None and torch.equal(kept, masks["sliding_bool"])
    min_fill = torch.zeros(1, 1, 5, 9).masked_fill(~masks["bool"], torch.finfo(torch.float32).min)
    assert attention._causal_or_mask(min_fill, 5, 9) is None
    flipped = masks["bool"].clone()
    flipped[..., 0, 0] = False
    assert attention._causal_or_mask(flipped, 5, 9) is not None  # edited in place: checked again


def test_the_mask_check_is_kept_for_one_forward_and_works_on_inference_tensors():
    with torch.inference_mode():  # inference tensors have no version counter to key a memo on
        sliding = _masks(5, 9)["sliding_bool"].clone()
        tokens = attention.enter_forward(_RecordingCache())
        try:
            first = attention._causal_or_mask(sliding, 5, 9)
            assert attention._causal_or_mask(sliding, 5, 9) is first  # every layer of the forward: one check
        finally:
            attention.exit_forward(tokens)
        assert attention.ACTIVE_CACHE.get() is None and attention._MASK_MEMO.get() is None
        assert attention._causal_or_mask(sliding, 5, 9) is not first  # the next forward checks afresh


class _RecordingCache:
    def __init__(self, window=None):
        self.window, self.recorded = window, []

    def scores_layer(self, layer_idx):
        return True

    def score_query_window(self, q_len):
        return self.window

    def record_attention(self, layer_idx, sums):
        self.recorded.append(sums)


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_output_attentions_warns_once():
    query, key, value = _inputs()
    token = attention.ACTIVE_CACHE.set(_RecordingCache())
    try:
        attention._warned_attentions = False
        with pytest.warns(UserWarning, match="output_attentions=True returns no attention weights"):
            out, weights = attention.pace_attention_attention(_Layer(), query, key, value, None, output_attentions=True)
        assert weights is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            attention.pace_attention_attention(_Layer(), query, key, value, None, output_attentions=True)
    finally:
        attention.ACTIVE_CACHE.reset(token)


def test_torch_compile_runs_the_pass_eagerly_without_recompiling():
    """Under torch.compile the attention is one opaque call: results equal eager, and masks with new
    contents (same shapes) do not recompile."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    layer = _Layer()

    def step(query, key, value, mask):
        out, _ = attention.pace_attention_attention(layer, query * 1.0, key, value, mask)
        return out + 1

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    cache = _RecordingCache()
    token = attention.ACTIVE_CACHE.set(cache)
    try:
        query, key, value = _inputs()
        masks = _masks(23, 40)
        for kind in ("bool", "sliding_bool", "bool"):
            got = compiled(query, key, value, masks[kind])
            want = attention.attention_with_column_sums_reference(query, key, value, masks[kind], 0.25, None)[0] + 1
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        frames = counter.frame_count
        compiled(query, key, value, masks["sliding_bool"])
        assert counter.frame_count == frames  # no recompile
    finally:
        attention.ACTIVE_CACHE.reset(token)
        torch._dynamo.reset()
    assert len(cache.recorded) == 4


def test_the_core_imports_and_runs_without_triton():
    """Triton is the ``cuda`` extra: with it unimportable, pace_hf imports, scores and re-rotates on CPU."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch, pace_hf, pace_hf.kernels
from pace_hf.attention import attention_with_column_sums
from pace_hf.rope import RotaryParams, rerotate
q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16)
out, sums = attention_with_column_sums(q, k, k, None, 0.25, None)
p = RotaryParams(inv_freq=1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16)), head_dim=16, layout="half")
rerotate(k, torch.arange(5), torch.arange(5) + 3, p)
assert "triton" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
try:
    pace_hf.kernels.rerotate_triton
except ImportError:
    print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_scores_are_the_one_rows_softmax(dtype):
    """One query: its probabilities are the column sums. On a strided view of a buffer with room to
    spare (as the cache holds keys) the decode pass gives the bits it gives on a contiguous copy, and
    it matches the reference and torch's own attention. It is one pass (logits, softmax, values) in
    both dtypes; in bf16 the logits are bf16, so the scores are a bf16 rounding from the fp32 reference."""
    g = torch.Generator().manual_seed(5)
    query = torch.randn(1, 6, 1, 16, generator=g).to(dtype)
    buffer = torch.randn(1, 2, 300, 16, generator=g).to(dtype)
    key, value = buffer[:, :, :257], torch.randn(1, 2, 257, 16, generator=g).to(dtype)
    out, sums = attention.attention_with_column_sums(query, key, value, None, 0.25, None)
    again_out, again_sums = attention.attention_with_column_sums(query, key.contiguous(), value, None, 0.25, None)
    assert torch.equal(out, again_out) and torch.equal(sums, again_sums)
    want_out, want_sums = attention.attention_with_column_sums_reference(query, key, value, None, 0.25, None)
    bf16 = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(sums, want_sums, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 3e-2)
    torch.testing.assert_close(out, want_out, **bf16)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), **bf16)
    torch.testing.assert_close(sums.sum(-1), torch.ones(1, 2))  # each query head's row sums to 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_outside_a_cache_packs_its_heads_and_equals_sdpa(dtype, monkeypatch):
    """A lone query with no cache of ours (a DynamicCache under pace_attention, a layer the cache does not
    score) runs as SDPA over each KV head with its query heads packed as queries, not transformers'
    ``enable_gqa`` call (about 10x slower on the CPU in bf16): the same attention as transformers' SDPA,
    on views as the cache holds them too. A mask, several queries, or one query head per KV head keep
    transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(7)
    query = torch.randn(1, 6, 1, 16, generator=g).to(dtype)
    buffer = torch.randn(1, 2, 90, 16, generator=g).to(dtype)
    key, value = buffer[:, :, :77], torch.randn(1, 2, 77, 16, generator=g).to(dtype)
    want = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)[0]
    calls = []
    monkeypatch.setattr(attention, "_one_query_packed",
                        lambda *a, real=attention._one_query_packed: calls.append(1) or real(*a))
    got = attention.attend(None, module, 0, query, key, value, None, 0.0, 0.25, None, None, {})
    assert calls and got.shape == want.shape == (1, 1, 6, 16) and got.dtype == dtype
    torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}))
    mask = torch.ones(1, 1, 1, 77, dtype=torch.bool)
    for q, k, m in ((query, key, mask), (torch.cat([query, query], 2), key, None), (query[:, :2], key, None)):
        calls.clear()
        attention.attend(None, module, 0, q, k, value, m, 0.0, 0.25, None, None, {})
        assert not calls


def test_a_full_cache_decodes_through_pace_attention_as_through_sdpa(monkeypatch):
    """A DynamicCache under ``pace_attention`` gives SDPA's logits; its one-token steps run packed."""
    from transformers import DynamicCache

    from tiny_models import tiny_model

    model = tiny_model("qwen2", attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    logits, calls = {}, []
    monkeypatch.setattr(attention, "_one_query_packed",
                        lambda *a, real=attention._one_query_packed: calls.append(1) or real(*a))
    for name in ("sdpa", attention.register()):
        model.set_attn_implementation(name)
        cache, out = DynamicCache(config=model.config), []
        with torch.no_grad():
            out.append(model(ids[:, :30], cache=cache).logits)
            out += [model(ids[:, p:p + 1], cache=cache).logits for p in range(30, 40)]
        logits[name] = torch.cat(out, 1)
    model.set_attn_implementation("sdpa")
    assert len(calls) == 10 * model.config.num_hidden_layers
    torch.testing.assert_close(logits[attention.ATTN_NAME], logits["sdpa"], atol=1e-5, rtol=1e-4)
