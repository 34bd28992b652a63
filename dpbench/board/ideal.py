"""The board's bootstrap laws computed exactly: what the rule's Monte Carlo draws
(``board/v3_rule.py``) tend to as their number grows (the "ideal" bootstrap), with no draw.

- The tuned gain's law (``v3_rule.tuned_draws``): the paired resample of the K trials (trial 0
  kept, trials 1..K-1 drawn K-1 times with replacement) re-selects both winners on
  validation; the joint law of the two re-selected winners is a K x K table computed by
  inclusion-exclusion over the trials each winner must beat (:func:`winner_table`), and the
  draw is the table's seed-0 test gain plus Welch's seed part (Student t), so its CDF is a
  finite mixture of t CDFs (:class:`TunedLaw`).
- The paired gain's law (``v3_rule.paired_draws``): the mean of n draws with replacement from
  the n shared trials' differences. Test accuracies are counts over the test set, so
  differences are whole multiples of 1/test-size: the sum's law is the n-fold convolution of
  the differences' law on that grid, computed by FFT (:class:`PairedLaw`).

Both answer the hypotheses' p-values (each the share of draws on the null's side, a
non-finite draw counting against every hypothesis, as ``v3_rule.hypotheses`` counts them) and
their percentile intervals. Why: board v4's design study simulates thousands of boards
(board/design_study.py), and a label settled by decide.py's Monte Carlo rule is, with the
rule's flip probability, the label of these exact p-values. Board v4 prints the tuned gain's
interval from :class:`TunedLaw` directly (no stream at all).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import scipy.optimize
import scipy.stats

from dpbench.board import uncertainty


def _beaten_sets(validation: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(allowed[j, i], legal[j]): a resample whose winner is trial j may hold trial i >= 1
    only where allowed (i ranks at or below j; for j = 0 strictly below), and j can win at all
    only where legal (trial 0 is in every resample, so a trial ranked below trial 0 never wins)."""
    ranks = uncertainty._ranks(validation)  # noqa: SLF001 (the search's own order)
    k = len(ranks)
    allowed = ranks[None, :] >= ranks[:, None]
    allowed[0] = ranks > ranks[0]
    allowed[:, 0] = False  # trial 0 is not drawn: it is always there
    legal = ranks < ranks[0]
    legal[0] = True
    return allowed.astype(np.int64), legal if k > 1 else np.array([True])


def winner_table(val_a: Sequence, val_b: Sequence) -> np.ndarray:
    """P[j, k]: the probability that a paired resample (``uncertainty.resampled_trials``) makes
    trial j A's winner and trial k B's (``uncertainty.resample_winners``). Each term is
    (|S| / (K - 1))^(K - 1) for the set S of trials the resample may draw, with inclusion-
    exclusion over the winners it must draw (trial 0 it always holds)."""
    k = len(val_a)
    if k == 1:
        return np.ones((1, 1))
    (allow_a, legal_a), (allow_b, legal_b) = _beaten_sets(val_a), _beaten_sets(val_b)
    n = k - 1
    size = allow_a @ allow_b.T  # |S_jk|: trials both winners may see
    eye = np.arange(k)
    in_a = allow_b[:, eye].T  # in_a[j, k]: trial j lies in B's set for winner k
    in_b = allow_a[:, eye]    # in_b[j, k]: trial k lies in A's set for winner j

    def f(m):
        return (np.maximum(m, 0) / n) ** n

    need_j = (eye >= 1)[:, None] * np.ones((1, k), bool)
    need_k = np.ones((k, 1), bool) * (eye >= 1)[None, :]
    same = eye[:, None] == eye[None, :]
    both = need_j & need_k & ~same
    without_j, without_k = size - (need_j & (in_a > 0)), size - (need_k & (in_b > 0))
    without_both = size - (need_j & (in_a > 0)) - (need_k & (in_b > 0))
    table = f(size) - np.where(need_j, f(without_j), 0) - np.where(need_k & ~same, f(
        without_k), 0) + np.where(both, f(without_both), 0)
    possible = legal_a[:, None] & legal_b[None, :]
    possible &= ~(need_j & (in_a == 0)) & ~(need_k & (in_b == 0))
    return np.where(possible, np.maximum(table, 0.0), 0.0)


def _finished(values) -> np.ndarray:
    return np.array([uncertainty.finished_score(v) is not None for v in values])


