"""The OpenAI chat-completions request schema, and OpenAI-style error JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the client gets as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    seed: int | None = None

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
