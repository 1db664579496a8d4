"""What each decoder layer of a model is, read from its config as transformers reads it.

A cache is a list of layers, one per decoder layer, and the kind of each decides what the cache may do
there (see ``EvictionCache``):

- ``full``: full attention. It holds every token it keeps, so eviction, foresight, bounded positions,
  spill and restore all run here.
- ``sliding``: a sliding window of ``window`` tokens. It keeps exactly the model's window, as
  transformers' ``DynamicSlidingWindowLayer`` does; nothing it drops could ever be read again, so no
  policy runs and nothing is spilled.
- ``linear``: linear attention (a recurrent and a conv state, no tokens): carried unchanged.

``rope`` names the layer's rotary embedding: the key of ``config.rope_parameters`` when the config
nests one RoPE per layer type (Gemma 3), ``""`` for the one RoPE of a flat config, and None for a NoPE
layer (no rotary embedding: its keys carry no position and are never re-rotated). The config only
declares it (``no_rope_layers``, a layer type whose RoPE is ``None``, a per-layer theta of 0); at bind
``pace_hf.cache.probe`` reads what each layer really does from the model, and that is what the cache uses.

Layer kinds are read with transformers' own ``get_layer_types_and_kwargs`` (``layer_types``, or
``sliding_window`` when a config sets it without them). Kinds no pace_hf cache handles are refused by
name, before anything is bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

from ..rope.params import is_nested

KINDS = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}

# Why each transformers layer type that is not handled is refused (the error names it).
REFUSED = {
    "chunked_attention": "chunked attention (Llama 4) restarts its window at fixed chunk boundaries of the "
                         "positions, which renumbering would move",
    "indexed_attention": "a sparse indexer (DeepSeek V3.2, GLM DSA) keeps its own key cache per token",
    "hybrid": "a layer that holds both a linear-attention state and full-attention KV",
    "hybrid_sliding": "a layer that holds both a linear-attention state and a sliding window",
    "conv": "a convolution-state layer (LFM2)",
    "dummy": "a layer that reads another layer's KV (KV sharing, as in Gemma 3n / 4) or holds none",
}

@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its kind, its window (sliding only) and its rotary embedding (None: NoPE).

    ``latent``: a multi-head latent attention layer (MLA: DeepSeek V3, Kimi, MiniCPM3, ...), found by the probe
    at bind. It stores one compressed latent and one decoupled rotary key per token, shared by every head
    (``cache.update(latent, k_rot)``); only the rotary key carries a position (``pace_hf.cache.latent``)."""

    kind: str
    window: int | None = None
    rope: str | None = ""
    latent: bool = False

    @property
    def evicts(self) -> bool:
        return self.kind == "full"


def layer_specs(config) -> list[LayerSpec]:
    """One ``LayerSpec`` per decoder layer of ``config`` (a model config; its text config is used).
    Raises ``NotImplementedError`` naming a layer kind no pace_hf cache handles."""
    config = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):  # transformers before 5.2x: one dict of kwargs for every layer
        kwargs = [kwargs] * len(types)
    layers = getattr(config, "num_hidden_layers", len(types))
    if len(kwargs) != len(types) or len(types) != layers:
        raise NotImplementedError(f"this model ({config.model_type}) has {layers} decoder layers but {len(types)} cache "
                                  "layers (layers that share another's KV): pace_hf does not support it")
    refused = sorted({t for t in types if t not in KINDS})
    if refused:
        why = "; ".join(f"{t!r}: {REFUSED.get(t, 'a layer kind pace_hf does not know')}" for t in refused)
        raise NotImplementedError(
            f"pace_hf caches handle full-attention, sliding-window and linear-attention layers; this model "
            f"({config.model_type}) also has {why}")
    rope = getattr(config, "rope_parameters", None) or {}
    nested = is_nested(rope)
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3, Llama 4: 1 = this layer uses RoPE
    thetas = getattr(config, "layer_rope_theta", None)  # per layer; 0 = no RoPE
    specs = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        kind = KINDS[t]
        declared = kind != "linear" and not (nested and rope.get(t) is None) and not (
            no_rope is not None and not no_rope[i]) and not (thetas is not None and not thetas[i])
        window = kw.get("sliding_window") if kind == "sliding" else None
        specs.append(LayerSpec(kind, window=window, rope=(t if nested else "") if declared else None))
    return specs


def describe(specs: list[LayerSpec]) -> list[str]:
    """The layout as the manifest and the docs write it: ``full``, ``sliding:512``, ``full:nope``, ``full:mla``,
    ``linear``."""
    out = []
    for s in specs:
        name = s.kind + (f":{s.window}" if s.window else "") + (":mla" if s.latent else "")
        out.append(name + (":nope" if s.rope is None and s.kind != "linear" else ""))
    return out


__all__ = ["KINDS", "LayerSpec", "describe", "layer_specs"]
