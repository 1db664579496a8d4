"""What a session is doing now, on one progress bar.

A long session spends minutes in each phase, so a bar that only counts tokens looks hung between them.
The bar counts the tokens the session's prompts prefill (its total is known when the session starts;
tqdm gives the ETA from it), and names the phase beside it: ``prefill probe 2/5``, ``answer 2/5:
37/256 tok``, ``scoring 2/5``. Each phase is told how many tokens it prefills and never counts more, so
the bar never passes its total; a phase that prefills more than the session's estimate (the answer's last
token, fed with the next turn) raises the total first.

Off a terminal (``make demo > log``, a pipe, a CI log) a bar's every redraw stays in the log as carriage
returns and cursor-up codes, so there the bars are off: each phase is one plain line instead, with the
time taken and an estimate of the time left (:func:`on_terminal`), and the libraries' own bars
(transformers' weights, datasets' "Generating train split") are off too (:func:`quiet_library_bars`).
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import StoppingCriteria


def on_terminal() -> bool:
    """Whether stderr, where the bars go, is a terminal (one that redraws a bar in place)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def quiet_library_bars() -> None:
    """Off a terminal, turn off the progress bars of transformers (converting a GGUF, loading and writing
    weights) and datasets (``Generating train split`` for the sessions generated in this process): in a
    log they are raw redraws that say nothing the run's own lines do not."""
    if on_terminal():
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:
        return
    datasets.disable_progress_bars()


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def time_left(elapsed: float, done: float, total: float) -> str:
    """The time left at the rate so far (``?`` before anything is done)."""
    return clock(elapsed * (total - done) / done) if done > 0 else "?"


class SessionProgress:
    """One (arm, session)'s bar. ``total``: the tokens its prompts prefill, as far as known up front.

    The cache reports each prefilled chunk through :meth:`update` (``cache.progress``); a cache that does
    not (transformers' DynamicCache) has its phase's tokens counted when the answer starts."""

    def __init__(self, desc: str, total: int):
        from tqdm.auto import tqdm

        self.desc, self.n, self.total = desc, 0, total
        self.plain = not on_terminal()  # then a line per phase instead of the bar
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, dynamic_ncols=True, disable=self.plain)
        self.started = time.monotonic()
        self._room = 0  # tokens the current phase may still count

    def phase(self, name: str, tokens: int = 0) -> None:
        """Start the phase ``name``, which prefills ``tokens`` tokens (the previous phase's uncounted
        tokens are counted first)."""
        self._count_rest()
        if self.n + tokens > self.total:
            self.total = self.bar.total = self.n + tokens
        self._room = tokens
        self.bar.set_postfix_str(name)
        if self.plain:
            self._line(name)

    def update(self, n: int) -> None:
        """Count ``n`` prefilled tokens, at most what the phase has left."""
        n = min(n, self._room)
        if n > 0:
            self._room -= n
            self.n += n
            self.bar.update(n)

    def _line(self, name: str) -> None:
        from tqdm.auto import tqdm

        elapsed = time.monotonic() - self.started
        tqdm.write(f"{self.desc}: {name}; {self.n:,}/{self.total:,} tokens prefilled in {clock(elapsed)}, "
                   f"~{time_left(elapsed, self.n, self.total)} of prefill left at this rate", file=sys.stderr)

    def answering(self, name: str, max_new_tokens: int, prompt_len: int) -> StoppingCriteria:
        """A stopping criterion (it never stops) that shows ``name: t/max_new_tokens tok`` as the answer
        decodes; its first call ends the prefill."""
        return _AnswerTicks(self, name, max_new_tokens, prompt_len)

    def close(self) -> None:
        self._count_rest()
        self.bar.close()
        if self.plain:
            from tqdm.auto import tqdm

            tqdm.write(f"{self.desc}: done in {clock(time.monotonic() - self.started)}", file=sys.stderr)

    def _count_rest(self) -> None:
        self.update(self._room)


class _AnswerTicks(StoppingCriteria):
    def __init__(self, progress: SessionProgress, name: str, max_new_tokens: int, prompt_len: int):
        self.progress, self.name, self.max_new_tokens, self.prompt_len = progress, name, max_new_tokens, prompt_len
        self.started = False

    def __call__(self, input_ids, scores, **kwargs):
        if not self.started:
            self.progress.phase(self.name)
            self.started = True
        self.progress.bar.set_postfix_str(
            f"{self.name}: {input_ids.shape[1] - self.prompt_len}/{self.max_new_tokens} tok")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
