"""The paper's tables and figures, drawn from a run's records (``probes.jsonl``).

* **Table 2** (:func:`summarize`): per arm, checks, full probes, recall, residency, the mean rotary gap,
  the paired comparison against a reference arm and the peak KV.
* **Table 3** (:func:`distance_table`): a sweep's checks and gaps, one row per definition distance D.

* **Figure 1** (``fig1_checks_vs_distance.png``): checks passed against the definition distance D, per
  arm. Each point pools the arm's probes at that D (checks passed / checks run, the table's ``checks``
  column), with a 95% Wilson interval over the checks; a line joins an arm's points across the D values,
  and the arm's mean residency of the needed tokens is written beside each point.
* **Figure 3** (``fig3_checks_vs_rotary_gap.png``): checks passed against the rotary gap at the probe,
  binned 0-8K, 8-16K, 16-32K and >32K tokens, for the foresight (PACE-family) arms at full residency,
  with the probes in each bin in a panel below. A probe with nothing resident has no gap: it is left
  out (and counted in the footnote), never put at 0.

* **The planner-robustness curve** (``robustness.png``, with ``robustness_table``): checks passed
  against the fraction of the oracle blueprint's edges dropped, with and without rehydration, beside
  H2O on the same sessions (``bench/robustness.py`` runs the points).

Each figure's title names the model, B, L, H, the session length and n. The settings come from the
command line, else from the run's ``run.json`` (the runner writes it beside ``probes.jsonl``), else from
the records; the session length and n always come from the records.

    python -m pace_bench.figures runs/48k
    python -m pace_bench.figures bench/results/48k --model qwen2.5-coder-0.5b --budget 2048 --limit 8192 --chunk 4096

Several run folders of one setting (say, a sweep and an arm added later at two of its distances) are
drawn as one, with their merged table (``--out`` is then required):

    python -m pace_bench.figures bench/results/sweep bench/results/sweep-h2o --out bench/results/sweep-all
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from .arms import ARMS, FORESIGHT_ARMS
from .stats import wilson
from .records import run_records, session_key

FIGURE_1 = "fig1_checks_vs_distance.png"
FIGURE_3 = "fig3_checks_vs_rotary_gap.png"
FIGURE_ROBUSTNESS = "robustness.png"

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
GAP_BINS = (0, 8192, 16384, 32768, math.inf)
GAP_LABELS = ("0-8K", "8-16K", "16-32K", ">32K")
# The context each packaged model was trained on, marked on Figure 1 when it falls inside the D range.
TRAINING_CONTEXT = {"qwen2.5-coder-0.5b": 32768, "smollm2-135m": 8192}
SETTINGS = ("model", "budget", "limit", "chunk")


def _rank(arm: str) -> int:
    """An arm's place in the registry (unknown arms after the known ones), so that it has the same color
    and marker, and the same place, in every figure of every run."""
    return list(ARMS).index(arm) if arm in ARMS else len(ARMS)


def arm_style(arm: str) -> dict:
    """A fixed color and marker per arm (unknown arms after the known ones)."""
    import matplotlib

    k = _rank(arm) if arm in ARMS else len(ARMS) + sum(map(ord, arm)) % 7
    return {"color": matplotlib.colormaps["tab10"](k % 10), "marker": _MARKERS[k % len(_MARKERS)]}


def _tokens(x: float) -> str:
    """About ``x`` tokens, in K = 1,024 (a 49,152-token session is 48K)."""
    return f"{x / 1024:.1f}K".replace(".0K", "K") if x >= 1024 else f"{x:.0f}"


def _tick(d: float) -> str:
    """A D value exactly: 16K when it is a whole number of K (1,024), else 48,707."""
    return f"{d / 1024:g}K" if d and d % 1024 == 0 else f"{d:,.0f}"


def distance_groups(df: pd.DataFrame) -> pd.Series:
    """The D each probe was run at: the runner's ``target_distance`` (the ``--distance`` asked for), else
    the actual distances clustered (sessions built for one D land within a few hundred tokens of it; a
    new group starts past a gap of max(1K, 10%)), each group labelled by its median."""
    target = df["target_distance"] if "target_distance" in df else pd.Series(np.nan, index=df.index)
    actual = df["distance"].astype(float)
    values = np.sort(actual[target.isna()].unique())
    label, group = {}, []
    for v in values:
        if group and v - group[-1] > max(1024.0, 0.1 * group[-1]):
            label.update({g: float(np.median(group)) for g in group})
            group = []
        group.append(v)
    label.update({g: float(np.median(group)) for g in group})
    return target.astype(float).fillna(actual.map(label))


def settings_for(run_dir: Path | None, records: list[dict], overrides: dict | None = None) -> dict:
    """Model, B, L and H: ``overrides`` (the command line) over ``run.json`` over the records' fields."""
    out = {}
    for r in records[:1]:
        out.update({k: r[k] for k in SETTINGS if r.get(k) is not None})
    if run_dir is not None and (Path(run_dir) / "run.json").exists():
        run = json.loads((Path(run_dir) / "run.json").read_text())
        out.update({k: run[k] for k in SETTINGS if run.get(k) is not None})
    out.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return out


