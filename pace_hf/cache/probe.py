"""What each attention layer of a model does with positions, read from the model itself at bind.

Config fields name a model's RoPE-free layers only by convention (``no_rope_layers``, a per-layer-type
``None``, a theta of 0, or nothing at all when a family's attention code simply skips RoPE on its
global layers), and families that share a design do not share those names. A cache that guessed would
re-rotate keys the model never rotated, and the output would change silently. So at bind the cache
runs the model on ``PROBE_TOKENS`` tokens twice, at positions ``0..n-1`` and ``s..s+n-1``, with a ``DynamicCache``
that records what every layer stores. ``s`` is ``SHIFT``, less where the model has fewer positions or its RoPE
switches frequencies sooner (``dynamic``, ``longrope``: the probe reads the RoPE the cache will see), and, under
``limit``, less again so that the probe too stays below ``limit`` (whenever ``limit > PROBE_TOKENS``): a user who
hooks the rotary embedding sees no position at or past ``limit``. Renumbering moves tokens only within
``0..limit-1``, so a shift inside that range is the one that must leave the output unchanged. A uniform shift changes no hidden state (attention
reads relative positions only), so per attention layer:

- keys equal under the shift: the layer carries no position (NoPE). It keeps no reference keys and is
  never re-rotated; bounded positions cost nothing there.
- keys that move exactly as the config's RoPE moves them (pairs ``half`` or ``interleaved``, whichever
  reproduces the model's keys): that RoPE.
- anything else: refused by name under ``limit``, never guessed.

A model whose output itself changes under the shift reads absolute positions (learned position
embeddings, a query scale that grows with position): renumbering would change what it computes, so
``limit`` is refused for it.

A layer that caches what multi-head latent attention caches (``cache.update(latent, k_rot)``: one
``kv_lora_rank`` latent and one rotary key per token, single-headed, read by every head) is marked ``latent``:
its latent must not move under the shift, and its rotary key is read as a layer's keys are above
(``pace_hf.cache.latent``).

The same probe refuses, whatever ``limit``, a layer whose stored tensors are not the keys its attention
scores (and are not an MLA latent), a model that does not run on
transformers' own ``DynamicCache`` (one with its own cache class), and a decoder that is not handed the
cache (the binding's hooks could not bracket its forwards). Results are kept per model.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref

import torch
from transformers import DynamicCache

from .. import attention
from ..binding import cache_from_kwargs, decoder_of
from ..rope import RotaryParams, rerotate_reference, trained_positions
from .layout import LayerSpec

PROBE_TOKENS = 8
SHIFT = 509  # positions of the second probe: far enough that every rotating pair, and a slow position scale, moves
# Relative difference below which two probes agree: rounding stays far below it, a wrong rotation far above.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
HALF_TOLERANCE = 0.1  # bf16 and fp16: real models differ by about 0.02 under the shift (Qwen 0.5B, Gemma 3 270M)

_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shift: _Reading}


class _Recorder(DynamicCache):
    """A DynamicCache that also keeps the keys and values each layer was handed."""

    def __init__(self, config):
        super().__init__(config=config)
        self.handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.handed[layer_idx] = (key_states.detach().float().cpu(), value_states.detach().float().cpu())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _ScoreShapes:
    """A score sink for ``pace_attention``: records the (KV heads, keys) each layer's scores cover."""

    def __init__(self):
        self.shapes: dict[int, tuple[int, int]] = {}

    def scores_layer(self, layer_idx: int) -> bool:
        return True

    def score_query_window(self, q_len: int):
        return None

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        self.shapes[layer_idx] = tuple(column_sums.shape[1:])


@dataclasses.dataclass
class _Reading:
    """The two probes' stored keys per layer and logits, the score shapes of the first, and how far apart
    they are and how close counts as equal (the model's dtype)."""

    keys: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]
    scored: dict[int, tuple[int, int]]
    logits: list[torch.Tensor]
    shift: int
    tolerance: float


def _shift(config, limit: int | None = None) -> int:
    """Where the second probe starts: its last position stays below the model's positions, its RoPE's switch
    length and ``limit`` (where each leaves room for one shifted probe)."""
    caps = [int(c) for c in (trained_positions(config), limit) if c]
    return SHIFT if not caps else max(1, min(SHIFT, min(caps) - PROBE_TOKENS))


