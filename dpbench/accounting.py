"""The one place that talks to dp_accounting: budgets, epsilon of a run's DpEvent, calibration.

Accountants: 'pld' (default; privacy loss distributions, tight) and 'rdp' (Renyi DP, looser).
Both are dp_accounting's own; nothing here re-derives a privacy bound, with one documented
reduction: RDP has no event for truncated Poisson sampling, so for RDP a truncated-Poisson step is
accounted as an exact Poisson step and the probability that truncation ever happens is charged to
delta (see :func:`_rdp_view`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from fractions import Fraction
from typing import Callable

import attr
import dp_accounting
import gin
import scipy.optimize
import scipy.stats
from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

ACCOUNTANTS = ("pld", "rdp")
# Calibration searches sigma in this interval; a target that needs more noise is unattainable.
SIGMA_BRACKET = (0.05, 512.0)
SIGMA_TOLERANCE = 1e-5


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PureDpEvent(dp_event.DpEvent):
    """A mechanism that is epsilon-DP (pure, delta = 0), e.g. GIP's index release.

    dp_accounting has no such event under add/remove adjacency, so this module accounts it:
    with PLD through the dominating pair of (epsilon, 0)-DP (``from_privacy_parameters``,
    tight for pure DP: binary randomized response), with RDP as (epsilon^2 / 2)-zCDP
    (Bun & Steinke 2016, Prop. 1.4). Never amplified by sampling.
    """

    epsilon: float


ONCE, EVERY_STEP = "once before training", "every step"
# A mechanism that touches an example only at the steps that can sample it (a cyclic Poisson
# sampler's part): counted as the sampler's participations, ceil(steps / parts).
EVERY_PARTICIPATION = "every step that samples the example's part"


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """One line of a run's privacy ledger: ``count`` occurrences of the mechanism ``event``.

    The ledger (a list of these) is the one source of both the run's DpEvent
    (:func:`ledger_event`) and its privacy statement (``records.privacy_statement``), so what a
    run claims is generated from exactly what the accountant composes.

    Attributes:
      name: what is released, in words ("Gaussian release of the clipped gradient sum").
      source: the stage(s) that declare the mechanism.
      schedule: ONCE, EVERY_STEP or EVERY_PARTICIPATION.
      event: the DpEvent of ONE occurrence (e.g. one sampled Gaussian step).
      count: how many times it runs in the ledger (the steps taken so far, or 1).
      details: machine-readable facts for the statement (sensitivity, noise multipliers, ...).
    """

    name: str
    source: str
    schedule: str
    event: dp_event.DpEvent
    count: int
    details: dict = dataclasses.field(default_factory=dict)

    def composed(self) -> dp_event.DpEvent:
        """The ``count`` occurrences as one event. Pure-DP events compose by basic composition
        into one pure event (exact sum, rounded up to a float); composing many tiny pure events
        one by one through the PLD would charge each a whole discretization interval."""
        if isinstance(self.event, PureDpEvent):
            return PureDpEvent(round_up_float(Fraction(self.event.epsilon) * self.count))
        if self.count == 1 and self.schedule == ONCE:
            return self.event
        return dp_event.SelfComposedDpEvent(self.event, self.count)


def round_up_float(value: Fraction) -> float:
    """The smallest float >= ``value`` (a privacy parameter must never round down)."""
    out = float(value)
    return out if Fraction(out) >= value else math.nextafter(out, math.inf)


def ledger_event(mechanisms) -> dp_event.DpEvent:
    """The run's DpEvent: the composition of every ledger line that ran at least once."""
    events = [m.composed() for m in mechanisms if m.count > 0]
    if not events:
        return dp_event.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events)


