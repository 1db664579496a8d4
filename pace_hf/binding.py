"""Binding caches to a model, reversibly.

A pace_hf cache needs three things from the model it serves, none of which a ``Cache`` object can do
from inside ``update()``:
- a forward pre-hook on the decoder, to renumber before a chunk and hand physical ``position_ids`` to
  the rotary embedding;
- a forward hook, to evict at the chunk boundary (so every layer announces the same kv length);
- the ``pace_attention`` attention function, which also yields the column sums that scores need.

One ``Binding`` per model holds these and is shared by every cache bound to it. Each cache holds one
reference; when the last one is released (``cache.unbind()``, leaving ``with cache.bound_to(model)``,
or the cache being garbage-collected) the model is exactly as loaded again: no hooks, no wrappers,
its original attention implementation.

While a bounded cache keeps every rotary position below the model's maximum, transformers' "exceeded
the model's predefined maximum length" reminder would be wrong, so ``generate`` is wrapped to drop
that one check for generations that use such a cache, and only for them.

The binding knows caches only through ``ForwardBracket``, the few members its hooks call, and the
attention function only through ``attention.ScoreSink``: integration imports no cache class.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from typing import Protocol, runtime_checkable

import torch

from . import attention
from .blueprint import as_index

_ATTR = "_pace_hf_binding"
# True while a generate call that uses a bounded pace_hf cache (limit <= max positions) runs.
_POSITIONS_BOUNDED: contextvars.ContextVar = contextvars.ContextVar("pace_positions_bounded", default=False)


@runtime_checkable
class ForwardBracket(Protocol):
    """What the hooks call on a cache around each forward of the model it is bound to."""

    binding: "Binding | None"
    limit: int | None  # rotary positions stay below it (None: unbounded)

    @property
    def in_forward(self) -> bool: ...

    def begin_forward(self, q_len: int, ids=None) -> int:
        """Prepare for ``q_len`` new tokens (their ``ids`` ``[1, q_len]``, or None for embeddings);
        return the first rotary position they get."""

    def check_prompt(self, input_ids) -> None:
        """Before ``generate``: refuse an input that does not continue what the cache holds."""

    def bracket_for(self, batch: int) -> "ForwardBracket":
        """What runs a forward of ``batch`` rows: the cache itself for one sequence, or its rows."""

    def end_forward(self, q_len: int) -> None:
        """The forward finished: evict at the chunk boundary."""

    def abort_forward(self) -> None:
        """The forward raised: undo its partial writes."""


def _is_pace_cache(obj) -> bool:
    return isinstance(obj, ForwardBracket)


def cache_from_kwargs(kwargs):
    """The cache argument: ``cache`` (transformers >= 5.24) or ``past_key_values`` (earlier 5.x)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def query_tokens(args, kwargs) -> torch.Tensor:
    """The decoder's input (ids or embeddings): ``[batch, q_len, ...]``."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    return args[0] if tokens is None and args else tokens


def decoder_of(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model


COMPILED = ("pace_hf caches do not run under torch.compile, and this model's forward is compiled "
            "(torch.compile(model.forward) or model.compile()): the hooks, the cache and the score pass break the "
            "graph at every layer and the cache's counters change every forward, so a compiled forward gains "
            "nothing and recompiles (or fails inside torch). Run the model uncompiled while a pace_hf cache is "
            "bound to it")


def check_not_compiled(model) -> None:
    """Refuse a model whose forward (or its decoder's) was compiled, in pace_hf's own words."""
    for module in (model, decoder_of(model)):
        if getattr(module.forward, "_torchdynamo_orig_callable", None) is not None or \
                getattr(module, "_compiled_call_impl", None) is not None:
            raise NotImplementedError(COMPILED)


def check_left_padded(attention_mask) -> None:
    """Refuse a right-padded batch before generate runs it. ``generate`` takes every row's next token from
    the last column's logits: a row that ends in padding would continue from a pad's, and differ from its
    prompt run alone (so does each such row under ``DynamicCache``, with only a warning of transformers').
    Pads elsewhere (on the left, or a gap inside a row) are dropped from their row and change nothing."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return
    ending = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
    if ending:
        shown = ", ".join(map(str, ending[:8])) + (", ..." if len(ending) > 8 else "")
        raise ValueError(
            f"the batch is right-padded: row(s) {shown} of attention_mask end in padding, and generate would "
            "continue each from a pad's logits (a row would differ from its prompt run alone, as it does with "
            "DynamicCache). Pad on the left: tokenizer.padding_side = 'left' before tokenizing the batch")


class Binding:
    """The hooks, wrappers and attention switch of one model, shared by the caches bound to it."""

    def __init__(self, model):
        self.model_ref = weakref.ref(model)
        self.decoder = decoder_of(model)
        self.original_attn = model.config._attn_implementation
        self.users = 0
        name = attention.register()
        if self.original_attn != name:
            model.set_attn_implementation(name)
        self.handles = [
            self.decoder.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            self.decoder.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]
        self.active_tokens: list = []  # one per running forward: how to reset ACTIVE_CACHE after it
        self.wrapped = {}
        for method in ("generate", "_get_stopping_criteria"):
            if hasattr(model, method):
                self.wrapped[method] = getattr(model, method)
                setattr(model, method, getattr(self, "_" + method.lstrip("_"))(self.wrapped[method]))
        setattr(self.decoder, _ATTR, self)

    @classmethod
    def acquire(cls, model) -> "Binding":
        binding = getattr(decoder_of(model), _ATTR, None) or cls(model)
        binding.users += 1
        return binding

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        model = self.model_ref()
        if model is not None:
            for method in self.wrapped:
                model.__dict__.pop(method, None)
            if model.config._attn_implementation != self.original_attn:
                model.set_attn_implementation(self.original_attn)
        if getattr(self.decoder, _ATTR, None) is self:
            delattr(self.decoder, _ATTR)

    # -- hooks -------------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        self.active_tokens.append(None)  # the post-hook runs even when this one raises
        cache = cache_from_kwargs(kwargs)
        if not _is_pace_cache(cache):
            return None
        if torch.compiler.is_compiling():
            raise NotImplementedError(COMPILED)
        if cache.binding is not self:
            raise RuntimeError(
                f"this {type(cache).__name__} is not bound to this model"
                + (" (it was unbound)" if cache.binding is None else " (it is bound to another model)")
                + ": create it with model=this model, or call cache.bind(model)"
            )
        tokens = query_tokens(args, kwargs)
        batch, q_len = tokens.shape[0], tokens.shape[1]
        bracket = cache.bracket_for(batch)  # the cache itself, or its rows (``pace_hf.cache.batch``)
        if not hasattr(bracket, "attend_rows"):  # one sequence
            start = cache.begin_forward(q_len, kwargs.get("input_ids"))
            kwargs["position_ids"] = torch.arange(start, start + q_len, device=tokens.device)[None]
        else:
            positions = bracket.begin_forward(q_len, kwargs.get("input_ids"), kwargs.get("attention_mask"))
            kwargs["position_ids"] = positions.to(tokens.device)
        self.active_tokens[-1] = attention.enter_forward(bracket)
        return args, kwargs

    def _post_forward(self, module, args, kwargs, output):
        token = self.active_tokens.pop() if self.active_tokens else None
        if token is not None:
            attention.exit_forward(token)
        cache = cache_from_kwargs(kwargs)
        if not _is_pace_cache(cache) or cache.binding is not self or not cache.in_forward:
            return None
        if output is None:  # the forward raised: undo its partial writes so nothing is lost
            cache.abort_forward()
            return None
        cache.end_forward(query_tokens(args, kwargs).shape[1])
        return None

    # -- generate wrappers ---------------------------------------------------------------------------
    def _generate(self, original):
        @functools.wraps(original)
        def generate(*args, **kwargs):
            cache = cache_from_kwargs(kwargs)
            chunk = kwargs.get("prefill_chunk_size")
            if _is_pace_cache(cache) and chunk is not None:
                try:  # an int, or an integer type that says it is one (numpy's), never a float or a bool
                    chunk = as_index(chunk, "prefill_chunk_size")
                except TypeError:
                    chunk = None
                if chunk is None or chunk < 1:
                    raise ValueError(f"prefill_chunk_size must be a whole number of tokens >= 1 (or None: one "
                                     f"forward for the whole prompt), got {kwargs['prefill_chunk_size']!r}")
                kwargs["prefill_chunk_size"] = chunk
            if _is_pace_cache(cache):
                check_not_compiled(self.model_ref())
                config = kwargs.get("generation_config") or getattr(self.model_ref(), "generation_config", None)
                beams = kwargs.get("num_beams", getattr(config, "num_beams", None))
                if beams is not None and beams > 1:
                    raise NotImplementedError(f"pace_hf caches do not support beam search (num_beams={beams}): each "
                                              "row keeps its own tokens, and beams would reorder them; use num_beams=1")
                prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
                if torch.is_tensor(prompt) and not prompt.is_floating_point():
                    cache.check_prompt(prompt)
                check_left_padded(kwargs.get("attention_mask"))
            model = self.model_ref()
            max_positions = getattr(model.config, "max_position_embeddings", None) if model is not None else None
            bounded = (_is_pace_cache(cache) and cache.limit is not None and max_positions is not None
                       and cache.limit <= max_positions)
            token = _POSITIONS_BOUNDED.set(bounded)
            try:
                return original(*args, **kwargs)
            finally:
                _POSITIONS_BOUNDED.reset(token)

        return generate

    def _get_stopping_criteria(self, original):
        from transformers.generation.stopping_criteria import MaxLengthCriteria

        @functools.wraps(original)
        def get_stopping_criteria(*args, **kwargs):
            criteria = original(*args, **kwargs)
            if _POSITIONS_BOUNDED.get():  # no position past `limit` reaches the model
                for criterion in criteria:
                    if isinstance(criterion, MaxLengthCriteria):
                        criterion.max_position_embeddings = None
            return criteria

        return get_stopping_criteria
