"""The census of model families: every decoder-only causal LM of the installed transformers, built tiny.

For each family ``check(model_type)`` builds a tiny random model from its config class and answers one
of:
- ``supported``: with nothing evicted, greedy tokens and scores equal the model's own cache's (DynamicCache) for a bounded PACE
  cache; and under ``limit``, after several renumbers, every layer's keys are
  the model's own (see ``renumbered_keys_are_the_models_own``);
- ``supported without limit``: the same with nothing evicted, and ``limit`` refused at bind by name;
- ``refused``: refused at bind, with the error (which must name what is unsupported);
- ``not built``: transformers itself cannot build or run it small (the reason), so nothing is claimed.

Anything else (a crash after bind, a silent difference) is a failure of the test. ``python tests/census.py
--write`` writes ``docs/concepts/families.md`` from the same checks.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import warnings

import torch
import transformers as tf
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pace_hf import Blueprint, H2OCache, PACECache, Span, StreamingLLMCache

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
SMALL_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
                 num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=1, topk_group=1)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Families whose default layout has no attention layer among the first four: one every other layer.
LAYOUTS = {
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "kimi_linear": dict(linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16,
                                            "num_heads": 4, "short_conv_kernel_size": 4}),
}
PROMPT, NEW, CHUNK = 40, 3, 16
LIMIT = 1024
MAX_PARAMETERS = 20_000_000  # a tiny model here has about 0.1M; a family whose sizes did not shrink is not built


def families() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The family's config with small sizes, where its class has the field; None if encoder-decoder."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    if getattr(default, "is_encoder_decoder", False):
        return None
    kwargs = {}
    for name, value in {**SMALL, **SMALL_MOE}.items():
        current = getattr(default, name, None)
        if current is not None and not isinstance(current, (list, dict)):
            kwargs[name] = value
    if getattr(default, "kv_lora_rank", None) is not None:  # compressed (MLA) attention: its own head sizes
        kwargs.update(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
        if getattr(default, "q_lora_rank", None) is not None:
            kwargs["q_lora_rank"] = 32
    elif getattr(default, "head_dim", None) is not None:
        kwargs["head_dim"] = 16
    if getattr(default, "sliding_window", None) is not None:
        kwargs["sliding_window"] = 16  # a window the renumbering check can pass several times
    kwargs.update(LAYOUTS.get(model_type, {}))
    for name, value in TOKENS.items():
        if hasattr(default, name):
            kwargs[name] = value
    return cls(**kwargs)


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(*_):
        raise TimeoutError(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt, cache, new: int = NEW, chunk: int = CHUNK):
    return model.generate(prompt, **({"cache": cache} if cache is not None else {}), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          prefill_chunk_size=chunk, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=0)


def same(out, ref, atol: float = 1e-4) -> bool:
    return torch.equal(out.sequences, ref.sequences) and all(
        torch.allclose(a, b, atol=atol, rtol=0) for a, b in zip(out.scores, ref.scores))


def renumbered_keys_are_the_models_own(model) -> None:
    """Under ``limit``, after several renumbers, every layer holds the model's own keys.

    StreamingLLM with no sinks keeps one contiguous run of the latest tokens, so each renumber shifts
    every resident position by the same amount: the model (attention reads relative positions) must give
    the same tokens and scores as the unbounded cache, and a layer whose keys carry no position must hold
    bit-for-bit the unbounded cache's keys. A layer rotated that the model never rotated, or rotated in the
    wrong pair layout, fails both. Layer 0 (its keys depend on the token alone) is also compared with a
    plain DynamicCache forward of the resident tokens at their new positions: the model's own keys (an MLA layer:
    its rotary keys, and its latents unchanged)."""
    prompt, budget, limit = ids(120, seed=1), 24, 48
    unbounded = StreamingLLMCache(model, budget=budget, sinks=0, recent=budget)
    ref = greedy(model, prompt, unbounded, new=4, chunk=12)
    bounded = StreamingLLMCache(model, budget=budget, sinks=0, recent=budget, limit=limit)
    out = greedy(model, prompt, bounded, new=4, chunk=12)
    assert bounded.renumbers >= 3, bounded.renumbers
    assert same(out, ref), "renumbering changed the output"
    for i, (a, b) in enumerate(zip(bounded.layers, unbounded.layers)):
        if bounded.rotary and bounded.rotary[i] is None and getattr(a, "keys", None) is not None and a.keys.numel():
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0, msg=lambda m: f"layer {i} (no RoPE): {m}")
    first = bounded.layers[0]
    if getattr(first, "logical", None) is not None and first.keys.numel():
        logical, physical = bounded.ledger(0)
        tokens = out.sequences[0, logical[0]]
        own = tf.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=tokens[None], position_ids=physical[0][None], cache=own, use_cache=True)
        # an MLA layer (pace_hf.cache.latent) holds the rotary keys as its keys and the latents as its values
        own_keys, own_values = own.layers[0].keys, own.layers[0].values
        if getattr(first, "latent", False):
            own_keys, own_values = own_values, own_keys
            torch.testing.assert_close(first.values, own_values[:, :, -first.values.shape[2]:], atol=1e-4, rtol=0,
                                       msg=lambda m: f"layer 0 latents (never rotated): {m}")
        torch.testing.assert_close(first.keys, own_keys[:, :, -first.keys.shape[2]:], atol=1e-4, rtol=0,
                                   msg=lambda m: f"layer 0 keys at their new positions: {m}")
    bounded.unbind()
    unbounded.unbind()


def check(model_type: str) -> tuple[str, str]:
    """(status, detail) of one family; raises AssertionError where pace_hf is silently wrong or crashes."""
    warnings.simplefilter("ignore")
    try:
        with time_limit(60):
            config = tiny_config(model_type)
            if config is None:
                return "not built", "encoder-decoder"
            with torch.device("meta"):  # sizes that live in sub-configs stay full size: never build those
                size = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
            if size > MAX_PARAMETERS:
                return "not built", f"{size / 1e6:,.0f}M parameters with the small sizes (its sizes are in sub-configs)"
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as err:  # transformers' own limits: nothing to claim
        return "not built", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    refusal = None  # first bind and unbind: refusals come before any forward; the reference runs unbound
    try:
        PACECache(model, budget=512, limit=LIMIT).unbind()
    except (NotImplementedError, ValueError) as err:
        refusal = str(err).splitlines()[0]
        try:
            H2OCache(model, budget=512).unbind()
        except (NotImplementedError, ValueError) as err2:
            return "refused", str(err2).splitlines()[0]
        assert isinstance(err, ValueError) and "limit" in refusal, refusal
    try:
        with time_limit(60):
            ref = greedy(model, ids(PROMPT), None)  # the model's own cache, its own attention
    except Exception as err:
        return "not built", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    if refusal is not None:
        unbounded = H2OCache(model, budget=512)
        assert same(greedy(model, ids(PROMPT), unbounded), ref), "H2O with nothing evicted differs from DynamicCache"
        unbounded.unbind()
        return "supported without limit", refusal
    bounded = PACECache(model, Blueprint([Span(0, 10, [1])]), budget=512, limit=LIMIT)
    assert same(greedy(model, ids(PROMPT), bounded), ref), "PACE with nothing evicted differs from DynamicCache"
    bounded.unbind()
    if any(kind != "linear" for kind in bounded.layout):  # a recurrent state holds no position to renumber
        renumbered_keys_are_the_models_own(model)
    return "supported", ",".join(dict.fromkeys(bounded.layout))


def table(results: dict[str, tuple[str, str]]) -> str:
    lines = ["| family | status | layers or reason |", "|---|---|---|"]
    for name, (status, detail) in sorted(results.items()):
        lines.append(f"| `{name}` | {status} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


PAGE = """# Model families

