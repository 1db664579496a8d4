"""``pace-serve --model PATH_OR_HUB_ID --host 127.0.0.1 --port 8000 --store disk:runs/serve``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..tiers.spelling import SPELLINGS, parse_store  # the spelling the cleanup command reads too
from .engine import CHUNK
from .tenants import Tenants, read_key


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default where there is one to show: not None, and not twice where the help says it."""

    def _get_help_string(self, action):
        if action.default in (None, argparse.SUPPRESS) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def load(name_or_path: str, dtype: str = "auto", loader=None):
    """``(model, tokenizer)``: from ``loader`` (a callable ``(name_or_path, dtype=...)``, or its
    ``"module:function"`` spelling, for models known by a name: see the README's server section), else
    ``from_pretrained`` of a local directory or a Hub id (of the Hub's local cache alone where the Hub
    cannot be reached, so that a name nobody knows fails in seconds, not after a minute of retries)."""
    import torch

    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    if isinstance(loader, str):
        loader = _import_loader(loader)
    if loader is not None:
        return loader(name_or_path, dtype=torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = not os.path.isdir(name_or_path) and not _hub_reachable()
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype or "auto", local_files_only=offline)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
    except OSError as e:
        raise SystemExit(f"pace-serve: --model {name_or_path!r} is no local model directory, and no Hub model "
                         f"could be loaded under that name ({str(e).splitlines()[0]}"
                         f"{'; the Hub is unreachable, so only its local cache was searched' if offline else ''}); "
                         "pass a directory, a Hub id, or --loader MODULE:FUNCTION for named models (the README's "
                         "Serving section names the loader of this project's packaged models)") from None
    return model.eval(), tokenizer


def _limit(text: str):
    """``--limit``: ``auto`` or a number of positions (0: unbounded)."""
    return text if text == "auto" else int(text)


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub's host takes a connection (always True behind a proxy, which may be the only way
    out). Without a network, ``from_pretrained`` retries each file for half a minute or more before it
    fails, so an unreachable Hub means a search of its local cache alone, which fails at once."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return True
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)),
                                 timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_loader(spec: str):
    """``"module:function"`` -> the function."""
    import importlib

    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise SystemExit(f"pace-serve: --loader {spec!r}: {e} (expected MODULE:FUNCTION)") from None