def title_for(df: pd.DataFrame, settings: dict) -> str:
    """``model, B=.., L=.., H=..`` over ``~N-token sessions, S sessions, n = P probes per arm``."""
    parts = [str(settings.get("model", "model ?"))]
    parts += [f"{name}={settings[key]:,}" if key in settings else f"{name}=?"
              for name, key in (("B", "budget"), ("L", "limit"), ("H", "chunk"))]
    lengths = df["context_len"]
    length = (f"~{_tokens(lengths.median())}" if lengths.max() - lengths.min() < 0.05 * lengths.max()
              else f"{_tokens(lengths.min())}-{_tokens(lengths.max())}")
    sessions = df.groupby(["session_id", "distance"]).ngroups
    per_arm = df.groupby("arm").size()
    n = f"{per_arm.iloc[0]}" if per_arm.nunique() == 1 else f"{per_arm.min()}-{per_arm.max()}"
    plural = "s" if sessions != 1 else ""
    return f"{', '.join(parts)}\n{length}-token sessions, {sessions} session{plural}, n = {n} probes per arm"


def _frame(records: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(records)
    for column, default in (("residency", 1.0), ("rotary_gap", np.nan)):
        df[column] = df[column].astype(float).fillna(default) if column in df else default
    return df


def _arms(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["arm"]))
    return sorted(present, key=lambda a: (_rank(a), present.index(a)))


