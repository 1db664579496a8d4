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
# strict: "stream": "yes", "max_tokens": "4" or true are refused, not coerced; an unknown field is a 400
# that names it (app.py), never dropped: a client that sent it expects it to do something
STRICT = ConfigDict(extra="forbid", strict=True)

MAX_STOP_CHARS = 128  # building a stop string's checker costs time linear in its length (a 4,096-character one
# took 6.7 s over Qwen's vocabulary); real stop strings ("\n\n", "```", "Observation:") are far shorter
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI caps them

# fields of OpenAI's chat-completions API that pace-serve refuses, and why (app.py's 400 says so)
UNSUPPORTED = {
    "tools": "pace-serve does not call tools", "tool_choice": "pace-serve does not call tools",
    "parallel_tool_calls": "pace-serve does not call tools", "functions": "pace-serve does not call tools",
    "function_call": "pace-serve does not call tools", "audio": "pace-serve answers in text only",
    "modalities": "pace-serve answers in text only", "prediction": "pace-serve has no predicted outputs",
    "web_search_options": "pace-serve does not search the web", "store": "pace-serve stores no completions for you",
    "metadata": "pace-serve stores no completions for you", "service_tier": "pace-serve has one service tier",
    "reasoning_effort": "the model has no reasoning setting", "verbosity": "the model has no verbosity setting",
}


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
    # what the openai client sends back when a reply's message object is appended to the conversation:
    # accepted while empty (a tool call or a refusal in them would be dropped, so that is a 400)
    refusal: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None
    tool_calls: Annotated[list, Field(max_length=0)] | None = None
    function_call: None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None  # the last chunk carries usage either way
    include_obfuscation: Literal[False] | None = None  # the padding against size side channels is not sent


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]  # the default; a JSON mode would not be enforced


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
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # a generator of the row's own (batcher.Sampler)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token id -> -100..100
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: Text | None = Field(None, max_length=512)  # OpenAI's abuse-monitoring id: no effect on the reply
    safety_identifier: Text | None = Field(None, max_length=512)  # its newer name
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
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop strings take at most {MAX_STOP_CHARS} characters each",
                           param="stop", code="stop_too_long")
        return stops

    def bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` as ``{token id: bias}``; a key that is not a token id of this model, or a bias
        outside -100..100, is a 400 that names it."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise APIError(400, f"logit_bias keys are token ids from 0 to {vocab_size - 1}, got {key!r}",
                               param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values are from -100 to 100, got {value} for token {key}",
                               param="logit_bias")
            out[int(key)] = value
        return out

    def top(self) -> int | None:
        """How many alternatives each token's logprobs list: None when no logprobs were asked for."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
