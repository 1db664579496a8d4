"""``pace-serve``: an OpenAI-compatible chat server whose sessions live in PACE caches and the tiers.

Why this shape: agent clients re-send the whole conversation at every request. The server finds the
session a request continues (a hash chain over its messages, or the ``X-Session-Id`` header), prefills
only the new messages, and keeps many sessions in bounded memory by parking idle ones in the store
(every completed turn is saved behind the reply) and resuming them when their conversation returns,
in this process or after a restart.

Modules: ``protocol`` (the request schema and OpenAI-style errors), ``engine`` (the one generation
worker, its bounded queue, the session table, parking and saves), ``batcher`` (the worker's batched
step: concurrent sessions decoded together, one token each per forward, beside one chunk of a prompt), ``metrics`` (Prometheus counters),
``app`` (the FastAPI routes), ``__main__`` (the ``pace-serve`` command).

FastAPI + uvicorn because the OpenAI schema is a pydantic model away and validation errors become
400s in one handler; sse-starlette because it notices a client that disconnects mid-stream (the
generator is cancelled), which is what stops a generation; prometheus-client for ``/metrics``.
"""

from .app import create_app
from .engine import Engine

__all__ = ["Engine", "create_app"]
