"""Chat messages as exact token spans.

An agent session is a chat; a blueprint speaks of token positions. ``ChatTemplate`` tokenizes one
message at a time under the tokenizer's own chat template, so that the concatenated blocks are
exactly the ids of the rendered conversation and every message's token span is known. It finds each
block by rendering a conversation with and without the message, so it works for any template that is
prefix-stable (each message only appends text); others get a clear error.
"""

from __future__ import annotations

DEFAULT_SYSTEM = "You are a helpful assistant."


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
        block = self.block(role, content)
        at = block.index(content)
        enc = self.tok(block, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        spans = {}
        for name, (cs, ce) in marks.items():
            cs, ce = cs + at, ce + at
            toks = [i for i, (s, e) in enumerate(offsets) if s < ce and e > cs and e > s]
            spans[name] = (toks[0], toks[-1] + 1)
        return ids, content, spans

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
