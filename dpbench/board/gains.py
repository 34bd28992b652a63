"""The gains board v4 labels, as laws a test reads (``below``/``above``): the paired gain of
a method over DP-SGD on their shared trials (the surface-adjusted t, or the plain paired t),
Welch's test of two arms' means over their own trials, and the dimension ladder's slope.
Board v4's analysis (board/v4.py) and its design study (board/design_study.py) use these
same laws, so the study judges what the board will print.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.stats

from dpbench.board import uncertainty

# The surface adjustment needs at least this many shared trials per regressor of the surface;
# fewer (a ladder rung of K 16) take the plain paired t.
TRIALS_PER_REGRESSOR = 3


class TLaw:
    """A gain's law under a t procedure: estimate + se x T_df (the paired t test of the shared
    trials' differences, or Welch's test of two arms' means over their own trials)."""

    def __init__(self, estimate: float, se: float, df: float):
        self.estimate, self.se, self.df = estimate, se, df

    @classmethod
    def paired(cls, differences) -> "TLaw":
        d = np.asarray(differences, float)
        return cls(float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1.0)

    @classmethod
    def adjusted(cls, differences, base, features, seed_variance: float) -> "TLaw":
        """The paired gain with the surface-adjusted variance: on scrambled Sobol points the
        part of the differences that moves with DP-SGD's smooth surface averages far better
        than independent draws would, so it leaves the variance: var(d) - s^2 (var(y0) - v0),
        s the slope of d on DP-SGD's accuracy y0 corrected for y0's seed noise
        (``seed_variance``), v0 y0's residual variance about its least-squares surface on
        ``features`` (its residual df); never below the two arms' seed variance; Student t
        with n - 1 df (board v4's design study: calibrated at its Holm levels). With fewer
        than TRIALS_PER_REGRESSOR trials per regressor: the plain paired t."""
        d, y0 = np.asarray(differences, float), np.asarray(base, float)
        n, p = features.shape
        if n < TRIALS_PER_REGRESSOR * p:
            return cls.paired(d)
        coef = np.linalg.lstsq(features, y0, rcond=None)[0]
        v0 = float(np.sum((y0 - features @ coef) ** 2) / (n - p))
        vy = float(np.var(y0, ddof=1))
        slope = (np.cov(d, y0)[0, 1] + seed_variance) / max(vy - seed_variance, 1e-12)
        var = max(float(np.var(d, ddof=1)) - slope ** 2 * max(vy - v0, 0.0),
                  2.0 * seed_variance)
        return cls(float(d.mean()), math.sqrt(var / n), float(n - 1))

    @classmethod
    def welch(cls, base, mine) -> "TLaw":
        gain, se, df = uncertainty.welch(base, mine)
        return cls(gain, se, df)

    def below(self, x: float, strict: bool = False) -> float:
        if self.se == 0:
            return float(self.estimate < x if strict else self.estimate <= x)
        return float(scipy.stats.t.cdf((x - self.estimate) / self.se, self.df))

    def above(self, x: float) -> float:
        return 1.0 - self.below(x, strict=True)




def slope_law(laws: list, log2_parameters) -> TLaw:
    """The least-squares slope of rung gains (independent laws) against log2(parameters):
    its estimate, standard error and Welch-Satterthwaite df."""
    x = np.asarray(log2_parameters, float)
    w = (x - x.mean()) / np.sum((x - x.mean()) ** 2)
    terms = (w * np.array([law.se for law in laws])) ** 2
    se = math.sqrt(float(terms.sum()))
    df = (float(terms.sum() ** 2 / np.sum(terms ** 2 / np.array([law.df for law in laws])))
          if se > 0 else math.inf)
    return TLaw(float(w @ np.array([law.estimate for law in laws])), se, df)
