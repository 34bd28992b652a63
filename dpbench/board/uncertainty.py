"""The pieces of a gain's uncertainty that board v3's rule (board/v3_rule.py) draws from, and
the shared trials' sign test.

- Selection (tuning luck): the paired trials resampled (the same trial indices for both
  methods, since trial j of each shares its draw; trial 0, the recipe, always kept), each
  method's winner re-selected on validation in every resample exactly as the search selects
  (``tuning.choose_trial``): ``resampled_trials``, ``resample_winners``.
- Seed noise of the chosen configurations, from their retrains only (seed 0 is the selected
  seed, biased upward): Welch's standard error with Welch-Satterthwaite degrees of freedom
  (``welch``; 2-4 seeds: Student t quantiles, not normal ones).
- ``paired_trial_gains``: the shared trials' median gain and sign test, a description outside
  every family.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import scipy.stats

from dpbench.search.tuning import finished_score


def _ranks(validation: Sequence) -> np.ndarray:
    """Each trial's place in the search's order (tuning.choose_trial: the highest finite
    validation accuracy first, ties to the smaller trial number); diverged trials last."""
    scores = [finished_score(v) for v in validation]
    order = sorted(range(len(scores)), key=lambda t: (scores[t] is None,
                                                      -(scores[t] or 0.0), t))
    ranks = np.empty(len(scores), np.int64)
    ranks[order] = np.arange(len(scores))
    return ranks


def resampled_trials(k: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """(draws, k) trial numbers of paired resamples that keep trial 0 (the recipe, part of
    every search) and redraw the K - 1 random trials with replacement among trials 1..K-1:
    the search's own structure, one fixed trial and J i.i.d. ones."""
    idx = np.zeros((draws, k), np.int64)
    if k > 1:
        idx[:, 1:] = rng.integers(1, k, size=(draws, k - 1))
    return idx


def resample_winners(validation: Sequence, idx: np.ndarray) -> np.ndarray:
    """Per resample (a row of trial numbers), the winner by the search's own rule; -1 where
    every resampled trial diverged."""
    ranks = _ranks(validation)
    best = idx[np.arange(len(idx)), np.argmin(ranks[idx], axis=1)]
    finished = np.array([finished_score(v) is not None for v in validation])
    return np.where(finished[best], best, -1)


def welch(seeds_a: Sequence[float], seeds_b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(B) - mean(A), Welch's s.e., Welch-Satterthwaite df) over the retrain seeds."""
    a, b = np.asarray(seeds_a, np.float64), np.asarray(seeds_b, np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("the seed part needs at least 2 retrain seeds per method")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return float(b.mean() - a.mean()), 0.0, math.inf
    df = scipy.stats.ttest_ind(b, a, equal_var=False).df  # Welch-Satterthwaite
    return float(b.mean() - a.mean()), se, float(df)


def paired_trial_gains(test_a, test_b, trials: Sequence[int]) -> Optional[dict]:
    """The per-trial gain of B over A on the paired trials ``trials`` (their shared draws are
    equal), seed 0: the median over trials where both finished, and a two-sided sign test of
    wins against losses (scipy's binomtest; a diverged run loses, ties are dropped)."""
    diffs, wins, losses = [], 0, 0
    for j in trials:
        a, b = finished_score(test_a[j]), finished_score(test_b[j])
        if a is None and b is None:
            continue
        if a is not None and b is not None:
            diffs.append(b - a)
        a = -math.inf if a is None else a
        b = -math.inf if b is None else b
        wins, losses = wins + (b > a), losses + (b < a)
    if wins + losses == 0 and not diffs:
        return None
    p = scipy.stats.binomtest(wins, wins + losses).pvalue if wins + losses else 1.0
    return dict(median=float(np.median(diffs)) if diffs else None, wins=int(wins),
                losses=int(losses), trials=len(list(trials)), sign_p=float(p))
