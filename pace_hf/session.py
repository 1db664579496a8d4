"""A persistent agent session over a PACE cache: chat messages in, exact token spans and a plan out.

Blueprints in raw token positions are the main friction of a bounded cache. ``PACESession`` keeps the
conversation's token ids, maps each message to its exact token span through the tokenizer's chat
template (``pace_hf.chat``), turns "this message is read at steps 5 and 9" into blueprint spans, and
prefills only the new tokens at each ``generate``. Every user message is a step. With a store the
session saves and resumes in another process (``save`` / ``PACESession.resume``).

    session = PACESession(model, tokenizer, budget=2048, store=store, session_id="agent-42")
    spec = session.add("user", "Step 1: the data model ...")
    session.plan(spec, readers=[5, 9])
    reply = session.generate(max_new_tokens=256)
    session.save(); session = PACESession.resume("agent-42", model, tokenizer, store=store)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .blueprint import Span, as_index, as_steps
from .cache import PACECache
from .memory import persist
from .memory.wing import MEMORY_KNOBS, KVMemory
from .chat import DEFAULT_SYSTEM, ChatTemplate

SESSION_KEY = "session"  # the conversation, an attachment of each save


@dataclass(frozen=True)
class Message:
    """One message of the session and its token span ``[start, end)`` (the whole template block)."""

    index: int
    role: str
    content: str
    start: int
    end: int
    step: int


class PACESession:
    """A chat whose KV lives in a ``PACECache`` (see the module docstring).

    Args:
        model, tokenizer: a causal LM and its tokenizer (with a chat template).
        budget, limit: the cache's token budget (default 2048) and rotary limit (default ``"auto"``: the
            model's trained positions; see ``PACECache``).
        store, session_id: a ``pace_hf.tiers.TieredStore`` for spills, restores and ``save``.
        cache: a ``PACECache`` built by the caller, instead of one from ``budget``, ``limit``, ``store``,
            ``session_id`` and ``cache_kwargs`` (giving both is refused); bound to ``model`` if it is not.
        system: the system prompt.
        chunk: ``prefill_chunk_size`` for generate (default: the room ``limit`` leaves above
            ``budget``, at most 4096).
        planner: optional; called as ``planner.plan(session)`` before each ``generate`` to add spans
            (see ``pace_hf.planner``).
        rehydrate: restore evicted spans whose identifiers the new user turn names (needs a planner
            with ``identifiers(text)`` and a store).
        retrieval: ``True`` or a ``pace_hf.memory.retrieval.PageRetriever``: each user turn restores the evicted
            pages its text matches, before it is prefilled (a no-op without a store).
        cache_kwargs: passed to ``PACECache`` (sinks, recent, phi, prefetch_steps, ...).
    """

    def __init__(self, model, tokenizer, *, budget: int | None = None, limit: int | str | None = "auto", store=None,
                 session_id: str | None = None, system: str = DEFAULT_SYSTEM, chunk: int | None = None,
                 planner=None, rehydrate: bool = False, cache: PACECache | None = None, retrieval=None,
                 **cache_kwargs):
        if not isinstance(system, str):
            raise TypeError(f"system is the system prompt, a str, got {type(system).__name__}")
        if cache is not None and not isinstance(cache, PACECache):
            raise TypeError(f"cache must be a PACECache (a session plans spans in its blueprint), "
                            f"got {type(cache).__name__}")
        if cache is not None:  # its settings are its own: another value here would be silently ignored
            mine = {"budget": cache.budget, "store": cache.store, "session_id": cache.session_id, "limit": cache.limit}
            given = {k: v for k, v in (("budget", budget), ("store", store), ("session_id", session_id)) if v is not None}
            given.update({"limit": limit} if limit != "auto" else {})  # None (no limit) is a value too
            differ = [k for k, v in given.items() if v is not mine[k] and v != mine[k]]
            if differ or cache_kwargs:
                raise TypeError(f"cache= is a built PACECache; {', '.join(differ + sorted(cache_kwargs))} belong to it, "
                                "not to the session: give them to PACECache(...) instead")
        budget = 2048 if budget is None else budget
        if retrieval not in (None, False, True) and not callable(getattr(retrieval, "retrieve", None)):
            raise TypeError(f"retrieval is True, False or a pace_hf.memory.retrieval.PageRetriever, got {retrieval!r}")
        chunk = as_index(chunk, "chunk") if chunk is not None else None
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk (tokens per prefill forward) must be >= 1, got {chunk}")
        self.model, self.tokenizer = model, tokenizer
        self.template = ChatTemplate(tokenizer, system)
        self.system = system
        if cache is None:  # the session owns its memory, and the cache tells it what it evicts
            knobs = {k: cache_kwargs.pop(k) for k in MEMORY_KNOBS if k in cache_kwargs}
            memory = KVMemory(store=store, session_id=session_id, **knobs)
            cache = PACECache(model, budget=budget, limit=limit, memory=memory, **cache_kwargs)
        else:
            cache.bind(model)  # (a no-op if bound to it): an unbound cache reads its limit="auto" here
        self.cache = cache
        self.memory = cache.memory
        room = (self.cache.limit - self.cache.budget) if self.cache.limit is not None else 4096
        self.chunk = chunk if chunk is not None else min(4096, room)
        if self.cache.limit is not None and self.chunk > room:
            raise ValueError(f"chunk={self.chunk} does not fit under limit={self.cache.limit} above "
                             f"budget={self.cache.budget} (a chunk's forward on a full budget needs limit >= budget + "
                             f"chunk = {self.cache.budget + self.chunk}): use chunk <= {room}, or "
                             f"limit >= {self.cache.budget + self.chunk}")
        self.planner, self.rehydrate = planner, rehydrate
        if rehydrate and (planner is None or self.cache.store is None):
            raise ValueError("rehydrate=True needs a planner (to read identifiers) and a store (to restore from)")
        self.ids: list[int] = list(self.template.system_ids)
        if retrieval is True:
            from .memory.retrieval import PageRetriever

            retrieval = PageRetriever(tokenizer)
        self.retrieval = retrieval or None
        self.messages: list[Message] = []
        self.step = 0

    # -- building the conversation ------------------------------------------------------------------
    def add(self, role: str, content: str) -> Message:
        """Append a message (user, assistant or tool); a user message starts a new step."""
        if role not in ("user", "assistant", "tool"):
            raise ValueError(f"role must be 'user', 'assistant' or 'tool', got {role!r}")
        if not isinstance(content, str):
            raise TypeError(f"content must be a str, got {type(content).__name__}")
        if role == "user":
            self.step += 1
        ids = self.template.encode(self.template.block(role, content))
        return self._append(role, content, ids)

    def _append(self, role: str, content: str, ids: list[int]) -> Message:
        message = Message(len(self.messages), role, content, len(self.ids), len(self.ids) + len(ids), self.step)
        self.ids += ids
        self.messages.append(message)
        if role == "user" and self.rehydrate:
            self.cache.step = self.step  # restored spans are read at this step
            self.planner.rehydrate(self, message)
        if role == "user" and self.retrieval is not None:
            self.cache.step = self.step
            self.cache.retrieve(content, self.ids[:message.start], retriever=self.retrieval)
        return message

    def plan(self, message: Message | int, readers=None, *, reader_steps=None) -> Span:
        """Mark ``message`` (a handle or its index) as read at the future steps ``readers`` (as a ``Span``'s
        ``readers``). ``reader_steps=`` is the old name, deprecated: it warns and goes in the next release."""
        if reader_steps is not None:
            if readers is not None:
                raise TypeError("plan() got readers twice (readers= and the deprecated reader_steps=)")
            import warnings

            warnings.warn("plan(reader_steps=...) is deprecated: the steps are readers=, as a Span's",
                          DeprecationWarning, stacklevel=2)
            readers = reader_steps
        if not isinstance(message, Message):
            try:
                index = as_index(message, "message")
            except TypeError:
                raise TypeError("plan() takes a message handle returned by add() (or its index)") from None
            if not 0 <= index < len(self.messages):
                raise IndexError(f"plan(): no message {index}; the session holds {len(self.messages)}")
            message = self.messages[index]
        if message not in self.messages:
            raise TypeError("plan() takes a message handle returned by add() (or its index)")
        steps = as_steps(readers, "readers")
        if not steps:
            raise ValueError("plan() needs at least one reader step")
        if steps[0] < self.step:  # a step that is over reads nothing: the span would be kept for no one
            raise ValueError(f"plan(): reader steps must be >= the current step {self.step}, got {list(steps)}")
        return self.cache.blueprint.add(Span(message.start, message.end, steps))

    # -- generating -----------------------------------------------------------------------------------
    def generate(self, max_new_tokens: int = 256, progress: bool = False, checkpoint_every: int | None = None,
                 **generate_kwargs) -> str:
        """Reply as the assistant: prefill only the new tokens, generate, append the reply.

        ``checkpoint_every=N``: :meth:`save` after every ``N`` prefilled chunks, so that a process killed
        in a long prefill resumes (``PACESession.resume``, then ``generate`` again) from its last save,
        to exactly the tokens an uninterrupted run gives (greedy). Saves end within the conversation,
        before the assistant header, so each is a whole session (``pace_hf.session.prefill_checkpointed``)."""
        if checkpoint_every is not None and self.cache.store is None:
            raise ValueError("checkpoint_every saves the session: it needs a session with a store")
        if not self.messages:
            raise ValueError("generate answers the conversation, and it has no message yet: add() one first")
        if self.planner is not None:
            self.planner.plan(self)
        self.cache.step = self.step
        header = self.template.encode(self.template.gen_header)
        ids = self.ids + header
        self.cache.progress = _progress_bar(len(ids) - self.cache.get_seq_length()) if progress else None
        try:
            if checkpoint_every is not None:
                generate_kwargs.update(checkpoint_every=checkpoint_every, checkpoint=self.save,
                                       checkpoint_upto=len(self.ids))
            reply = generate_reply(self.model, ids, self.cache, max_new_tokens=max_new_tokens,
                                   stop_ids=self.template.stop_ids(), chunk=self.chunk, **generate_kwargs)
        finally:
            if self.cache.progress is not None:
                self.cache.progress.close()
            self.cache.progress = None
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        self._append("assistant", text, header + reply + self.template.turn_end_ids())
        return text

    # -- persistence --------------------------------------------------------------------------------
    def save(self, lease=None) -> str:
        """Save the cache and the conversation to the store as one generation, all or nothing (see
        ``pace_hf.memory.persist``): returns the generation, or raises and the previous save stays whole.
        ``lease``: the session's writer lease when the caller already holds it (``store.lease(id)``)."""
        if self.cache.store is None:
            raise ValueError("save needs a session with a store")
        meta = {"messages": [asdict(m) for m in self.messages], "step": self.step, "system": self.system,
                "chunk": self.chunk}
        return persist.save(self.cache, {SESSION_KEY: ({"ids": torch.tensor(self.ids, dtype=torch.long)}, meta)},
                            lease=lease)

    @classmethod
    def resume(cls, session_id: str, model, tokenizer, *, store, planner=None, rehydrate: bool = False,
               retrieval=None) -> "PACESession":
        """Continue a saved session, possibly in another process: the conversation and the cache of
        one save, verified together."""
        cache, attachments = persist.resume(PACECache, session_id, store=store, model=model)
        if SESSION_KEY not in attachments:
            cache.unbind()
            raise KeyError(f"session {session_id!r} was saved by a bare cache (cache.save()), without a conversation: "
                           "resume it with PACECache.resume")
        tensors, meta = attachments[SESSION_KEY]
        session = cls(model, tokenizer, system=meta["system"], chunk=meta["chunk"], cache=cache,
                      planner=planner, rehydrate=rehydrate, retrieval=retrieval)
        session.ids = tensors["ids"].tolist()
        session.messages = [Message(**m) for m in meta["messages"]]
        session.step = meta["step"]
        if cache.get_seq_length() > len(session.ids):
            raise ValueError(f"session {session_id!r}: the cache has seen more tokens than the conversation holds")
        return session

    # -- rewinding ----------------------------------------------------------------------------------
    def rewind(self, keep: int) -> None:
        """Keep the first ``keep`` messages and crop the cache to them, exactly.

        Why: an agent that edits its history, or a client that retries a turn, must never be answered
        from the KV of a conversation that no longer exists. The crop is exact only while no token past
        the cut was evicted (an evicted one would sit in the spill log and could come back); otherwise
        this raises ``ValueError`` and the caller starts a new session from the messages. Planned spans
        that reach past the cut and pending restores there are dropped; a planner that tracks the spans
        it added (``SymbolPlanner``) should be replaced after a rewind."""
        keep = as_index(keep, "keep")
        if not 0 <= keep <= len(self.messages):
            raise ValueError(f"keep must be in [0, {len(self.messages)}], got {keep}")
        if keep == len(self.messages):
            return
        cache, cut = self.cache, self.messages[keep].start
        if cache.in_forward:
            raise RuntimeError("rewind cannot run inside a forward")
        seen = cache.get_seq_length()
        if seen > cut:
            tail = seen - cut
            for layer in cache.layers:
                if layer.is_initialized and not layer.can_drop_last(tail):
                    raise ValueError(f"cannot rewind to token {cut}: tokens past it were evicted" if layer.evicts else
                                     f"cannot rewind to token {cut}: a sliding-window or linear-attention layer no "
                                     "longer holds the state before it (it keeps only what the model reads next)")
            for layer in cache.layers:
                if layer.is_initialized:
                    layer.drop_last(tail)
            if cache.bounded:
                tops = [int(layer.physical.max()) + 1 for layer in cache.layers
                        if layer.is_initialized and getattr(layer, "physical", None) is not None and layer.physical.numel()]
                cache.next_physical = max(tops, default=0)
        cache.restores.forget_past(cut)
        if cache.blueprint is not None:
            for span in [s for s in cache.blueprint if s.end > cut]:
                cache.blueprint.remove(span)
        self.ids, self.messages = self.ids[:cut], self.messages[:keep]
        self.step = self.messages[-1].step if self.messages else 0
        cache.step = self.step

    def kept(self, messages) -> int:
        """How many of the session's messages ``messages`` (``(role, content)`` pairs) begins with: what
        :meth:`sync` would keep."""
        held = [(m.role, m.content) for m in self.messages]
        return next((i for i, (a, b) in enumerate(zip(held, messages)) if a != tuple(b)), min(len(held), len(messages)))

    def sync(self, messages) -> int:
        """Make the session's messages equal ``messages`` (``(role, content)`` pairs after the system
        prompt): rewind to the first difference (see ``rewind``, which may raise ``ValueError``), then
        add the rest, unprefilled. Returns how many of the session's messages were kept."""
        messages = [(role, content) for role, content in messages]
        keep = self.kept(messages)
        self.rewind(keep)
        for role, content in messages[keep:]:
            self.add(role, content)
        return keep


