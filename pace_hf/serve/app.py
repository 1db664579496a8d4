"""The HTTP routes: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /metrics``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Turn
from .protocol import UNSUPPORTED, APIError, ChatRequest
from .requestlog import RequestLog
from .tenants import Tenants


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class BodyLimit:
    """Reads each request's body before the app does: over ``max_bytes`` is a 413 and a body not all
    there within ``timeout_s`` a 408, so neither a huge body (tokenized on the one worker) nor a slow
    one (a slowloris holding a connection open) ties the server up. The rest of a body too large is read
    and dropped (until the deadline) before the 413: a server that closes on unread data resets the
    connection, and the client sees that instead of the error."""

    def __init__(self, app, max_bytes: int, timeout_s: float, metrics):
        self.app, self.max_bytes, self.timeout_s, self.metrics = app, max_bytes, timeout_s, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        chunks, size, over = [], 0, declared.isdigit() and int(declared) > self.max_bytes

        async def read() -> bool:
            nonlocal size, over
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                size += len(message.get("body", b""))
                over = over or size > self.max_bytes
                if not over:
                    chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    return True

        try:
            if not await asyncio.wait_for(read(), self.timeout_s):
                return
        except asyncio.TimeoutError:
            if not over:
                return await self._refuse(APIError(408, f"the request body did not arrive within "
                                                        f"{self.timeout_s:g} s", code="request_timeout"),
                                          scope, receive, send)
        if over:
            return await self._refuse(APIError(413, f"the request body exceeds {self.max_bytes} bytes",
                                               code="request_too_large"), scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # then the disconnect sse-starlette waits for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, e: APIError, scope, receive, send):
        self.metrics.requests.labels(str(e.status)).inc()
        e.headers["Connection"] = "close"
        await _error(e)(scope, receive, send)


class KeyCheck:
    """Every ``/v1`` request needs a tenant's key, checked before the app validates its body: without one
    it is a 401 whatever it sends (a bad body is not a 400 that shows what the server takes). The body
    was read by ``BodyLimit`` (size and time), never parsed. The tenant goes into the request's state."""

    def __init__(self, app, tenants: Tenants, metrics):
        self.app, self.tenants, self.metrics = app, tenants, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            tenant = self.tenants.tenant_of(_authorization(scope))
            if tenant is None:
                self.metrics.requests.labels("401").inc()
                return await _error(_unauthorized("missing or invalid API key: send 'Authorization: Bearer KEY' "
                                                  "with a key this server was given (--api-keys)"))(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _authorization(scope) -> str | None:
    """The request's ``Authorization`` header, decoded as Starlette decodes headers (latin-1)."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def create_app(engine: Engine, served_names: list[str], *, max_body_bytes: int = 16 << 20,
               body_timeout_s: float = 60.0, tenants: Tenants | None = None, metrics_key: str | None = None) -> FastAPI:
    """The app around a (not yet started) engine; the app's lifespan starts and closes it. With
    ``tenants``, every ``/v1`` request needs a key, and its tenant's sessions are its own. ``/metrics``
    counts every tenant's tokens: with ``metrics_key`` it needs that key (the operator's), and with
    ``tenants`` but no ``metrics_key`` it is refused."""
    operator = Tenants({metrics_key: "operator"}) if metrics_key is not None else None

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="pace-serve", lifespan=lifespan)
    if tenants is not None:
        app.add_middleware(KeyCheck, tenants=tenants, metrics=engine.metrics)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s, metrics=engine.metrics)
    app.add_middleware(RequestLog)  # outermost: it sees every status, the refusals of the two above included
    created = int(time.time())
    vocab = _vocab_size(engine.model)  # logit_bias keys are checked against it

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def malformed(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        extra = [".".join(str(p) for p in err["loc"] if p != "body") for err in e.errors()
                 if err.get("type") == "extra_forbidden"]
        if extra:  # every one named, with why where it is OpenAI's
            why = [f"{name!r} ({UNSUPPORTED[name]})" if name in UNSUPPORTED else f"{name!r}" for name in extra]
            engine.metrics.requests.labels("400").inc()
            return _error(APIError(400, f"pace-serve does not take the parameter{'s' * (len(extra) > 1)} "
                                        f"{', '.join(why)}; nothing is ignored silently",
                                   param=extra[0], code="unsupported_parameter"))
        if first.get("type") == "json_invalid":  # its loc is a character offset, no field
            where = None
            why = first.get("ctx", {}).get("error", "")
            msg = f"malformed request: invalid JSON at character {first['loc'][-1]}: {why}"
        else:
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
            msg = f"malformed request: {first.get('msg', 'invalid body')}" + (f" at {where}" if where else "")
        engine.metrics.requests.labels("400").inc()
        return _error(APIError(400, msg, param=where, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return _error(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None,
                               headers=e.headers))  # a 405's Allow

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        return _error(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pace_hf"}
                                           for name in served_names]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request):
        if operator is not None and operator.tenant_of(request.headers.get("authorization")) is None:
            raise _unauthorized("/metrics needs the operator's key: send 'Authorization: Bearer KEY' with the key "
                                "of --metrics-key")
        if operator is None and tenants is not None:
            raise _unauthorized("/metrics counts every tenant's tokens, so a server with --api-keys serves it only "
                                "to the operator: start it with --metrics-key FILE")
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        """Liveness for anyone; the queue depth and resident sessions only to whom ``/metrics`` is served (the
        operator's key where there is one): how busy the server is tells a tenant about the others."""
        if operator is not None and operator.tenant_of(request.headers.get("authorization")) is None:
            return {"status": "ok"}
        if operator is None and tenants is not None:
            return {"status": "ok"}
        return {"status": "ok", "queue": engine.queue.qsize(), "resident": len(engine.resident)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            return await _chat(body, request)
        except APIError as e:
            engine.metrics.requests.labels(str(e.status)).inc()
            raise

    async def _chat(body: ChatRequest, request: Request):
        tenant = request.state.tenant if tenants is not None else None  # KeyCheck's
        if body.model not in served_names:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served_names}",
                           code="model_not_found", param="model")
        system, messages = body.conversation()
        body.check_stream_options()
        sampling, top = {}, body.top()
        if body.temperature:  # None or 0: greedy
            sampling.update(do_sample=True, temperature=body.temperature, top_p=body.top_p or 1.0)
        # what changes the reply (a greedy reply has no use for its seed, a zero penalty does nothing)
        extra = {"logit_bias": body.bias(vocab) or None, "presence_penalty": body.presence_penalty or None,
                 "frequency_penalty": body.frequency_penalty or None,
                 "seed": body.seed if body.temperature else None, "logprobs": top}
        extra = {k: v for k, v in extra.items() if v is not None}
        if engine.batcher is None and extra:  # generate's path takes none of them
            name = next(iter(extra))
            raise APIError(400, f"{name} is served by the batched worker only; this server runs with "
                                "--no-batch-decode", param=name, code="unsupported_parameter")
        extra.pop("logprobs", None)
        sampling.update(extra)
        turn = Turn(system=system, messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
                    stops=body.stops(), sampling=sampling, session_name=request.headers.get("x-session-id") or None,
                    tenant=tenant, cache_salt=body.cache_salt, logprobs=top,
                    loop=asyncio.get_running_loop())
        request.state.turn = turn  # for the request log (RequestLog)
        engine.submit(turn)
        cid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            kind, payload = await turn.events.get()  # started, or an error before generation
        except asyncio.CancelledError:
            turn.cancelled.set()
            raise
        if kind == "error":
            raise payload
        sid = payload["session"]
        headers = {"X-Session-Id": sid}
        if not payload.get("previous_turn_saved", True):  # never silent: that turn is not durable
            headers["X-Pace-Previous-Turn-Saved"] = "false"
        if not body.stream:
            try:
                while True:
                    kind, payload = await turn.events.get()
                    if kind == "error":
                        raise payload
                    if kind == "done":
                        break
            except asyncio.CancelledError:
                turn.cancelled.set()
                raise
            engine.metrics.requests.labels("200").inc()
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": now, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": payload["content"]},
                             "logprobs": _logprobs(payload["logprobs"]), "finish_reason": payload["finish_reason"]}],
                "usage": _usage(payload)}, headers=headers)
        return EventSourceResponse(_stream(turn, body, cid, now), headers=headers, ping=15)

    async def _stream(turn: Turn, body: ChatRequest, cid: str, now: int):
        def chunk(delta: dict, finish=None, usage=None, logprobs=None) -> dict:
            out = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": body.model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": _logprobs(logprobs), "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return {"data": json.dumps(out)}

        hold = max((len(s) for s in turn.stops), default=1) - 1  # text that may begin a stop string
        text, sent = "", 0
        pending, streamed = [], 0  # logprobs: (where the token's text begins, entry), and how many went out
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, payload = await turn.events.get()
                if kind == "error":
                    yield {"data": json.dumps(payload.body())}
                    engine.metrics.requests.labels(str(payload.status)).inc()
                    return
                if kind == "logprob":
                    pending.append(payload)
                    continue
                if kind == "done":
                    rest = payload["content"][sent:]
                    left = payload["logprobs"][streamed:] if payload["logprobs"] is not None else None
                    if rest or left:
                        yield chunk({"content": rest}, logprobs=left)
                    yield chunk({}, payload["finish_reason"], _usage(payload))
                    yield {"data": "[DONE]"}
                    engine.metrics.requests.labels("200").inc()
                    return
                text += payload
                cut = min([text.find(s) for s in turn.stops if s in text], default=len(text) - hold)
                if cut > sent:
                    piece, sent = text[sent:cut], cut
                    out = [entry for at, entry in pending if at < sent]  # tokens whose text has begun
                    pending, streamed = pending[len(out):], streamed + len(out)
                    yield chunk({"content": piece}, logprobs=out if turn.logprobs is not None else None)
        finally:
            turn.cancelled.set()  # a no-op once done; mid-stream it stops the generation

    return app


def _vocab_size(model) -> int:
    """How many logits the model gives: its output layer's rows (a config's vocab_size may differ)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.get_text_config().vocab_size)


def _logprobs(content: list | None) -> dict | None:
    """OpenAI's ``choices[].logprobs``: null unless the request asked for logprobs."""
    return None if content is None else {"content": content, "refusal": None}


def _usage(p: dict) -> dict:
    return {"prompt_tokens": p["prompt_tokens"], "completion_tokens": p["completion_tokens"],
            "total_tokens": p["prompt_tokens"] + p["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": p["reused_tokens"]}}
