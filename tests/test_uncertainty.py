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
    tolerance = 0.03 * (want[1] - want[0])  # Monte Carlo error of 40,000 draws
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
    assert np.mean(np.isclose(draws, 0.0)) == pytest.approx(p_without_2, abs=0.015)


def test_a_diverged_trial_is_never_reselected():
    val_a, val_b = [None, 0.5, 0.6], [0.7, float("nan"), 0.6]
    test_a, test_b = [0.99, 0.5, 0.6], [0.7, 0.99, 0.6]
    draws = uncertainty.selection_draws(val_a, test_a, val_b, test_b, draws=2000,
                                        rng=np.random.default_rng())
    assert np.all(draws < 0.5)  # neither 0.99 ever enters


@pytest.mark.parametrize("seeds", [4, 2])
def test_the_seed_part_uses_student_t_with_welch_df(seeds):
    """No selection spread: the interval is gain +- t_{0.975, df} s.e. with Welch's df (equal
    spreads and sizes: df = 2 (n - 1), so t = 2.447 for 4 seeds, 4.303 for 2), not +- 1.96."""
    rng = np.random.default_rng()
    a = rng.normal(0.8, 0.01, seeds)
    b = a[::-1] + 0.01  # the same spread as a's: Welch's df is exactly 2 (n - 1)
    gain, se, df = uncertainty.welch(a, b)
    assert df == pytest.approx(2 * (seeds - 1))
    got = uncertainty.gain_interval(a, b, np.zeros(60000), 0.0, rng=rng)
    half = scipy.stats.t.ppf(0.975, df) * se
    assert half > 2.4 * se
    assert got["low"] == pytest.approx(gain - half, abs=0.03 * half)
    assert got["high"] == pytest.approx(gain + half, abs=0.03 * half)


def test_verdict_words_only_where_the_interval_excludes_zero():
    assert uncertainty.verdict(dict(low=0.001, high=0.02)) == "better"
    assert uncertainty.verdict(dict(low=-0.02, high=-0.001)) == "worse"
    assert uncertainty.verdict(dict(low=-0.001, high=0.02)) == "tie"


def test_paired_win_rate_counts_ties_half_and_divergence_as_a_loss():
    a, b = [0.5, 0.8, 0.7, None, 0.6], [0.4, 0.9, 0.7, 0.6, None]
    assert uncertainty.paired_win_rate(a, b, [1, 2, 3, 4]) == pytest.approx((1 + 0.5 + 1 + 0) / 4)