def mechanism_fields(mechanism: Mechanism) -> dict:
    """A ledger line as plain JSON fields: enough to rebuild its DpEvent with dp_accounting
    alone (sampling probability, dataset size, truncation, effective noise multiplier, count;
    or the pure epsilon), plus the stage's details and the events themselves."""
    event = mechanism.event
    out = dict(name=mechanism.name, source=mechanism.source, schedule=mechanism.schedule,
               count=mechanism.count, event=event_to_json(event),
               composed_event=event_to_json(mechanism.composed()))
    if isinstance(event, PureDpEvent):
        out.update(kind="pure", epsilon_per_occurrence=event.epsilon,
                   epsilon_total=mechanism.composed().epsilon,
                   composition="basic composition into one pure-DP event")
    elif isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        out.update(kind="gaussian", sampling_probability=event.sampling_probability,
                   dataset_size=event.dataset_size,
                   truncated_batch_size=event.truncated_batch_size,
                   effective_noise_multiplier=event.noise_multiplier)
    elif isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
            event.event, dp_event.GaussianDpEvent):
        out.update(kind="gaussian", sampling_probability=event.sampling_probability,
                   dataset_size=None, truncated_batch_size=None,
                   effective_noise_multiplier=event.event.noise_multiplier)
    else:
        raise ValueError(f"no statement fields for {type(event).__name__}")
    for key, value in mechanism.details.items():
        out.setdefault(key, value)
    return out


def accountant_settings(budget: Budget) -> dict:
    """The accountant's own settings, machine-readable (for the privacy statement)."""
    if budget.accountant == "pld":
        return dict(value_discretization_interval=budget.pld_discretization)
    return dict(orders="dp_accounting RdpAccountant defaults")


def accounting_note(event: dp_event.DpEvent, budget: Budget) -> str:
    """How the accountant composes ``event``, in words (for the privacy statement)."""
    pure = ("; pure-DP events enter as the (epsilon, 0) dominating pair" if
            _contains_pure(event) else "")
    if budget.accountant == "pld":
        return (f"privacy loss distributions, value discretization "
                f"{budget.pld_discretization:g}{pure}")
    _, overflow = _rdp_view(event)
    note = "Renyi DP"
    if _contains_pure(event):
        note += "; pure epsilon-DP events enter as epsilon^2/2-zCDP"
    if overflow > 0:
        note += (f"; truncated Poisson accounted as Poisson, with the chance that any batch is "
                 f"truncated ({overflow:.3g}) times (1 + e^epsilon) charged to delta")
    return note


class BudgetError(ValueError):
    """A privacy budget or sampling setting that cannot be used; the message says what to change."""


@gin.configurable("budget")
@dataclasses.dataclass(frozen=True)
class Budget:
    """The run's target (epsilon, delta) and the accountant that must certify it."""

    epsilon: float = gin.REQUIRED
    delta: float = gin.REQUIRED
    accountant: str = "pld"
    pld_discretization: float = 1e-3

    def validate(self, dataset_size: int) -> None:
        """Raises BudgetError unless 0 < epsilon < inf, 0 < delta < 1/N and the accountant
        exists."""
        eps, delta = self.epsilon, self.delta
        if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise BudgetError(f"budget.epsilon must be a finite number > 0, got {eps!r}; "
                              "set e.g. --gin_bindings='EPSILON = 3.0'")
        if not isinstance(delta, (int, float)) or not 0 < delta < 1.0 / dataset_size:
            raise BudgetError(
                f"budget.delta must lie in (0, 1/N) = (0, {1.0 / dataset_size:.3g}) for the "
                f"N = {dataset_size} private training examples, got {delta!r}; "
                "set e.g. --gin_bindings='DELTA = 1e-5'")
        if self.accountant not in ACCOUNTANTS:
            raise BudgetError(f"budget.accountant must be one of {ACCOUNTANTS}, "
                              f"got {self.accountant!r}")
        if not 0 < self.pld_discretization <= 0.1:
            raise BudgetError(f"budget.pld_discretization must lie in (0, 0.1], "
                              f"got {self.pld_discretization!r}")


def accountant_version() -> str:
    return f"dp-accounting {importlib.metadata.version('dp-accounting')}"


def make_accountant(budget: Budget) -> dp_accounting.PrivacyAccountant:
    if budget.accountant == "pld":
        return pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=budget.pld_discretization)
    if budget.accountant == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    raise BudgetError(f"budget.accountant must be one of {ACCOUNTANTS}, got {budget.accountant!r}")


