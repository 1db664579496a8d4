"""The report of one long session (the 1M-token PACE run, ``bench/run_1m.sh``): tokens/s per prefill
chunk and cache memory against the full cache's estimate over the whole run, as a figure, and the
probes' checks, recall, residency and rotary gap, as a table.

    python bench/session_1m_report.py runs/length-1m --out bench/results/length/1m

Reads RUN/chunks.jsonl (``pace-bench --chunk-log``), RUN/probes.jsonl and RUN/run.json; writes
OUT/fig_chunks.png, OUT/report.md and copies of the run's logs. Flatness is read as the issue states
its targets: per-chunk tokens/s over the first 48K tokens against the last 48K (target within +-15%),
and the peak cache over the whole run against the peak over its first 48K (target <= 1.05x). The run
shares a 2-core CPU with whatever else runs, so the same ratio is also given in tokens per CPU-second
of the run's own process, which other load barely moves (chunks logged before that field existed are
left out of it), and as the median chunk of each window (a chunk that spanned a stop, or a foreground
test, moves a sum but not a median). It runs across working sessions, on whichever machine each one
gets, so a table of every 128K tokens shows whether the speed trends with the length or only varies.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from pace_bench.checkpoint import read_chunk_log
from pace_bench.records import read_jsonl

WINDOW = 48 * 1024  # the "first 48K" and "last 48K"
STRETCH = 128 * 1024  # the rows of the table over the whole run


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def flatness(chunks: list[dict]) -> dict:
    """Tokens/s of the first and last ``WINDOW`` tokens of prefill (tokens over seconds, whole chunks of
    the context only), and the peak cache in the first window and over the run."""
    full = [c for c in chunks if c["tokens"] == max(c["tokens"] for c in chunks)]  # the context's chunks
    end = max(c["seen"] for c in full)
    first = [c for c in full if c["seen"] <= WINDOW] or full[:1]
    last = [c for c in full if c["seen"] > end - WINDOW] or full[-1:]
    rate = lambda cs, key="seconds": sum(c["tokens"] for c in cs) / sum(c[key] for c in cs)  # noqa: E731
    timed = [c for c in full if c.get("cpu_seconds")]
    cpu_first = [c for c in timed if c["seen"] <= WINDOW] or timed[:1]
    cpu_last = [c for c in timed if c["seen"] > end - WINDOW] or timed[-1:]
    cpu = {"first_tok_cpu_s": rate(cpu_first, "cpu_seconds"), "last_tok_cpu_s": rate(cpu_last, "cpu_seconds"),
           "tok_cpu_s_ratio": rate(cpu_last, "cpu_seconds") / rate(cpu_first, "cpu_seconds")} if timed else {}
    early_peak = max(c["cache_bytes"] for c in chunks if c["seen"] <= max(WINDOW, first[-1]["seen"]))
    median = {"first_median_tok_s": _median(first, "tokens_per_s"), "last_median_tok_s": _median(last, "tokens_per_s")}
    median["median_ratio"] = median["last_median_tok_s"] / median["first_median_tok_s"]
    return {"first_tok_s": rate(first), "last_tok_s": rate(last), "tok_s_ratio": rate(last) / rate(first), **median,
            "early_peak": early_peak, "peak": max(c["cache_bytes"] for c in chunks),
            "peak_ratio": max(c["cache_bytes"] for c in chunks) / early_peak,
            "full_at_end": max(c["full_cache_bytes"] for c in chunks), "seen": max(c["seen"] for c in chunks),
            "prefill_hours": sum(c["seconds"] for c in chunks) / 3600, **cpu}


def _median(chunks: list[dict], key: str) -> float:
    values = sorted(c[key] for c in chunks)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def stretches(chunks: list[dict]) -> list[str]:
    """Table rows, one per ``STRETCH`` tokens of the context's chunks: median tokens/s per chunk, median
    tokens per CPU-second, the mean load average and the peak cache."""
    full = [c for c in chunks if c["tokens"] == max(c["tokens"] for c in chunks)]
    rows = []
    for lo in range(0, max(c["seen"] for c in full), STRETCH):
        part = [c for c in full if lo < c["seen"] <= lo + STRETCH]
        if not part:
            continue
        timed = [dict(c, per_cpu=c["tokens"] / c["cpu_seconds"]) for c in part if c.get("cpu_seconds")]
        cpu = f"{_median(timed, 'per_cpu'):.1f}" if timed else "n/a"
        load = [c["load1"] for c in part if c.get("load1") is not None]
        load_text = f"{sum(load) / len(load):.2f}" if load else "n/a"
        rows.append(f"| {lo // 1024:,}K-{part[-1]['seen'] // 1024:,}K | {len(part)} | {_median(part, 'tokens_per_s'):.1f} "
                    f"| {cpu} | {load_text} | {_mib(max(c['cache_bytes'] for c in part))} |")
    return rows


def figure(chunks: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = [c["seen"] / 1024 for c in chunks]
    fig, (speed, memory) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    speed.plot(seen, [c["tokens_per_s"] for c in chunks], ".", markersize=3)
    speed.set_ylabel("prefill tokens/s per chunk")
    speed.set_ylim(bottom=0)
    speed.set_title(title)
    memory.plot(seen, [c["cache_bytes"] / 2**20 for c in chunks], label="PACE cache (each forward's peak)")
    memory.plot(seen, [c["full_cache_bytes"] / 2**20 for c in chunks], "--", label="full cache (estimate)")
    memory.set_yscale("log")
    memory.set_ylabel("MiB")
    memory.set_xlabel("tokens seen (K)")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(run: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads((run / "run.json").read_text())
    chunks = read_chunk_log(run / "chunks.jsonl")
    records = read_jsonl(run / "probes.jsonl")
    if not chunks or not records:
        raise SystemExit(f"{run}: no chunk log or no probe records (run pace-bench with --chunk-log to the end)")
    f = flatness(chunks)
    title = (f"{settings['model']} ({settings['dtype']}), PACE, B={settings['budget']:,}, H={settings['chunk']:,}, "
             f"L={settings['limit']:,}, {f['seen']:,} tokens")
    figure(chunks, out / "fig_chunks.png", title)
    lines = [f"# One session at {f['seen']:,} tokens", "", title, "",
             "| probe | checks | recall | residency | rotary gap | peak cache (vs full cache) |", "|---|---|---|---|---|---|"]
    for r in records:
        gap = f"{r['rotary_gap']:,}" if r.get("rotary_gap") is not None else "n/a"
        lines.append(f"| {r['probe']} | {r['checks_passed']}/{r['checks_total']} | {r['recall_hits']}/{r['recall_total']} "
                     f"| {r.get('residency', 1.0):.3f} | {gap} | {_mib(r['peak_cache_bytes'])} "
                     f"({r['peak_cache_bytes'] / r['full_cache_bytes']:.3f}x of {_mib(r['full_cache_bytes'])}) |")
    checks = sum(r["checks_passed"] for r in records), sum(r["checks_total"] for r in records)
    lines += ["", f"Checks {checks[0]}/{checks[1]}. Prefill {f['prefill_hours']:.2f} h over {len(chunks)} chunks.", "",
              f"- Per-chunk tokens/s: {f['first_tok_s']:.1f} over the first 48K tokens, {f['last_tok_s']:.1f} over "
              f"the last 48K: {f['tok_s_ratio']:.3f}x (target within 0.85-1.15x); the median chunk: "
              f"{f['first_median_tok_s']:.1f} and {f['last_median_tok_s']:.1f}, {f['median_ratio']:.3f}x.",
              *([f"- Per CPU-second of the run's process (other load barely moves it): {f['first_tok_cpu_s']:.1f} "
                 f"tokens over the first 48K, {f['last_tok_cpu_s']:.1f} over the last 48K: {f['tok_cpu_s_ratio']:.3f}x."]
                if "tok_cpu_s_ratio" in f else []),
              f"- Peak cache: {_mib(f['peak'])} over the run, {_mib(f['early_peak'])} over the first 48K: "
              f"{f['peak_ratio']:.3f}x (target <= 1.05x); the full cache would hold {_mib(f['full_at_end'])} "
              f"({f['peak'] / f['full_at_end']:.4f}x).", "",
              "| tokens | chunks | tokens/s (median chunk) | tokens per CPU-second (median) | load average | peak cache |",
              "|---|---|---|---|---|---|", *stretches(chunks), "",
              "![tokens/s and cache memory per chunk](fig_chunks.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    if out.resolve() != run.resolve():
        for name in ("probes.jsonl", "run.json", "table.md", "chunks.jsonl"):
            if (run / name).exists():
                shutil.copy(run / name, out / name)
    return out / "report.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run's --out folder")
    ap.add_argument("--out", type=Path, default=None, help="where the report goes (default: the run's folder)")
    args = ap.parse_args(argv)
    print(report(args.run, args.out or args.run).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