Every decoder-only causal LM of the installed transformers ({version}), built tiny from its config class
and checked by `tests/test_census.py` (which fails when a row below no longer says what it finds):

- **supported**: with nothing evicted, a bounded PACE cache gives the model's own greedy tokens and scores;
  under `limit`, after several renumbers, every layer holds the model's own keys (a layer without RoPE
  keeps them untouched, the rest are re-rotated exactly, and the output equals the unbounded cache's).
  The last column is the layer layout the cache found (`:nope`: a layer whose keys carry no position,
  read from the model at bind, see Hybrid models).
- **supported without limit**: the same with nothing evicted; `limit` is refused at bind, by name.
- **refused**: refused at bind with the error shown, before any forward.
- **not built**: transformers itself cannot build or run the family this small, or it is not a
  decoder-only model; nothing is claimed.

Regenerate with `python tests/census.py --write`.

"""


if __name__ == "__main__":
    write = "--write" in sys.argv
    names = [a for a in sys.argv[1:] if a != "--write"] or families()
    results = {}
    for name in names:
        try:
            results[name] = check(name)
        except AssertionError as err:
            results[name] = ("WRONG", str(err).splitlines()[0] if str(err) else "assertion")
        except Exception as err:
            results[name] = ("CRASH", f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
        print(name, *results[name], sep=" | ", flush=True)
    if write:
        from pathlib import Path

        page = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "families.md"
        page.write_text(PAGE.format(version=tf.__version__) + table(results) + "\n")
