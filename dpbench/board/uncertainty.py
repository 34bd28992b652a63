"""A gain's uncertainty that includes the search that chose both configurations.

Two sources, combined:
- Selection (tuning luck): the paired trials are resampled (the same trial indices for both
  methods, since trial j of each shares its draw), each method's winner re-selected on
  validation in every resample exactly as the search selects (``tuning.choose_trial``), and the
  gain read from the re-selected winners' seed-0 test accuracies. Its spread around the gain of
  the winners the search actually chose is the selection part.
- Seed noise of the chosen configurations, from their retrains only (seed 0 is the selected
  seed, biased upward: winner's curse): Welch's standard error with Welch-Satterthwaite degrees
  of freedom, Student t quantiles (2-4 seeds: a 95% interval is +-2.8 to 4.3 s.e., not +-2).

The interval: percentiles of gain + (selection draw - realized selection gain) + s.e. x T_df
over paired Monte Carlo draws. Verdict words only where it excludes zero.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import scipy.stats

from dpbench.tuning import choose_trial, finished_score


def resample_winner(validation: Sequence, indices: np.ndarray) -> Optional[int]:
    """The winner among the resampled trials (trial numbers ``indices``, repeats allowed), by
    the search's own rule; None when every resampled trial diverged."""
    scores = {int(t): validation[int(t)] for t in indices
              if finished_score(validation[int(t)]) is not None}
    return choose_trial(scores) if scores else None


def selection_draws(val_a, test_a, val_b, test_b, *, draws: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Per paired resample of the K trials: test(B's re-selected winner) - test(A's), seed 0.
    Resamples where either method has no finished trial are skipped."""
    k = len(val_a)
    if len(val_b) != k or len(test_a) != k or len(test_b) != k:
        raise ValueError("paired trials: both methods need the same number of trials")
    out = []
    for _ in range(draws):
        idx = rng.integers(k, size=k)
        wa, wb = resample_winner(val_a, idx), resample_winner(val_b, idx)
        if wa is not None and wb is not None:
            out.append(test_b[wb] - test_a[wa])
    return np.asarray(out, dtype=np.float64)


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


def gain_interval(seeds_a, seeds_b, selection: np.ndarray, realized: float, *,
                  level: float = 0.95, rng: np.random.Generator) -> dict:
    """The gain of B over A (means over retrain seeds) and its interval combining the
    selection draws (centred on ``realized``, the chosen winners' seed-0 gain) with the seed
    part (s.e. x Student t). Deterministic for a seeded ``rng``."""
    gain, se, df = welch(seeds_a, seeds_b)
    if len(selection) == 0:
        raise ValueError("no selection draw finished: cannot bound the selection part")
    t = rng.standard_t(df, size=len(selection)) if math.isfinite(df) else rng.standard_normal(
        len(selection))
    combined = gain + (selection - realized) + se * t
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(combined, [tail, 100 - tail])
    return dict(gain=gain, low=float(lo), high=float(hi), seed_se=se, seed_df=df,
                selection_sd=float(np.std(selection, ddof=1)) if len(selection) > 1 else 0.0,
                level=level, draws=len(selection))


def verdict(interval: dict) -> str:
    """'better' / 'worse' only where the interval excludes zero; 'tie' otherwise."""
    if interval["low"] > 0:
        return "better"
    if interval["high"] < 0:
        return "worse"
    return "tie"


def paired_win_rate(test_a, test_b, trials: Sequence[int]) -> Optional[float]:
    """Share of the paired trials (``trials``: those whose shared draws are equal) where B's
    seed-0 test accuracy beats A's, ties counting one half; diverged trials (None) lose."""
    wins = []
    for j in trials:
        a, b = finished_score(test_a[j]), finished_score(test_b[j])
        if a is None and b is None:
            continue
        a = -math.inf if a is None else a
        b = -math.inf if b is None else b
        wins.append(1.0 if b > a else 0.5 if b == a else 0.0)
    return float(np.mean(wins)) if wins else None
