"""The statistics of every suite's tables and figures: Wilson's interval for a pass rate, and the exact sign
test for two arms compared entry by entry."""

from __future__ import annotations

import math

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


def sign_test(better, worse):
    """Two-sided exact sign test (binomial, p = 1/2) on the untied pairs; 1.0 when none."""
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)
