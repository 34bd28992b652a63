"""The trial count of a search (the tuning protocol's ``trials``): K = 1 + J trials per method
of a group, J fixed or drawn once per group from one of Papernot & Steinke's truncated negative
binomial laws (dp_accounting's RepeatAndSelect family: shape 0 logarithmic, 1 geometric, inf
Poisson): the draw itself (search/tuning.py seeds it and accounts for it)."""

from __future__ import annotations

import math

import numpy as np
import scipy.stats
from dp_accounting.rdp import rdp_privacy_accountant


def shape_of(trials: dict) -> float:
    shape = trials["shape"]
    return math.inf if shape in ("inf", math.inf) else float(shape)


def sample_trial_count(rng: np.random.Generator, mean: float, shape: float) -> int:
    """One draw of Papernot & Steinke's trial count: Poisson(mean) for shape = inf; else the
    truncated negative binomial P[J = j] ~ C(j + shape - 1, j) (1 - gamma)^j on j >= 1, with
    gamma from the mean by dp_accounting's own inversion (shape 0: logarithmic, 1: geometric)."""
    if shape == math.inf:
        return int(rng.poisson(mean))
    if mean == 1:  # the law is the point mass at 1 (gamma = 1)
        return 1
    gamma = rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean)
    if shape == 0:  # logarithmic: P[J = j] proportional to (1 - gamma)^j / j
        return int(scipy.stats.logser(1 - gamma).rvs(random_state=rng))
    while True:  # scipy's nbinom(n, p) is C(j + n - 1, j) p^n (1 - p)^j; condition on j >= 1
        j = int(scipy.stats.nbinom(shape, gamma).rvs(random_state=rng))
        if j >= 1:
            return j
