"""What a model's rotary embedding does, read from its config.

Re-rotating a cached key is only exact if it uses the very same inverse frequencies, attention
scaling and pair layout as the model. We obtain frequencies and scaling from transformers' own RoPE
init functions (the model's rotary class for ``default``) instead of re-deriving the formulas.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# RoPE types whose frequencies do not depend on the sequence length: a key rotated at p can be moved
# exactly to p'.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
# RoPE types that transformers switches with the length (``dynamic_rope_update``, on max(position_ids) + 1):
# static up to their switch length (see ``switch_length``), so exact under a ``limit`` at or below it.
SWITCHING_ROPE_TYPES = ("dynamic", "longrope")

# The pair layout lives in the model code, not in the config. These models rotate pairs (2i, 2i+1);
# every other model rotates (i, i + d/2) with ``rotate_half``.
INTERLEAVED_MODEL_TYPES = frozenset(
    {"cohere", "cohere2", "cohere2_moe", "glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe"}
)

LAYOUTS = ("half", "interleaved")


@dataclass(frozen=True)
class RotaryParams:
    """The rotary embedding of one layer type.

    ``inv_freq`` holds one fp32 frequency per rotated pair, so ``rotary_dim = 2 * len(inv_freq)``
    (smaller than ``head_dim`` for partial rotary; the remaining dims are not rotated).
    ``attention_scaling`` is YaRN's mscale: stored keys already carry it, so re-rotation must not
    apply it again; it is kept here for reference only.
    """

    inv_freq: torch.Tensor
    head_dim: int
    attention_scaling: float = 1.0
    layout: str = "half"
    rope_type: str = "default"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown rotary layout {self.layout!r}; expected one of {LAYOUTS}")
        if self.inv_freq.ndim != 1 or 2 * self.inv_freq.numel() > self.head_dim:
            raise ValueError(
                f"inv_freq of shape {tuple(self.inv_freq.shape)} does not fit head_dim {self.head_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def from_config(cls, config: Any, layer_type: str | None = None, limit: int | None = None) -> "RotaryParams":
        """Read the RoPE of ``config`` (a model or its config); ``layer_type`` picks one of Gemma3-style
        per-layer-type RoPEs (e.g. ``"sliding_attention"`` or ``"full_attention"``).

        ``dynamic`` and ``longrope`` are read only with a ``limit`` at or below their switch length: every
        position then stays below it, where transformers uses their base (short-factor) frequencies."""
        config = getattr(config, "config", config)  # accept a model too
        config = getattr(config, "get_text_config", lambda: config)()
        if not hasattr(config, "standardize_rope_params"):
            config = _LegacyConfig(config)
        params, layer_type = _layer_rope(config, layer_type)
        nested = layer_type is not None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in SWITCHING_ROPE_TYPES:
            switch, field = _switch(config, params, rope_type)
            if limit is None or limit > switch:
                raise ValueError(
                    f"RoPE type {rope_type!r} switches frequencies once max(position_ids) + 1 exceeds {field}="
                    f"{switch}: exact key re-rotation keeps every position below limit, so it needs limit <= "
                    f"{switch}" + ("" if limit is None else f" (got limit={limit})")
                )
        elif rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} is not supported: exact key re-rotation needs frequencies that "
                f"do not change with the sequence length (supported: {', '.join(STATIC_ROPE_TYPES)}; "
                f"{', '.join(SWITCHING_ROPE_TYPES)} with limit at or below their switch length)"
            )
        kwargs = {"layer_type": layer_type} if nested else {}
        if rope_type == "default":
            init_fn = _default_init_fn(config)
        else:
            init_fn = ROPE_INIT_FUNCTIONS[rope_type]
        # No seq_len: the frequencies the rotary embedding is built with, which transformers keeps below the
        # switch (dynamic: the base ones; longrope: the short factor, with its attention factor)
        inv_freq, scaling = init_fn(config, device=torch.device("cpu"), **kwargs)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layout = "interleaved" if config.model_type in INTERLEAVED_MODEL_TYPES else "half"
        return cls(
            inv_freq=inv_freq.detach().to(torch.float32).cpu(),
            head_dim=int(head_dim),
            attention_scaling=float(scaling),
            layout=layout,
            rope_type=rope_type,
        )


def switch_length(config: Any) -> int | None:
    """The most positions (max(position_ids) + 1) for which the config's RoPE stays static: the smallest switch
    length over its layer types, None where no layer type switches with the length."""
    config = getattr(config, "config", config)
    config = getattr(config, "get_text_config", lambda: config)()
    try:
        if not hasattr(config, "standardize_rope_params"):
            config = _LegacyConfig(config)
        rope = _rope_parameters(config)
    except ValueError:  # no RoPE at all
        return None
    lengths = []
    for params in (rope.values() if is_nested(rope) else [rope]):
        rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
        if rope_type in SWITCHING_ROPE_TYPES:
            lengths.append(_switch(config, params, rope_type)[0])
    return min(lengths) if lengths else None


def trained_positions(config: Any) -> int | None:
    """The most positions the model reads as it was trained to: ``max_position_embeddings``, capped by a
    switching RoPE's switch length (None where the config states neither). It is a bounded cache's
    ``limit="auto"``: below it, every rotary distance is one the model has seen."""
    config = getattr(config, "config", config)
    config = getattr(config, "get_text_config", lambda: config)()
    caps = [c for c in (getattr(config, "max_position_embeddings", None), switch_length(config)) if c]
    return min(int(c) for c in caps) if caps else None


def _switch(config: Any, params: dict, rope_type: str) -> tuple[int, str]:
    """(switch length, the field it comes from): transformers' ``dynamic_rope_update`` grows ``dynamic``'s base
    once max(position_ids) + 1 > max_position_embeddings, and moves ``longrope`` to its long factor once it is
    > original_max_position_embeddings."""
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if original:
            return int(original), "original_max_position_embeddings"
    return int(config.max_position_embeddings), "max_position_embeddings"


def _layer_rope(config: Any, layer_type: str | None) -> tuple[dict, str | None]:
    """The RoPE dict of ``layer_type`` (None where the config has one RoPE for every layer) and that type."""
    rope = _rope_parameters(config)
    if not is_nested(rope):
        return rope, None
    if layer_type is None:
        raise ValueError(f"this config has one RoPE per layer type {sorted(rope)}; pass layer_type=")
    if layer_type not in rope or rope[layer_type] is None:
        raise ValueError(f"unknown layer_type {layer_type!r}; the config has {sorted(rope)}")
    return rope[layer_type], layer_type


def is_nested(rope: dict) -> bool:
    return bool(rope) and all(isinstance(v, dict) or v is None for v in rope.values())


class _LegacyConfig:
    """A view of a config that predates ``rope_parameters``, shaped for transformers' RoPE init
    functions (they call ``standardize_rope_params`` and read ``rope_parameters``)."""

    def __init__(self, config: Any):
        self._config = config
        self.rope_parameters = _rope_parameters(config)

    def standardize_rope_params(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def _rope_parameters(config: Any) -> dict:
    """The config's RoPE dict, standardized from the legacy ``rope_scaling``/``rope_theta`` form."""
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    rope = getattr(config, "rope_parameters", None)
    if rope is None:  # legacy configs that were never standardized
        legacy = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
        if theta is None and not legacy:
            raise ValueError(f"{type(config).__name__} has no rope_parameters, rope_scaling or rope_theta")
        legacy.setdefault("rope_type", legacy.pop("type", "default"))
        if theta is not None:
            legacy.setdefault("rope_theta", theta)
        rope = legacy
    return dict(rope)


def _default_init_fn(config: Any):
    """The model's own ``compute_default_rope_parameters`` (it knows e.g. partial rotary)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module_name = model_type_to_module_name(config.model_type)
    try:
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError as err:
        raise ValueError(f"cannot find the modeling code of model type {config.model_type!r}") from err
    for obj in vars(module).values():
        fn = getattr(obj, "compute_default_rope_parameters", None)
        if isinstance(obj, type) and fn is not None and obj.__name__.endswith("RotaryEmbedding"):
            return fn
    raise ValueError(f"model type {config.model_type!r} has no rotary embedding class")
