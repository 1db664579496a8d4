"""pace-serve's resident memory after a burst: idle, at the burst's peak, and every 5 s for a while after.

    python bench/serve_burst.py                       # SmolLM2-135M bf16, 40 requests at once, 90 s after
    python bench/serve_burst.py --requests 40 --watch-s 90 --out bench/results/serve_burst

One real ``pace-serve`` (a disk store, ``--idle-ttl 30``: its sessions are parked 30 s after their turns) takes
one warm-up turn; its RSS 5 s later is *idle*. Then ``--requests`` clients each send one new conversation
at once (a 600-token prompt, 16 tokens asked): some are served, the rest refused with 429 by the bounded
queue. The RSS is sampled during the burst (its peak) and every 5 s for ``--watch-s`` after. The goal
(pace-serve's guide): within 10% of idle once the sessions are parked. Each run is appended to
``results.jsonl`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import psutil

TEXT = " ".join(f"record {i} settles amount {i * 7} to account {i % 13}." for i in range(60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def burst(args) -> dict:
    port, store = free_port(), tempfile.mkdtemp(prefix="serve_burst.")
    cmd = [str(Path(sys.executable).parent / "pace-serve"), "--model", args.model, "--loader", args.loader,
           "--port", str(port), "--store", f"disk:{store}", "--idle-ttl", "30", "--dtype", args.dtype,
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=900)
        deadline = time.time() + 600
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.time() > deadline or proc.poll() is not None:
                    raise SystemExit("serve_burst: pace-serve did not start") from None
                time.sleep(1)
        model = client.models.list().data[0].id

        def rss() -> float:
            return psutil.Process(proc.pid).memory_info().rss / 2**20

        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Warm up: " + TEXT}],
                                       max_tokens=8)
        time.sleep(5)
        idle, peak, codes = rss(), [], []

        def one(i: int) -> None:
            try:
                client.chat.completions.create(model=model, max_tokens=16,
                                               messages=[{"role": "user", "content": f"Burst {i}: {TEXT}"}])
                codes.append("200")
            except openai.APIStatusError as e:
                codes.append(str(e.status_code))
            except openai.APIError as e:
                codes.append(type(e).__name__)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak.append(rss())
            time.sleep(0.2)
        after, t0 = {}, time.time()
        while time.time() - t0 < args.watch_s:
            after[round(time.time() - t0)] = rss()
            time.sleep(5)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(store, ignore_errors=True)
    last = after[max(after)]
    return {"model": args.model, "dtype": args.dtype, "requests": args.requests, "idle_mib": idle,
            "peak_mib": max(peak + [idle]), "after_mib": after, "last_mib": last, "last_over_idle": last / idle,
            "replies": {c: codes.count(c) for c in sorted(set(codes))}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--loader", default="pace_bench.models:load_model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--watch-s", type=float, default=90)
    p.add_argument("--out", default="bench/results/serve_burst")
    args = p.parse_args()
    row = burst(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"idle {row['idle_mib']:.0f} MiB, peak {row['peak_mib']:.0f} MiB, {args.watch_s:.0f} s after "
          f"{row['last_mib']:.0f} MiB ({100 * (row['last_over_idle'] - 1):+.1f}% of idle); replies {row['replies']}")


if __name__ == "__main__":
    main()