def _rdp_view(event: dp_event.DpEvent) -> tuple[dp_event.DpEvent, float]:
    """Returns (event with truncated-Poisson Gaussians replaced by Poisson ones, P[any truncation]).

    Truncated and plain Poisson sampling coincide unless some step's Poisson draw exceeds the
    truncation size, so on every dataset the two mechanisms are within total variation
    ``p = sum over steps of P[overflow]``. If the Poisson run is (eps, delta)-DP, the truncated one
    is (eps, delta + (1 + e^eps) p)-DP. The overflow probability is taken at N + 1 examples,
    which bounds it for both neighbours.
    """
    if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        overflow = scipy.stats.binom.sf(event.truncated_batch_size, event.dataset_size + 1,
                                        event.sampling_probability)
        return (dp_event.PoissonSampledDpEvent(event.sampling_probability,
                                               dp_event.GaussianDpEvent(event.noise_multiplier)),
                float(overflow))
    if isinstance(event, PureDpEvent):
        return dp_event.ZCDpEvent(event.epsilon ** 2 / 2), 0.0
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner, overflow = _rdp_view(event.event)
        return dp_event.SelfComposedDpEvent(inner, event.count), overflow * event.count
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [_rdp_view(e) for e in event.events]
        return dp_event.ComposedDpEvent([p[0] for p in parts]), sum(p[1] for p in parts)
    return event, 0.0


# epsilon_of's answers in this process, by everything they depend on. Why: a sweep's trials
# share their (q, steps) and so most of the accountant calls of their calibrations (the
# bracket's sigmas 1, 2, 0.5, ...), and a PLD call costs 0.1-0.5 s; the accountant is a pure
# function of these inputs, so a remembered answer is the one it would give again.
_EPSILONS: dict = {}
_EPSILONS_KEPT = 4096


def epsilon_of(event: dp_event.DpEvent, budget: Budget, delta: float | None = None) -> float:
    """The accountant's epsilon for ``event`` at ``delta`` (default: the budget's delta)."""
    delta = budget.delta if delta is None else delta
    key = (json.dumps(event_to_json(event), sort_keys=True, default=repr), float(delta),
           budget.accountant, budget.pld_discretization,
           budget.epsilon if budget.accountant == "rdp" else None)  # rdp's overflow term
    if key not in _EPSILONS:
        if len(_EPSILONS) >= _EPSILONS_KEPT:
            _EPSILONS.clear()
        _EPSILONS[key] = _epsilon_of(event, budget, delta)
    return _EPSILONS[key]


def _epsilon_of(event: dp_event.DpEvent, budget: Budget, delta: float) -> float:
    accountant = make_accountant(budget)
    if budget.accountant == "rdp":
        event, overflow = _rdp_view(event)
        # (1 + e^eps) * overflow must come out of delta; eps is at most the target here (the run
        # stops at its target), so e^target bounds it.
        delta = delta - (1.0 + math.exp(budget.epsilon)) * overflow
        if delta <= 0:
            raise BudgetError(
                "with accountant 'rdp' the chance that a truncated Poisson batch overflows uses "
                "up all of delta; raise sampler.overflow_stddevs or use budget.accountant='pld'")
    elif _contains_pure(event):
        return float(_pld_of(event, budget).get_epsilon_for_delta(delta))
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _contains_pure(event) -> bool:
    if isinstance(event, PureDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _contains_pure(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(_contains_pure(e) for e in event.events)
    return False


def _pld_of(event, budget: Budget):
    """The PLD of an event tree that holds PureDpEvents (the PLD accountant rejects them)."""
    vdi = budget.pld_discretization
    if isinstance(event, PureDpEvent):
        return pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(event.epsilon, 0.0),
            value_discretization_interval=vdi)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _pld_of(event.event, budget).self_compose(event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        plds = [_pld_of(e, budget) for e in event.events]
        out = plds[0]
        for other in plds[1:]:
            out = out.compose(other)
        return out
    if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        return pld_lib.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=event.dataset_size, sampling_probability=event.sampling_probability,
            truncated_batch_size=event.truncated_batch_size,
            noise_multiplier=event.noise_multiplier, value_discretization_interval=vdi)
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
            event.event, dp_event.GaussianDpEvent):
        return pld_lib.from_gaussian_mechanism(
            event.event.noise_multiplier, sampling_prob=event.sampling_probability,
            value_discretization_interval=vdi)
    if isinstance(event, dp_event.GaussianDpEvent):
        return pld_lib.from_gaussian_mechanism(event.noise_multiplier,
                                               value_discretization_interval=vdi)
    raise BudgetError(f"dpbench's PLD composition does not support {type(event).__name__}; "
                      "use budget.accountant='rdp'")


