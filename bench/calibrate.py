"""Calibrate the benchmark: the no-eviction control on short sessions.

Plays N sessions through plain ``model.generate`` with the default DynamicCache (greedy,
bf16 where the CPU has native bf16 kernels, else fp32: see ``--dtype``): prefill the context, then for each probe append its prompt, generate the answer,
append the answer and the end-of-turn ids, and go on to the next probe. Scores the
answers with the ``pace_coding`` metric and prints the check pass rate. The acceptance
bar: >= 90% of checks at <= 8K tokens on the default model.

    PACE_ALLOW_CODE_EVAL=1 python bench/calibrate.py --sessions 10 --tokens 8192 --out runs/calib.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def generate_answer(model, tokenizer, ids: list[int], cache, max_new_tokens: int, stop_ids: list[int],
                    prefill_chunk_size: int) -> list[int]:
    """Greedy answer to the conversation ``ids`` (which ends with a generation prompt),
    reusing ``cache`` (which holds a prefix of ``ids``). Returns the new ids without EOS."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
        eos_token_id=stop_ids, pad_token_id=stop_ids[0], prefill_chunk_size=prefill_chunk_size,
        attention_mask=torch.ones_like(input_ids),
    )
    with torch.no_grad():
        try:
            out = model.generate(input_ids, cache=cache, **kwargs)
        except (TypeError, ValueError) as e:  # transformers before the `cache=` argument
            if "cache" not in str(e):
                raise
            out = model.generate(input_ids, past_key_values=cache, **kwargs)
    new = out[0, len(ids):].tolist()
    while new and new[-1] in stop_ids:
        new.pop()
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--distance", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--filler-mode", default="non-repeating")
    ap.add_argument("--first-session", type=int, default=0, help="skip sessions before this index")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the per-probe budget")
    ap.add_argument("--prefill-chunk-size", type=int, default=2048)
    ap.add_argument("--out", default=None, help="append one JSON line per probe here")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                    help="auto: bfloat16 where the CPU has native bf16 kernels (AVX512/AMX), else float32")
    ap.add_argument("--show", action="store_true", help="print each answer")
    args = ap.parse_args(argv)

    if os.environ.get("PACE_ALLOW_CODE_EVAL") != "1":
        print("scoring executes model-generated code: set PACE_ALLOW_CODE_EVAL=1 to opt in", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    torch.manual_seed(0)

    import evaluate
    from transformers import DynamicCache

    from pace_hf.bench import load_sessions
    from pace_hf.metrics import PACE_CODING
    from pace_hf.models import load_model, preferred_dtype

    dtype = preferred_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=dtype)
    print(f"model {args.model} ({dtype}) loaded in {time.perf_counter() - t0:.1f}s; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    sessions = load_sessions(tok, n_sessions=args.sessions, total_tokens=args.tokens, distance=args.distance,
                             seed=args.seed, filler_mode=args.filler_mode, keep_in_memory=True)
    metric = evaluate.load(PACE_CODING)
    stop_ids = [i for i in {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
                if isinstance(i, int) and i >= 0]
    out_f = open(args.out, "a") if args.out else None

    predictions, references = [], []
    for row in sessions.select(range(args.first_session, len(sessions))):
        cache = DynamicCache(config=model.config) if "config" in DynamicCache.__init__.__code__.co_varnames else DynamicCache()
        ids = list(row["context_ids"])
        t_session = time.perf_counter()
        for probe in row["probes"]:
            ids += probe["prompt_ids"]
            t = time.perf_counter()
            budget = args.max_new_tokens or probe["max_new_tokens"]
            answer = generate_answer(model, tok, ids, cache, budget, stop_ids, args.prefill_chunk_size)
            dt = time.perf_counter() - t
            ids += answer + list(row["turn_end_ids"])
            text = tok.decode(answer, skip_special_tokens=True)
            res = metric.compute(predictions=[text], references=[probe["reference"]])
            d = res["details"][0]
            failed = [f"{c['name']}[{c['fact']}]: {c['status']} {c['got']}" for c in d["checks"] if not c["passed"]]
            print(f"{row['session_id']} {probe['name']:8s} ctx={len(ids):6d} new={len(answer):4d} "
                  f"{dt:6.1f}s checks {d['checks_passed']}/{d['checks_total']} "
                  f"recall {d['recall_hits']}/{d['recall_total']}" + (f"  FAILED {failed}" if failed else ""),
                  flush=True)
            if args.show:
                print(text, flush=True)
            predictions.append(text)
            references.append(probe["reference"])
            if out_f:
                out_f.write(json.dumps({"session_id": row["session_id"], "probe": probe["name"],
                                        "context_len": row["context_len"], "answer": text,
                                        "new_tokens": len(answer), "seconds": dt, "score": d}) + "\n")
                out_f.flush()
        print(f"{row['session_id']} done in {time.perf_counter() - t_session:.0f}s", flush=True)

    res = metric.compute(predictions=predictions, references=references)
    print(f"\nchecks {res['checks_passed']}/{res['checks_total']} ({100 * res['check_pass_rate']:.1f}%), "
          f"full probes {res['probes_passed']}/{res['probes_total']}, recall {100 * res['recall']:.1f}%")
    for fact, pf in sorted(res["per_fact"].items()):
        print(f"  {fact:15s} {pf['passed']}/{pf['total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
