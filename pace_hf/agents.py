"""``PACEModel``: a smolagents ``Model`` whose KV lives in one ``PACESession`` per agent run.

Why: a smolagents agent re-sends the whole conversation at every step. ``PACEModel.generate`` matches
the incoming messages against its session's messages and prefills only the new ones. When the history
was edited (smolagents rewrites each model output before it re-sends it: stripped, with its tool calls
appended; a new ``agent.run`` starts over from the system prompt), the session is rewound to the first
difference and the cache is cropped there (``PACESession.rewind``); when that cannot be exact (tokens
past the cut were evicted), a new session is started from the messages. Stale KV is never reused.

Planning steps (``planning_interval``) are answered in a throwaway session, and the plan's items
become ``SymbolPlanner`` step descriptions for the coming steps of the main session.

    model, tokenizer = load_model("smollm2")
    agent = CodeAgent(tools=[...], model=PACEModel(model, tokenizer, budget=4096))
"""

from __future__ import annotations

import re

from smolagents.models import (ChatMessage, MessageRole, Model, TokenUsage, get_clean_message_list,
                               remove_content_after_stop_sequences, tool_role_conversions)

from .chat import DEFAULT_SYSTEM
from .planner import SymbolPlanner
from .session import PACESession

PLAN_END = "<end_plan>"  # smolagents' planning calls, and only they, stop on it


def flatten(messages) -> tuple[str, list[tuple[str, str]]]:
    """``(system prompt, [(role, text), ...])`` of smolagents messages, as its own models see them:
    tool calls become assistant text, tool responses user text, and consecutive same-role messages
    are merged."""
    clean = get_clean_message_list(messages, role_conversions=tool_role_conversions)
    out = []
    for m in clean:
        role = m["role"].value if isinstance(m["role"], MessageRole) else str(m["role"])
        content = m["content"]
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("PACEModel takes text messages only (no images)")
            content = "\n".join(part["text"] for part in content)
        out.append((role, content or ""))
    system = DEFAULT_SYSTEM
    if out and out[0][0] == "system":
        system = out.pop(0)[1]
    if any(role == "system" for role, _ in out):
        raise ValueError("PACEModel takes one system message, first")
    return system, out


def plan_items(plan: str) -> list[str]:
    """The items of a smolagents plan (numbered or bulleted lines), or the whole plan as one item."""
    items = [m.strip() for m in re.split(r"^\s*(?:\d+[.)]|[-*])\s+", plan, flags=re.M)[1:] if m.strip()]
    return items or ([plan.strip()] if plan.strip() else [])