def _run(model, shift: int) -> _Reading:
    config = model.config
    text = config.get_text_config(decoder=True)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 2:
        raise NotImplementedError(f"pace_hf cannot probe {text.model_type}: its config has no vocab_size")
    ids = torch.randint(min(3, vocab - 1), vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    modes = {module: module.training for module in model.modules()}
    model.eval()  # dropout would make the two probes differ
    readings, logits, sink, handed = [], [], _ScoreShapes(), []
    decoder = decoder_of(model)  # where the binding's hooks bracket every forward: it must see the cache
    hook = decoder.register_forward_pre_hook(lambda m, a, kwargs: handed.append(cache_from_kwargs(kwargs)),
                                             with_kwargs=True)
    try:
        for n, start in enumerate((0, shift)):
            cache = _Recorder(config)
            positions = torch.arange(start, start + PROBE_TOKENS, device=ids.device)[None]
            tokens = attention.enter_forward(sink) if n == 0 else None
            try:
                with torch.no_grad():
                    out = model(input_ids=ids, position_ids=positions, use_cache=True, **{_cache_argument(model): cache})
            finally:
                if tokens is not None:
                    attention.exit_forward(tokens)
            readings.append(cache.handed)
            logits.append(out.logits.detach().float().cpu())
    except NotImplementedError:
        raise
    except Exception as err:  # the model refused transformers' own cache, or the score pass failed in it
        raise NotImplementedError(
            f"pace_hf caches are transformers Cache objects scored through {attention.ATTN_NAME!r}, and a probe "
            f"forward of this model ({text.model_type}) with a DynamicCache failed: {type(err).__name__}: {err}. "
            "Models with their own cache class, or attention that cannot be scored, are not supported") from err
    finally:
        hook.remove()
        for module, mode in modes.items():
            module.training = mode
    if not any(isinstance(cache, _Recorder) for cache in handed):
        raise NotImplementedError(
            f"this model's decoder ({type(decoder).__name__}, {text.model_type}) is not handed the cache as cache= or "
            "past_key_values=, so pace_hf's hooks cannot renumber before and evict after its forwards")
    return _Reading(readings, sink.shapes, logits, shift, TOLERANCE.get(model.dtype, HALF_TOLERANCE))


def _cache_argument(model) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.24), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _matching_rotation(params: RotaryParams, k0: torch.Tensor, k1: torch.Tensor, shift: int,
                       tolerance: float) -> RotaryParams | None:
    """``params`` in the pair layout that moves the first probe's keys onto the second's, or None."""
    src = torch.arange(k0.shape[-2])
    for layout in dict.fromkeys((params.layout, "half", "interleaved")):
        candidate = dataclasses.replace(params, layout=layout)
        try:
            moved = rerotate_reference(k0, src, src + shift, candidate, out_dtype=torch.float32)
        except ValueError:  # another head size: these are not the keys this RoPE rotates
            return None
        if _relative(moved, k1) < tolerance:
            return candidate
    return None


def _is_latent(config, k0: torch.Tensor, v0: torch.Tensor, scored: tuple[int, int]) -> bool:
    """Whether a layer stores what multi-head latent attention caches (``pace_hf.cache.latent``): one latent of
    ``kv_lora_rank`` dims and one rotary key per token, each a single head, read by more heads than that."""
    rank = getattr(config, "kv_lora_rank", None)
    return (rank is not None and k0.dim() == 4 and k0.shape[:-1] == v0.shape[:-1] and k0.shape[1] == 1
            and k0.shape[-1] == rank and scored[1] == k0.shape[2] and scored[0] >= 1)