def main(argv: list[str] | None = None, loader=None) -> None:
    """The command; ``loader`` (a callable) replaces ``--loader`` (see ``load``)."""
    p = argparse.ArgumentParser(prog="pace-serve", description=__doc__,
                                formatter_class=_Defaults)
    p.add_argument("--model", required=True, help="a local model directory or a Hub id (or a name --loader knows)")
    p.add_argument("--loader", default=None, metavar="MODULE:FUNCTION",
                   help="a function (name_or_path, dtype=...) -> (model, tokenizer) that loads --model by name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-keys", default=os.environ.get("PACE_SERVE_API_KEYS"), metavar="FILE",
                   help="'TENANT KEY' lines: every request needs a key, each tenant's sessions are its own "
                        "(also $PACE_SERVE_API_KEYS)")
    p.add_argument("--metrics-key", default=os.environ.get("PACE_SERVE_METRICS_KEY"), metavar="FILE",
                   help="a file holding the operator's key: /metrics needs it (with --api-keys, /metrics is refused "
                        "without it: it counts every tenant's tokens) (also $PACE_SERVE_METRICS_KEY)")
    p.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback --host without --api-keys (anyone who reaches it shares one namespace)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--store", default="disk:runs/serve", help=f"tiers, fastest first, comma-separated: {SPELLINGS}")
    p.add_argument("--served-name", action="append", help="a name requests may use for the model (default: --model)")
    p.add_argument("--budget", type=int, default=2048, help="resident tokens per session cache")
    p.add_argument("--limit", type=_limit, default="auto",
                   help="rotary position limit (0: unbounded; auto: the model's trained positions)")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"prompt tokens a prefill forward takes (eviction runs at each chunk's end); with chunked "
                        f"prefill, what a batched step carries beside the decoding rows (default: {CHUNK}, or the "
                        "room --limit leaves above --budget if less)")
    p.add_argument("--max-context", type=int, default=32768, help="prompt + max_tokens, per request")
    p.add_argument("--max-tokens", type=int, default=512, help="default reply length")
    p.add_argument("--max-resident", type=int, default=8, help="sessions kept in memory (LRU); the others are parked (and no more are decoded together)")
    p.add_argument("--idle-ttl", type=float, default=600.0, help="seconds before an idle session is parked")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait; more get a 429")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body (more: 413)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive (more: 408; a slow client holds no connection)")
    p.add_argument("--spill-cap-mb", type=float, default=512.0,
                   help="spilled KV a session may keep in the store (least recently used pages go first; 0: none)")
    p.add_argument("--retain-mb", type=float, default=0.0,
                   help="the most the store may hold: whole sessions go, least recently saved first (0: no cap)")
    p.add_argument("--retain-hours", type=float, default=0.0,
                   help="sessions not saved for this long are deleted (0: kept until deleted)")
    p.add_argument("--retrieval", action=argparse.BooleanOptionalAction, default=True,
                   help="each user turn restores the evicted pages its text matches (pace_hf.memory.retrieval)")
    p.add_argument("--batch-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="decode the turns of several sessions together, one batched forward per token, which also "
                        "carries a chunk of an admitted prompt (--chunked-prefill); --no-batch-decode runs one turn at "
                        "a time")
    p.add_argument("--max-batch", type=int, default=8,
                   help="turns decoded together at most (and no more than --max-resident)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="a batched step carries one --chunk of an admitted prompt beside the decoding rows, so a long "
                        "prompt delays them by one chunk a step; --no-chunked-prefill prefills each prompt whole "
                        "between two steps (the same chunks and replies) while the other rows wait")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info: a line per request and one at shutdown; debug adds the /health and /metrics requests")
    args = p.parse_args(argv)
    if args.spill_cap_mb < 0:
        p.error(f"--spill-cap-mb must be >= 0, got {args.spill_cap_mb}")
    tenants = None
    if args.api_keys:
        try:
            tenants = Tenants.from_file(args.api_keys)
        except (OSError, ValueError) as e:
            p.error(f"--api-keys: {e}")
    elif not _loopback(args.host) and not args.insecure:
        p.error(f"--host {args.host} is reachable from other machines, and without --api-keys every client "
                "would share (continue, rewind, time) every session: give --api-keys FILE, or --insecure")
    metrics_key = None
    if args.metrics_key:
        try:
            metrics_key = read_key(args.metrics_key)
        except (OSError, ValueError) as e:
            p.error(f"--metrics-key: {e}")
        if tenants is not None and tenants.tenant_of(f"Bearer {metrics_key}") is not None:
            p.error("--metrics-key: this key is also a tenant's (--api-keys): that tenant would see every tenant's "
                    "token counts")
    if args.retain_mb < 0 or args.retain_hours < 0:
        p.error("--retain-mb and --retain-hours must be >= 0 (0: off)")
    if args.max_batch < 1:
        p.error(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_body_mb <= 0 or args.body_timeout <= 0:
        p.error("--max-body-mb and --body-timeout must be > 0")
    # other libraries' INFO lines (a Hub download's every request) stay out unless debug is asked for
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=logging.WARNING if level == logging.INFO else level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("pace_hf").setLevel(level)

    import uvicorn

    from .app import create_app
    from .engine import Engine

    try:
        store = parse_store(args.store)
    except ValueError as e:
        raise SystemExit(f"pace-serve: --store: {e}") from None
    model, tokenizer = load(args.model, args.dtype, loader or args.loader)
    names = args.served_name or [args.model]
    try:
        engine = Engine(model, tokenizer, store, names[0], budget=args.budget, limit=args.limit if args.limit != 0 else None,
                        chunk=args.chunk, max_context=args.max_context, max_tokens=args.max_tokens,
                        max_resident=args.max_resident, idle_ttl_s=args.idle_ttl, queue_size=args.queue_size,
                        spill_cap_bytes=int(args.spill_cap_mb * 2**20), retrieval=args.retrieval,
                        retain_bytes=int(args.retain_mb * 2**20) or None, retain_age_s=args.retain_hours * 3600 or None,
                        batch_decode=args.batch_decode, max_batch=args.max_batch, chunked_prefill=args.chunked_prefill)
    except ValueError as e:  # a budget, limit or chunk the cache cannot take; a generation config not applied
        raise SystemExit(f"pace-serve: {e}") from None
    app = create_app(engine, names, max_body_bytes=int(args.max_body_mb * 2**20), body_timeout_s=args.body_timeout,
                     tenants=tenants, metrics_key=metrics_key)
    retention = (f"retention: {args.retain_mb:g} MB, {args.retain_hours:g} h" if args.retain_mb or args.retain_hours
                 else "no retention: saved sessions stay until deleted (--retain-mb, --retain-hours)")
    access = (f"API keys for {len(tenants.names)} tenant(s)" if tenants else
              "no API keys: one namespace for every client" + ("" if _loopback(args.host) else " (--insecure)"))
    access += ("; /metrics: the operator's key" if metrics_key else
               "; /metrics: refused (--metrics-key FILE serves it)" if tenants else "; /metrics: open")
    print(f"pace-serve: serving {names[0]} on http://{args.host}:{args.port}/v1 ({access}; store: {args.store}; "
          f"{retention})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)  # the request log's line (pace_hf.serve.requestlog) says more


if __name__ == "__main__":
    main()
