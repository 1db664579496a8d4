"""Chat messages as exact token spans.

An agent session is a chat; a blueprint speaks of token positions. ``ChatTemplate`` tokenizes one
message at a time under the tokenizer's own chat template, so that the concatenated blocks are
exactly the ids of the rendered conversation and every message's token span is known. It finds each
block by rendering a conversation with and without the message, so it works for any template that is
prefix-stable (each message only appends text); others get a clear error.

``TokenOffsets`` is the one character -> token lookup of the library (marks here, character spans in
``Blueprint.from_char_spans``, definitions in the planner).
"""

from __future__ import annotations

import bisect

DEFAULT_SYSTEM = "You are a helpful assistant."


class TokenOffsets:
    """Which tokens of a tokenized text cover a character range (from a fast tokenizer's
    ``offset_mapping``; zero-width tokens such as added special tokens cover nothing)."""

    def __init__(self, offsets):
        kept = [(i, int(s), int(e)) for i, (s, e) in enumerate(offsets) if e > s]
        self.index = [i for i, _, _ in kept]
        self.starts = [s for _, s, _ in kept]
        self.ends = [e for _, _, e in kept]

    @classmethod
    def of(cls, tokenizer, text: str) -> tuple["TokenOffsets", list[int]]:
        """Tokenize ``text`` as the model sees it (no special tokens added): its lookup and its ids."""
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return cls(enc["offset_mapping"]), list(enc["input_ids"])

    def span(self, start_char: int, end_char: int) -> tuple[int, int] | None:
        """``(first, last + 1)``: the tokens that overlap ``[start_char, end_char)``; None if none do."""
        lo = bisect.bisect_right(self.ends, start_char)   # first token ending after start_char
        hi = bisect.bisect_left(self.starts, end_char)    # tokens starting before end_char
        if lo >= hi:
            return None
        return self.index[lo], self.index[hi - 1] + 1


class ChatTemplate:
    """Token blocks of single messages under a tokenizer's chat template."""

    def __init__(self, tokenizer, system: str = DEFAULT_SYSTEM):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this tokenizer has no chat template")
        self.tok = tokenizer
        self.system = {"role": "system", "content": system}
        self._base = self._render([self.system])
        u, a = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}
        with_gen = self._render([self.system, u], add_generation_prompt=True)
        without = self._render([self.system, u])
        full = self._render([self.system, u, a])
        self.gen_header = self._suffix(with_gen, without)
        reply = self._suffix(full, with_gen)
        if not reply.startswith("A"):
            raise ValueError("chat template: the assistant reply does not follow the generation prompt")
        self.turn_end = reply[1:]
        self.system_ids = self.encode(self._base)

    def _render(self, messages, add_generation_prompt=False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @staticmethod
    def _suffix(longer: str, prefix: str) -> str:
        if not longer.startswith(prefix):
            raise ValueError("chat template is not prefix-stable: messages cannot be tokenized one by one")
        return longer[len(prefix):]

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def block(self, role: str, content: str) -> str:
        """The text the template adds for one message of ``role`` (user, assistant or tool)."""
        if role == "assistant":
            u = {"role": "user", "content": "U"}
            before = self._render([self.system, u])
            return self._suffix(self._render([self.system, u, {"role": "assistant", "content": content}]), before)
        return self._suffix(self._render([self.system, {"role": role, "content": content}]), self._base)

    def user_block(self, content: str) -> str:
        return self.block("user", content)

    def assistant_block(self, content: str) -> str:
        return self.block("assistant", content)

    def message_ids(self, role: str, pieces) -> tuple[list[int], str, dict[str, tuple[int, int]]]:
        """Tokenize a message made of pieces (strings, or ``(name, text)`` marks); returns its ids,
        its content, and the token span (relative to the block) of each marked piece."""
        content, marks = "", {}
        for p in ([pieces] if isinstance(pieces, str) else pieces):
            if isinstance(p, tuple):
                name, text = p
                marks[name] = (len(content), len(content) + len(text))
                content += text
            else:
                content += p
        offsets, ids, at = self.content_offsets(role, content)
        spans = {}
        for name, (cs, ce) in marks.items():
            spans[name] = offsets.span(cs + at, ce + at)
        return ids, content, spans

    def content_offsets(self, role: str, content: str) -> tuple[TokenOffsets, list[int], int]:
        """The lookup and ids of one message's block, and where its content starts in the block: the
        tokens of content characters ``[a, b)`` are ``offsets.span(a + at, b + at)``, relative to the
        block's first token."""
        block = self.block(role, content)
        at = block.rfind(content) if content else len(block)
        offsets, ids = TokenOffsets.of(self.tok, block)
        return offsets, ids, at

    def user_pieces(self, pieces) -> tuple[list[int], str, dict[str, tuple[int, int]]]:
        return self.message_ids("user", pieces)

    def turn_end_ids(self) -> list[int]:
        """Ids that end an assistant turn after its content (``<|im_end|>\\n`` for ChatML)."""
        return self.encode(self.turn_end)

    def stop_ids(self) -> list[int]:
        """Token ids that end a generated reply: the first id of the turn end, and EOS."""
        turn_end = self.turn_end_ids()
        ids = {turn_end[0] if turn_end else None, self.tok.eos_token_id}
        return sorted(i for i in ids if isinstance(i, int) and i >= 0)
