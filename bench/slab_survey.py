"""What each kind of kernel object a sandboxed run may still make costs the host, at the most one run can make.

The memory cgroup charges most of a run's kernel memory; what it does not charge is refused by seccomp
(byte-range locks, shared mappings, same-page merging: ``tests/test_sandbox_kernel.py``). This survey
floods each kind of object the allowlist still permits, as many as one run can make before its limits
(the sandbox's defaults, the CPU limit raised to let a flood run its course), and reads the host's slab
and page tables (``pace_bench.host_slab``) at their peak while the run lasts and after it ended:

    PACE_ALLOW_CODE_EVAL=1 python bench/slab_survey.py --seconds 5 --out bench/results/slab_survey

Writes ``results.json`` and ``results.md`` into ``--out``; the figures go in the threat model. The host's
other work moves the readings by a few MB either way: read a row as a bound, not a measurement of one object.
"""

from __future__ import annotations

import argparse
import json
import platform
import textwrap
import time
from pathlib import Path

from pace_bench.host_slab import KERNEL, SlabPeak, slab_mb
from pace_bench.metrics.pace_coding.sandbox import SandboxLimits, run_calls

# Each flood makes objects of one kind until its limit refuses one or its time is up, and returns how many.
FLOODS = {
    "directories (tmpfs inode + dentry)": """
import os, time
def flood(seconds):
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            os.mkdir("d%d" % n)
        except OSError:
            break
        n += 1
    return n
""",
    "renames (dentry churn, one inode)": """
import os, time
def flood(seconds):
    open("f0", "w").close()
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        os.rename("f%d" % n, "f%d" % (n + 1))
        n += 1
    return n
""",
    "missing names looked up (negative dentries)": """
import os, time
def flood(seconds):
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            os.stat("m%0200d" % n)
        except OSError:
            pass
        n += 1
    return n
""",
    "epoll instances watching eventfds (epitems)": """
import os, select, time
keep = []
def flood(seconds):
    n = 0
    try:
        fds = [os.eventfd(0) for _ in range(8)]
        keep.extend(fds)
        while True:
            ep = select.epoll()
            keep.append(ep)
            for fd in fds:
                ep.register(fd, select.EPOLLIN)
                n += 1
    except OSError:
        return n
""",
    "threads (task, stack)": """
import threading, time
def flood(seconds):
    stop, n = threading.Event(), 0
    try:
        while True:
            threading.Thread(target=stop.wait, daemon=True).start()
            n += 1
    except RuntimeError:
        pass
    time.sleep(min(seconds, 1.0))
    stop.set()
    return n
""",
    "private mappings split apart (VMAs, page tables)": """
import mmap, time
keep = []
def flood(seconds):
    end, gaps = time.monotonic() + seconds, []
    while time.monotonic() < end:
        try:
            m = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
            m[0] = 1
            keep.append(m)
            gaps.append(mmap.mmap(-1, 1 << 21, flags=mmap.MAP_PRIVATE))
        except OSError:
            break
        if len(gaps) >= 100:
            for g in gaps:
                g.close()
            gaps = []
    return len(keep)
""",
}


def survey(seconds: float) -> list[dict]:
    limits = SandboxLimits(timeout_s=seconds + 20, cpu_s=int(seconds) + 15)
    rows = []
    for name, program in FLOODS.items():
        with SlabPeak(fields=KERNEL) as kernel:
            (result,) = run_calls(textwrap.dedent(program), [f"flood({seconds})"], limits)
        time.sleep(0.5)
        after = slab_mb(KERNEL)
        made = result.value if result.status == "ok" else None
        rows.append({"object": name, "made": made, "status": result.status, "error": result.exc_type,
                     "peak_mb": round(kernel.peak_growth, 1), "after_mb": round(after - kernel.before, 1),
                     "bytes_each": round(kernel.peak_growth * 2**20 / made) if made else None})
        print(f"{name:<50} made {made!s:>9}  kernel memory peak +{kernel.peak_growth:.1f} MB, after "
              f"+{after - kernel.before:.1f} MB", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="the longest each flood runs")
    ap.add_argument("--out", default="runs/slab_survey")
    args = ap.parse_args(argv)
    rows = survey(args.seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"kernel": platform.release(), "seconds": args.seconds, "limits": "SandboxLimits() defaults"}
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [f"kernel {meta['kernel']}; one run per kind, sandbox defaults, at most {args.seconds:g} s; host slab "
             "and page tables (MB) at their peak during the run and 0.5 s after it", "",
             "| object | made by one run | peak | after | per object (peak) |", "|---|---|---|---|---|"]
    for r in rows:
        made = f"{r['made']:,}" if r["made"] is not None else f"{r['status']} ({r['error']})"
        each = f"{r['bytes_each']:,} B" if r["bytes_each"] else "-"
        lines.append(f"| {r['object']} | {made} | {r['peak_mb']:+.1f} | {r['after_mb']:+.1f} | {each} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