def generate_reply(model, ids: list[int], cache, *, max_new_tokens: int, stop_ids: list[int], chunk: int | None = None,
                   checkpoint_every: int | None = None, checkpoint=None, checkpoint_upto: int | None = None,
                   **generate_kwargs) -> list[int]:
    """The new tokens ``model.generate`` answers the conversation ``ids`` with (``cache`` holds a prefix of
    it, and only the rest is prefilled, ``chunk`` tokens per forward), without trailing stop tokens.
    Greedy unless ``generate_kwargs`` sets ``do_sample=True``.

    ``checkpoint_every=N``: call ``checkpoint()`` (a save) after every ``N`` prefilled chunks whose end
    is at most ``checkpoint_upto`` (default: the last token but one); see :func:`prefill_checkpointed`."""
    if checkpoint_every is not None:
        prefill_checkpointed(model, ids, cache, chunk=chunk, every=checkpoint_every, save=checkpoint,
                             upto=checkpoint_upto, stop_ids=stop_ids)
    generate_kwargs.setdefault("do_sample", False)
    if not generate_kwargs["do_sample"]:
        generate_kwargs.update(temperature=None, top_p=None, top_k=None)
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids, cache=cache, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=stop_ids[0],
                             prefill_chunk_size=chunk, **generate_kwargs)
    reply = out[0, len(ids):].tolist()
    while reply and reply[-1] in stop_ids:
        reply.pop()
    return reply


