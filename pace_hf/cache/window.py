"""The layers a pace_hf cache carries without evicting: sliding windows and linear-attention states.

Both keep exactly what the model itself would keep (transformers' ``DynamicSlidingWindowLayer`` and
``LinearAttentionLayer``), so no policy runs and nothing is spilled: a token a window drops, or a
state a recurrence overwrites, could never be read again. What they add is what a pace_hf cache needs
of every layer: the forward bracket (a failed forward leaves the layer as it was), bounded positions
(a window's keys follow the renumbering, exactly), and ``tensors()`` / ``load()`` for save and resume.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from ..rope import RotaryParams, rerotate


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer: the last ``sliding_window - 1`` tokens, as transformers keeps them, with
    their physical positions and, under bounded positions, a reference copy of their keys.

    Renumbering moves the whole window by one shift: its newest token ends right before the next
    query, so every distance the window sees is exactly the distance it had (a sliding layer reads only
    relative distances). Keys are re-rotated from the reference, in fp32, rounded once, as the full
    layers' are: rounding never compounds. A NoPE window (``rotary=False``) moves only its positions."""

    evicts = False

    def __init__(self, sliding_window: int, keep_reference: bool):
        super().__init__(sliding_window=sliding_window)
        self.keep_reference = keep_reference
        self.physical = self.ref_keys = self.ref_pos = None  # physical, ref_pos: [n] (every head alike)
        self._before = None

    @property
    def resident_count(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    @property
    def logical(self) -> torch.Tensor | None:
        """Logical positions ``[kv_heads, n]`` of the window: always the last ``n`` tokens seen."""
        if not self.is_initialized:
            return None
        n = self.resident_count
        return torch.arange(self.cumulative_length - n, self.cumulative_length, device=self.device).expand(
            self.keys.shape[1], n)

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True
        self.physical = torch.empty(0, dtype=torch.long, device=self.device)
        if self.keep_reference:
            self.ref_keys, self.ref_pos = self.keys, self.physical

    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if physical_start is None:
            raise RuntimeError("WindowLayer.update needs chunk positions; call it through its cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keep = self.sliding_window - 1
        full_keys, full_values = torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)
        fresh = torch.arange(key_states.shape[-2], device=self.device) + physical_start
        self.cumulative_length += key_states.shape[-2]
        # a slice keeps its whole storage alive: after a prefill chunk, copy the window out, so the layer
        # holds the window and not the chunk (a decode step's slice wastes one token: no copy)
        hold = (lambda t: t.clone()) if key_states.shape[-2] > 1 else (lambda t: t)  # noqa: E731
        self.keys, self.values = hold(full_keys[:, :, -keep:]), hold(full_values[:, :, -keep:])
        self.physical = torch.cat([self.physical, fresh])[-keep:]
        if self.keep_reference:  # keys arrive rotated at their physical position: that is the reference
            self.ref_keys = hold(torch.cat([self.ref_keys, key_states], -2)[:, :, -keep:])
            self.ref_pos = torch.cat([self.ref_pos, fresh])[-keep:]
        return full_keys, full_values

    def offsets(self, room: int) -> torch.Tensor:
        """A window keeps its distances exactly: one position per token it holds, whatever the room."""
        return torch.arange(self.resident_count - 1, -1, -1, device=self.device)

    def renumber(self, params: RotaryParams | None, physical: torch.Tensor) -> None:
        """Shift the window whole to ``physical``; keys re-rotated from the reference."""
        self.physical = physical
        if params is not None and self.keep_reference:
            self.keys = rerotate(self.ref_keys, self.ref_pos[None, None], self.physical[None, None], params,
                                 out_dtype=self.keys.dtype)

    # -- the forward bracket: update() replaces tensors (never writes in place), so holding the old
    # ones is the whole snapshot
    def begin_forward(self) -> None:
        self._before = (self.keys, self.values, self.physical, self.ref_keys, self.ref_pos, self.cumulative_length)

    def end_forward(self) -> None:
        self._before = None

    def abort_forward(self) -> None:
        if self._before is not None:
            self.keys, self.values, self.physical, self.ref_keys, self.ref_pos, self.cumulative_length = self._before
            self._before = None

    def can_drop_last(self, count: int) -> bool:
        """Whether the last ``count`` tokens can be forgotten with the window before them still whole."""
        return count == 0 or self.resident_count >= min(self.cumulative_length, count + self.sliding_window - 1)

    def drop_last(self, count: int) -> None:
        if not self.can_drop_last(count):
            raise ValueError(f"a sliding window of {self.sliding_window} no longer holds the tokens before the last "
                             f"{count}: it cannot be rewound")
        if count:
            for name in ("keys", "values", "ref_keys"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name)[:, :, :-count])
            self.physical = self.physical[:-count]
            self.ref_pos = self.ref_pos[:-count] if self.ref_pos is not None else None
            self.cumulative_length -= count

    def reset(self) -> None:
        self.cumulative_length = 0
        if self.is_initialized:
            self.lazy_initialization(self.keys[:, :, :0], self.values[:, :, :0])

    # -- save and resume ---------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("keys", "values", "physical") + (("ref_keys", "ref_pos") if self.keep_reference else ())
        return {name: getattr(self, name).contiguous() for name in names}

    def load(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        self.lazy_initialization(tensors["keys"], tensors["values"])
        self.keys, self.values, self.physical = (tensors[k].clone() for k in ("keys", "values", "physical"))
        if self.keep_reference:
            self.ref_keys, self.ref_pos = tensors["ref_keys"].clone(), tensors["ref_pos"].clone()
        self.cumulative_length = seen


class RecurrentLayer(LinearAttentionLayer):
    """A linear-attention layer (Qwen3-Next, Qwen3.5): its conv and recurrent states, carried unchanged.

    It holds no tokens and no positions. A failed forward puts the states back as they were (they are
    written in place, so the bracket keeps a copy, the size of the states, not of the context)."""

    evicts = False
    is_sliding = False

    def __init__(self, number_of_states: int = 1):
        super().__init__(number_of_states=number_of_states)
        self._before = None

    @property
    def is_initialized(self) -> bool:
        return any(self.is_conv_states_initialized.values()) or any(self.is_recurrent_states_initialized.values())

    resident_count = 0

    def _states(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                out[f"conv{i}"] = self.conv_states[i]
            if self.is_recurrent_states_initialized[i]:
                out[f"recurrent{i}"] = self.recurrent_states[i]
        return out

    def begin_forward(self) -> None:
        self._before = ({k: v.clone() for k, v in self._states().items()}, dict(self.has_previous_state))

    def end_forward(self) -> None:
        self._before = None

    def abort_forward(self) -> None:
        if self._before is None:
            return
        states, previous = self._before
        self._before = None
        for name, tensor in self._states().items():
            if name in states:
                tensor.copy_(states[name])
            else:
                tensor.zero_()
        self.has_previous_state.update(previous)

    def offsets(self, room: int) -> torch.Tensor:
        """No positions."""
        return torch.zeros(0, dtype=torch.long)

    def renumber(self, params, physical: torch.Tensor) -> None:
        """No positions to move."""

    def can_drop_last(self, count: int) -> bool:
        return count == 0

    def drop_last(self, count: int) -> None:
        if count:
            raise ValueError("a linear-attention layer's state cannot be rewound: it holds no tokens to forget")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t.contiguous() for name, t in self._states().items()}

    def load(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        for name, tensor in tensors.items():
            i = int(name.removeprefix("conv").removeprefix("recurrent"))
            if name.startswith("conv"):
                self.lazy_initialization(conv_states=tensor, state_idx=i)
                self.conv_states[i].copy_(tensor)
            else:
                self.lazy_initialization(recurrent_states=tensor, state_idx=i)
                self.recurrent_states[i].copy_(tensor)
            self.has_previous_state[i] = True


__all__ = ["RecurrentLayer", "WindowLayer"]
