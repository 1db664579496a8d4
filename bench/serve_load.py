"""Load test for pace-serve: N concurrent clients, each a multi-turn conversation, on loopback.

    python bench/serve_load.py --model smollm2 --clients 1,4,16 --turns 10 --tokens 2000 --out runs/serve_load

For each N it starts a fresh server (``pace-serve``, a temporary disk store, at most
``--max-resident`` sessions in memory), runs N client threads with the openai client (streaming, so the
time to first token is measured), and reports throughput, TTFT, and the prefill tokens avoided by
reuse against a server that re-prefills (that server prefills every request's whole prompt, so its
count is the sum of ``prompt_tokens``; it needs no second run). Checks: no reply is lost (a 429 is
retried after its Retry-After; any other error fails the run), and every transcript is intact (each
turn after the first is served from exactly the previous turn's tokens: ``cached_tokens`` equals the
previous prompt plus its reply, minus the reply's last token when the reply was cut at
``max_tokens``). Bounded: ``--time-limit`` per N stops new turns. The server's peak RSS and
resident-session count are sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
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


def user_turn(rng: random.Random, client: int, turn: int, tokens: int) -> str:
    """About ``tokens`` tokens of code-like text (roughly 1.3 tokens per word)."""
    lines = [f"Client {client}, turn {turn}. Read this and answer briefly."]
    words = 0
    while words * 1.3 < tokens:
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"def {a}_{b}_{turn}(record):\n    return record.{c} * {rng.randint(2, 99)}")
        words += 8
    return "\n".join(lines)


def rss_kib(pid: int) -> int:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
    except (OSError, AttributeError):
        return 0


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run(n: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tempfile.mkdtemp(prefix="serve_load.")
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--model", args.model, "--port", str(port),
                             "--store", f"disk:{store}", "--max-resident", str(args.max_resident),
                             "--queue-size", str(args.queue_size), "--max-context", "131072",
                             "--budget", str(args.budget), "--limit", str(args.limit)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.5)
        peak = {"rss": 0, "resident": 0}
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak["rss"] = max(peak["rss"], rss_kib(proc.pid))
                peak["resident"] = max(peak["resident"], metric(url, "pace_resident_sessions"))
                time.sleep(0.5)

        results, errors = [], []
        stop_at = time.time() + args.time_limit

        def client(c: int):
            oc = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.time_limit + 600)
            rng = random.Random(c)
            msgs, prev, prev_text, prev_finish = [], None, "", None
            for t in range(args.turns):
                if time.time() > stop_at:
                    break
                msgs.append({"role": "user", "content": user_turn(rng, c, t, args.tokens)})
                while True:
                    t0, first, text, usage, finish = time.perf_counter(), None, "", None, None
                    try:
                        for ch in oc.chat.completions.create(model=args.model, messages=msgs, stream=True,
                                                             max_tokens=args.max_tokens):
                            if ch.choices and ch.choices[0].delta.content:
                                first = first or time.perf_counter() - t0
                                text += ch.choices[0].delta.content
                            if ch.choices and ch.choices[0].finish_reason:
                                finish = ch.choices[0].finish_reason
                            if ch.usage is not None:
                                usage = ch.usage
                        break
                    except openai.RateLimitError as e:
                        time.sleep(float(e.response.headers.get("retry-after", 1)))
                    except Exception as e:  # noqa: BLE001 - a lost reply fails the run
                        errors.append(f"client {c} turn {t}: {type(e).__name__}: {e}")
                        return
                if usage is None:
                    errors.append(f"client {c} turn {t}: no usage in the stream (reply lost)")
                    return
                cached = usage.prompt_tokens_details.cached_tokens
                # the session holds every reply token it fed back: all of a reply that stopped, all but
                # the last of one cut at max_tokens (that token was never forwarded)
                cut = int(prev_finish == "length")
                expected = None if prev is None else prev.prompt_tokens + prev.completion_tokens - cut
                intact = prev is None or cached == expected
                results.append({"client": c, "turn": t, "ttft": first, "seconds": time.perf_counter() - t0,
                                "prompt": usage.prompt_tokens, "cached": cached, "expected_cached": expected,
                                "completion": usage.completion_tokens, "previous_reply_tail": prev_text[-40:],
                                "new": usage.prompt_tokens - (prev.prompt_tokens + prev.completion_tokens if prev else 0),
                                "intact": intact})
                msgs.append({"role": "assistant", "content": text})
                prev, prev_text, prev_finish = usage, text, finish

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        resumes = metric(url, "pace_session_resumes_total")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(store, ignore_errors=True)  # the sessions' saves and spilled KV (GBs at N = 16)
    prompt = sum(r["prompt"] for r in results)
    history = sum(r["prompt"] - max(r["new"], 0) for r in results if r["turn"] > 0)
    cached = sum(r["cached"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"clients": n, "turns": len(results), "errors": errors, "wall_s": wall,
            "turns_per_min": 60 * len(results) / wall, "tokens_per_s": sum(r["completion"] for r in results) / wall,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None, "ttft_max_s": max(ttfts) if ttfts else None,
            "prefill_ours": prompt - cached, "prefill_reprefill_server": prompt,
            "history_avoided": cached / history if history else None,
            "intact": all(r["intact"] for r in results), "resumes": resumes,
            "peak_rss_mib": peak["rss"] / 1024, "peak_resident": peak["resident"], "max_resident": args.max_resident,
            "per_turn": results}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=2000, help="new tokens per user turn (about)")
    p.add_argument("--max-tokens", type=int, default=32, help="reply length")
    p.add_argument("--max-resident", type=int, default=4)
    p.add_argument("--queue-size", type=int, default=8)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--limit", type=int, default=8192)
    p.add_argument("--time-limit", type=float, default=900, help="seconds per N after which no new turn starts")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = [run(int(n), args) for n in args.clients.split(",")]
    print("| clients | turns | errors | turns/min | gen tok/s | TTFT p50 (s) | TTFT max (s) | prefill (ours) | "
          "prefill (re-prefill server) | history avoided | transcripts intact | resumes | peak resident / cap | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        avoided = f"{100 * r['history_avoided']:.1f}%" if r["history_avoided"] is not None else "-"
        print(f"| {r['clients']} | {r['turns']} | {len(r['errors'])} | {r['turns_per_min']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_p50_s']:.2f} | {r['ttft_max_s']:.2f} | {r['prefill_ours']:,} | {r['prefill_reprefill_server']:,} | "
              f"{avoided} | {'yes' if r['intact'] else 'NO'} | {r['resumes']:.0f} | {r['peak_resident']:.0f} / "
              f"{r['max_resident']} | {r['peak_rss_mib']:.0f} |")
    for r in rows:
        for e in r["errors"]:
            print("error:", e)
        for t in [t for t in r["per_turn"] if not t["intact"]][:5]:
            print(f"N={r['clients']} client {t['client']} turn {t['turn']}: cached {t['cached']}, expected "
                  f"{t['expected_cached']} (the previous reply ended {t['previous_reply_tail']!r})")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_load.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if any(r["errors"] or not r["intact"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
