"""Perplexity against position, StreamingLLM style: the field's first figure for a KV cache.

A long real text streams through the model in chunks of H tokens; each arm's cache applies its policy
as the text streams (evicting at every chunk's end), and every token's negative log-likelihood is
recorded. The report bins the NLL by position (PPL per bin and overall) for each arm, measured in one
run on the same tokens, and plots log-PPL against position. Arms are the benchmark's registry
(``pace_bench.arms``) with no plan, so the foresight arms run as they do between plans, plus one:

- ``full``: DynamicCache (the model's own cache: on a hybrid model its sliding layers keep their window);
- ``h2o``, ``snapkv``, ``streaming``: the scoring policies, positions unbounded;
- ``positions_only``, ``streaming_bounded``, ``snapkv_bounded``: the same with bounded positions
  (``limit``; ``streaming_bounded`` is the StreamingLLM paper's own setting, positions inside the cache);
- ``pace``: PACECache with no plan (so H2O under bounded positions, as PACE runs between plans);
- ``pace_retrieval``: ``pace`` with a host tier: before each chunk, the evicted pages that the chunk
  just read matches (``cache.retrieve``, BM25) are restored. The query is the previous chunk, never the
  one being predicted, so no token's NLL sees text after it.

It runs on the suite skeleton (``pace_bench.suite.play_all``): one record per arm in ``probes.jsonl``,
the settings in ``run.json``, ``--resume`` plays only the arms missing, and under ``accelerate launch``
the arms are dealt to the processes.

The text (``--text``) is real text nobody here wrote that ships with CPython: ``prose``, the
documentation topics of ``pydoc_data.topics`` (about 465K characters), followed, for longer runs, by the
license texts of the installed packages; or ``code``, the standard library's own modules, whole files
in sorted order. Usage:

    python bench/perplexity.py --model gemma3-270m --tokens 32768 --chunk 2048 --budget 1024 --limit 4096 \\
        --arms full,h2o,snapkv,pace --out runs/ppl-gemma3          # --resume skips the arms already done

``--out`` holds ``probes.jsonl`` (one record per arm: the per-token NLL sums per bin; runs before the
skeleton wrote ``ppl.jsonl``), ``run.json``, ``table.md`` and ``ppl.png``. Logits are computed a slice at a time from the decoder's hidden states, so a 262K-token
vocabulary (Gemma 3) never needs a ``[chunk, vocab]`` fp32 tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from pace_bench import arms as registry

ARMS = (*registry.ARMS, "pace_retrieval")
RUN_KEYS = ("model", "text", "tokens", "chunk", "budget", "limit", "bin", "dtype")  # --resume must match
TEXTS = ("prose", "code")
LOGIT_SLICE = 256


def prose(tokenizer, n: int) -> torch.Tensor:
    """``[1, n]`` token ids of real prose: CPython's documentation topics, then installed license texts."""
    import importlib.metadata

    from pydoc_data.topics import topics

    parts = [topics[k] for k in sorted(topics)]
    licenses = (f for dist in importlib.metadata.distributions() for f in (dist.files or [])
                if "LICENSE" in f.name.upper() or "COPYING" in f.name.upper())
    while True:
        ids = tokenizer("\n\n".join(parts), return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] >= n:
            return ids[:, :n]
        more = []
        for f in licenses:
            try:
                more.append(f.read_text(errors="replace"))
            except OSError:
                continue
            if len(more) == 32:
                break
        if not more:
            raise ValueError(f"only {ids.shape[1]} tokens of prose available here, {n} asked")
        parts += more


def code(tokenizer, n: int) -> torch.Tensor:
    """``[1, n]`` token ids of real code: the standard library's modules, whole files in sorted order."""
    import sysconfig

    ids, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        piece = tokenizer(path.read_text(errors="replace") + "\n\n", return_tensors="pt", add_special_tokens=False).input_ids
        ids.append(piece)
        total += piece.shape[1]
        if total >= n:
            return torch.cat(ids, 1)[:, :n]
    raise ValueError(f"only {total} tokens of standard-library code available here, {n} asked")


def make_cache(arm: str, model, budget: int, limit: int, store):
    """The registry's cache for ``arm``, with no plan; ``pace_retrieval`` is ``pace`` spilling to ``store``."""
    from pace_hf import Blueprint

    settings = registry.ArmSettings(budget=budget, limit=limit)
    if arm == "pace_retrieval":
        return registry.make_cache("pace", model, Blueprint(), settings, store=store, session_id="ppl")
    return registry.make_cache(arm, model, Blueprint(), settings)


