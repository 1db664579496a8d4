"""``CacheRows``: the caches of several sequences run as the rows of one batched forward.

Every pace_hf cache keeps one sequence: its own budget, ledger, scores, positions and memory. A batch
is a list of such caches, one per row, that one forward of the model serves together:
- the weights are read once for every row (the projections and the MLP run batched), which is where a
  batch gains on a CPU as on a GPU;
- attention runs row by row, each row on its own resident keys through the same path a cache alone
  takes (``pace_hf.attention.attend``), so no row's keys are padded, masked or copied for the others,
  and every row keeps exactly what it would keep alone;
- pad tokens (``attention_mask`` 0, e.g. left padding) are never given to a row: they are not stored,
  scored, counted as sinks, spilled or planned, and the row's logical positions count its own tokens.

``model.generate(ids, attention_mask=mask, cache=cache)`` with a batch of ``b`` builds ``b`` rows inside
the cache (``cache.rows``). pace-serve builds ``CacheRows([...], packed=[...])`` over its sessions' caches
for a step: the rows' tokens one after another as one sequence (``input_ids [1, sum(packed)]``), so one
row's prefill chunk and the other rows' single decode tokens share a forward without padding (a padded
batch of 8 rows would run 8 times the chunk through every projection). Linear-attention layers (a
recurrent state per sequence, written by the model itself) and beam search are refused by name.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import Cache

from .. import attention
from .window import WindowLayer


class FixedRows:
    """What transformers may ask of a cache's rows and a pace_hf cache refuses: reordering them for beams,
    repeating them, cutting them. Each row keeps its own tokens; a cache's rows are fixed at its first forward."""

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("pace_hf caches do not support beam search (num_beams must be 1)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("pace_hf caches cannot repeat their rows: give generate the rows it will run")

    def batch_select_indices(self, indices):
        raise NotImplementedError("pace_hf caches cannot drop rows in place: build CacheRows of the rows to keep")


class CacheRows(FixedRows, Cache):
    """Row ``r`` of the batch is ``rows[r]``, a one-sequence pace_hf cache bound to the model.

    What transformers sees: ``update`` stores each row's part of the chunk in that row (pads dropped)
    and returns a zero-strided stand-in of the batch's shape; ``pace_attention`` finds the rows' keys
    here (``attend_rows``). ``get_seq_length`` counts the columns the batch was given (pads included),
    which is what ``generate`` slices its input by; each row's own count is ``rows[r].get_seq_length()``.
    """

    def __init__(self, rows, packed=None):
        rows = list(rows)
        if not rows:
            raise ValueError("CacheRows needs at least one row")
        binding = rows[0].binding
        for i, row in enumerate(rows):
            if getattr(row, "binding", None) is None:
                raise RuntimeError(f"row {i} of the batch is not bound to a model: bind every row first")
            if row.binding is not binding:
                raise ValueError(f"row {i} is bound to another model than row 0: a batch runs one model")
            if row.in_forward:
                raise RuntimeError(f"row {i} is inside a forward already")
            if len(row.rows) != 1:
                raise ValueError(f"row {i} holds a batch of its own: a row is a one-sequence cache")
            if any(kind == "linear" for kind in row.layout):
                raise NotImplementedError(
                    f"this model has linear-attention layers ({type(row).__name__}.layout: 'linear'): their recurrent "
                    "state is written by the model itself, per batch row, and pads would enter it; batches are not "
                    "supported for it yet. Run one sequence at a time")
        if len({id(row) for row in rows}) != len(rows):
            raise ValueError("a cache appears twice in the batch: every row needs its own cache")
        if packed is not None and (len(packed) != len(rows) or min(packed) < 1):
            raise ValueError(f"packed gives each of the {len(rows)} rows its count of tokens (>= 1), got {packed}")
        Cache.__init__(self, layers=[])
        self.rows = rows
        self.packed = None if packed is None else list(packed)  # per row: its tokens of the one packed sequence
        self.binding = binding
        limits = [row.limit for row in rows]
        self.limit = None if None in limits else min(limits)
        self.columns = max(row.get_seq_length() for row in rows)
        self._active: list | None = None  # per row: (batch row, its columns in it, how many), or None: none
        self._kv: dict[int, list] = {}  # per layer, per row: the keys and values its attention reads

    # -- what transformers calls -------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0  # the padding mask's length; the mask itself is never built

    @property
    def is_sliding(self) -> list[bool]:
        return self.rows[0].is_sliding

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._active is None:
            raise RuntimeError("CacheRows.update outside a forward: pass the batch to a model bound to its rows")
        stored = []
        for row, active in zip(self.rows, self._active):
            if active is None:
                stored.append(None)
                continue
            b, columns, _ = active
            keys, values = (t[b:b + 1] if columns is ALL else t[b:b + 1, :, columns] for t in (key_states, value_states))
            stored.append(row.update(keys, values, layer_idx))
        self._kv[layer_idx] = stored
        longest = max((k.shape[-2] for k, _ in filter(None, stored)), default=0)
        b, heads = key_states.shape[:2]
        if getattr(self.rows[0].layers[layer_idx], "latent", False):
            return _latents_padded(stored, b, longest, key_states, value_states)
        stand_in = lambda t: t.new_zeros(()).expand(b, heads, longest, t.shape[-1])  # noqa: E731
        return stand_in(key_states), stand_in(value_states)

    # -- attention, row by row (called by ``pace_attention``) ----------------------------------------
    def attend_rows(self, module, query, layer_idx: int, scaling, dropout: float, softcap, sinks, kwargs,
                    key=None, value=None):
        """The batch's attention output ``[b, q, q_heads, d_v]``: each row's queries against its own keys,
        through the path a cache alone takes; a pad query's output is zeros (nothing reads it).

        An MLA layer's attention reads keys and values the model decompressed from the latents ``update``
        returned (each row's, left-aligned): ``key`` and ``value``, cut to each row's own tokens."""
        latent = getattr(self.rows[0].layers[layer_idx], "latent", False)
        stored = self._kv.pop(layer_idx, None)
        if stored is None:
            raise RuntimeError(f"layer {layer_idx} attended without storing its keys in the batch's rows first")
        outs = []
        for row, active, kv in zip(self.rows, self._active, stored):
            if active is None:
                outs.append(None)
                continue
            b, columns, _ = active
            keys, values = kv
            if latent:  # the model's own decompression of this row's latents
                n = keys.shape[-2]
                keys, values = key[b:b + 1, :, :n], value[b:b + 1, :, :n]
            q = query[b:b + 1] if columns is ALL else query[b:b + 1, :, columns]
            mask = _window_mask(row.layers[layer_idx], q.shape[2], keys.shape[-2])
            outs.append(attention.attend(row, module, layer_idx, q, keys, values, mask, dropout, scaling, softcap,
                                         sinks, kwargs))
        if self.packed is not None:  # the rows' tokens one after another
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if all(entry is not None and entry[1] is ALL for entry in self._active):  # every row has every column (decode)
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        first = next(o for o in outs if o is not None)
        out = first.new_zeros(query.shape[0], query.shape[2], *first.shape[2:])
        for active, rows_out in zip(self._active, outs):
            if rows_out is not None:
                b, columns, _ = active
                out[b, columns] = rows_out[0]
        return out

    # -- the forward bracket (called by the binding's hooks) --------------------------------------------
    @property
    def in_forward(self) -> bool:
        return self._active is not None

    @property
    def batch(self) -> int:
        """The input's batch size: one sequence when the rows are packed, else one row each."""
        return 1 if self.packed is not None else len(self.rows)

    def bracket_for(self, batch: int) -> "CacheRows":
        if batch != self.batch:
            raise ValueError(f"this batch takes an input of {self.batch} rows, but the input has {batch}")
        return self

    def check_prompt(self, input_ids) -> None:
        """A batch's rows were filled one by one: only the batch size can be checked against them."""
        if input_ids.shape[0] != self.batch:
            raise ValueError(f"this batch takes an input of {self.batch} rows, but the input has {input_ids.shape[0]}")

    def begin_forward(self, q_len: int, ids=None, attention_mask=None) -> torch.Tensor:
        """Give each row its tokens of the chunk (those ``attention_mask`` keeps; packed: its own run of
        columns); returns the batch's ``position_ids``, each row's from its own cache (a pad's is its row's
        first)."""
        active = self._packed_columns(q_len, attention_mask) if self.packed is not None else \
            self._columns(q_len, attention_mask)
        positions = torch.zeros(self.batch, q_len, dtype=torch.long)
        begun = []
        try:
            for row, entry in zip(self.rows, active):
                if entry is None:  # all pads in this chunk: the row sits the forward out
                    continue
                b, columns, n = entry
                row_ids = None if ids is None else ids[b:b + 1] if columns is ALL else \
                    ids[b:b + 1, columns if isinstance(columns, slice) else columns.to(ids.device)]
                start = row.begin_forward(n, row_ids)
                begun.append(row)
                if columns is not ALL and not isinstance(columns, slice):
                    positions[b] = start
                positions[b, columns] = torch.arange(start, start + n)
        except BaseException:
            for row in begun:
                row.abort_forward()
            raise
        device = ids.device if ids is not None else (attention_mask.device if attention_mask is not None else None)
        if device is not None:
            active = [e if e is None or isinstance(e[1], slice) else (e[0], e[1].to(device), e[2]) for e in active]
        self._active = active
        return positions.to(device) if device is not None else positions

    def _columns(self, q_len: int, attention_mask) -> list:
        """A padded batch: row ``r`` is input row ``r``, its columns those its mask keeps."""
        keep = _columns_kept(attention_mask, len(self.rows), q_len)
        active = []
        for r in range(len(self.rows)):
            columns = ALL if keep is None or bool(keep[r].all()) else keep[r].nonzero().flatten()
            n = q_len if columns is ALL else columns.numel()
            active.append(None if n == 0 else (r, columns, n))
        if all(entry is None for entry in active):
            raise ValueError("every token of this forward is padding (attention_mask is 0 for all of them)")
        return active

    def _packed_columns(self, q_len: int, attention_mask) -> list:
        """A packed batch: row ``r`` is the ``packed[r]`` columns after the rows before it."""
        if q_len != sum(self.packed):
            raise ValueError(f"the packed rows hold {sum(self.packed)} tokens, but the input has {q_len}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("a packed batch has no padding: pass no attention_mask")
        ends = list(itertools.accumulate(self.packed))
        return [(0, slice(end - n, end), n) for n, end in zip(self.packed, ends)]

    def end_forward(self, q_len: int) -> None:
        active, self._active, self._kv = self._active, None, {}
        for row, entry in zip(self.rows, active):
            if entry is not None:
                row.end_forward(entry[2])
        self.columns += q_len

    def abort_forward(self) -> None:
        active, self._active, self._kv = self._active, None, {}
        for row, entry in zip(self.rows or [], active or []):
            if entry is not None:
                row.abort_forward()


ALL = slice(None)  # a row that takes every column of the chunk (no pad in it)


def _columns_kept(attention_mask, batch: int, q_len: int) -> torch.Tensor | None:
    """``[b, q_len]`` bool: the chunk's tokens that are not padding (None: all of them)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
        raise NotImplementedError(
            f"a batch takes a 2D padding mask [batch, columns] as generate builds it (got {tuple(attention_mask.shape)}): "
            "pace_hf caches build each row's attention themselves")
    if attention_mask.shape[1] < q_len:
        raise ValueError(f"the attention_mask covers {attention_mask.shape[1]} columns, fewer than this forward's {q_len}")
    keep = attention_mask[:, -q_len:].to("cpu").bool()
    return None if bool(keep.all()) else keep


def _latents_padded(stored, b: int, longest: int, key_states, value_states):
    """An MLA layer's ``(latent, k_rot)`` for the batch ``[b, 1, longest, dim]``: each row's resident tokens
    left-aligned, zeros after. The model decompresses them into per-head keys and values, which
    ``attend_rows`` cuts back to each row's own tokens; a row that sits the forward out stays zeros."""
    out = []
    for i, like in enumerate((key_states, value_states)):
        padded = like.new_zeros(b, like.shape[1], longest, like.shape[-1])
        for r, kv in enumerate(stored):
            if kv is not None:
                padded[r:r + 1, :, :kv[i].shape[-2]] = kv[i]
        out.append(padded)
    return tuple(out)


def _window_mask(layer, q_len: int, kv_len: int) -> torch.Tensor | None:
    """A sliding window's mask for a row's chunk (bool ``[1, 1, q, kv]``, True: attend); None where the
    causal mask aligned to the end of the keys is the whole rule (full layers, and one query in a window)."""
    if not isinstance(layer, WindowLayer) or q_len == 1:
        return None
    query = torch.arange(kv_len - q_len, kv_len)[:, None]
    key = torch.arange(kv_len)[None, :]
    seen = (key <= query) & (key > query - layer.sliding_window)
    return seen[None, None].to(layer.device)


__all__ = ["CacheRows", "FixedRows"]
