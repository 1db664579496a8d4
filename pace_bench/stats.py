"""The one confidence interval of every suite's tables and figures: Wilson's, for a pass rate."""

from __future__ import annotations

import numpy as np
from statsmodels.stats.proportion import proportion_confint


def wilson(successes, trials, alpha: float = 0.05):
    """The Wilson score interval (``statsmodels``) of ``successes`` out of ``trials``, 95% by default:
    scalars give a ``(low, high)`` pair of floats, arrays a pair of arrays. A partial score (RULER's)
    counts as that fraction of a success; no trials give (0, 1), no information."""
    k, n = np.asarray(successes, dtype=float), np.asarray(trials, dtype=float)
    some = n > 0
    low, high = proportion_confint(np.where(some, k, 0.0), np.where(some, n, 1.0), alpha=alpha, method="wilson")
    low, high = np.where(some, low, 0.0), np.where(some, high, 1.0)
    return (float(low), float(high)) if low.ndim == 0 else (low, high)