def _layer_config(config, i: int):
    """``config`` as layer ``i`` rotates: a per-layer ``layer_rope_theta`` (Granite) replaces the shared theta."""
    thetas = getattr(config, "layer_rope_theta", None)
    if not thetas:
        return config
    config = copy.copy(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": thetas[i]}
    return config


def read_layers(model, specs: list[LayerSpec], bounded: bool,
                limit: int | None = None) -> tuple[list[LayerSpec], list[RotaryParams | None]]:
    """``specs`` with ``rope`` set to None on every attention layer whose keys carry no position, and,
    when ``bounded``, the verified ``RotaryParams`` of each layer (None where nothing rotates).
    ``limit`` (when ``bounded``) keeps the probe's positions below it and admits a RoPE that switches with the
    length (``dynamic``, ``longrope``) when it is at or below the switch.
    Raises ``NotImplementedError`` naming what no cache can support, ``ValueError`` naming what bounded
    positions cannot re-rotate exactly (only when ``bounded``)."""
    config = model.config.get_text_config(decoder=True)
    limit = limit if bounded else None
    shift = _shift(config, limit)
    readings = _MEMO.setdefault(model, {})
    reading = readings.get(shift)
    if reading is None:
        reading = readings[shift] = _run(model, shift)
    kind = config.model_type
    if bounded and _relative(reading.logits[1], reading.logits[0]) >= reading.tolerance:
        raise ValueError(f"this model's ({kind}) output changes when every position moves by the same amount: it reads "
                         "absolute positions (learned position embeddings, or a query scale that grows with position), "
                         "which renumbering would change")
    out, rotary = [], []
    for i, spec in enumerate(specs):
        if spec.kind == "linear":
            out.append(spec)
            rotary.append(None)
            continue
        if i not in reading.keys[0] or i not in reading.keys[1]:
            raise NotImplementedError(f"layer {i} of this model ({kind}) is an attention layer that stored nothing "
                                      "in the cache (it reads another layer's KV): pace_hf does not support it")
        (k0, v0), (k1, v1) = reading.keys[0][i], reading.keys[1][i]
        scored = reading.scored.get(i)
        if scored is None:
            raise NotImplementedError(
                f"layer {i} of this model ({kind}) computes attention in its own code, not through transformers' "
                f"attention interface, so {attention.ATTN_NAME!r} cannot score its keys for eviction")
        if _is_latent(config, k0, v0, scored):  # MLA: (latent, k_rot), one of each per token for every head
            if spec.kind != "full":
                raise NotImplementedError(f"layer {i} of this model ({kind}) is a {spec.kind} layer with a compressed "
                                          "(MLA) cache: pace_hf keeps MLA only in full-attention layers")
            if bounded and _relative(k1, k0) >= reading.tolerance:
                raise ValueError(f"layer {i} of this model ({kind}) caches a compressed latent (MLA) that changes when "
                                 "every position moves: bounded positions re-rotate only its rotary key")
            spec = dataclasses.replace(spec, latent=True)
            k0, k1 = v0, v1  # what carries the position: the decoupled rotary key
        elif k0.shape[:-1] != v0.shape[:-1] or scored != (k0.shape[1], k0.shape[2]):
            raise NotImplementedError(
                f"layer {i} of this model ({kind}) stores tensors of shapes {tuple(k0.shape)} and {tuple(v0.shape)} "
                f"that are not the keys its attention reads ({scored[0]} heads, {scored[1]} keys): pace_hf cannot "
                "score it")
        if _relative(k1, k0) < reading.tolerance:  # no position in the keys
            out.append(dataclasses.replace(spec, rope=None))
            rotary.append(None)
            continue
        out.append(dataclasses.replace(spec, rope=spec.rope if spec.rope is not None else ""))
        if not bounded:
            rotary.append(None)
            continue
        if spec.rope is None:
            raise ValueError(f"layer {i} of this model ({kind}) rotates its keys, but its config declares no "
                                      "RoPE for it: bounded positions cannot re-rotate what they cannot reproduce")
        params = RotaryParams.from_config(_layer_config(config, i), layer_type=spec.rope or None, limit=limit)
        if spec.latent and params.head_dim != k0.shape[-1] and params.rotary_dim <= k0.shape[-1]:
            params = dataclasses.replace(params, head_dim=k0.shape[-1])  # the rotary key is its own head size
        found = _matching_rotation(params, k0, k1, reading.shift, reading.tolerance)
        if found is None:
            raise ValueError(
                f"layer {i} of this model ({kind}) moves its keys with position in a way its config's RoPE "
                f"({params.rope_type}, rotary dim {params.rotary_dim}) does not reproduce in either pair layout: "
                "bounded positions would re-rotate them wrongly")
        rotary.append(found)
    return out, rotary


__all__ = ["PROBE_TOKENS", "SHIFT", "read_layers"]