class PACEModel(Model):
    """A smolagents model over a local transformers model and a PACE cache (see the module docstring).

    Args:
        model, tokenizer: a causal LM and its tokenizer (with a chat template).
        budget, limit, store, session_id, chunk, cache_kwargs: as for ``PACESession``. With a store
            the session is planned *and* rehydrated (evicted definitions that a new turn names come
            back); a rebuilt session gets the id ``f"{session_id}.{n}"``.
        retrieval: with a store, each user turn also restores the evicted pages its text matches
            (``True``, the default; or a ``pace_hf.memory.retrieval.PageRetriever``; ``False``: off).
        max_new_tokens: the default reply length (``generate(max_new_tokens=...)`` overrides it).

    ``last`` holds the accounting of the last call: ``prompt_tokens``, ``reused_tokens`` (history
    served from the cache), ``prefilled_tokens``, ``kept_messages``, ``rewound`` / ``rebuilt``.
    """

    def __init__(self, model, tokenizer, *, budget: int = 4096, limit: int | str | None = "auto", store=None,
                 session_id: str | None = None, chunk: int | None = None, max_new_tokens: int = 512,
                 model_id: str | None = None, retrieval=True, **cache_kwargs):
        super().__init__(model_id=model_id or getattr(model.config, "_name_or_path", None) or "pace")
        if store is not None and not session_id:
            raise ValueError("a PACEModel with a store needs a session_id")
        self.model, self.tokenizer = model, tokenizer
        self.session_kwargs = dict(budget=budget, limit=limit, store=store, chunk=chunk, **cache_kwargs)
        self.base_id, self.rebuilds = session_id, 0
        self.max_new_tokens = max_new_tokens
        self.retrieval = retrieval
        self.steps: dict[int, str] = {}  # the planner's step descriptions, from smolagents' plans
        self.session: PACESession | None = None
        self.last: dict = {}

    # -- the session ------------------------------------------------------------------------------
    def _new_session(self, system: str) -> PACESession:
        store = self.session_kwargs["store"]
        session_id = None
        if store is not None:
            if self.session is not None:
                store.delete_session(self.session.cache.session_id)
                self.rebuilds += 1
            session_id = self.base_id if self.rebuilds == 0 else f"{self.base_id}.{self.rebuilds}"
        return PACESession(self.model, self.tokenizer, system=system, session_id=session_id,
                           planner=SymbolPlanner(self.steps), rehydrate=store is not None,
                           retrieval=self.retrieval if store is not None else None, **self.session_kwargs)

    def reset(self) -> None:
        """Forget the session: the next call starts a new one."""
        if self.session is not None:
            self.session.cache.unbind()
        self.session = None
        self.steps = {}

    def _sync(self, system: str, messages: list[tuple[str, str]]) -> dict:
        """Make the session's messages equal ``messages``: rewind to the first difference, add the rest."""
        info = {"rewound": False, "rebuilt": False}
        if self.session is not None and self.session.system != system:
            self.session.cache.unbind()
            self.session, info["rebuilt"] = None, True
        if self.session is None:
            self.session = self._new_session(system)
        held = len(self.session.messages)
        try:
            keep = self.session.sync(messages)
        except ValueError:  # tokens past the first difference were evicted: start over, never reuse them
            self.session.cache.unbind()
            self.session = self._new_session(system)
            keep, info["rebuilt"] = self.session.sync(messages), True
        if keep < held and not info["rebuilt"]:
            self.session.planner = SymbolPlanner(self.steps)  # the old one tracks spans the rewind dropped
            info["rewound"] = True
        info["kept_messages"] = keep
        return info

    # -- smolagents' Model interface --------------------------------------------------------------------
    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None,
                 **kwargs) -> ChatMessage:
        if response_format is not None:
            raise NotImplementedError("PACEModel does not constrain output to a response_format")
        system, flat = flatten(messages)
        if not flat:
            raise ValueError("PACEModel needs at least one message after the system prompt")
        max_new_tokens = kwargs.pop("max_new_tokens", None) or self.max_new_tokens
        stops = list(stop_sequences or [])
        if PLAN_END in stops:
            return self._plan(system, flat, stops, max_new_tokens)
        info = self._sync(system, flat)
        session = self.session
        text, usage = self._reply(session, stops, max_new_tokens, info)
        return ChatMessage(role=MessageRole.ASSISTANT, content=remove_content_after_stop_sequences(text, stops),
                           raw={"text": text, **self.last}, token_usage=usage)

    def _reply(self, session: PACESession, stops: list[str], max_new_tokens: int, info: dict):
        reused = session.cache.get_seq_length()
        prompt = len(session.ids) + len(session.template.encode(session.template.gen_header))
        extra = {"stop_strings": stops, "tokenizer": self.tokenizer} if stops else {}
        text = session.generate(max_new_tokens=max_new_tokens, **extra)
        reply = session.messages[-1]  # its block: generation header, reply tokens, turn end
        out_tokens = reply.end - reply.start - (prompt - reply.start) - len(session.template.turn_end_ids())
        self.last = {"prompt_tokens": prompt, "reused_tokens": reused, "prefilled_tokens": prompt - reused,
                     "output_tokens": out_tokens, **info}
        return text, TokenUsage(input_tokens=prompt, output_tokens=out_tokens)

    def _plan(self, system: str, flat, stops, max_new_tokens) -> ChatMessage:
        """A planning call: answered in a throwaway session (its messages are another conversation);
        the plan's items become the step descriptions of the main session's next steps."""
        kwargs = {k: v for k, v in self.session_kwargs.items() if k != "store"}
        scratch = PACESession(self.model, self.tokenizer, system=system, **kwargs)
        try:
            for role, content in flat:
                scratch.add("user" if role == "user" else "assistant", content)
            text, usage = self._reply(scratch, stops, max_new_tokens, {"planning": True})
        finally:
            scratch.cache.unbind()
        plan = remove_content_after_stop_sequences(text, stops)
        # the agent appends the plan and a user turn to its memory: the first item is read at the
        # step after that turn's, and each later item one step later
        first = (self.session.step if self.session is not None else 0) + 1
        self.steps.update({first + i: item for i, item in enumerate(plan_items(plan))})
        if self.session is not None and self.session.planner is not None:
            self.session.planner.add_steps(self.steps)
        return ChatMessage(role=MessageRole.ASSISTANT, content=plan, raw={"text": text, **self.last},
                           token_usage=usage)
