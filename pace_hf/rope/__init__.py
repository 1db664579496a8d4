"""Exact key re-rotation for every static RoPE variant, and for ``dynamic``/``longrope`` below their switch
length (see ``RotaryParams`` and ``rerotate``)."""

from .params import (INTERLEAVED_MODEL_TYPES, STATIC_ROPE_TYPES, SWITCHING_ROPE_TYPES, RotaryParams, switch_length,
                     trained_positions)
from .rerotate import rerotate, rerotate_reference

__all__ = ["RotaryParams", "rerotate", "rerotate_reference", "STATIC_ROPE_TYPES", "SWITCHING_ROPE_TYPES",
           "INTERLEAVED_MODEL_TYPES", "switch_length", "trained_positions"]
