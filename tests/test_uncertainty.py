"""The tuned gain's draws (board/v3_rule.tuned_draws over board/uncertainty.py's pieces):
selection (paired bootstrap, winners re-selected) + seed noise (Welch, Student t)."""

import itertools

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from dpbench.board import uncertainty, v3_rule
from dpbench.search import tuning


def _cell(val_a, test_a, val_b, test_b, seeds_a, seeds_b):
    """A comparison of B with A as the board reads it (winners chosen on validation)."""
    def arm(val, test, seeds):
        return v3_rule.Arm(list(val), list(test), tuning.choose_trial(dict(enumerate(val))),
                           list(seeds), None)
    return v3_rule.Cell("g", "b", 1.0, "m", arm(val_a, test_a, seeds_a),
                        arm(val_b, test_b, seeds_b), True, None)


def selection_draws(val_a, test_a, val_b, test_b, draws):
    """The selection part alone (fractions): identical retrains on both sides (no seed part),
    the realized gain added back; a resample where a method has no finished trial is nan."""
    cell = _cell(val_a, test_a, val_b, test_b, [0.5, 0.5], [0.5, 0.5])
    realized = test_b[cell.mine.winner] - test_a[cell.base.winner]
    return v3_rule.tuned_draws(cell, draws, int(np.random.default_rng().integers(1 << 30))
                               ) / 100 + realized


def gain_interval(seeds_a, seeds_b, val_a, test_a, val_b, test_b, draws, level=0.95):
    d = v3_rule.tuned_draws(_cell(val_a, test_a, val_b, test_b, seeds_a, seeds_b), draws,
                            int(np.random.default_rng().integers(1 << 30))) / 100
    lo, hi = np.percentile(d, [50 * (1 - level), 100 - 50 * (1 - level)])
    return dict(low=lo, high=hi)


def _small_case(rng):
    """K = 3 paired trials with validation / seed-0 test accuracies; 4 retrain seeds each."""
    val_a, val_b = rng.uniform(0.7, 0.9, 3).tolist(), rng.uniform(0.7, 0.9, 3).tolist()
    test_a = [v + rng.normal(0, 0.01) for v in val_a]
    test_b = [v + rng.normal(0, 0.01) for v in val_b]
    seeds_a, seeds_b = rng.normal(0.80, 0.004, 4), rng.normal(0.81, 0.004, 4)
    return val_a, test_a, val_b, test_b, seeds_a, seeds_b


def _exact_selection(val_a, test_a, val_b, test_b):
    """Every one of the (K-1)^(K-1) paired resamples, equally likely (brute force): trial 0
    (the recipe) in each, the K - 1 random trials redrawn from trials 1..K-1."""
    k = len(val_a)
    out = []
    for rest in itertools.product(range(1, k), repeat=k - 1):
        idx = np.asarray((0,) + rest)
        wa = max(set(idx.tolist()), key=lambda t: (val_a[t], -t))
        wb = max(set(idx.tolist()), key=lambda t: (val_b[t], -t))
        out.append(test_b[wb] - test_a[wa])
    return np.asarray(out)


def test_the_interval_matches_brute_force_on_a_small_case():
    rng = np.random.default_rng()
    val_a, test_a, val_b, test_b, seeds_a, seeds_b = _small_case(rng)
    realized = test_b[int(np.argmax(val_b))] - test_a[int(np.argmax(val_a))]
    exact = _exact_selection(val_a, test_a, val_b, test_b)
    gain, se, df = uncertainty.welch(seeds_a, seeds_b)

    def cdf(x):  # P(gain + (D - realized) + se T <= x), D over every resample
        return np.mean(scipy.stats.t.cdf((x - gain - (exact - realized)) / se, df))

    width = 10 * (se + np.ptp(exact))
    want = [scipy.optimize.brentq(lambda x: cdf(x) - p, gain - width, gain + width)
            for p in (0.025, 0.975)]
    got = gain_interval(seeds_a, seeds_b, val_a, test_a, val_b, test_b, 40000)
    # Monte Carlo error of 40,000 draws: the exact binomial law of the order statistics at each
    # case's mixture gives false failures ~5e-8 averaged over 30,000 simulated cases (9e-5 in
    # the worst of them)
    tolerance = 0.03 * (want[1] - want[0])
    assert abs(got["low"] - want[0]) < tolerance and abs(got["high"] - want[1]) < tolerance


def test_resampling_is_paired_keeps_trial_0_and_reselects_the_winner():
    """Trial 2 is both methods' best on validation; A's trial 2 tests badly. A resample
    without trial 2 re-selects trial 1 for both: the selection part sees both outcomes.
    Trial 0 (the recipe) is in every resample: it is part of every search."""
    val = [0.1, 0.5, 0.9]
    test_a, test_b = [0.6, 0.8, 0.5], [0.6, 0.8, 0.9]
    exact = _exact_selection(val, test_a, val, test_b)
    assert set(np.round(exact, 6)) == {0.0, 0.4}
    rng = np.random.default_rng()
    draws = selection_draws(val, test_a, val, test_b, 20000)
    p_without_2 = (1 / 2) ** 2  # no index 2 among the 2 redrawn random trials
    # 4.6 binomial sds of 20,000 draws (0.014): false failures 4e-6 (scipy.stats.binom)
    assert np.mean(np.isclose(draws, 0.0, atol=1e-9)) == pytest.approx(p_without_2, abs=0.014)
    idx = uncertainty.resampled_trials(5, 1000, rng)
    assert np.all(idx[:, 0] == 0) and np.all(idx[:, 1:] >= 1) and idx.max() == 4
    # the recipe wins a resample where it is best on validation: never dropped
    only_recipe = selection_draws([0.9, 0.1, 0.2], [0.7, 0.0, 0.0], [0.9, 0.1, 0.2],
                                  [0.8, 0.0, 0.0], 500)
    assert np.allclose(only_recipe, 0.1)


