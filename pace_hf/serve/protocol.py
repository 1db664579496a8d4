"""The OpenAI chat-completions request schema, and OpenAI-style error JSON."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError


class APIError(Exception):
    """An error the client gets as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _utf8(s: str) -> str:
    """A lone surrogate (``"\\ud800"`` is valid JSON) cannot be encoded: it would fail deep in the worker."""
    try:
        s.encode()
    except UnicodeEncodeError:
        raise PydanticCustomError("string_unicode", "Input should be valid unicode (a lone surrogate is not)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
# strict: "stream": "yes", "max_tokens": "4" or true are refused, not coerced; extra fields are ignored
STRICT = ConfigDict(extra="ignore", strict=True)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


def _str_or_list(item, what: str):
    """``str | list[item]``, the branch chosen by the value's type: a bad list gets its own error (not
    "Input should be a valid string" first), any other type one error that names both shapes."""
    return Annotated[Annotated[Text, Tag("text")] | Annotated[list[item], Tag("list")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "list" if isinstance(v, list) else None,
                                   custom_error_type="str_or_list",
                                   custom_error_message=f"Input should be a string or a list of {what}")]


class MessageIn(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _str_or_list(TextPart, '{"type": "text", "text": ...} parts') | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = STRICT
    model: Text = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: _str_or_list(Text, "strings") | None = None
    n: int | None = Field(None, ge=1, le=1)
    seed: int | None = None
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)  # vLLM's: no reuse across salts

    def conversation(self) -> tuple[str | None, list[tuple[str, str]]]:
        """``(system prompt or None, [(role, text), ...])``; a system message is allowed only first."""
        messages = list(self.messages)
        system = None
        if messages[0].role in ("system", "developer"):
            system = messages.pop(0).text()
        if any(m.role in ("system", "developer") for m in messages):
            raise APIError(400, "a system message is only allowed as the first message", param="messages")
        if not messages:
            raise APIError(400, "messages needs at least one user message after the system prompt", param="messages")
        return system, [(m.role, m.text()) for m in messages]

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops
