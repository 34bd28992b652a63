import json
import math

import numpy as np
import pytest
import scipy.stats
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

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


def _small_overflow_case(padded=164):
    """A truncated sampler whose overflow is rare but costs a good part of delta = 1e-5 over
    100 steps: P[a step's batch > 164], at N + 1 examples (the neighbour), is 1.4e-9."""
    n, b, steps = 10_000, 100, 100
    sampler = sampling.PoissonSampler(n, b, seed=0, padded_batch_size=padded)
    assert sampler.truncated
    overflow = steps * scipy.stats.binom.sf(padded, n + 1, b / n)  # union bound over steps
    poisson = dp_event.PoissonSampledDpEvent(b / n, dp_event.GaussianDpEvent(1.0))
    return _run_event(sampler, steps)(1.0), poisson, steps, overflow


def test_rdp_charges_exactly_the_truncation_overflow_to_delta():
    """RDP accounts a truncated run as the Poisson one and takes (1 + e^eps) x sum over steps
    of P[overflow] out of delta: the epsilon equals dp_accounting's RDP epsilon of the Poisson
    run at that smaller delta (a charge without the step count or the e^eps factor would not)."""
    event, poisson, steps, overflow = _small_overflow_case()
    charged = 1e-5 - (1 + math.exp(3.0)) * overflow
    assert 0.2e-5 < 1e-5 - charged < 0.5e-5  # the charge matters here
    got = accounting.epsilon_of(event, accounting.Budget(3.0, 1e-5, "rdp"))
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(poisson, steps)
    assert got == pytest.approx(rdp.get_epsilon(charged), rel=1e-9)
    assert got > rdp.get_epsilon(1e-5) * 1.001


def test_the_search_epsilon_charges_every_runs_overflow_to_delta():
    """The search (trial 0 plus J ~ geometric(mean 3) trials of the same truncated run): its
    RDP is dp_accounting's repeat-and-select of the Poisson run, and (1 + 3) expected runs'
    overflow, times (1 + e^(eps + 1)), comes out of delta."""
    from dpbench.search import tuning
    event, poisson, steps, overflow = _small_overflow_case(padded=168)  # 1.7e-10 a step
    got = tuning.search_epsilon(event, [event], mean_random=3.0, shape=1.0, delta=1e-5)
    orders = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)
    run = rdp_privacy_accountant.RdpAccountant(list(orders))
    run.compose(poisson, steps)
    curve = np.asarray(run._rdp)
    search = curve + np.asarray(rdp_privacy_accountant._compute_rdp_repeat_and_select(
        orders, curve, 3.0, 1.0))
    uncharged = rdp_privacy_accountant.compute_epsilon(orders, search, 1e-5)[0]
    charged = 1e-5 - (1 + math.exp(uncharged + 1)) * (1 + 3.0) * overflow
    assert 0.1e-5 < 1e-5 - charged < 0.6e-5  # the charge matters here
    assert got == pytest.approx(rdp_privacy_accountant.compute_epsilon(orders, search,
                                                                      charged)[0], rel=1e-9)
    assert got > uncharged * 1.001


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


@pytest.mark.parametrize("truncated", [False, True])
def test_a_gaussian_lines_statement_fields_rebuild_its_own_epsilon(truncated):
    """The statement's machine-readable fields of a sampled Gaussian ledger line (plain or
    truncated Poisson) rebuild, with dp_accounting's own constructors alone, exactly the
    epsilon of the line's composed event: a field off (the effective noise multiplier 10%
    high, say) fails here, for either sampler."""
    from dp_accounting.pld import pld_privacy_accountant
    rng = np.random.default_rng()
    n, q = 5000, float(rng.uniform(0.01, 0.05))
    sigma, steps = float(rng.uniform(0.8, 1.5)), int(rng.integers(50, 200))
    event = (dp_event.TruncatedSubsampledGaussianDpEvent(n, q, int(q * n + 6 * math.sqrt(q * n)),
                                                         sigma) if truncated else
             dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
    line = accounting.Mechanism("Gaussian release of the clipped gradient sum",
                                "clip.global_l2 + noise.gaussian", accounting.EVERY_STEP,
                                event, steps)
    fields = accounting.mechanism_fields(line)
    assert fields["effective_noise_multiplier"] == sigma and fields["count"] == steps
    if fields["truncated_batch_size"] is None:
        rebuilt = dp_event.PoissonSampledDpEvent(
            fields["sampling_probability"],
            dp_event.GaussianDpEvent(fields["effective_noise_multiplier"]))
    else:
        rebuilt = dp_event.TruncatedSubsampledGaussianDpEvent(
            fields["dataset_size"], fields["sampling_probability"],
            fields["truncated_batch_size"], fields["effective_noise_multiplier"])
    by_fields, by_ledger = (pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
                           for _ in range(2))
    by_fields.compose(rebuilt, fields["count"])
    by_ledger.compose(line.composed())
    assert by_fields.get_epsilon(1e-5) == pytest.approx(by_ledger.get_epsilon(1e-5), rel=1e-9)


def test_a_remembered_epsilon_is_the_accountants_answer_for_every_input_it_depends_on():
    """epsilon_of remembers answers in-process (a sweep's calibrations share most of their
    accountant calls): each variation of the event, delta, accountant, PLD discretization and
    (rdp: the target, which sizes the overflow term) gets the accountant's own fresh answer,
    asked a second time the same one, and never another variation's."""
    rng = np.random.default_rng()
    sigma, q = rng.uniform(0.8, 2.0), rng.uniform(0.005, 0.05)
    steps = int(rng.integers(50, 200))
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
        q, dp_event.GaussianDpEvent(sigma)), steps)
    # truncated 7 standard deviations over its mean: an overflow small enough for delta,
    # large enough that the target's share of it moves epsilon
    truncated = dp_event.SelfComposedDpEvent(dp_event.TruncatedSubsampledGaussianDpEvent(
        60000, q, int(q * 60000 + 7 * math.sqrt(q * 60000)), sigma), steps)
    base = accounting.Budget(epsilon=3.0, delta=1e-5)
    cases = [(event, base, None), (event, base, 1e-6),
             (dp_event.SelfComposedDpEvent(event.event, steps + 1), base, None),
             (event, accounting.Budget(3.0, 1e-5, accountant="rdp"), None),
             (event, accounting.Budget(3.0, 1e-5, pld_discretization=2e-3), None),
             (truncated, accounting.Budget(3.0, 1e-5, accountant="rdp"), None),
             (truncated, accounting.Budget(8.0, 1e-5, accountant="rdp"), None)]
    fresh = [accounting._epsilon_of(e, b, b.delta if d is None else d) for e, b, d in cases]
    assert len(set(fresh)) == len(fresh), fresh  # every input matters somewhere
    for _ in range(2):
        assert [accounting.epsilon_of(e, b, d) for e, b, d in cases] == fresh