def _pooled(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    g = df.groupby(by, observed=True).agg(passed=("checks_passed", "sum"), total=("checks_total", "sum"),
                                          probes=("probe", "size"), residency=("residency", "mean")).reset_index()
    g["rate"] = g["passed"] / g["total"].where(g["total"] > 0)
    g["low"], g["high"] = wilson(g["passed"], g["total"])
    return g


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=130, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def figure_distance(records: list[dict], settings: dict, path: Path) -> Path:
    """Figure 1: checks passed against D, per arm, with 95% Wilson intervals and residency annotated."""
    import matplotlib.pyplot as plt

    df = _frame(records)
    df["D"] = distance_groups(df)
    g = _pooled(df, ["arm", "D"])
    arms, ds = _arms(df), np.sort(g["D"].unique())
    span = (ds[-1] - ds[0]) if len(ds) > 1 else max(ds[0], 1024.0) * 0.5
    step = span * (0.06 if len(ds) == 1 else 0.045)  # arms side by side at each D, never on top of each other
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, arm in enumerate(arms):
        a = g[g["arm"] == arm].sort_values("D")
        x = a["D"] + (i - (len(arms) - 1) / 2) * step
        style = arm_style(arm)
        ax.errorbar(x, a["rate"], yerr=[a["rate"] - a["low"], a["high"] - a["rate"]], capsize=3, lw=1.5, ms=7,
                    linestyle="-" if len(a) > 1 else "none", label=arm, **style)
        for xi, (_, row) in zip(x, a.iterrows()):
            ax.annotate(f"res {row['residency']:.2f}, n={row['probes']}", (xi, row["high"]), textcoords="offset points",
                        xytext=(0, 4), ha="center", va="bottom", fontsize=7, rotation=90, color=style["color"])
    pad = span * 0.35 if len(ds) > 1 else span * 0.5
    ax.set_xlim(ds[0] - pad if len(ds) > 1 else ds[0] - span / 2, ds[-1] + pad if len(ds) > 1 else ds[0] + span / 2)
    trained = TRAINING_CONTEXT.get(str(settings.get("model", "")).lower())
    if trained and ax.get_xlim()[0] < trained < ax.get_xlim()[1]:
        ax.axvline(trained, color="0.5", linestyle=":", lw=1, label=f"the model's training\ncontext ({_tick(trained)})")
    ax.set_xticks(ds, [_tick(d) for d in ds])
    ax.set_ylim(-0.04, 1.32)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("definition distance D (tokens between the definitions and the first probe)")
    ax.set_ylabel("checks passed (fraction of the checks run,\n95% Wilson CI)")
    ax.set_title("Figure 1. Checks passed against definition distance\n" + title_for(df, settings), fontsize=9)
    ax.legend(title="arm (res = mean residency of\nthe needed tokens, n = probes)", bbox_to_anchor=(1.02, 1),
              loc="upper left", fontsize=8, title_fontsize=8, frameon=False)
    return _save(fig, path)


def figure_gap(records: list[dict], settings: dict, path: Path, arms=FORESIGHT_ARMS,
               min_residency: float = 1.0) -> Path:
    """Figure 3: checks passed against the binned rotary gap, for ``arms`` at residency >= ``min_residency``
    (probes with nothing resident have no gap and are left out), with the probes per bin below."""
    import matplotlib.pyplot as plt

    df = _frame(records)
    family = df[df["arm"].isin(arms)]
    kept = family[(family["residency"] >= min_residency - 1e-9) & family["rotary_gap"].notna()].copy()
    kept["bin"] = pd.cut(kept["rotary_gap"], GAP_BINS, right=False, labels=GAP_LABELS)
    g = _pooled(kept, ["arm", "bin"]) if len(kept) else pd.DataFrame(columns=["arm", "bin"])
    shown = _arms(kept) if len(kept) else []
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True, height_ratios=(3, 1.2))
    width = 0.8 / max(1, len(shown))
    for i, arm in enumerate(shown):
        a = g[g["arm"] == arm]
        x = a["bin"].cat.codes + (i - (len(shown) - 1) / 2) * width
        style = arm_style(arm)
        ax.errorbar(x, a["rate"], yerr=[a["rate"] - a["low"], a["high"] - a["rate"]], capsize=3, ms=7,
                    linestyle="none", label=arm, **style)
        counts = a.set_index("bin")["probes"].reindex(GAP_LABELS, fill_value=0)
        b = bars.bar(np.arange(len(GAP_LABELS)) + (i - (len(shown) - 1) / 2) * width, counts, width * 0.9,
                     color=style["color"], alpha=0.8)
        bars.bar_label(b, labels=[str(c) if c else "" for c in counts], fontsize=7, padding=1)
    if not shown:
        ax.text(0.5, 0.5, f"no probe of {', '.join(arms)} at full residency", transform=ax.transAxes, ha="center")
    ax.set_ylim(-0.04, 1.1)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylabel("checks passed (fraction of the\nchecks run, 95% Wilson CI)")
    bars.set_xticks(range(len(GAP_LABELS)), GAP_LABELS)
    bars.set_xlim(-0.6, len(GAP_LABELS) - 0.4)
    bars.set_ylabel("probes")
    bars.set_ylim(0, max([1, *kept.groupby(["arm", "bin"], observed=True).size()]) * 1.35)
    bars.set_xlabel("rotary gap at the probe (tokens between its first query and the farthest needed token)")
    below = int((family["residency"] < min_residency - 1e-9).sum())
    no_gap = int(((family["residency"] >= min_residency - 1e-9) & family["rotary_gap"].isna()).sum())
    ax.set_title("Figure 3. Checks passed against rotary gap, foresight arms at full residency\n"
                 + title_for(df, settings), fontsize=9)
    if len(shown):
        ax.legend(title="arm", bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8, title_fontsize=8,
                  frameon=False)
    fig.text(0.01, -0.01, f"Left out: {below} probe(s) of these arms below full residency, {no_gap} with no gap "
             f"(nothing resident); other arms are not shown.", fontsize=7, color="0.35", ha="left", va="top")
    return _save(fig, path)