class TunedLaw:
    """The ideal bootstrap law of ``v3_rule.tuned_draws`` for one cell (points): a mixture over the
    re-selected winner pairs of (centre + se x T_df); ``nan_mass`` is the share of resamples
    where a winner diverged (its draws are nan)."""

    def __init__(self, val_a, test_a, winner_a, retrains_a, val_b, test_b, winner_b,
                 retrains_b):
        table = winner_table(val_a, val_b)
        ta = np.array([np.nan if v is None else 100.0 * v for v in test_a])
        tb = np.array([np.nan if v is None else 100.0 * v for v in test_b])
        gain, se, df = uncertainty.welch(retrains_a, retrains_b)
        realized = tb[winner_b] - ta[winner_a]
        ok = _finished(val_a)[:, None] & _finished(val_b)[None, :]
        centres = 100.0 * gain + (tb[None, :] - ta[:, None]) - realized
        keep = ok & (table > 0)
        self.weights, self.centres = table[keep], centres[keep]
        self.nan_mass = float(table[~ok].sum())
        self.se, self.df = 100.0 * se, df

    def _cdf_unit(self, z: np.ndarray) -> np.ndarray:
        return (scipy.stats.t.cdf(z, self.df) if math.isfinite(self.df)
                else scipy.stats.norm.cdf(z))

    def below(self, x: float, strict: bool = False) -> float:
        """P(draw <= x) (P(draw < x) when strict), nan draws excluded."""
        if self.se == 0:
            hit = self.centres < x if strict else self.centres <= x
            return float(self.weights[hit].sum())
        return float(self.weights @ self._cdf_unit((x - self.centres) / self.se))

    def above(self, x: float) -> float:
        """P(draw >= x)."""
        return float(self.weights.sum()) - self.below(x, strict=True)

    def quantile(self, q: float) -> float:
        total = float(self.weights.sum())
        if self.se == 0:
            order = np.argsort(self.centres, kind="stable")
            cum = np.cumsum(self.weights[order]) / total
            return float(self.centres[order][np.searchsorted(cum, q - 1e-15)])
        lo = float(self.centres.min() - 60 * self.se)
        hi = float(self.centres.max() + 60 * self.se)
        return float(scipy.optimize.brentq(lambda x: self.below(x) / total - q, lo, hi,
                                           xtol=1e-9))


class PairedLaw:
    """The ideal bootstrap law of ``v3_rule.paired_draws``: the mean of n draws with replacement
    from the n paired differences, exact on the grid of 1 / ``grid`` points (differences of
    test accuracies over a test set of ``grid`` x 100 examples are multiples of it)."""

    def __init__(self, differences: Sequence[float], grid: int = 100):
        d = np.asarray(differences, float)
        units = np.rint(d * grid).astype(np.int64)
        if not np.allclose(units, d * grid, atol=1e-6):
            raise ValueError(f"paired differences are not multiples of 1/{grid} point")
        self.n, self.grid = len(units), grid
        self.low = int(units.min())
        width = int(units.max()) - self.low
        one = np.bincount(units - self.low, minlength=width + 1).astype(float) / self.n
        length = self.n * width + 1
        size = 1 << max(1, int(math.ceil(math.log2(length))))
        law = np.fft.irfft(np.fft.rfft(one, size) ** self.n, size)[:length]
        self.pmf = np.clip(law, 0.0, None)
        self.pmf /= self.pmf.sum()
        self.cdf = np.cumsum(self.pmf)
        self.sums = self.n * self.low + np.arange(length)  # the sum, in grid units

    def below(self, x: float, strict: bool = False) -> float:
        """P(mean <= x) (P(mean < x) when strict)."""
        limit = x * self.n * self.grid
        hit = self.sums < limit - 1e-9 if strict else self.sums <= limit + 1e-9
        return float(self.pmf[hit].sum())

    def above(self, x: float) -> float:
        return 1.0 - self.below(x, strict=True)

    def quantile(self, q: float) -> float:
        i = int(np.searchsorted(self.cdf, q - 1e-15))
        return float(self.sums[min(i, len(self.sums) - 1)] / (self.n * self.grid))


def p_values(law, margin: float, claim_low: Optional[float] = None) -> dict:
    """The registered hypotheses' ideal p-values (``v3_rule.hypotheses``' null sides): 'better'
    P(d <= 0), 'worse' P(d >= 0), 'equivalent' (TOST) max(P(d <= -margin), P(d >= margin)),
    'claim' P(d >= claim); a nan draw (a diverged winner) counts against each."""
    nan = getattr(law, "nan_mass", 0.0)
    out = dict(better=law.below(0.0) + nan, worse=law.above(0.0) + nan,
               equivalent=max(law.below(-margin), law.above(margin)) + nan)
    if claim_low is not None:
        out["claim"] = law.above(claim_low) + nan
    return {k: min(1.0, v) for k, v in out.items()}