def token_nll(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL (fp32) of ``targets`` ``[n]`` under the logits of ``hidden`` ``[1, n, d]``, a slice at a time."""
    head = model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    out = []
    for start in range(0, targets.numel(), LOGIT_SLICE):
        logits = head(hidden[0, start:start + LOGIT_SLICE]).float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        out.append(torch.nn.functional.cross_entropy(logits, targets[start:start + LOGIT_SLICE], reduction="none"))
    return torch.cat(out)


def stream(model, ids: torch.Tensor, cache, chunk: int, tokenizer=None) -> tuple[torch.Tensor, list[float]]:
    """Every token's NLL (the first one has none: ``[n - 1]``) and each chunk's seconds. With a
    ``tokenizer``, each chunk after the first is preceded by a retrieval for the chunk before it."""
    decoder = model.get_decoder()
    nll, seconds, carry = [], [], None  # carry: the last hidden state of the previous chunk
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            t0 = time.perf_counter()
            if tokenizer is not None and start:
                cache.retrieve(tokenizer.decode(ids[0, start - chunk:start]), ids[0, :start], tokenizer)
            hidden = decoder(input_ids=piece, cache=cache, use_cache=True).last_hidden_state
            seconds.append(time.perf_counter() - t0)
            if carry is None:  # the text's first token is predicted by nothing
                states, targets = hidden[:, :-1], piece[0, 1:]
            else:
                states, targets = torch.cat([carry, hidden[:, :-1]], 1), piece[0]
            nll.append(token_nll(model, states, targets))
            carry = hidden[:, -1:]
    return torch.cat(nll), seconds


def bytes_by_kind(model, cache) -> dict[str, int]:
    """The cache's bytes (``cache_nbytes``) per layer kind of ``model`` (full, sliding, linear)."""
    from types import SimpleNamespace

    from pace_hf.cache import cache_nbytes
    from pace_hf.cache.layout import layer_specs

    out: dict[str, int] = {}
    for spec, layer in zip(layer_specs(model.config), getattr(cache, "layers", [])):
        out[spec.kind] = out.get(spec.kind, 0) + cache_nbytes(SimpleNamespace(layers=[layer]))
    return out


def bins(nll: torch.Tensor, width: int) -> list[dict]:
    """Per bin of ``width`` positions (position = the predicted token's index): tokens, NLL sum, PPL."""
    out = []
    for start in range(0, nll.numel() + 1, width):  # token i's NLL is nll[i - 1]
        part = nll[max(0, start - 1):start + width - 1]
        if part.numel():
            out.append({"start": start, "tokens": part.numel(), "nll_sum": float(part.double().sum()),
                        "ppl": math.exp(float(part.double().mean()))})
    return out


def table(records: list[dict]) -> str:
    run = records[0]
    text = {"prose": "CPython's documentation prose", "code": "CPython's standard-library code"}[run.get("text", "prose")]
    lines = [f"model {run['model']} ({run['dtype']}), {run['tokens']:,} tokens of {text}, "
             f"chunk H={run['chunk']:,}, B={run['budget']:,}, L={run['limit']:,}; PPL per bin of positions",
             "", "| positions | " + " | ".join(r["arm"] for r in records) + " |",
             "|---|" + "---|" * len(records)]
    for i, b in enumerate(records[0]["bins"]):
        end = b["start"] + run["bin"]
        lines.append(f"| {b['start']:,}-{end:,} | " + " | ".join(f"{r['bins'][i]['ppl']:.2f}" for r in records) + " |")
    lines.append("| **all** | " + " | ".join(f"**{r['ppl']:.3f}**" for r in records) + " |")
    for reference in ("full", "h2o"):
        ref = next((r for r in records if r["arm"] == reference), None)
        if ref is not None:
            lines.append(f"| ratio to {reference} | " + " | ".join(f"{r['ppl'] / ref['ppl']:.4f}" for r in records) + " |")
    for kind in sorted({k for r in records for k in r.get("cache_bytes", {})}):
        lines.append(f"| cache MiB, {kind} layers | " + " | ".join(
            f"{r.get('cache_bytes', {}).get(kind, 0) / 2**20:.1f}" for r in records) + " |")
    lines.append("| seconds | " + " | ".join(f"{sum(r['seconds']):.0f}" for r in records) + " |")
    if any("cpu_seconds" in r for r in records):  # what the arm cost, whatever else ran (older records lack it)
        lines.append("| CPU seconds | " + " | ".join(f"{r['cpu_seconds']:.0f}" if "cpu_seconds" in r else "-"
                                                      for r in records) + " |")
    return "\n".join(lines) + "\n"


def figure(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in records:
        xs = [b["start"] + r["bin"] / 2 for b in r["bins"]]
        ax.plot(xs, [math.log(b["ppl"]) for b in r["bins"]], marker="o", label=f"{r['arm']} ({r['ppl']:.2f})")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("log perplexity")
    ax.set_title(f"{records[0]['model']}: log-PPL against position (B={records[0]['budget']:,}, L={records[0]['limit']:,})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def play(model, tokenizer, ids: torch.Tensor, arm: str, run: dict, store) -> dict:
    """One arm streamed over ``ids``: its record."""
    cache = make_cache(arm, model, run["budget"], run["limit"], store)
    cpu = time.process_time()
    nll, seconds = stream(model, ids, cache, run["chunk"], tokenizer if arm == "pace_retrieval" else None)
    cpu = time.process_time() - cpu
    held = bytes_by_kind(model, cache)
    restored = getattr(cache, "tier_stats", {}).get("retrieval_tokens_restored")
    if hasattr(cache, "unbind"):
        cache.unbind()
    if arm == "pace_retrieval":
        store.delete_session("ppl")
    return {**{k: run[k] for k in RUN_KEYS}, "arm": arm, "session_id": run["text"], "probe": 0, "ppl": math.exp(float(nll.double().mean())),
            "bins": bins(nll, run["bin"]), "seconds": [round(x, 3) for x in seconds], "cpu_seconds": round(cpu, 1),
            "cache_bytes": held, **({"retrieval_tokens_restored": restored} if restored is not None else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a packaged model name or a local directory")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=4096)
    ap.add_argument("--bin", type=int, default=4096, help="positions per reported bin")
    ap.add_argument("--arms", default="full,h2o,snapkv,pace", help=f"from {{{', '.join(ARMS)}}}")
    ap.add_argument("--text", choices=TEXTS, default="prose")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true", help="keep the arms OUT already holds and play the rest")
    args = ap.parse_args(argv)
    arms = list(dict.fromkeys(args.arms.split(",")))
    bad = [a for a in arms if a not in ARMS]
    if bad or args.tokens < 2 * args.chunk or args.limit <= args.budget + args.chunk:
        ap.error(f"unknown arm(s) {bad} (known: {', '.join(ARMS)})" if bad else
                 "--tokens must hold two chunks, and --limit must exceed --budget + --chunk")

    from pace_bench.models import load_model, resolve_dtype
    from pace_bench.records import read_jsonl, shard_paths
    from pace_bench.suite import play_all

    out = Path(args.out)
    dtype = resolve_dtype(args.dtype)
    run = {k: getattr(args, k) for k in RUN_KEYS if k != "dtype"} | {"dtype": str(dtype).removeprefix("torch.")}
    kept = []
    if args.resume and (out / "run.json").exists():
        before = json.loads((out / "run.json").read_text())
        differ = [k for k in RUN_KEYS if before.get(k) != run[k]]
        if differ:
            raise SystemExit(f"perplexity: --resume: {out} was played with other {', '.join(differ)}; "
                             "resume with the same settings, or use another --out")
        kept = [r for r in read_jsonl([p for p in [out / "probes.jsonl", *shard_paths(out)] if p.exists()])
                if r["arm"] in arms]
    done = {r["arm"] for r in kept}
    model, tokenizer = load_model(args.model, dtype=dtype)
    ids = (prose if args.text == "prose" else code)(tokenizer, args.tokens)

    def finish(records):
        ordered = sorted(records, key=lambda r: arms.index(r["arm"]))
        (out / "table.md").write_text(table(ordered))
        figure(ordered, out / "ppl.png")
        print(table(ordered))

    play_all(out, run, kept, [a for a in arms if a not in done],
             lambda arm, store: [play(model, tokenizer, ids, arm, run, store)],
             rank=lambda r: arms.index(r["arm"]), describe=lambda r: f"{r['arm']}: PPL {r['ppl']:.3f} in "
             f"{sum(r['seconds']):.0f} s", desc="perplexity arms", finish=finish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
