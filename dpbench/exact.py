"""Exact sampling on the host for pure-DP mechanisms whose privacy rests on exact probabilities.

A pure epsilon-DP claim bounds the RATIO of output probabilities; for GIP's index release the
per-group epsilon is ~1e-8, far below float32 (6e-8 relative) and, for the tails of its law,
below any fixed-precision float (at l = 256 the law's smallest masses are ~1e-76). So the
index release is sampled here with integer and rational arithmetic only: every probability the
sampler realizes is exactly the one the privacy proof uses, given uniform random bits.

- :func:`uniform_below` draws an exact uniform integer in [0, n) for any Python int n
  (rejection on masked random bytes).
- :func:`bernoulli_exp` draws Bernoulli(exp(-gamma)) exactly for a rational gamma >= 0
  (Canonne, Kamath & Steinke 2020, "The Discrete Gaussian for Differential Privacy", Alg. 1).
- :class:`MallowsDistance` draws the Mallows model's swap count i with
  P(i) proportional to C(m, i) C(l - m, i) exp(-2 theta i): propose i with probability
  C(m, i) C(l - m, i) / C(l, m) (exact integers; the Vandermonde identity makes them sum to
  C(l, m)), accept with probability exp(-2 theta i); repeat until accepted.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np


def uniform_below(rng: np.random.Generator, n: int) -> int:
    """An exactly uniform integer in [0, n), for any positive Python int ``n``."""
    if n < 1:
        raise ValueError(f"uniform_below needs n >= 1, got {n}")
    bits = (n - 1).bit_length()
    if bits == 0:
        return 0
    mask = (1 << bits) - 1
    while True:  # accepted with probability > 1/2 per round
        value = int.from_bytes(rng.bytes((bits + 7) // 8), "little") & mask
        if value < n:
            return value


def bernoulli(rng: np.random.Generator, p: Fraction) -> bool:
    """True with probability exactly ``p`` (a rational in [0, 1])."""
    if not 0 <= p <= 1:
        raise ValueError(f"bernoulli needs p in [0, 1], got {p}")
    return uniform_below(rng, p.denominator) < p.numerator


def _bernoulli_exp_at_most_one(rng: np.random.Generator, num: int, den: int) -> bool:
    """exp(-num/den) for 0 <= num/den <= 1: count K = 1, 2, ... while Bernoulli(gamma / K)
    succeeds; "K is odd" has probability sum_k (-gamma)^k / k! = exp(-gamma). Integers only
    (Fraction arithmetic made it 5x slower)."""
    k = 1
    while num and uniform_below(rng, den * k) < num:
        k += 1
    return k % 2 == 1


def bernoulli_exp(rng: np.random.Generator, gamma: Fraction) -> bool:
    """True with probability exactly exp(-gamma), for a rational ``gamma >= 0`` (gamma > 1
    as a product of exp(-1) factors and one exp(-(gamma - whole)))."""
    gamma = Fraction(gamma)
    if gamma < 0:
        raise ValueError(f"bernoulli_exp needs gamma >= 0, got {gamma}")
    return _bernoulli_exp(rng, gamma.numerator, gamma.denominator)


def _bernoulli_exp(rng: np.random.Generator, num: int, den: int) -> bool:
    while num > den:
        if not _bernoulli_exp_at_most_one(rng, 1, 1):
            return False
        num -= den
    return _bernoulli_exp_at_most_one(rng, num, den)


class MallowsDistance:
    """The swap count i of the Mallows model on m-subsets of l coordinates, sampled exactly.

    Around a reference set I0 with m ones, the Mallows model P(I) ~ exp(-theta d(I, I0)) with
    the Hamming distance d = 2i puts mass C(m, i) C(l - m, i) exp(-2 theta i) / Z on swap
    count i (that many masks lie at distance 2i); given i, the output is uniform over them.
    ``theta`` is a rational (Fraction), so ``acceptance_exponent(i) = 2 theta i`` is exact.
    """

    def __init__(self, group_size: int, m: int, theta: Fraction):
        if not 0 <= m <= group_size:
            raise ValueError(f"m must lie in [0, {group_size}], got {m}")
        theta = Fraction(theta)
        if theta < 0:
            raise ValueError(f"theta must be >= 0, got {theta}")
        self.group_size, self.m, self.theta = group_size, m, theta
        self.max_distance = min(m, group_size - m)
        counts = [math.comb(m, i) * math.comb(group_size - m, i)
                  for i in range(self.max_distance + 1)]
        self.cumulative = list(np.cumsum(np.array(counts, dtype=object)))
        self.total = self.cumulative[-1]  # == C(l, m), by Vandermonde's identity
        self._exponents = [self.acceptance_exponent(i) for i in range(self.max_distance + 1)]
        self._exponents = [(g.numerator, g.denominator) for g in self._exponents]

    def proposal_count(self, i: int) -> int:
        """How many of the C(l, m) equally likely proposals give swap count i."""
        return self.cumulative[i] - (self.cumulative[i - 1] if i else 0)

    def acceptance_exponent(self, i: int) -> Fraction:
        """A proposal with swap count i is accepted with probability exp(-this)."""
        return 2 * self.theta * i

    def sample(self, rng: np.random.Generator) -> int:
        while True:
            i = bisect.bisect_right(self.cumulative, uniform_below(rng, self.total))
            if _bernoulli_exp(rng, *self._exponents[i]):
                return i

    def pmf(self) -> np.ndarray:
        """P(i) in float64, for statistical tests (the sampler itself never uses floats)."""
        logs = np.array([math.log(self.proposal_count(i)) - float(self.acceptance_exponent(i))
                         for i in range(self.max_distance + 1)])
        p = np.exp(logs - logs.max())
        return p / p.sum()
