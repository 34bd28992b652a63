"""Labels decided, not guessed: a family of bootstrap tests judged under Holm's correction,
with the bootstrap's own Monte Carlo error bounded, and more draws taken until each label is
settled or the schedule runs out ("undecided at N draws").

A bootstrap p-value is a proportion of draws: with n draws and h hits its true value (the one
infinitely many draws would give) lies in the Clopper-Pearson interval of h / n. Holm's adjusted
p-values are non-decreasing in every raw p, so putting every raw p at its interval's low end
bounds every adjusted p from below, and at its high end from above. A comparison is rejected
when its adjusted upper bound is below alpha, retained when its lower bound is at or above
alpha, and undecided otherwise, in which case the family is drawn again at the schedule's next
size. Each interval's two tails are ``flip_probability / (2 m looks)``: by the union bound, the
chance that any label of the family differs from the one infinitely many draws would give is
at most ``flip_probability``, whatever stream drew it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import scipy.stats

LABELS = ("reject", "retain", "undecided")


class Decision(NamedTuple):
    labels: tuple          # per comparison: 'reject', 'retain' or 'undecided'
    draws: int             # the draws of the last look
    adjusted_low: np.ndarray
    adjusted_high: np.ndarray
    low: np.ndarray        # per comparison: the bounds on its raw p (Holm ranks by these)
    high: np.ndarray
    settled_draws: np.ndarray  # per comparison: the draws of its last look (its label's)


def holm_adjusted(p) -> np.ndarray:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest p times
    (m - i), made monotone, capped at 1 (ties kept in input order). The board's one Holm
    ; scipy offers Benjamini-Hochberg only, which controls
    the false discovery rate, not the chance of any false label."""
    p = np.asarray(p, float)
    order = np.argsort(p, kind="stable")
    steps = np.minimum(1.0, (len(p) - np.arange(len(p))) * p[order])
    adjusted = np.empty(len(p))
    adjusted[order] = np.maximum.accumulate(steps) if len(p) else steps
    return adjusted


def proportion_bounds(hits, draws: int, tail: float) -> tuple:
    """Clopper-Pearson bounds on proportions ``hits / draws``, each side missing with
    probability at most ``tail``."""
    hits = np.asarray(hits, float)
    low = np.where(hits > 0, scipy.stats.beta.ppf(tail, hits, draws - hits + 1), 0.0)
    high = np.where(hits < draws, scipy.stats.beta.ppf(1 - tail, hits + 1, draws - hits), 1.0)
    return low, high


def decide(hits_at: Callable[[int], np.ndarray], alpha: float, schedule: Sequence[int],
           flip_probability: float,
           hits_for: Optional[Callable[[int, np.ndarray], np.ndarray]] = None) -> Decision:
    """The family's labels at level ``alpha`` (Holm). ``hits_at(n)`` gives, per comparison,
    how many of ``n`` bootstrap draws are at least as extreme as the data (its p-value is the
    proportion); it is called with the ``schedule``'s sizes in turn until every label is
    settled. Each look draws again only the comparisons still undecided (``hits_for(n,
    indices)``, when given, computes just those): a settled comparison keeps its bounds, and
    every comparison's bounds are the intersection of its looks' intervals, so they only
    tighten and a settled label stays settled (Holm's adjusted bounds are monotone in every
    raw one)."""
    if not schedule or list(schedule) != sorted(schedule) or schedule[0] <= 0:
        raise ValueError(f"the schedule must be increasing positive draw counts, got "
                         f"{schedule!r}")
    if not 0 < flip_probability < 1 or not 0 < alpha < 1:
        raise ValueError("alpha and flip_probability must lie in (0, 1)")
    low = high = todo = settled = None
    for draws in schedule:
        if todo is None:
            hits = np.asarray(hits_at(int(draws)))
            low, high, todo = np.zeros(len(hits)), np.ones(len(hits)), np.arange(len(hits))
            settled = np.zeros(len(hits), int)
            if not len(hits):  # no comparison: nothing to decide
                return Decision((), int(draws), low, high, low, high, settled)
        else:
            hits = np.asarray(hits_for(int(draws), todo) if hits_for is not None
                              else np.asarray(hits_at(int(draws)))[todo])
        tail = flip_probability / (2 * len(low) * len(schedule))
        new_low, new_high = proportion_bounds(hits, int(draws), tail)
        low[todo], high[todo] = np.maximum(low[todo], new_low), np.minimum(high[todo], new_high)
        settled[todo] = int(draws)
        adjusted_low, adjusted_high = holm_adjusted(low), holm_adjusted(high)
        labels = tuple("reject" if hi < alpha else "retain" if lo >= alpha else "undecided"
                       for lo, hi in zip(adjusted_low, adjusted_high))
        if "undecided" not in labels:
            break
        todo = np.array([i for i, label in enumerate(labels) if label == "undecided"])
    return Decision(labels, int(draws), adjusted_low, adjusted_high, low, high, settled)
