"""A persistent agent session over a PACE cache: chat messages in, exact token spans and a plan out.

Blueprints in raw token positions are the main friction of a bounded cache. ``PACESession`` keeps the
conversation's token ids, maps each message to its exact token span through the tokenizer's chat
template (``pace_hf.chat``), turns "this message is read at steps 5 and 9" into blueprint spans, and
prefills only the new tokens at each ``generate``. Every user message is a step. With a store the
session saves and resumes in another process (``save`` / ``PACESession.resume``).

    session = PACESession(model, tokenizer, budget=2048, limit=8192, store=store, session_id="agent-42")
    spec = session.add("user", "Step 1: the data model ...")
    session.plan(spec, readers=[5, 9])
    reply = session.generate(max_new_tokens=256)
    session.save(); session = PACESession.resume("agent-42", model, tokenizer, store=store)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .blueprint import Span, as_steps
from .cache import PACECache
from .chat import DEFAULT_SYSTEM, ChatTemplate

SESSION_KEY, SESSION_FINGERPRINT = "session", "pace-session-messages"


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
        budget, limit: the cache's token budget and rotary limit.
        store, session_id: a ``pace_hf.tiers.TieredStore`` for spills, restores and ``save``.
        system: the system prompt.
        chunk: ``prefill_chunk_size`` for generate (default: the room ``limit`` leaves above
            ``budget``, at most 4096).
        planner: optional; called as ``planner.plan(session)`` before each ``generate`` to add spans
            (see ``pace_hf.planner``).
        rehydrate: restore evicted spans whose identifiers the new user turn names (needs a planner
            with ``identifiers(text)`` and a store).
        cache_kwargs: passed to ``PACECache`` (sinks, recent, phi, prefetch_steps, ...).
    """

    def __init__(self, model, tokenizer, *, budget: int = 2048, limit: int | None = 8192, store=None,
                 session_id: str | None = None, system: str = DEFAULT_SYSTEM, chunk: int | None = None,
                 planner=None, rehydrate: bool = False, cache: PACECache | None = None, **cache_kwargs):
        self.model, self.tokenizer = model, tokenizer
        self.template = ChatTemplate(tokenizer, system)
        self.system = system
        self.cache = cache if cache is not None else PACECache(
            None, model=model, budget=budget, limit=limit, store=store, session_id=session_id, **cache_kwargs)
        room = (self.cache.limit - self.cache.budget) if self.cache.limit is not None else 4096
        self.chunk = chunk if chunk is not None else min(4096, room)
        if self.cache.limit is not None and self.chunk > room:
            raise ValueError(f"chunk {self.chunk} does not fit under limit {self.cache.limit} above budget "
                             f"{self.cache.budget}: use chunk <= {room}")
        self.planner, self.rehydrate = planner, rehydrate
        if rehydrate and (planner is None or self.cache.store is None):
            raise ValueError("rehydrate=True needs a planner (to read identifiers) and a store (to restore from)")
        self.ids: list[int] = list(self.template.system_ids)
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
        return message

    def plan(self, message: Message | int, readers=None, *, reader_steps=None) -> Span:
        """Mark ``message`` (a handle or its index) as read at the given future steps."""
        if isinstance(message, int) and not isinstance(message, bool):
            message = self.messages[message]
        if not isinstance(message, Message) or message not in self.messages:
            raise TypeError("plan() takes a message handle returned by add() (or its index)")
        steps = as_steps(readers if readers is not None else reader_steps, "readers")
        if not steps:
            raise ValueError("plan() needs at least one reader step")
        return self.cache.blueprint.add(Span(message.start, message.end, steps))

    # -- generating -----------------------------------------------------------------------------------
    def generate(self, max_new_tokens: int = 256, progress: bool = False, **generate_kwargs) -> str:
        """Reply as the assistant: prefill only the new tokens, generate, append the reply."""
        if self.planner is not None:
            self.planner.plan(self)
        self.cache.step = self.step
        header = self.template.encode(self.template.gen_header)
        input_ids = torch.tensor([self.ids + header], dtype=torch.long, device=self.model.device)
        stop = self.template.stop_ids()
        generate_kwargs.setdefault("do_sample", False)
        if not generate_kwargs["do_sample"]:
            generate_kwargs.update(temperature=None, top_p=None, top_k=None)
        self.cache.progress = _progress_bar(input_ids.shape[1] - self.cache.get_seq_length()) if progress else None
        try:
            with torch.no_grad():
                out = self.model.generate(
                    input_ids, cache=self.cache, attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop[0],
                    prefill_chunk_size=self.chunk, **generate_kwargs)
        finally:
            if self.cache.progress is not None:
                self.cache.progress.close()
            self.cache.progress = None
        reply = out[0, input_ids.shape[1]:].tolist()
        while reply and reply[-1] in stop:
            reply.pop()
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        self._append("assistant", text, header + reply + self.template.turn_end_ids())
        return text

    # -- persistence --------------------------------------------------------------------------------
    def save(self) -> None:
        """Save the cache and the conversation to the store, durably."""
        store = self.cache.store
        if store is None:
            raise ValueError("save needs a session with a store")
        meta = {"messages": [asdict(m) for m in self.messages], "step": self.step, "system": self.system,
                "chunk": self.chunk}
        store.put(SESSION_KEY, {"ids": torch.tensor(self.ids, dtype=torch.long)}, meta,
                  fingerprint=SESSION_FINGERPRINT, session_id=self.cache.session_id)
        self.cache.save()

    @classmethod
    def resume(cls, session_id: str, model, tokenizer, *, store, planner=None, rehydrate: bool = False) -> "PACESession":
        """Continue a saved session, possibly in another process."""
        got = store.get(SESSION_KEY, fingerprint=SESSION_FINGERPRINT, session_id=session_id)
        if got is None:
            raise KeyError(f"no saved session {session_id!r} in this store (or it failed verification)")
        cache = PACECache.resume(session_id, store=store, model=model)
        tensors, meta = got
        session = cls(model, tokenizer, system=meta["system"], chunk=meta["chunk"], cache=cache,
                      planner=planner, rehydrate=rehydrate)
        session.ids = tensors["ids"].tolist()
        session.messages = [Message(**m) for m in meta["messages"]]
        session.step = meta["step"]
        if cache.get_seq_length() > len(session.ids):
            raise ValueError(f"session {session_id!r}: the cache has seen more tokens than the conversation holds")
        return session


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="prefill", unit="tok", leave=False)
