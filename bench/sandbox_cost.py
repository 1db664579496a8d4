"""Per-run cost of the pace_coding sandbox, the host slab a stat flood leaves, the jitter of a run's
start after the previous run's end (what bounds the clock-phase channel), and the parent's CPU on an
answer that floods its report and stderr FIFOs until the timeout (issue 66), for this tree and an older
revision, interleaved in one process so that both see the same machine (issue 41).

    PACE_ALLOW_CODE_EVAL=1 python bench/sandbox_cost.py --before 2b0924c --runs 20 --out bench/results/sandbox_cost

The older revision's sandbox (its sandbox.py and _sandbox_child.py, read with ``git show``) is loaded
from a temporary folder. Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pace_bench.host_slab import SlabPeak, slab_mb

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "pace_bench/metrics/pace_coding"
PROGRAM = "from decimal import Decimal\ndef fee_for(amount):\n    return amount * Decimal('0.03')\n"
CALLS = ["fee_for(Decimal('100'))", "fee_for(Decimal('250.50'))", "str(fee_for(Decimal('1')))"]
FLOOD = """
import os, sys, time
ROOT = next(p for p in sys.path if os.path.isdir(p))  # the standard library, where the program imports it
def flood(seconds, salt):
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(1000):
            try:
                os.stat("%s/%s%0234d" % (ROOT, salt, n))  # 250 characters, never looked up before
            except OSError:
                pass
            n += 1
    return n
"""


def load_sandbox(rev: str | None, tmp: Path):
    """The sandbox module of revision ``rev`` (None: this tree)."""
    if rev is None:
        from pace_bench.metrics.pace_coding import sandbox
        return sandbox
    where = tmp / rev
    where.mkdir()
    for name in ("sandbox.py", "_sandbox_child.py"):
        text = subprocess.run(["git", "show", f"{rev}:{FOLDER}/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (where / name).write_text(text)  # the old sandbox.py starts the _sandbox_child.py beside it
    spec = importlib.util.spec_from_file_location(f"sandbox_{rev}", where / "sandbox.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def flood(sandbox, seconds: float) -> dict:
    """One run that stats fresh 250-character names under the standard library for ``seconds``: the
    host's slab before, at its peak while the run lasts, and 1 s after."""
    limits = sandbox.SandboxLimits(timeout_s=seconds + 4, memory_mb=64, cpu_s=int(seconds) + 2)
    with SlabPeak() as slab:
        result = sandbox.run_calls(FLOOD, [f"flood({seconds}, {secrets.token_hex(8)!r})"], limits)[0]
    time.sleep(1.0)
    return {"lookups": result.value, "slab_before_mb": round(slab.before, 1), "slab_peak_growth_mb": round(slab.peak_growth, 1),
            "slab_growth_after_mb": round(slab_mb() - slab.before, 1)}


# Issue 66's flood: every FIFO the answer can write to (the report FIFO where it reaches it, stderr) gets a
# line that breaks the protocol, then a 4 MB JSON line of lists nested 50 deep, again and again; the call
# never returns, so the run lasts until its timeout.
FLOOD_ANSWER = """
import fcntl, os, stat, threading, time
LINE = ("[" + ",".join(["[" * 49 + "]" * 49] * 42_000) + "]\\n").encode()

def _flood(fd):
    try:
        os.write(fd, b"not an answer\\n")
        while True:
            os.write(fd, LINE)
    except OSError:
        pass

def flood():
    for fd in range(64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
                threading.Thread(target=_flood, args=(fd,), daemon=True).start()
        except OSError:
            pass
    time.sleep(3600)
"""


def parent_cpu_on_flood(sandbox, timeout_s: float) -> dict:
    """The parent's CPU time (this process's, not the child's) and wall time for one run of the flood
    answer at ``timeout_s``."""
    limits = sandbox.SandboxLimits(timeout_s=timeout_s, cpu_s=int(timeout_s) + 5)
    cpu, wall = time.process_time(), time.perf_counter()
    sandbox.run_calls(FLOOD_ANSWER, ["flood()"], limits)
    return {"timeout_s": timeout_s, "parent_cpu_s": round(time.process_time() - cpu, 2),
            "wall_s": round(time.perf_counter() - wall, 1)}


END = "import time\ndef end():\n    return time.time()\n"
START = "import time\nSTARTED = time.time()\ndef start():\n    return STARTED\n"


def clock_phase(sandbox, pairs: int, timeout_s: float = 10.0) -> dict:
    """A run reports when it ends, the next when its program starts: the spread of that delay bounds
    what the first can tell the second by choosing when to end. Bits per run left: log2 of the time a
    run can choose its end in (its timeout) over the delay's spread (10th to 90th percentile)."""
    delays = []
    for _ in range(pairs):
        end = sandbox.run_calls(END, ["end()"])[0].value
        delays.append(sandbox.run_calls(START, ["start()"])[0].value - end)
    delays.sort()
    spread = delays[len(delays) * 9 // 10] - delays[len(delays) // 10]
    return {"delay_s_median": round(statistics.median(delays), 3), "delay_s_p10_p90": round(spread, 3),
            "bits_per_run": round(math.log2(timeout_s / max(spread, 1e-3)), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the git revision to compare with (e.g. the commit before issue 41)")
    ap.add_argument("--runs", type=int, default=20, help="runs of each sandbox, interleaved")
    ap.add_argument("--flood-seconds", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"before": load_sandbox(args.before, Path(tmp)), "after": load_sandbox(None, Path(tmp))}
        times = {name: [] for name in arms}
        for _ in range(args.runs):
            for name, sandbox in arms.items():
                start = time.perf_counter()
                results = sandbox.run_calls(PROGRAM, CALLS)
                times[name].append(time.perf_counter() - start)
                assert all(r.status == "ok" for r in results), results
        report = {"before": args.before, "runs": args.runs, "arms": {}}
        for name, sandbox in arms.items():
            report["arms"][name] = {
                "per_run_s_median": round(statistics.median(times[name]), 3),
                "per_run_s_min": round(min(times[name]), 3), "per_run_s_max": round(max(times[name]), 3),
                "layers": sandbox.isolation_layers(), "stat_flood": flood(sandbox, args.flood_seconds),
                "clock_phase": clock_phase(sandbox, args.runs),
                "report_flood": [parent_cpu_on_flood(sandbox, t) for t in (10.0, 20.0)]}
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    rows = ["| sandbox | per run (median, s) | min-max (s) | stat-flood lookups | slab growth at peak (MB) | "
            "slab growth 1 s after (MB) | next run's start after an end: spread (s) | clock-phase bits per run | "
            "parent CPU on the report flood, 10 s timeout (s) | at 20 s (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["arms"].items():
        f, c, (ten, twenty) = r["stat_flood"], r["clock_phase"], r["report_flood"]
        rows.append(f"| {name} ({'the --before revision' if name == 'before' else 'this tree'}) | {r['per_run_s_median']} | "
                    f"{r['per_run_s_min']}-{r['per_run_s_max']} | {f['lookups']:,} | {f['slab_peak_growth_mb']} | "
                    f"{f['slab_growth_after_mb']} | {c['delay_s_p10_p90']} | {c['bits_per_run']} | "
                    f"{ten['parent_cpu_s']} | {twenty['parent_cpu_s']} |")
    (out / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
