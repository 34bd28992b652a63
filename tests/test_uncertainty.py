"""The board's intervals: selection (paired bootstrap, winners re-selected) + seed noise (t)."""

import itertools

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from dpbench.board import uncertainty


def _small_case(rng):
    """K = 3 paired trials with validation / seed-0 test accuracies; 4 retrain seeds each."""
    val_a, val_b = rng.uniform(0.7, 0.9, 3).tolist(), rng.uniform(0.7, 0.9, 3).tolist()
    test_a = [v + rng.normal(0, 0.01) for v in val_a]
    test_b = [v + rng.normal(0, 0.01) for v in val_b]
    seeds_a, seeds_b = rng.normal(0.80, 0.004, 4), rng.normal(0.81, 0.004, 4)
    return val_a, test_a, val_b, test_b, seeds_a, seeds_b


def _exact_selection(val_a, test_a, val_b, test_b):
    """Every one of the K^K paired resamples, equally likely (brute force)."""
    k = len(val_a)
    out = []
    for idx in itertools.product(range(k), repeat=k):
        idx = np.asarray(idx)
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
    draws = uncertainty.selection_draws(val_a, test_a, val_b, test_b, draws=40000, rng=rng)
    got = uncertainty.gain_interval(seeds_a, seeds_b, draws, realized, rng=rng)
    assert got["gain"] == pytest.approx(np.mean(seeds_b) - np.mean(seeds_a))
    # Monte Carlo error of 40,000 draws: the exact binomial law of the order statistics at each
    # case's mixture gives false failures ~5e-8 averaged over 30,000 simulated cases (9e-5 in
    # the worst of them)
    tolerance = 0.03 * (want[1] - want[0])
    assert abs(got["low"] - want[0]) < tolerance and abs(got["high"] - want[1]) < tolerance


def test_resampling_is_paired_and_reselects_the_winner():
    """Trial 2 is both methods' best on validation; A's trial 2 tests badly. A resample
    without trial 2 re-selects trial 1 for both: the selection part sees both outcomes."""
    val = [0.1, 0.5, 0.9]
    test_a, test_b = [0.6, 0.8, 0.5], [0.6, 0.8, 0.9]
    exact = _exact_selection(val, test_a, val, test_b)
    assert set(np.round(exact, 6)) == {0.0, 0.4}
    draws = uncertainty.selection_draws(val, test_a, val, test_b, draws=20000,
                                        rng=np.random.default_rng())
    p_without_2 = (2 / 3) ** 3  # no index 2 among the 3 draws
    # 4.6 binomial sds of 20,000 draws: false failures 3.4e-6 (scipy.stats.binom)
    assert np.mean(np.isclose(draws, 0.0)) == pytest.approx(p_without_2, abs=0.015)


def test_a_diverged_trial_is_never_reselected():
    val_a, val_b = [None, 0.5, 0.6], [0.7, float("nan"), 0.6]
    test_a, test_b = [0.99, 0.5, 0.6], [0.7, 0.99, 0.6]
    draws = uncertainty.selection_draws(val_a, test_a, val_b, test_b, draws=2000,
                                        rng=np.random.default_rng())
    assert np.all(draws < 0.5)  # neither 0.99 ever enters
    # and the resamples did happen and re-select: A's winner is trial 1 or 2 (0.5 / 0.6), B's
    # trial 0 or 2 (0.7 / 0.6), so the gains 0.2, 0.1, 0.0 (and 0.0 via 2 vs 2) all occur
    # (25/27 of resamples finish, each gain has >= 6/27: false failures < 1e-200)
    assert len(draws) > 0.5 * 2000
    assert {0.0, 0.1, 0.2} <= set(np.round(draws, 6).tolist())


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
    got = uncertainty.gain_interval(a, b, np.zeros(60000), 0.0, rng=rng)
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


def test_verdict_words_only_where_the_interval_excludes_zero():
    assert uncertainty.verdict(dict(low=0.001, high=0.02)) == "better"
    assert uncertainty.verdict(dict(low=-0.02, high=-0.001)) == "worse"
    assert uncertainty.verdict(dict(low=-0.001, high=0.02)) == "tie"


def test_paired_win_rate_counts_ties_half_and_divergence_as_a_loss():
    a, b = [0.5, 0.8, 0.7, None, 0.6], [0.4, 0.9, 0.7, 0.6, None]
    assert uncertainty.paired_win_rate(a, b, [1, 2, 3, 4]) == pytest.approx((1 + 0.5 + 1 + 0) / 4)
