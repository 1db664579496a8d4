"""Exact key re-rotation for every static RoPE variant (see ``RotaryParams`` and ``rerotate``)."""

from .params import INTERLEAVED_MODEL_TYPES, STATIC_ROPE_TYPES, RotaryParams
from .rerotate import rerotate, rerotate_reference

__all__ = ["RotaryParams", "rerotate", "rerotate_reference", "STATIC_ROPE_TYPES", "INTERLEAVED_MODEL_TYPES"]
