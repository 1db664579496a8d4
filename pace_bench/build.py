"""Assembling one session: the chat's token ids, turns, fact spans, probes and oracle blueprint.

The layout and the row format are described in :mod:`pace_bench.sessions`. Every message is
tokenized on its own under the tokenizer's chat template (:class:`pace_hf.chat.ChatTemplate`), so
the concatenated ids are exactly the rendered conversation and every span is exact.
"""

from __future__ import annotations

import json
import random
import re
import secrets

from pace_hf.chat import ChatTemplate

from .checks import build_checks, stand_in_rate
from .facts import sample_facts
from .filler import FILLER_ACK, FILLER_MODES, FillerStream
from .billing_spec import (ANSWER_PREFIX, MAX_NEW_TOKENS, PROBE_READS, PROBE_RECALL, PROBE_TEXT, PROBES, definition_pieces,
                   probe_preamble)

__all__ = ["GENERATOR_VERSION", "SYSTEM_PROMPT", "MIN_CHUNK_TOKENS", "build_session", "answer_suffix_ids",
           "check_knobs", "check_length", "check_secret", "new_secret"]

GENERATOR_VERSION = "16"  # bump whenever the generated content changes
SECRET_HEX = 32  # a session secret: 128 bits, as hex digits

SYSTEM_PROMPT = (
    "You are a careful Python coding assistant in a long working session on one repository. "
    "When asked for code, follow the specification given earlier in this conversation exactly."
)
DEFINITION_ACK = "Understood."
MIN_CHUNK_TOKENS = 128  # a filler turn holds its header, the ack and at least a few lines of code
_MIN_REGION = 32  # a filler region shorter than this is left out


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_knobs(total_tokens, distance, filler_mode, chunk_tokens) -> None:
    """Reject knobs that would silently make another session than asked (issue 13, item 10)."""
    if not is_int(total_tokens) or total_tokens <= 0:
        raise ValueError(f"total_tokens must be a positive int (tokens before the first probe), got {total_tokens!r}")
    if distance is not None and (not is_int(distance) or distance < 0):
        raise ValueError(f"distance must be None or an int >= 0 (tokens of filler between the definitions and "
                         f"the first probe), got {distance!r}")
    if filler_mode not in FILLER_MODES:
        raise ValueError(f"filler_mode must be one of {FILLER_MODES}, got {filler_mode!r}")
    if not is_int(chunk_tokens) or chunk_tokens < MIN_CHUNK_TOKENS:
        raise ValueError(f"chunk_tokens must be an int >= {MIN_CHUNK_TOKENS} (tokens per filler turn), "
                         f"got {chunk_tokens!r}")


def check_length(total_tokens: int, distance: int | None, fixed: int) -> tuple[int, int]:
    """Split the filler budget into (before, after) the definitions, or say why it cannot be split:
    ``fixed`` tokens (the system prompt and the definitions) must fit in ``total_tokens``, and a
    ``distance`` must fit in what is left."""
    budget = total_tokens - fixed
    if budget < 0:
        raise ValueError(f"total_tokens={total_tokens} is shorter than the system prompt and the definitions "
                         f"({fixed} tokens for this session): ask for at least {fixed}")
    if distance is None:
        return 0, budget
    if distance > budget:
        raise ValueError(f"distance={distance} does not fit: total_tokens={total_tokens} leaves {budget} tokens of "
                         f"filler after the system prompt and the definitions ({fixed} tokens); ask for "
                         f"total_tokens >= {fixed + distance} or a distance <= {budget}")
    return budget - distance, distance