def prefill_checkpointed(model, ids: list[int], cache, *, chunk: int | None, every: int, save, upto: int | None = None,
                         stop_ids: list[int]) -> int:
    """Prefill what ``cache`` lacks of ``ids`` in segments of ``every`` chunks of ``chunk`` tokens, calling
    ``save()`` after each, while a whole segment ends at or before ``upto`` (default ``len(ids) - 1``: the
    last token is left to the ``generate`` that answers). Returns the number of saves.

    Why this gives exactly the uninterrupted tokens: ``generate`` splits what the cache lacks into chunks
    of ``chunk`` counted from the cache's length, and each segment is whole chunks, so every segment, and
    a run resumed from any save, ends on a chunk boundary of the uninterrupted prefill and runs the same
    forwards. A segment is ``generate`` with one greedy new token, which runs no forward beyond its
    prefill and draws no random numbers. A save between forwards also sees the cache evicted to its
    budget, as every forward leaves it."""
    every = as_index(every, "checkpoint_every")
    if every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {every}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError("checkpoint_every needs a prefill chunk size (chunk=...): a save lands between chunks")
    if not callable(save):
        raise TypeError("checkpoint_every needs checkpoint=, the save to call (e.g. cache.save)")
    upto = len(ids) - 1 if upto is None else min(int(upto), len(ids) - 1)
    saves = 0
    while cache.get_seq_length() + every * chunk <= upto:
        segment = ids[:cache.get_seq_length() + every * chunk]
        generate_reply(model, segment, cache, max_new_tokens=1, stop_ids=stop_ids, chunk=chunk)
        save()
        saves += 1
    return saves


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="prefill", unit="tok", leave=False)