def gap_text(value) -> str:
    """A rotary gap as the tables print it; ``n/a`` when nothing needed was resident."""
    return "n/a" if value is None else f"{value:,.0f}"


def reference_for(records: list[dict], reference_arm: str | None) -> str | None:
    """The arm the table pairs the others against: ``reference_arm`` if it was run, else the first arm
    run (with a warning unless none was asked for), so that the paired column is never silently empty."""
    arms = list(dict.fromkeys(r["arm"] for r in records))
    if not arms or reference_arm in arms:
        return reference_arm if arms else None
    if reference_arm is not None:
        warnings.warn(f"reference arm {reference_arm!r} was not run; pairing against {arms[0]!r}, the first arm run",
                      stacklevel=2)
    return arms[0]


def summarize(records: list[dict], reference_arm: str | None) -> str:
    """A Markdown table in the shape of the paper's Table 2. Probes with nothing resident have no rotary
    gap: they are left out of the mean and counted as missing, never taken as 0."""
    from pace_bench.metrics.pace_coding.pace_coding import paired_comparison

    reference_arm = reference_for(records, reference_arm)
    arms = list(dict.fromkeys(r["arm"] for r in records))
    by_arm = {a: [r for r in records if r["arm"] == a] for a in arms}
    key = lambda r: (*session_key(r), r["probe"])  # noqa: E731
    memory = all("peak_cache_bytes" in r for r in records)  # logs written before it was recorded lack it
    lines = [f"| arm | checks | full probes | recall | residency | mean rotary gap | vs {reference_arm} "
             "(better/worse/tied, p) |" + (" peak KV (vs full cache) |" if memory else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if memory else "")]
    ref = {key(r): r for r in by_arm.get(reference_arm, [])}
    for arm, rs in by_arm.items():
        passed, total = sum(r["checks_passed"] for r in rs), sum(r["checks_total"] for r in rs)
        full = sum(r["checks_passed"] == r["checks_total"] for r in rs)
        recall = sum(r["recall_hits"] for r in rs) / max(1, sum(r["recall_total"] for r in rs))
        residency = sum(r.get("residency", 1.0) for r in rs) / len(rs)
        gaps = [r["rotary_gap"] for r in rs if r.get("rotary_gap") is not None]
        gap = gap_text(sum(gaps) / len(gaps) if gaps else None)
        if 0 < len(rs) - len(gaps) and gaps:
            gap += f" ({len(rs) - len(gaps)} n/a)"
        paired = "-"  # the reference arm itself
        if arm != reference_arm:
            pairs = [(r, ref[key(r)]) for r in rs if key(r) in ref]
            p = paired_comparison([a for a, _ in pairs], [b for _, b in pairs])
            paired = f"{p['better']}/{p['worse']}/{p['tied']}, p={p['p_value']:.3g}"
        lines.append(f"| {arm} | {passed}/{total} ({100 * passed / max(1, total):.0f}%) | {full}/{len(rs)} | "
                     f"{100 * recall:.0f}% | {residency:.3f} | {gap} | {paired} |"
                     + (f" {_peak_memory(rs)} |" if memory else ""))
    return "\n".join(lines)