def _bracket(epsilon_at: Callable[[float], float], target: float) -> tuple[float, float]:
    """An interval [lo, hi] with epsilon(lo) > target >= epsilon(hi), found by doubling from 1.

    Small sigmas make the PLD very wide and slow, so the search walks outwards from sigma = 1
    instead of starting at the interval's ends.
    """
    lo_limit, hi_limit = SIGMA_BRACKET
    hi = 1.0
    while epsilon_at(hi) > target:
        if hi >= hi_limit:
            raise BudgetError(
                f"target epsilon {target} is unattainable: even noise multiplier {hi_limit} "
                f"gives epsilon {epsilon_at(hi_limit):.4g}; raise budget.epsilon, or lower the "
                "number of steps (train.epochs) or the sampling rate (train.batch_size)")
        hi = min(2 * hi, hi_limit)
    lo = hi / 2
    while epsilon_at(lo) <= target:
        if lo <= lo_limit:
            return lo, lo  # meets the target even at the smallest sigma searched
        hi, lo = lo, max(lo / 2, lo_limit)
    return lo, hi


def calibrate_noise_multiplier(make_event: Callable[[float], dp_event.DpEvent],
                               budget: Budget) -> float:
    """The smallest sigma (to SIGMA_TOLERANCE) whose event meets (budget.epsilon, budget.delta).

    Brent's method (scipy) on the accountant's epsilon, in a bracket found by doubling; the
    result is re-checked: the accountant's epsilon at the returned sigma is <= the target
    (never overshoots). Raises BudgetError when even sigma = SIGMA_BRACKET[1] cannot meet the
    target.
    """
    cache = {}

    def epsilon_at(sigma: float) -> float:
        if sigma not in cache:
            cache[sigma] = epsilon_of(make_event(sigma), budget)
        return cache[sigma]

    lo, hi = _bracket(epsilon_at, budget.epsilon)
    if lo == hi:
        sigma = hi
    else:
        # Brent's method on epsilon(sigma) - target (monotone in sigma) needs about 8
        # accountant calls where bisection (dp_accounting.calibrate_dp_mechanism) needed 13-21:
        # 3.7 s -> see leaderboard/PERF.md for PLD on the DP-SGD run. Then the root is rounded
        # UP onto the tolerance, and stepped up until the accountant confirms the target.
        root = scipy.optimize.brentq(lambda x: epsilon_at(x) - budget.epsilon, lo, hi,
                                     xtol=SIGMA_TOLERANCE / 4, rtol=1e-12)
        sigma = min(root + SIGMA_TOLERANCE / 2, hi)
        while epsilon_at(sigma) > budget.epsilon:
            sigma = min(sigma + SIGMA_TOLERANCE / 2, hi)
    if epsilon_at(sigma) > budget.epsilon:  # must never happen; a guard, not a fallback
        raise AssertionError(f"calibration overshot the target epsilon at sigma={sigma}")
    return float(sigma)


def event_to_json(event: dp_event.DpEvent):
    """A DpEvent as plain JSON (class name plus fields), for the ledger in checkpoints and
    records: anyone can rebuild the composed event and recompute epsilon from it."""
    if isinstance(event, dp_event.DpEvent):
        fields = {f.name: event_to_json(getattr(event, f.name))
                  for f in attr.fields(type(event))}
        return {"class": type(event).__name__, **fields}
    if isinstance(event, (list, tuple)):
        return [event_to_json(e) for e in event]
    return event


def event_from_json(obj):
    """Inverse of :func:`event_to_json`: rebuilds the DpEvent a ledger or record holds."""
    if isinstance(obj, list):
        return [event_from_json(o) for o in obj]
    if isinstance(obj, dict) and "class" in obj:
        name = obj["class"]
        cls = PureDpEvent if name == "PureDpEvent" else getattr(dp_event, name, None)
        if cls is None:
            raise ValueError(f"unknown DpEvent class {name!r} in a ledger")
        return cls(**{k: event_from_json(v) for k, v in obj.items() if k != "class"})
    return obj
