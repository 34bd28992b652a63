"""The compiler's accounting of a release whose noise has memory (compiler/ledger.py): from
its declaration, on the sampler it is proven for, it is DP-SGD's event over the sampler's
participations, and on any other sampler it is refused."""

import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
from dp_accounting.pld import pld_privacy_accountant

from dpbench import accounting, compiler, stages
from tests.conftest import compile_small


def bandmf(bands):
    return [stages.grad.per_example(), stages.clip.global_l2(1.0),
            stages.noise.banded(bands=bands), stages.optimize.optax_optimizer(optimizer="sgd")]


@pytest.mark.parametrize("bands", [2, 3, 4])
def test_banded_noise_is_accounted_as_dpsgd_at_the_parts_rate_over_ceil_steps_over_b(bands):
    """Calibrated to eps 3, the run's event is the sampler's one-participation event composed
    ceil(T / b) times, and dp_accounting's own PLD accountant, given DP-SGD's event at rate
    p = B b / N and the same sigma for ceil(T / b) steps, confirms the run's epsilon."""
    steps = int(np.random.default_rng().integers(9, 30))
    compiled, _, _ = compile_small(bandmf(bands), n=96, batch_size=8, total_steps=steps,
                                   parts=bands)
    sampler, sigma = compiled.sampler, compiled.noise_multiplier
    participations = -(-steps // bands)
    (line,) = compiled.ledger()
    assert line.count == participations and line.schedule == accounting.EVERY_PARTICIPATION
    assert line.event == sampler.dp_event(sigma)
    assert sampler.sampling_rate == pytest.approx(8 * bands / 96)
    dpsgd = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    dpsgd.compose(sampler.dp_event(sigma), participations)
    assert compiled.epsilon_after(steps) == pytest.approx(dpsgd.get_epsilon(1e-5), rel=1e-9)
    assert compiled.epsilon_after(steps) <= 3.0
    # mid-band: the first step already counts one participation, the next b - 1 add none
    assert compiled.epsilon_after(1) == compiled.epsilon_after(bands) < compiled.epsilon_after(
        bands + 1)


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of a Gaussian mechanism with shift mu (Balle & Wang 2018):
    delta(eps) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)."""
    def gap(eps):
        return (scipy.stats.norm.cdf(-eps / mu + mu / 2)
                - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2) - delta)
    return scipy.optimize.brentq(gap, 0.0, 100.0)


def test_a_hand_computed_value():
    """Rate 1 (each step takes its whole part) and a given sigma: no amplification, so the run
    is ceil(T / b) Gaussian mechanisms of shift 1 / sigma, i.e. one of shift
    sqrt(ceil(T / b)) / sigma, whose exact epsilon is Balle & Wang's. The PLD accountant is
    within its discretization (1e-3 per composition, pessimistic) above it; DP-SGD's own
    accounting of T steps is far above."""
    bands, steps, sigma = 4, 22, 3.0
    compiled, _, _ = compile_small(bandmf(bands), n=64, batch_size=16, total_steps=steps,
                                   parts=bands, noise_multiplier=sigma,
                                   budget=accounting.Budget(epsilon=10.0, delta=1e-5))
    assert compiled.sampler.sampling_rate == 1.0 and not compiled.sampler.truncated
    exact = _gaussian_epsilon(math.sqrt(math.ceil(steps / bands)) / sigma, 1e-5)
    assert exact == pytest.approx(3.46682, abs=1e-5)  # mu = sqrt(6) / 3 (PLD at 1e-5: 3.466823)
    got = compiled.epsilon_after(steps)
    assert exact <= got <= exact + 0.01
    assert _gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5) > got + 3


@pytest.mark.parametrize("sampler_parts,shuffled", [(1, False), (2, False), (8, False),
                                                    (1, True)])
def test_banded_noise_on_a_sampler_it_is_not_proven_for_is_refused(sampler_parts, shuffled):
    """4 bands need cyclic Poisson over exactly 4 parts: plain Poisson, 2 or 8 parts and
    shuffled batches are refused at compile time, the error naming the stage, the sampler and
    what to bind. With the right sampler it compiles; one band runs on any Poisson sampler."""
    from dpbench import sampling
    sampler = sampling.ShuffleSampler(128, 8, seed=0, pad_multiple=8) if shuffled else None
    with pytest.raises(compiler.PipelineError, match=r"noise.banded.*bind sampler.parts = 4"):
        compile_small(bandmf(4), n=128, batch_size=8, parts=sampler_parts, sampler=sampler)


def test_the_right_sampler_compiles_and_one_band_needs_none():
    compile_small(bandmf(4), n=128, batch_size=8, parts=4)
    compiled, _, _ = compile_small(bandmf(1), n=128, batch_size=8)
    (line,) = compiled.ledger()
    assert line.schedule == accounting.EVERY_STEP and line.count == compiled.total_steps


def test_the_statement_names_the_mechanism_the_sampler_the_bands_and_the_equivalence():
    from dpbench import records
    compiled, _, _ = compile_small(bandmf(3), n=96, batch_size=8, total_steps=12, parts=3)
    fields = [accounting.mechanism_fields(m) for m in compiled.ledger()]
    (line,) = fields
    assert line["correlated_noise"]["bands"] == 3 and line["sampler_parts"] == 3
    assert len(line["correlated_noise"]["strategy_coefficients"]) == 3
    text = records.privacy_statement(
        epsilon=1.0, delta=1e-5, mechanisms=fields, sampler=compiled.sampler.describe(),
        steps=12, accountant="pld", accountant_version="x", accountant_settings={},
        accounting_note="", not_covered=[])["statement"]
    for words in ("4 times per example", "cyclic Poisson sampling over 3 parts",
                  "3-banded lower-triangular Toeplitz strategy", "Amplified",
                  "ceil(steps / b) steps", "rate q = 0.25"):
        assert words in text, words


def test_one_band_states_no_correlation():
    compiled, _, _ = compile_small(bandmf(1), n=128, batch_size=8)
    (line,) = [accounting.mechanism_fields(m) for m in compiled.ledger()]
    assert "correlated_noise" not in line and "sampler_parts" not in line
