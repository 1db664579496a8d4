"""The server's log of what it served: one line per request once its response has ended, and one at shutdown.

A line of a chat turn names its tenant, its session, its prompt and cached (reused) tokens, the tokens it
generated, its status and how long it took, so an operator sees what each turn cost without ``/metrics``.
The ``/v1`` requests log at INFO, the others (``/health``, ``/metrics``: probes, often every few seconds)
at DEBUG. The shutdown line counts the ``/v1`` requests by status and says that the sessions' saves have
landed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger("pace_hf.serve")


class RequestLog:
    """ASGI middleware, outermost: it sees each request's status (a refusal by a middleware included),
    the tenant ``KeyCheck`` found and the turn the chat route ran (``scope["state"]``), and the lifespan's
    end, after the engine's close."""

    def __init__(self, app):
        self.app = app
        self.statuses: Counter = Counter()
        self.started: float | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan(send))
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500  # the server's error handler answers it, outside this middleware
            raise
        finally:
            self._line(scope, status, time.perf_counter() - t0)

    def _line(self, scope, status: int | None, seconds: float) -> None:
        state = scope.get("state") or {}
        turn = state.get("turn")
        outcome = dict(getattr(turn, "outcome", None) or {})
        # a turn that failed after its 200 went out (a streamed reply) reports the error it streamed
        status = outcome.get("error") or status
        status_text = str(status) if status is not None else "no-response"
        if turn is not None and status == 200 and "finish_reason" not in outcome:
            status_text += " (unfinished: the client left)"
        api = scope.get("path", "").startswith("/v1")
        if api:
            self.statuses[status_text.split()[0]] += 1
        fields = [scope.get("method", "?"), scope.get("path", "?"), status_text,
                  f"tenant={state.get('tenant') or '-'}"]
        if turn is not None:
            fields += [f"session={outcome.get('session', '-')}", f"prompt={outcome.get('prompt_tokens', '-')}",
                       f"cached={outcome.get('reused_tokens', '-')}",
                       f"completion={outcome.get('completion_tokens', '-')}"]
        fields.append(f"{seconds:.2f}s")
        log.log(logging.INFO if api else logging.DEBUG, "pace-serve: %s", " ".join(fields))

    def _lifespan(self, send):
        async def sending(message):
            if message["type"] == "lifespan.startup.complete":
                self.started = time.monotonic()
            await send(message)
            if message["type"] == "lifespan.shutdown.complete":
                up = time.monotonic() - self.started if self.started is not None else 0.0
                served = sum(self.statuses.values())
                by_status = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items())) or "none"
                log.info("pace-serve: shut down after %d API requests in %d:%02d:%02d (by status: %s); every "
                         "session's last save has landed and the store is closed", served, up // 3600,
                         up % 3600 // 60, up % 60, by_status)
            elif message["type"] == "lifespan.shutdown.failed":
                log.error("pace-serve: shutdown failed (%s): the last saves may not have landed",
                          message.get("message", ""))
        return sending