def test_a_diverged_trial_is_never_reselected():
    val_a, val_b = [None, 0.5, 0.6], [0.7, float("nan"), 0.6]
    test_a, test_b = [0.99, 0.5, 0.6], [0.7, 0.99, 0.6]
    draws = selection_draws(val_a, test_a, val_b, test_b, 2000)
    assert np.all(draws < 0.5)  # neither 0.99 ever enters
    # and the resamples did happen and re-select: A's winner is trial 1 or 2 (0.5 / 0.6), B's
    # always its trial 0 (0.7, in every resample), so the gains 0.2 and 0.1 both occur (each
    # in 1/4 or 3/4 of resamples: missing one of them, 0.75^2000 < 1e-200); every resample
    # finishes (both redrawn trials are A's finished 1 or 2)
    assert len(draws) == 2000
    assert set(np.round(draws, 6).tolist()) == {0.1, 0.2}


@pytest.mark.parametrize("seeds", [4, 2])
def test_the_seed_part_uses_student_t_with_welch_df(seeds):
    """No selection spread: the interval is gain +- t_{0.975, df} s.e. with Welch's df (equal
    spreads and sizes: df = 2 (n - 1), so t = 2.447 for 4 seeds, 4.303 for 2), not +- 1.96."""
    rng = np.random.default_rng()
    a = rng.normal(0.8, 0.01, seeds)
    b = a[::-1] + 0.01  # the same spread as a's: Welch's df is exactly 2 (n - 1)
    gain, se, df = uncertainty.welch(a, b)
    assert df == pytest.approx(2 * (seeds - 1))
    # Welch's s.e. from its definition, not from the code under test
    assert se == pytest.approx(np.sqrt(np.var(a, ddof=1) / seeds + np.var(b, ddof=1) / seeds))
    assert gain == pytest.approx(np.mean(b) - np.mean(a))
    same = [0.8, 0.7, 0.6]  # one winner in every resample: no selection spread
    got = gain_interval(a, b, same, same, same, same, 60000)
    q = scipy.stats.t.ppf(0.975, df)
    half = q * se
    assert half > 2.4 * se
    # 5 Monte Carlo standard errors of a 2.5% quantile of 60,000 draws (1.4% of the half-width
    # for df = 2, whose tails are heavy; a fixed 3% failed ~7% of runs there): false failures
    # 1.3e-6 (df 6) and 1.9e-6 (df 2), exact binomial law of the order statistics
    tolerance = 5 * np.sqrt(0.025 * 0.975 / 60000) / scipy.stats.t.pdf(q, df) * se
    assert got["low"] == pytest.approx(gain - half, abs=tolerance)
    assert got["high"] == pytest.approx(gain + half, abs=tolerance)
    assert tolerance < 0.1 * half  # still tight enough to tell t from a normal (+-1.96 s.e.)


def test_welch_on_a_known_case():
    """a = [0, 1], b = [1, 3]: variances 0.5 and 2, s.e. sqrt(0.5/2 + 2/2) = sqrt(1.25),
    df = 1.25^2 / ((0.25^2 + 1^2) / 1) = 1.470588..."""
    gain, se, df = uncertainty.welch([0.0, 1.0], [1.0, 3.0])
    assert (gain, se) == (pytest.approx(1.5), pytest.approx(np.sqrt(1.25)))
    assert df == pytest.approx(1.25 ** 2 / (0.25 ** 2 + 1.0))


def test_paired_trial_gains_take_the_median_and_a_sign_test():
    a, b = [0.5, 0.8, 0.7, None, 0.6, 0.5], [0.4, 0.9, 0.7, 0.6, None, 0.6]
    got = uncertainty.paired_trial_gains(a, b, [1, 2, 3, 4, 5])
    # finished pairs: trials 1 (+0.1), 2 (0), 5 (+0.1); trial 3 B wins (A diverged), 4 A wins
    assert got["median"] == pytest.approx(0.1)
    assert (got["wins"], got["losses"]) == (3, 1)
    assert got["sign_p"] == pytest.approx(scipy.stats.binomtest(3, 4).pvalue)
    # 7 of 7 wins: the sign test's p = 2 / 2^7 = 0.015625 (board v3's RS vs DP-SGD)
    seven = uncertainty.paired_trial_gains([0.5] * 8, [0.6] * 8, range(1, 8))
    assert seven["sign_p"] == pytest.approx(0.015625)