def _peak_memory(records: list[dict]) -> str:
    """An arm's largest cache peak, in MiB, and its ratio to the full cache's size at the same length."""
    peak = max(records, key=lambda r: r["peak_cache_bytes"])
    return f"{peak['peak_cache_bytes'] / 2**20:,.0f} MiB ({peak['peak_cache_bytes'] / peak['full_cache_bytes']:.2f}x)"


def distance_table(records: list[dict]) -> str:
    """The sweep's table (the paper's Table 3 shape): one row per definition distance D, one column per
    arm, each cell the checks passed there and the mean rotary gap at the probes (probes with nothing
    resident have no gap and are left out of the mean)."""
    df = _frame(records)
    df["D"] = distance_groups(df)
    arms = _arms(df)
    g = df.groupby(["D", "arm"]).agg(passed=("checks_passed", "sum"), total=("checks_total", "sum"),
                                     gap=("rotary_gap", "mean"))
    sessions = df.groupby("D")["session_id"].nunique()
    lines = ["| D | sessions | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for d in sorted(df["D"].unique()):
        cells = []
        for arm in arms:
            if (d, arm) not in g.index:
                cells.append("-")
                continue
            r = g.loc[(d, arm)]
            gap = "" if np.isnan(r["gap"]) else f", gap {_tokens(r['gap'])}"
            cells.append(f"{int(r['passed'])}/{int(r['total'])} ({r['passed'] / max(1, r['total']):.0%}){gap}")
        lines.append(f"| {_tick(d)} | {sessions[d]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_distance_table(table: str, records: list[dict]) -> str:
    """``table`` followed by the table by definition distance, when the records span more than one D."""
    if distance_groups(_frame(records)).nunique() < 2:
        return table
    return table + "\n\nBy definition distance D:\n\n" + distance_table(records)


def _pool(records: list[dict]) -> dict:
    """Checks, full probes, recall and residency pooled over ``records``."""
    df = _frame(records)
    return {"passed": df["checks_passed"].sum(), "total": df["checks_total"].sum(), "probes": len(df),
            "full": int((df["checks_passed"] == df["checks_total"]).sum()),
            "recall": df["recall_hits"].sum() / max(1, df["recall_total"].sum()), "residency": df["residency"].mean()}


def _robustness_frame(points: dict[tuple[float, bool], list[dict]]) -> pd.DataFrame:
    """One pooled row per (dropped fraction, rehydration) point that has records."""
    rows = [{"drop": drop, "rehydrate": rehydrate, **_pool(records)}
            for (drop, rehydrate), records in sorted(points.items()) if records]
    g = pd.DataFrame(rows, columns=["drop", "rehydrate", "passed", "total", "probes", "full", "recall", "residency"])
    g["rate"] = g["passed"] / g["total"].where(g["total"] > 0)
    g["low"], g["high"] = wilson(g["passed"], g["total"])
    return g


def robustness_table(points: dict[tuple[float, bool], list[dict]], reference: list[dict] | None = None,
                     reference_arm: str = "h2o") -> str:
    """A markdown table: one row per (dropped fraction, rehydration) point, then the reference arm."""
    lines = ["| oracle edges dropped | rehydration | checks | full probes | recall | residency |",
             "|---|---|---|---|---|---|"]
    for r in _robustness_frame(points).itertuples():
        lines.append(f"| {r.drop:g} | {'yes' if r.rehydrate else 'no'} | {r.passed}/{r.total} ({r.rate:.0%}) "
                     f"| {r.full}/{r.probes} | {r.recall:.0%} | {r.residency:.3f} |")
    if reference:
        r = _pool(reference)
        lines.append(f"| ({reference_arm}) | - | {r['passed']}/{r['total']} ({r['passed'] / r['total']:.0%}) "
                     f"| {r['full']}/{r['probes']} | {r['recall']:.0%} | {r['residency']:.3f} |")
    return "\n".join(lines) + "\n"


def figure_robustness(points: dict[tuple[float, bool], list[dict]], settings: dict, path: Path,
                      reference: list[dict] | None = None, reference_arm: str = "h2o") -> Path:
    """Checks passed (95% Wilson interval) against the dropped fraction of oracle edges: one line
    without and one with rehydration, and the reference arm as a dashed line."""
    import matplotlib.pyplot as plt

    g = _robustness_frame(points)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for rehydrate, marker, label in ((False, "o", "PACE, plan only"), (True, "s", "PACE + rehydration")):
        line = g[g["rehydrate"] == rehydrate]
        if len(line):
            ax.errorbar(line["drop"], line["rate"], yerr=[line["rate"] - line["low"], line["high"] - line["rate"]],
                        marker=marker, capsize=3, label=label, color=arm_style("pace")["color"],
                        linestyle="-" if rehydrate else ":")
    if reference:
        r = _pool(reference)
        ax.axhline(r["passed"] / r["total"], linestyle="--",
                   color=arm_style(reference_arm)["color"], label=reference_arm)
    ax.set_xlabel("fraction of the oracle blueprint's (span, reader) edges dropped")
    ax.set_ylabel("checks passed")
    ax.set_ylim(-0.03, 1.03)
    # each point counts as its own arm in the title's n
    records = [dict(r, arm=f"{drop:g}/{rehydrate}") for (drop, rehydrate), rs in points.items() for r in rs]
    records += list(reference or [])
    ax.set_title(title_for(_frame(records), settings) if records else str(settings.get("model", "")), fontsize=9)
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, Path(path))


def make_figures(records: list[dict], out_dir: Path, settings: dict) -> list[Path]:
    """Both figures into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    return [figure_distance(records, settings, out_dir / FIGURE_1), figure_gap(records, settings, out_dir / FIGURE_3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pace_bench.figures", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                    help="a run's folder: probes.jsonl (and run.json, if the runner wrote it); several are merged")
    ap.add_argument("--model", default=None, help="the model named in the titles (default: from run.json)")
    ap.add_argument("--budget", type=int, default=None, help="B (default: from run.json)")
    ap.add_argument("--limit", type=int, default=None, help="L (default: from run.json)")
    ap.add_argument("--chunk", type=int, default=None, help="H (default: from run.json)")
    ap.add_argument("--reference-arm", default="h2o", help="the arm the merged table pairs the others against")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the PNGs (default: RUN_DIR; required with several RUN_DIRs)")
    args = ap.parse_args(argv)
    if len(args.run_dirs) > 1 and args.out is None:
        ap.error("several RUN_DIRs are drawn as one: pass --out for the merged figures and table")
    overrides = {k: getattr(args, k) for k in SETTINGS}
    runs = [(run_dir, run_records(run_dir)) for run_dir in args.run_dirs]
    per_run = [settings_for(run_dir, records, overrides) for run_dir, records in runs]
    differ = [k for k in SETTINGS if len({str(s.get(k)) for s in per_run}) > 1]
    if differ:
        raise SystemExit(f"figures: the runs differ in {', '.join(differ)}: they cannot be drawn as one")
    records, settings = [r for _, rs in runs for r in rs], per_run[0]
    missing = [k for k in SETTINGS if k not in settings]
    if missing:
        print(f"figures: {', '.join(missing)} unknown (no run.json): pass --{' --'.join(missing)}; titles show '?'",
              file=sys.stderr)
    out = args.out or args.run_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    if len(runs) > 1:
        sources = ", ".join(str(d) for d in args.run_dirs)
        table = with_distance_table(summarize(records, args.reference_arm), records)
        (out / "table.md").write_text(f"merged from {sources}\n\n{table}\n")
        print(out / "table.md")
    for path in make_figures(records, out, settings):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
