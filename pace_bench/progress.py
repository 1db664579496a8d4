"""What a session is doing now, on one progress bar.

A long session spends minutes in each phase, so a bar that only counts tokens looks hung between them.
The bar counts the tokens the session's prompts prefill (its total is known when the session starts;
tqdm gives the ETA from it), and names the phase beside it: ``prefill probe 2/5``, ``answer 2/5:
37/256 tok``, ``scoring 2/5``. Each phase is told how many tokens it prefills and never counts more, so
the bar never passes its total; a phase that prefills more than the session's estimate (the answer's last
token, fed with the next turn) raises the total first.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria


class SessionProgress:
    """One (arm, session)'s bar. ``total``: the tokens its prompts prefill, as far as known up front.

    The cache reports each prefilled chunk through :meth:`update` (``cache.progress``); a cache that does
    not (transformers' DynamicCache) has its phase's tokens counted when the answer starts."""

    def __init__(self, desc: str, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, dynamic_ncols=True)
        self._room = 0  # tokens the current phase may still count

    def phase(self, name: str, tokens: int = 0) -> None:
        """Start the phase ``name``, which prefills ``tokens`` tokens (the previous phase's uncounted
        tokens are counted first)."""
        self._count_rest()
        if self.bar.n + tokens > self.bar.total:
            self.bar.total = self.bar.n + tokens
        self._room = tokens
        self.bar.set_postfix_str(name)

    def update(self, n: int) -> None:
        """Count ``n`` prefilled tokens, at most what the phase has left."""
        n = min(n, self._room)
        if n > 0:
            self._room -= n
            self.bar.update(n)

    def answering(self, name: str, max_new_tokens: int, prompt_len: int) -> StoppingCriteria:
        """A stopping criterion (it never stops) that shows ``name: t/max_new_tokens tok`` as the answer
        decodes; its first call ends the prefill."""
        return _AnswerTicks(self, name, max_new_tokens, prompt_len)

    def close(self) -> None:
        self._count_rest()
        self.bar.close()

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
