"""Exact host samplers: uniform integers, Bernoulli(exp(-gamma)), the Mallows swap count."""

import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.stats

from dpbench import exact


def _rng():
    return np.random.default_rng()


@pytest.mark.parametrize("n", [1, 3, 7, 3 << 70])
def test_uniform_below_is_uniform_for_small_and_huge_bounds(n):
    rng = _rng()
    draws = [exact.uniform_below(rng, n) for _ in range(6000)]
    assert min(draws) >= 0 and max(draws) < n
    if n == 1:
        return
    cells = n if n < 16 else 3  # 3 << 70 splits into 3 cells of equal mass
    observed = np.bincount([d * cells // n for d in draws], minlength=cells)
    # false failures 1.2e-5 (3 cells) and 0.9e-5 (7) at this 1e-5, in 4e6 simulated multinomial
    # draws (1.08e-4 for 3 cells at 1e-4); the shortcut's p-value stays < 1e-98 (1e5 simulated)
    assert scipy.stats.chisquare(observed).pvalue > 1e-5
    if n == 3:  # the usual modulo shortcut on 2 random bits gives 1/2, 1/4, 1/4: rejected
        assert scipy.stats.chisquare(observed, np.array([0.5, 0.25, 0.25]) * 6000).pvalue < 1e-6


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(1, 3), Fraction(1), Fraction(5, 2)])
def test_bernoulli_exp_has_probability_exp_minus_gamma(gamma):
    rng = _rng()
    n = 20_000
    hits = sum(exact.bernoulli_exp(rng, gamma) for _ in range(n))
    p = math.exp(-gamma)
    if gamma == 0:
        assert hits == n
        return
    # exact binomial test: false failures 9.5e-5..9.97e-5 (scipy.stats.binom over the accepted
    # counts); the twin passes < 1e-6 with probability 3e-12 (gamma 1/3) or less
    assert scipy.stats.binomtest(hits, n, p).pvalue > 1e-4
    assert scipy.stats.binomtest(hits, n, math.exp(-0.85 * gamma)).pvalue < 1e-6


@pytest.mark.parametrize("l,m,theta", [(16, 5, Fraction(1, 5)), (12, 9, Fraction(1, 20)),
                                       (8, 4, Fraction(1, 2))])
def test_mallows_distance_counts_are_exact_and_samples_match_the_closed_form(l, m, theta):
    law = exact.MallowsDistance(l, m, theta)
    # every m-subset of l is one proposal, split by its swap count: C(m, i) C(l - m, i)
    assert law.total == math.comb(l, m)
    for i in range(law.max_distance + 1):
        assert law.proposal_count(i) == math.comb(m, i) * math.comb(l - m, i)
        assert law.acceptance_exponent(i) == 2 * theta * i
    i = np.arange(law.max_distance + 1)
    weights = np.array([math.comb(m, k) * math.comb(l - m, k) for k in i]) * np.exp(
        -2 * float(theta) * i)
    np.testing.assert_allclose(law.pmf(), weights / weights.sum(), rtol=1e-12)
    rng = _rng()
    draws = np.bincount([law.sample(rng) for _ in range(10_000)], minlength=len(i))
    keep = law.pmf() * 10_000 >= 5
    expected = law.pmf()[keep] * draws[keep].sum() / law.pmf()[keep].sum()
    # false failures 1.7e-5..2.8e-5 at this 1e-5, in 4e6 simulated multinomial draws per case
    # (1.2e-4..1.7e-4 at 1e-4: bins of ~10 counts fatten the tail); the twin's p-value < 1e-196
    assert scipy.stats.chisquare(draws[keep], expected).pvalue > 1e-5
    wrong = exact.MallowsDistance(l, m, 2 * theta + Fraction(1, 5)).pmf()[keep]
    assert scipy.stats.chisquare(draws[keep], wrong * draws[keep].sum() / wrong.sum()).pvalue \
        < 1e-6


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        exact.uniform_below(_rng(), 0)
    with pytest.raises(ValueError, match="gamma >= 0"):
        exact.bernoulli_exp(_rng(), Fraction(-1))
    with pytest.raises(ValueError, match="m must lie"):
        exact.MallowsDistance(8, 9, Fraction(0))