def new_secret() -> str:
    """A fresh session secret: 128 random bits, as 32 hex digits."""
    return secrets.token_hex(SECRET_HEX // 2)


def check_secret(secret) -> str:
    """``secret`` if it is a session secret (32 or more hex digits), else a ValueError that says so."""
    if not (isinstance(secret, str) and len(secret) >= SECRET_HEX and re.fullmatch(r"[0-9a-f]+", secret)):
        raise ValueError(f"a session secret is a str of at least {SECRET_HEX} lowercase hex digits (128 bits), as "
                         f"a row's 'secret' or run.json's 'secret' holds it; got {secret!r}")
    return secret


def session_rng(seed: int, session_index: int, secret: str) -> random.Random:
    """The session's random source. The seed and index alone do not give it: the facts must not follow
    from public code and a small seed (a program that recognised its session could compute them), so
    the secret, drawn when the session is generated and kept out of every sandbox, goes in too."""
    return random.Random(f"pace-session:{GENERATOR_VERSION}:{check_secret(secret)}:{seed}:{session_index}")


def _definitions(chat: ChatTemplate, facts: dict[str, str]):
    """The definition messages, tokenized: ``[(user ids, content, fact spans)]``, the ack's ids, and
    the tokens they take in all (acks included)."""
    defs = [chat.user_pieces(p) for p in definition_pieces(facts)]
    ack_ids = chat.encode(chat.assistant_block(DEFINITION_ACK))
    return defs, ack_ids, sum(len(u) + len(ack_ids) for u, _, _ in defs)


def fixed_tokens(tokenizer, seed: int, session_index: int, secret: str) -> int:
    """Tokens a session takes before any filler: the system prompt and the definitions."""
    chat = ChatTemplate(tokenizer, SYSTEM_PROMPT)
    return len(chat.system_ids) + _definitions(chat, sample_facts(session_rng(seed, session_index, secret)))[2]


def build_session(
    tokenizer,
    seed: int = 0,
    total_tokens: int = 8192,
    distance: int | None = None,
    filler_mode: str = "non-repeating",
    chunk_tokens: int = 2000,
    session_index: int = 0,
    return_messages: bool = False,
    secret: str | None = None,
):
    """Build one session row (see :mod:`pace_bench.sessions`). ``secret``: the session secret
    (:func:`new_secret`; a fresh one by default), which the row records: the same seed gives the same
    session only with the same secret. With ``return_messages``, return ``(row, messages)`` where
    ``messages`` is the chat (system, definitions, filler) that ``context_ids`` tokenizes, as
    ``[{"role", "content"}]``."""
    check_knobs(total_tokens, distance, filler_mode, chunk_tokens)
    secret = new_secret() if secret is None else secret
    rng = session_rng(seed, session_index, secret)
    facts = sample_facts(rng)
    stand_in = stand_in_rate(rng)
    checks = build_checks(facts, rng, stand_in)
    chat = ChatTemplate(tokenizer, SYSTEM_PROMPT)
    filler = FillerStream(chat, rng, filler_mode, chunk_tokens)

    ids: list[int] = list(chat.system_ids)
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    turns: list[dict] = [{"step": -1, "role": "system", "kind": "system", "start": 0, "end": len(ids)}]
    step = 0

    def add_turn(user_ids, ack_ids, content, ack, kind) -> None:
        nonlocal step
        messages.extend([{"role": "user", "content": content}, {"role": "assistant", "content": ack}])
        for role, block in (("user", user_ids), ("assistant", ack_ids)):
            turns.append({"step": step, "role": role, "kind": kind, "start": len(ids), "end": len(ids) + len(block)})
            ids.extend(block)
        step += 1

    def add_filler(region_tokens: int) -> None:
        goal = len(ids) + region_tokens
        while goal - len(ids) >= _MIN_REGION:
            user_ids, ack_ids, content = filler.take(goal - len(ids))
            add_turn(user_ids, ack_ids, content, FILLER_ACK, "filler")

    # Definitions, tokenized first so that their length is known.
    defs, def_ack_ids, defs_len = _definitions(chat, facts)
    pre, post = check_length(total_tokens, distance, len(ids) + defs_len)
    add_filler(pre)

    fact_rows: list[dict] = []
    def_spans: dict[int, tuple[int, int]] = {}
    for k, (user_ids, content, spans) in enumerate(defs, start=1):
        start = len(ids)
        for name, (s, e) in spans.items():
            fact_rows.append({"name": name, "value": facts[name], "step": step, "start": start + s, "end": start + e})
        add_turn(user_ids, def_ack_ids, content, DEFINITION_ACK, "definition")
        def_spans[k] = (start, len(ids))
    defs_end = len(ids)
    add_filler(post)

    probes = []
    for k, name in enumerate(PROBES):
        text = PROBE_TEXT[name]
        prompt = chat.user_block(text) + chat.gen_header + ANSWER_PREFIX[name]
        recall = [facts[x] for x in PROBE_RECALL[name]]
        reference = {"probe": name, "step": step + k, "checks": checks[name], "recall": recall,
                     "recall_facts": list(PROBE_RECALL[name]),
                     "preamble": probe_preamble(name, stand_in), "answer_prefix": ANSWER_PREFIX[name]}
        probes.append({
            "name": name, "step": step + k, "prompt": text, "prompt_ids": chat.encode(prompt),
            "checks": json.dumps(checks[name]), "recall": recall, "reference": json.dumps(reference),
            "max_new_tokens": MAX_NEW_TOKENS[name], "answer_prefix": ANSWER_PREFIX[name],
        })
    probe_steps = {p["name"]: p["step"] for p in probes}
    blueprint = [
        {"start": def_spans[k][0], "end": def_spans[k][1],
         "readers": sorted(probe_steps[p] for p in PROBES if k in PROBE_READS[p])}
        for k in (1, 2, 3)
    ]
    fact_rows.sort(key=lambda r: r["start"])
    row = {
        "session_id": f"s{seed}-{session_index}",
        "seed": int(seed),
        "session_index": int(session_index),
        "total_tokens": int(total_tokens),
        "filler_mode": filler_mode,
        "system_prompt": SYSTEM_PROMPT,
        "context_ids": ids,
        "context_len": len(ids),
        "definitions_start": def_spans[1][0],
        "definitions_end": defs_end,
        "distance": len(ids) - defs_end,
        "turn_end_ids": chat.turn_end_ids(),
        "turns": turns,
        "facts": fact_rows,
        "probes": probes,
        "blueprint": blueprint,
        "filler_files": list(filler.used),
        "generator_version": GENERATOR_VERSION,
        "secret": secret,
    }
    return (row, messages) if return_messages else row


def answer_suffix_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn after its content (``<|im_end|>\\n`` for ChatML): append them
    after a generated answer (without its EOS) before the next probe."""
    return ChatTemplate(tokenizer, SYSTEM_PROMPT).turn_end_ids()
