"""The benchmark's agent sessions: randomized definitions, long filler, late coding probes.

A session is a chat with one *step* per user turn (steps count user turns from 0; the
system prompt is not a step). Its layout:

==========  ====================================================================
part        content
==========  ====================================================================
definitions three randomized steps of a spec for ``billing.py``, each a short text and
            a code block: (1) the imports and a dataclass with its field names,
            (2) status values, an error code, an exception class and ``settle``,
            (3) the fee rule ``fee_for`` with its constants: base fee, rate, quantum
            and rounding mode
filler      Python standard-library source (see :mod:`pace_bench.filler`), about
            ``chunk_tokens`` tokens per user turn, each answered with a fixed ack
probes      three user turns: write ``fee_for`` (the file already holds steps 1-2),
            write ``settle`` (it holds steps 1 and 3), write the complete module
grading     hidden checks per probe (executed by the ``pace_coding`` metric), and the
            facts that each answer should recall
==========  ====================================================================

With ``distance=None`` all the filler comes after the definitions; with a distance D
(tokens between the end of the definitions and the first probe) the rest of the
``total_tokens`` budget is filler *before* the definitions.

Token ids are built message by message from the tokenizer's own chat template, so
``context_ids`` is exactly what ``apply_chat_template`` gives for the whole conversation,
and every span is exact. How a runner plays a session::

    ids = row["context_ids"]                     # prefill (system, definitions, filler)
    for probe in row["probes"]:
        ids += probe["prompt_ids"]               # user turn + assistant header
        answer = generate(ids)                   # new tokens, without a trailing EOS
        ids += answer + row["turn_end_ids"]      # end the assistant turn
        score(answer_text, probe["reference"])   # pace_coding metric

``turn_end_ids`` (also :func:`answer_suffix_ids`) are the template's end-of-turn tokens
(``<|im_end|>\\n`` for ChatML templates): strip any EOS the model generated (e.g.
``<|im_end|>``) before appending them.

Row schema (one row per session): see :data:`FEATURES`. ``checks`` is a JSON string: a
list of ``{"name", "expr", "expected", "fact"}``; ``expr`` is a Python expression
evaluated in the namespace of the answer's code; ``expected`` is plain data (a
``Decimal`` as ``{"__decimal__": "1.25"}``) for a normal return, or
``{"raises": "ExcName"|null, "args": [...] (optional, exact), "code": "..." (optional:
equal to one of the exception's args or attribute values)}``; ``fact`` names the fact
the check controls (each fact has at least one check that fails when only that fact is
wrong), or null. ``reference`` is the JSON grading record that the metric takes:
``{"probe", "step", "checks", "recall", "preamble", "answer_prefix"}``.

The parts live in their own modules: :mod:`~pace_bench.facts` (the randomized facts and the fee
rule), :mod:`~pace_bench.billing_spec` (the definition and probe text, and the correct answers),
:mod:`~pace_bench.amounts` and :mod:`~pace_bench.checks` (the hidden checks),
:mod:`~pace_bench.filler` (the filler), :mod:`~pace_bench.build` (one session's row). This
module is the loader: sessions as a cached ``datasets.Dataset``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

from .build import (GENERATOR_VERSION, SYSTEM_PROMPT, answer_suffix_ids, build_session, check_knobs, check_length,
                    check_secret, fixed_tokens, is_int, new_secret)
from .facts import FACT_NAMES, sample_facts
from .filler import FILLER_MODES, REPEATING_SET_SIZE, filler_identity
from .billing_spec import PROBES, reference_solution

__all__ = [
    "GENERATOR_VERSION",
    "SYSTEM_PROMPT",
    "FEATURES",
    "FACT_NAMES",
    "FILLER_MODES",
    "REPEATING_SET_SIZE",
    "PROBES",
    "load_sessions",
    "build_session",
    "new_secret",
    "sample_facts",
    "reference_solution",
    "answer_suffix_ids",
    "session_fingerprint",
    "session_messages",
    "tokenizer_identity",
    "to_parquet",
]


def _features():
    from datasets import Features, Sequence, Value

    span = {"start": Value("int64"), "end": Value("int64")}
    return Features({
        "session_id": Value("string"),
        "seed": Value("int64"),
        "session_index": Value("int64"),
        "total_tokens": Value("int64"),
        "filler_mode": Value("string"),
        "system_prompt": Value("string"),
        "context_ids": Sequence(Value("int32")),
        "context_len": Value("int64"),
        "definitions_start": Value("int64"),
        "definitions_end": Value("int64"),
        "distance": Value("int64"),
        "turn_end_ids": Sequence(Value("int32")),
        "turns": [{"step": Value("int64"), "role": Value("string"), "kind": Value("string"), **span}],
        "facts": [{"name": Value("string"), "value": Value("string"), "step": Value("int64"), **span}],
        "probes": [{
            "name": Value("string"), "step": Value("int64"), "prompt": Value("string"),
            "prompt_ids": Sequence(Value("int32")), "checks": Value("string"),
            "recall": Sequence(Value("string")), "reference": Value("string"),
            "max_new_tokens": Value("int64"), "answer_prefix": Value("string"),
        }],
        "blueprint": [{**span, "readers": Sequence(Value("int64"))}],
        "filler_files": Sequence(Value("string")),
        "generator_version": Value("string"),
        "secret": Value("string"),
    })


def __getattr__(name):  # FEATURES is built lazily: importing datasets is slow
    if name == "FEATURES":
        return _features()
    raise AttributeError(name)


def tokenizer_identity(tokenizer) -> str:
    """A hash of what matters about a tokenizer here: its class, vocabulary size, chat
    template and how it tokenizes a fixed sample."""
    sample = "def fee_for(amount):\n    return Decimal('0.05')  # <|im_end|> naïve"
    h = hashlib.sha256()
    for part in (type(tokenizer).__name__, str(len(tokenizer)), str(tokenizer.chat_template or ""),
                 json.dumps(tokenizer(sample, add_special_tokens=False)["input_ids"])):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def session_fingerprint(tokenizer, n_sessions: int = 3, total_tokens: int = 8192, distance: int | None = None,
                        seed: int = 0, filler_mode: str = "non-repeating", chunk_tokens: int = 2000,
                        secret: str = "") -> str:
    """The dataset fingerprint: the knobs, :data:`GENERATOR_VERSION`, a hash of the session secret, the
    filler source (Python version, files and sizes) and the tokenizer."""
    knobs = {"n_sessions": int(n_sessions), "total_tokens": int(total_tokens),
             "distance": None if distance is None else int(distance), "seed": int(seed),
             "filler_mode": filler_mode, "chunk_tokens": int(chunk_tokens),
             "secret": hashlib.sha256(secret.encode()).hexdigest()}
    payload = json.dumps({"generator": GENERATOR_VERSION, "knobs": knobs, "filler": filler_identity(),
                          "tokenizer": tokenizer_identity(tokenizer)}, sort_keys=True)
    return "pace-sessions-" + hashlib.sha256(payload.encode()).hexdigest()[:32]


_TOKENIZERS: dict[str, Any] = {}


def _generate(fingerprint: str, n_sessions: int, seed: int, total_tokens: int, distance, filler_mode: str,
              chunk_tokens: int, secret: str) -> Iterator[dict]:
    tokenizer = _TOKENIZERS[fingerprint]
    for i in range(n_sessions):
        yield build_session(tokenizer, seed=seed, total_tokens=total_tokens, distance=distance,
                            filler_mode=filler_mode, chunk_tokens=chunk_tokens, session_index=i, secret=secret)


def load_sessions(
    tokenizer,
    n_sessions: int = 3,
    total_tokens: int = 8192,
    distance: int | None = None,
    seed: int = 0,
    filler_mode: str = "non-repeating",
    chunk_tokens: int = 2000,
    cache_dir: str | None = None,
    keep_in_memory: bool = False,
    secret: str | None = None,
):
    """Generate (or load from the datasets cache) ``n_sessions`` sessions as a
    :class:`datasets.Dataset`, one row per session (see :data:`FEATURES`).

    ``total_tokens``: about the length of the context before the first probe.
    ``distance``: tokens of filler between the end of the definitions and the first
    probe (default: all the filler); the rest of the budget goes before the definitions.
    ``filler_mode``: ``"non-repeating"`` (no file is used twice) or ``"repeating"``
    (cycles a set of four small files). ``secret``: the session secret (:func:`new_secret`; a fresh one
    by default), recorded in every row: the sessions are deterministic for a seed and a secret, never for
    a seed alone. The cache is keyed on :func:`session_fingerprint`. Export with :func:`to_parquet`
    (``dataset.to_parquet``).
    """
    from datasets import Dataset

    if not is_int(n_sessions) or n_sessions < 1:
        raise ValueError(f"n_sessions must be an int >= 1, got {n_sessions!r}")
    check_knobs(total_tokens, distance, filler_mode, chunk_tokens)
    secret = new_secret() if secret is None else check_secret(secret)
    for i in range(n_sessions):  # every session must fit before any is generated
        check_length(total_tokens, distance, fixed_tokens(tokenizer, seed, i, secret))
    fp = session_fingerprint(tokenizer, n_sessions, total_tokens, distance, seed, filler_mode, chunk_tokens, secret)
    _TOKENIZERS[fp] = tokenizer
    try:
        return Dataset.from_generator(
            _generate,
            features=_features(),
            cache_dir=cache_dir,
            keep_in_memory=keep_in_memory,
            gen_kwargs={"fingerprint": fp, "n_sessions": int(n_sessions), "seed": int(seed),
                        "total_tokens": int(total_tokens), "distance": distance,
                        "filler_mode": filler_mode, "chunk_tokens": int(chunk_tokens), "secret": secret},
            fingerprint=fp,
        )
    finally:
        _TOKENIZERS.pop(fp, None)


def session_messages(row, tokenizer) -> list:
    """The session's turns (system prompt excluded) as ``pace_hf.session.Message`` objects: exact token
    spans, and the text each turn's ids decode to, without template tokens or the role line."""
    from pace_hf.session import Message

    out = []
    for turn in row["turns"]:
        if turn["role"] == "system":
            continue
        text = tokenizer.decode(row["context_ids"][turn["start"]:turn["end"]], skip_special_tokens=True)
        head, _, rest = text.partition("\n")
        content = rest if head.strip() == turn["role"] else text
        out.append(Message(len(out), turn["role"], content, turn["start"], turn["end"], turn["step"]))
    return out


def to_parquet(dataset, path) -> str:
    """Write the sessions to one Parquet file (``dataset.to_parquet``); returns the path."""
    dataset.to_parquet(str(path))
    return str(path)
