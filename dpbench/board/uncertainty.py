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
over paired Monte Carlo draws (Welch: each arm's own seed variance, no data-dependent gate).
Labels on a paired board come from the rule board v4 first registered (board/v3_rule.py,
paired.apply_rule); ``label`` here is board v2's verdict word ('better' / 'worse' where the Holm-adjusted p is below
5%, 'equivalent within +-1' where the 90% interval lies inside +-1 point, else
'inconclusive'), kept for v2's page.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import scipy.stats

from dpbench.board import decide
from dpbench.search.tuning import finished_score


ALPHA = 0.05  # the board's family-wise error rate (Holm over every comparison it shows)
POWER = 0.8  # the power at which a cell's minimum detectable gain is stated
EQUIVALENCE = 0.01  # 'equivalent' means: the 90% interval lies within +-1 test point
BATCHES = 20  # batch means for the Monte Carlo error of the interval's ends


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


def selection_draws(val_a, test_a, val_b, test_b, *, draws: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Per paired resample of the K trials (``resampled_trials``): test(B's re-selected winner)
    - test(A's), seed 0. Resamples where either method has no finished trial are skipped."""
    k = len(val_a)
    if len(val_b) != k or len(test_a) != k or len(test_b) != k:
        raise ValueError("paired trials: both methods need the same number of trials")
    idx = resampled_trials(k, draws, rng)
    wa, wb = resample_winners(val_a, idx), resample_winners(val_b, idx)
    keep = (wa >= 0) & (wb >= 0)
    ta = np.array([np.nan if v is None else float(v) for v in test_a])
    tb = np.array([np.nan if v is None else float(v) for v in test_b])
    return (tb[wb[keep]] - ta[wa[keep]]).astype(np.float64)


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


def _ends(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def gain_interval(seeds_a, seeds_b, selection: np.ndarray, realized: float, *,
                  level: float = 0.95, rng: np.random.Generator) -> dict:
    """The gain of B over A (means over retrain seeds) and its interval combining the
    selection draws (centred on ``realized``, the chosen winners' seed-0 gain) with the seed
    part (Welch's s.e. x Student t). Also: the ends' Monte Carlo error (batch means),
    the two-sided bootstrap p-value of 'no gain', the 90% interval (equivalence), and the
    minimum gain detectable at 80% power (normal approximation: (z_0.975 + z_0.8) x the
    combined s.d.). Deterministic for a seeded ``rng``."""
    gain, se, df = welch(seeds_a, seeds_b)
    if len(selection) == 0:
        raise ValueError("no selection draw finished: cannot bound the selection part")
    t = rng.standard_t(df, size=len(selection)) if math.isfinite(df) else rng.standard_normal(
        len(selection))
    combined = gain + (selection - realized) + se * t
    lo, hi = _ends(combined, level)
    batches = [_ends(b, level) for b in np.array_split(combined, BATCHES)]
    mc_error = float(max(np.std(np.array(batches), axis=0, ddof=1)) / math.sqrt(BATCHES))
    p = min(1.0, max(2 * min(np.mean(combined <= 0), np.mean(combined >= 0)),
                     1 / len(combined)))
    sd = float(np.std(combined, ddof=1))
    lo90, hi90 = _ends(combined, 1 - 2 * ALPHA)
    return dict(gain=gain, low=lo, high=hi, low90=lo90, high90=hi90, mc_error=mc_error,
                p_value=float(p), p_mc_error=float(2 * math.sqrt(p * (1 - p / 2) / 2
                                                                 / len(combined))), sd=sd,
                mde=float((scipy.stats.norm.ppf(1 - ALPHA / 2) + scipy.stats.norm.ppf(POWER))
                          * sd),
                seed_se=se, seed_df=df,
                selection_sd=float(np.std(selection, ddof=1)) if len(selection) > 1 else 0.0,
                level=level, draws=len(selection))


MC_GUARD = 3  # Monte Carlo errors between an estimate and a threshold before a label uses it


def holm(p_values: dict) -> dict:
    """Holm's step-down adjustment (family-wise error rate) of {name: p}: decide.holm_adjusted,
    keyed by name."""
    names = sorted(p_values, key=lambda n: (p_values[n], n))  # ties in name order
    return dict(zip(names, decide.holm_adjusted([p_values[n] for n in names]).tolist()))


def label(interval: dict, p_adjusted: float, alpha: float = ALPHA,
          margin: float = EQUIVALENCE) -> str:
    """'better' / 'worse': the Holm-adjusted (conservative) p-value is below ``alpha``;
    'equivalent within +-margin': the 90% interval lies inside +-margin (two one-sided tests at
    5%) by more than MC_GUARD Monte Carlo errors of its ends; otherwise 'inconclusive' (the
    board could not tell, which is not 'no difference')."""
    if p_adjusted < alpha:
        return "better" if interval["gain"] > 0 else "worse"
    guard = MC_GUARD * interval.get("mc_error", 0.0)
    if -margin < interval["low90"] - guard and interval["high90"] + guard < margin:
        return f"equivalent within ±{100 * margin:g}"
    return "inconclusive"


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
