import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event

from dpbench import accounting, sampling


def _run_event(sampler, steps):
    return lambda sigma: dp_event.SelfComposedDpEvent(sampler.dp_event(sigma), steps)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrated_epsilon_is_at_most_the_target_and_within_1e_3(accountant):
    rng = np.random.default_rng()
    target = float(rng.uniform(1.0, 8.0))
    budget = accounting.Budget(epsilon=target, delta=1e-5, accountant=accountant)
    sampler = sampling.PoissonSampler(60_000, 256, seed=0)
    make = _run_event(sampler, 1000)
    sigma = accounting.calibrate_noise_multiplier(make, budget)
    eps = accounting.epsilon_of(make(sigma), budget)
    assert eps <= target
    assert target - eps < 1e-3
    # and a slightly smaller sigma would overshoot: the calibration is not just conservative
    assert accounting.epsilon_of(make(sigma * 0.99), budget) > target


def test_pld_is_no_looser_than_rdp():
    sampler = sampling.PoissonSampler(60_000, 256, seed=0)
    event = _run_event(sampler, 2000)(1.1)
    pld = accounting.epsilon_of(event, accounting.Budget(3.0, 1e-5, "pld"))
    rdp = accounting.epsilon_of(event, accounting.Budget(3.0, 1e-5, "rdp"))
    assert pld <= rdp


def test_unattainable_target_raises_with_what_to_change():
    budget = accounting.Budget(epsilon=1e-6, delta=1e-10)
    sampler = sampling.PoissonSampler(100, 100, seed=0)
    with pytest.raises(accounting.BudgetError, match="unattainable"):
        accounting.calibrate_noise_multiplier(_run_event(sampler, 10_000), budget)


@pytest.mark.parametrize("eps,delta,match", [
    (0.0, 1e-5, "epsilon"), (-1.0, 1e-5, "epsilon"), (math.inf, 1e-5, "epsilon"),
    (math.nan, 1e-5, "epsilon"), (3.0, 0.0, "delta"), (3.0, 1e-3, "delta"),
    (3.0, -1e-5, "delta")])
def test_bad_budgets_are_rejected(eps, delta, match):
    with pytest.raises(accounting.BudgetError, match=match):
        accounting.Budget(eps, delta).validate(dataset_size=55_000)


def test_good_budget_passes_and_unknown_accountant_fails():
    accounting.Budget(3.0, 1e-5).validate(55_000)
    with pytest.raises(accounting.BudgetError, match="accountant"):
        accounting.Budget(3.0, 1e-5, accountant="moments").validate(55_000)


def test_rdp_charges_truncation_overflow_to_delta():
    # A padded size barely above the mean overflows often; RDP must pay for it in delta.
    tight = sampling.PoissonSampler(10_000, 100, seed=0, padded_batch_size=110)
    loose = sampling.PoissonSampler(10_000, 100, seed=0, padded_batch_size=10_000)
    budget = accounting.Budget(3.0, 1e-5, "rdp")
    with pytest.raises(accounting.BudgetError, match="overflow"):
        accounting.epsilon_of(_run_event(tight, 100)(2.0), budget)
    assert accounting.epsilon_of(_run_event(loose, 100)(2.0), budget) > 0


def test_dpbench_pld_composition_agrees_with_the_accountant_on_gaussian_events():
    sampler = sampling.PoissonSampler(60_000, 256, seed=0)
    budget = accounting.Budget(3.0, 1e-5)
    event = _run_event(sampler, 500)(1.0)
    via_accountant = accounting.epsilon_of(event, budget)
    via_walker = float(accounting._pld_of(event, budget).get_epsilon_for_delta(1e-5))
    assert via_walker == pytest.approx(via_accountant, rel=1e-9)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_pure_dp_events_compose_soundly_and_not_looser_than_basic_composition(accountant):
    budget = accounting.Budget(3.0, 1e-5, accountant)
    pure = dp_event.SelfComposedDpEvent(accounting.PureDpEvent(0.01), 100)
    eps = accounting.epsilon_of(pure, budget)
    assert eps <= 100 * 0.01 + 1e-9        # never looser than basic composition
    assert eps > 0.1                         # and not free (advanced composition scale)
    one = accounting.epsilon_of(accounting.PureDpEvent(0.5), budget)
    assert one == pytest.approx(0.5, abs=0.01) if accountant == "pld" else one >= 0.5


def test_ledger_json_round_trips_to_the_same_epsilon():
    budget = accounting.Budget(epsilon=3.0, delta=1e-5)
    event = dp_event.ComposedDpEvent([
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)),
        dp_event.SelfComposedDpEvent(dp_event.TruncatedSubsampledGaussianDpEvent(
            dataset_size=60000, sampling_probability=0.01, truncated_batch_size=700,
            noise_multiplier=1.1), 300),
        accounting.PureDpEvent(0.03)])
    rebuilt = accounting.event_from_json(json.loads(json.dumps(accounting.event_to_json(event))))
    assert rebuilt == event
    assert accounting.epsilon_of(rebuilt, budget) == accounting.epsilon_of(event, budget)
