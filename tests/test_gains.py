"""dpbench/board/gains.py: the laws board v4's decisions read: the paired t is scipy's, the
surface adjustment falls back where it has too few trials, covers its truth on simulated
surfaces (statistical, false failures stated) where a twin without its seed-noise terms does
not, and the ladder's slope law is the least-squares one."""

import math

import numpy as np
import pytest
import scipy.stats

from dpbench.board import board_model as bm
from dpbench.board.gains import TLaw, slope_law

SPACE = bm.Space((0.1, 1.6), (0.02, 0.2), {"train.batch_size": [1024, 2048],
                                          "train.ema_decay": [0.0, 0.99]})


def test_the_paired_law_is_the_one_sample_t_test():
    d = np.random.default_rng().normal(0.3, 1.0, 20)
    law = TLaw.paired(d)
    want = scipy.stats.ttest_1samp(d, 0.0, alternative="greater").pvalue
    assert law.below(0.0) == pytest.approx(want, rel=1e-10)
    assert law.above(0.0) == pytest.approx(1 - want, rel=1e-10)


def test_too_few_trials_per_regressor_take_the_plain_t():
    rng = np.random.default_rng()
    points = SPACE.draw(16, rng)
    features = SPACE.features(points)
    d, y0 = rng.normal(0, 1, 16), rng.normal(80, 2, 16)
    law = TLaw.adjusted(d, y0, features, 0.05)
    plain = TLaw.paired(d)
    assert (law.estimate, law.se, law.df) == (plain.estimate, plain.se, plain.df)


def _adjusted_without_seed_terms(d, y0, features, seed_variance):
    """The twin: the slope not corrected for y0's seed noise and no floor."""
    n = len(d)
    coef = np.linalg.lstsq(features, y0, rcond=None)[0]
    v0 = np.sum((y0 - features @ coef) ** 2) / (n - features.shape[1])
    slope = np.cov(d, y0)[0, 1] / np.var(y0, ddof=1)
    var = max(np.var(d, ddof=1) - 2 * slope ** 2 * (np.var(y0, ddof=1) - v0), 1e-12)
    return TLaw(float(d.mean()), math.sqrt(var / n), n - 1.0)


def _coverage(make, reps: int, rng) -> float:
    """Share of 95% intervals holding the truth (the space-mean gain 0.3) on simulated
    surfaces: DP-SGD quadratic in the space plus configuration terms and seed noise, the
    method's gain moving with DP-SGD's accuracy (slope -0.5) plus its own terms."""
    hits = 0
    for _ in range(reps):
        points = SPACE.draw(32, rng)
        features = SPACE.features(points)
        f = 84 + 4 * points[:, 0] - 6 * points[:, 0] ** 2 + points[:, 1]
        mbar = 84 + 4 / 2 - 6 / 3 + 0.5  # f's mean over the unit square
        mu0 = f + 0.8 * rng.standard_normal(32)
        mu1 = mu0 + 0.3 - 0.5 * (mu0 - mbar) + 0.3 * rng.standard_normal(32)
        y0 = mu0 + 0.25 * rng.standard_normal(32)
        y1 = mu1 + 0.25 * rng.standard_normal(32)
        law = make(y1 - y0, y0, features, 0.25 ** 2)
        q = scipy.stats.t.ppf(0.975, law.df)
        hits += abs(law.estimate - 0.3) <= q * law.se
    return hits / reps


def test_the_adjusted_interval_covers_its_truth_and_a_twin_without_seed_terms_does_not():
    """600 surfaces each: the adjusted 95% interval's coverage is at least 0.95 - 4.3 s.e. of
    a binomial share (false failures < 1e-5 if it covered 95%; it is conservative here); the
    twin covers < 90% (measured at 2,000 surfaces: adjusted 95.5%, twin 76.8%, plain t 98.7%)."""
    rng = np.random.default_rng()
    reps = 600
    floor = 0.95 - 4.3 * math.sqrt(0.95 * 0.05 / reps)
    assert _coverage(TLaw.adjusted, reps, rng) >= floor
    assert _coverage(_adjusted_without_seed_terms, reps, rng) < 0.90


def test_the_slope_law_is_least_squares_over_the_rungs():
    laws = [TLaw(0.0, 0.1, 30), TLaw(1.0, 0.2, 15), TLaw(2.0, 0.2, 15)]
    x = np.log2([1, 4, 16])
    law = slope_law(laws, x)
    assert law.estimate == pytest.approx(np.polyfit(x, [0, 1, 2], 1)[0])
    w = (x - x.mean()) / np.sum((x - x.mean()) ** 2)
    assert law.se == pytest.approx(math.sqrt(np.sum((w * [0.1, 0.2, 0.2]) ** 2)))
    assert 15 <= law.df <= 60
