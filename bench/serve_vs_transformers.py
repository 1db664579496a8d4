"""pace-serve against ``transformers serve --continuous-batching``: one client, multi-turn agent sessions.

    python bench/serve_vs_transformers.py --sessions 8 --length 4096 --turns 3 --rounds 1 \\
        --out bench/results/serve_vs_transformers            # runs the arms not yet in results.jsonl
    python bench/serve_vs_transformers.py --report --out bench/results/serve_vs_transformers

Both servers load the same local model directory (default: the dense bf16 copy of Qwen2.5-Coder-0.5B
that ``pace_bench.models.load_model`` keeps under its cache root) in bf16 on the CPU, and the same
client script drives both over real HTTP with the ``openai`` client (streamed, greedy).

A session is a conversation that has already reached ``--length`` tokens: a history of real text (the
standard library's ``pydoc_data.topics``, a different stretch per session) in user turns of
``--new-tokens`` tokens, each followed by a short assistant answer. Growing 16 sessions to 16K tokens
one turn at a time would take hours on a 2-core CPU, so each arm measures the steady state at that
length instead:
1. warm-up (untimed): every session sends its whole history and one more user turn, concurrently; each
   server takes the history in once (pace-serve prefills it into a session of ``--budget`` resident
   tokens; transformers serve into its paged cache);
2. ``--turns`` timed turns: each session appends the server's reply and ``--new-tokens`` new tokens of
   text and asks for at most ``--max-tokens`` greedy tokens, all sessions concurrently, each sending its
   next turn as soon as its reply is complete.

Reported per arm (one server at one (sessions, length) point in one round): completion tokens/s and
turns/min over the timed phase's wall time, TTFT p50 and p99 (the first streamed content), peak RSS of the
server's process tree (sampled every 0.2 s) in the warm-up and in the timed phase, the server's CPU
seconds per timed turn, the host's load average, and how much of each timed turn's prompt the server
did not prefill again: pace-serve's ``usage.prompt_tokens_details.cached_tokens``; for transformers serve,
the prefix matches its paged cache logs (``Found a prefix match of N tokens``, read from its debug log:
it reports no cached tokens in ``usage``). The servers alternate within a run: round r runs them in
``--order``, reversed on odd rounds. Every arm is appended to ``results.jsonl`` under ``--out`` as it
ends, and an arm already there is skipped, so a run can be stopped and resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import psutil

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("pace", "transformers")
TF_LOGGING = "import logging\nlogging.getLogger('ContinuousBatchingLogger').setLevel(logging.DEBUG)\n"
PAGE = 256  # transformers' continuous batching page (block) size, its default
ASK = "\n\nWhat is the most important point above, in one sentence?"


def default_model_dir() -> Path:
    """The dense bf16 copy of the packaged Qwen2.5-Coder-0.5B-Instruct that ``load_model`` keeps."""
    from pace_bench.models import cache_root

    found = sorted(p for p in cache_root().glob("qwen2.5-coder-0.5b-instruct.bfloat16.*")
                   if (p / "pace_hf_source.json").exists())
    if not found:
        raise SystemExit("no dense bf16 copy of qwen2.5-coder-0.5b yet: run "
                         "python -c \"import torch; from pace_bench.models import load_model; "
                         "load_model('qwen2.5-coder-0.5b', dtype=torch.bfloat16)\" once, or pass --model-dir")
    return found[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Text:
    """The standard library's ``pydoc_data.topics`` as one token stream, cut into turns of ``n`` tokens; each
    session reads its own stretch (wrapping around), so no two sessions share a prefix."""

    def __init__(self, tokenizer, n: int):
        from pydoc_data.topics import topics

        self.tokenizer, self.n = tokenizer, n
        self.ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)

    def turn(self, session: int, index: int) -> str:
        start = (session * 7919 * self.n // 8 + index * self.n) % (len(self.ids) - self.n)
        return self.tokenizer.decode(self.ids[start:start + self.n])


def conversation(text: Text, tokenizer, session: int, length: int) -> tuple[list[dict], int]:
    """``(messages, next turn index)``: a history of about ``length`` tokens (user turns of text, each
    answered by its first sentence-ish), ending with an assistant message."""
    msgs = [{"role": "system", "content": f"You are agent {session}. You read documentation and answer briefly."}]
    used, i = 30, 0
    while used < length:
        user = text.turn(session, i) + ASK
        answer = " ".join(user.split()[:24]) + "."
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        used += len(tokenizer.encode(user)) + len(tokenizer.encode(answer)) + 10  # the template's few tokens
        i += 1
    return msgs, i


def cb_blocks(args) -> list[str]:
    """``--cb-num-blocks``: twice what the sessions hold at their last turn (left unset, transformers serve
    sizes its paged cache from the machine's memory: 14 GB of RSS here for 2 short sessions)."""
    if args.tf_blocks == 0:
        return []
    need = args.sessions * (args.length + (args.turns + 1) * (args.new_tokens + args.max_tokens + 40) + PAGE)
    return ["--cb-num-blocks", str(args.tf_blocks or 2 * -(-need // PAGE))]


class Server:
    """One server process on its own port: started, watched (RSS, CPU) and stopped."""

    def __init__(self, kind: str, args, model_dir: Path, log: Path, work: Path):
        self.kind, self.log, self.port = kind, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if kind == "pace":
            self.cmd = [sys.executable, "-m", "pace_hf.serve", "--model", str(model_dir), "--dtype", "bfloat16",
                        "--served-name", "model", "--port", str(self.port), "--store", f"disk:{work / 'store'}",
                        "--budget", str(args.budget), "--max-resident", str(max(8, args.sessions)),
                        "--max-batch", str(args.sessions), "--queue-size", str(4 * args.sessions),
                        "--max-context", str(4 * args.length + 8192)] + args.pace_args
        else:
            exe = Path(sys.executable).with_name("transformers")
            self.cmd = [str(exe), "serve", str(model_dir), "--continuous-batching", "--host", "127.0.0.1",
                        "--port", str(self.port), "--device", "cpu", "--dtype", "bfloat16",
                        "--enable-log-requests"] + cb_blocks(args) + args.tf_args
            # its continuous batching's logger at debug, in the process that runs the model too (a spawned
            # one): the prefix matches of its paged cache are debug lines
            (work / "sitecustomize.py").write_text(TF_LOGGING)
            env["PYTHONPATH"] = f"{work}{os.pathsep}{env['PYTHONPATH']}"
        self.env = env
        self.proc = None
        self.peak = 0
        self._phase_peak = 0
        self._stop = threading.Event()

    def start(self, timeout_s: float = 900) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.time() + timeout_s
        while True:
            try:
                self.model = openai.OpenAI(base_url=self.url + "/v1", api_key="x", timeout=5).models.list().data[0].id
                break
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the {self.kind} server did not start: see {self.log}")
                time.sleep(1)
        threading.Thread(target=self._watch, daemon=True).start()

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def rss(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def cpu_s(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            r = self.rss()
            self.peak, self._phase_peak = max(self.peak, r), max(self._phase_peak, r)

    def phase_peak(self) -> int:
        """The peak RSS since the last call (the sampler's, and now's)."""
        out, self._phase_peak = max(self._phase_peak, self.rss()), 0
        return out

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # the rest of its group (transformers' spawned model process, its resource tracker) may still write
        # to the log: wait for them, so that the log is scrubbed after its last line
        for _ in range(300 if self.proc is not None else 0):
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def ask(server: Server, msgs: list[dict], max_tokens: int, timeout_s: float) -> dict:
    """One streamed, greedy turn: its reply and timings. A request past ``timeout_s`` in all raises
    ``TimeoutError``, not retried (the client's own timeout bounds each wait for a chunk, not the stream)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=timeout_s)
    t0 = time.perf_counter()
    first, text, usage, finish, chunks = None, "", None, None, 0
    stream = client.chat.completions.create(model=server.model, messages=msgs, stream=True, max_tokens=max_tokens,
                                            temperature=0, stream_options={"include_usage": True})

    def past_deadline() -> None:
        if time.perf_counter() - t0 > timeout_s:
            stream.close()
            raise TimeoutError(f"the request took over {timeout_s:g} s")

    for ch in stream:
        past_deadline()
        if ch.choices and ch.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text += ch.choices[0].delta.content
            chunks += 1
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if ch.usage is not None:
            usage = ch.usage
    past_deadline()
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"text": text, "ttft": first, "seconds": time.perf_counter() - t0, "finish": finish,
            "prompt": usage.prompt_tokens if usage else None,
            "completion": usage.completion_tokens if usage else chunks,
            "cached": getattr(details, "cached_tokens", None) if details is not None else None}


PREFIX = re.compile(r"Found a prefix match of (\d+) tokens for request (\S+)")


def prefix_matches(log: Path, start: int) -> list[int]:
    """transformers serve's prefix matches logged after byte ``start`` of its log."""
    with log.open("rb") as f:
        f.seek(start)
        return [int(m.group(1)) for m in PREFIX.finditer(f.read().decode("utf-8", "replace"))]


def scrub(log: Path, names: dict[str, str]) -> None:
    """The log without this machine's paths (the model directory, the arm's scratch directory, the home)."""
    text = log.read_text(errors="replace")
    for path, name in names.items():
        text = text.replace(path, name)
    log.write_text(text)


def arm(kind: str, args, model_dir: Path, tokenizer, text: Text, rnd: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"svt.{kind}."))
    log = Path(args.out) / f"{kind}-s{args.sessions}-l{args.length}-r{rnd}.log"
    log.unlink(missing_ok=True)
    server = Server(kind, args, model_dir, log, work)
    load0 = os.getloadavg()
    try:
        t0 = time.perf_counter()
        server.start()
        started_s = time.perf_counter() - t0
        idle_rss = server.rss()
        server.phase_peak()
        convs = [conversation(text, tokenizer, s, args.length) for s in range(args.sessions)]
        records: list[dict] = []
        errors: list[str] = []
        barrier = threading.Barrier(args.sessions + 1)
        marks = {}

        def play(s: int) -> None:
            msgs, nxt = convs[s]
            msgs = list(msgs)
            for t in range(args.turns + 1):  # turn 0 is the warm-up
                if t == 1:
                    barrier.wait()  # every session warmed up: the timed phase starts together
                msgs.append({"role": "user", "content": text.turn(s, nxt + t) + ASK})
                try:
                    r = ask(server, msgs, args.max_tokens, args.timeout)
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    errors.append(f"session {s} turn {t}: {type(e).__name__}: {e}")
                    if t == 0:
                        barrier.wait()
                    return
                msgs.append({"role": "assistant", "content": r.pop("text")})
                records.append({"session": s, "turn": t, "at": time.perf_counter(), **r})

        threads = [threading.Thread(target=play, args=(s,)) for s in range(args.sessions)]
        tw = time.perf_counter()
        for th in threads:
            th.start()
        barrier.wait()
        warm_s = time.perf_counter() - tw
        warm_peak = server.phase_peak()
        log_at = log.stat().st_size
        cpu0, t1 = server.cpu_s(), time.perf_counter()
        for th in threads:
            th.join()
        timed_s = time.perf_counter() - t1
        cpu = server.cpu_s() - cpu0
        timed_peak = server.phase_peak()
        marks["matches"] = prefix_matches(log, log_at) if kind == "transformers" else None
        time.sleep(2)
        after_rss = server.rss()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        scrub(log, {str(model_dir): "MODEL_DIR", str(work): "WORK", str(Path.home()): "~"})
    timed = [r for r in records if r["turn"] >= 1]
    warm_prompts = [r["prompt"] for r in records if r["turn"] == 0 and r["prompt"]]
    ttfts = sorted(r["ttft"] for r in timed if r["ttft"] is not None)
    completion = sum(r["completion"] or 0 for r in timed)
    prompt = sum(r["prompt"] or 0 for r in timed)
    if kind == "pace":
        reused = sum(r["cached"] or 0 for r in timed)
    else:
        reused = sum(marks["matches"]) if marks["matches"] is not None else None
    return {"server": kind, "sessions": args.sessions, "length": args.length, "round": rnd, "turns": args.turns,
            "new_tokens": args.new_tokens, "max_tokens": args.max_tokens, "budget": args.budget,
            "model_dir": model_dir.name, "errors": errors, "start_s": started_s, "warmup_s": warm_s,
            "warmup_prompt_tokens": statistics.mean(warm_prompts) if warm_prompts else None,
            "timed_s": timed_s, "timed_turns": len(timed), "completion_tokens": completion,
            "prompt_tokens": prompt, "reused_tokens": reused,
            "prefix_matches": marks["matches"],
            "tok_s": completion / timed_s, "turns_min": 60 * len(timed) / timed_s,
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] if ttfts else None,
            "idle_rss_mib": idle_rss / 2**20, "peak_rss_warmup_mib": warm_peak / 2**20,
            "peak_rss_timed_mib": timed_peak / 2**20, "rss_after_mib": after_rss / 2**20,
            "cpu_s_per_turn": cpu / max(1, len(timed)), "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "host_cpus": os.cpu_count(), "per_turn": records}


def table(rows: list[dict]) -> str:
    head = ("| sessions | length | server | round | timed turns | completion tok/s | turns/min | TTFT p50 s | "
            "TTFT p99 s | prompt not prefilled again | peak RSS MiB (warm-up / timed) | CPU s/turn | load avg |\n"
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n")
    out = []
    for r in sorted(rows, key=lambda r: (r["length"], r["sessions"], r["round"], SERVERS.index(r["server"]))):
        reused = f"{100 * r['reused_tokens'] / r['prompt_tokens']:.0f}%" if r["reused_tokens"] is not None and r["prompt_tokens"] else "?"
        name = "pace-serve" if r["server"] == "pace" else "transformers serve --continuous-batching"
        err = f" ({len(r['errors'])} errors)" if r["errors"] else ""
        p50, p99 = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("ttft_p50", "ttft_p99"))  # no turn timed
        out.append(f"| {r['sessions']} | {r['length']} | {name}{err} | {r['round']} | {r['timed_turns']} | "
                   f"{r['tok_s']:.2f} | {r['turns_min']:.2f} | {p50} | {p99} | {reused} | "
                   f"{r['peak_rss_warmup_mib']:.0f} / {r['peak_rss_timed_mib']:.0f} | {r['cpu_s_per_turn']:.1f} | "
                   f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f} |")
    return head + "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None, help="a local model directory both servers load")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--length", type=int, default=4096, help="tokens of history each session starts from")
    p.add_argument("--turns", type=int, default=3, help="timed turns per session (after one untimed warm-up)")
    p.add_argument("--new-tokens", type=int, default=300, help="new tokens of text per user turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048, help="pace-serve's resident tokens per session")
    p.add_argument("--tf-blocks", type=int, default=None,
                   help="transformers serve's --cb-num-blocks (default: twice what the sessions need; 0: its own sizing)")
    p.add_argument("--timeout", type=float, default=6 * 3600,
                   help="seconds a request may take before it counts as an error (default 6 h: transformers "
                        "serve's warm-up of 16 sessions at 4K took 80 minutes on 2 cores, and 3 of its requests "
                        "timed out at 1 hour)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--order", default="pace,transformers", help="the servers' order in round 0 (reversed in odd rounds)")
    p.add_argument("--pace-args", default="", help="more pace-serve flags, one string")
    p.add_argument("--tf-args", default="", help="more transformers serve flags, one string")
    p.add_argument("--out", default="bench/results/serve_vs_transformers")
    p.add_argument("--report", action="store_true", help="print the table of --out's results.jsonl and exit")
    args = p.parse_args(argv)
    args.pace_args, args.tf_args = args.pace_args.split(), args.tf_args.split()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    if args.report:
        print(table(done), end="")
        return
    model_dir = args.model_dir or default_model_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = Text(tokenizer, args.new_tokens)
    order = args.order.split(",")
    if sorted(order) != sorted(SERVERS):
        p.error(f"--order names {SERVERS} once each")
    for rnd in range(args.rounds):
        for kind in (order if rnd % 2 == 0 else order[::-1]):
            key = (kind, args.sessions, args.length, rnd)
            if any((r["server"], r["sessions"], r["length"], r["round"]) == key for r in done):
                print(f"{key}: already in {results}", file=sys.stderr)
                continue
            print(f"{key}: running", file=sys.stderr, flush=True)
            row = arm(kind, args, model_dir, tokenizer, text, rnd)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
            print(table([row]), end="", flush=True)
    (out / "table.md").write_text(table(done))
    print(table(done), end="")


if __name__ == "__main__":
    main()
