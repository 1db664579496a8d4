"""The argument types the suites' command lines share (``pace-bench``, ``--suite ruler``, ``--suite repo``):
each turns bad input into a one-line usage error before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path


def int_at_least(low: int):
    """An argparse type: a whole number >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def choice_list(choices, what: str):
    """An argparse type: a comma-separated list of ``choices`` (say ``what`` they are), each once, in
    the order given."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none given)'}: choose from "
                                             f"{', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def token_counts(text: str) -> list[int]:
    """An argparse type: comma-separated token counts (session or context lengths), each >= 1, sorted and
    each once."""
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1, got {text!r}")
    return values


def model_name(text: str) -> str:
    """A model the project can load without a hub: a packaged name, or a local directory."""
    from pace_bench.models import model_names

    if text.lower() in model_names() or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(f"unknown model {text!r}: choose from {', '.join(model_names())}, or give a "
                                     "local model directory (no hub is reached)")
