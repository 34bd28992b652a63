"""noise.banded (BandMF): the noise it streams is C^-1 z, the strategy it declares is the one
it runs (the check recovers it), its privacy holds exactly for the sampler it is proven for and
fails for a broken one, and one band is DP-SGD bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from dpbench import config, sampling, stages
from dpbench import run as run_lib
from dpbench.compiler import check, check_correlation
from dpbench.ops import add_gaussian_noise, gaussian_noise
from dpbench.stages.base import StepContext
from tests.conftest import made
from tests.test_pipelines import golden_run
from tests.test_sampling import _RedrawnEachEpochSampler
from tests.stages.test_strategy import toeplitz


def noise_stream(fns, steps, stddev, size, seed):
    """The noise the stage adds at each of ``steps`` steps to a zero value of ``size``
    coordinates: [steps, size] (float64)."""
    value = {"w": jnp.zeros((size,), jnp.float32)}
    state = fns.init(value, jax.random.key(0))
    apply = jax.jit(lambda value, state, step, key: fns.apply(value, state, StepContext(
        params=None, step=step, key=key, noise_stddev=stddev)))  # stddev: a compile-time float
    out = []
    for t in range(steps):
        noisy, state = apply(value, state, jnp.asarray(t),
                             jax.random.fold_in(jax.random.key(seed), t))
        out.append(np.asarray(noisy["w"], np.float64))
    return np.stack(out)


def whitened_p_value(stream, coefficients, stddev) -> float:
    """The smallest Bonferroni-adjusted p of the hypothesis that C w / stddev is i.i.d.
    N(0, 1) over steps (C the coefficients' Toeplitz matrix), i.e. that the stream's
    covariance is stddev^2 C^-1 C^-T: per step an exact chi-square test of its variance, per
    pair of steps an exact Student t test of their correlation."""
    steps, size = stream.shape
    z = toeplitz(np.asarray(coefficients), steps) @ stream / stddev
    tests = []
    for t in range(steps):
        chi2 = float(np.sum(z[t] ** 2))
        tests.append(2 * min(scipy.stats.chi2.cdf(chi2, size), scipy.stats.chi2.sf(chi2, size)))
        for s in range(t):
            r = np.corrcoef(z[t], z[s])[0, 1]
            tests.append(2 * scipy.stats.t.sf(abs(r) * np.sqrt((size - 2) / (1 - r * r)),
                                              size - 2))
    return min(1.0, min(tests) * len(tests))


class _FreshDrawsAtTheCorrelatedScale:
    """The broken twin: each step's noise drawn fresh, with the stage's own per-step variance
    (the diagonal of C^-1 C^-T), so its marginals are right and its correlation is gone."""

    def __init__(self, fns, coefficients, steps):
        inverse = np.linalg.inv(toeplitz(np.asarray(coefficients), steps))
        self.scales = np.sqrt(np.sum(inverse ** 2, axis=1))
        self.fns = fns

    def init(self, value, key):
        return {"t": jnp.zeros((), jnp.int32)}

    def apply(self, value, state, ctx):
        scale = jnp.asarray(self.scales, jnp.float32)[state["t"]]
        fresh = jax.tree.map(lambda v: v + scale * ctx.noise_stddev * jax.random.normal(
            ctx.key, v.shape, v.dtype), value)
        return fresh, {"t": state["t"] + 1}


@pytest.mark.parametrize("bands", [2, 4])
def test_the_streamed_noise_has_covariance_sigma2_c_inverse_c_inverse_transposed(bands):
    """Exact tests of every variance and correlation of the whitened stream (Bonferroni over
    them): false failures <= 1e-5 per run. The twin with fresh draws at the correlated scale
    (right marginals, no correlation) is rejected far below that."""
    rng = np.random.default_rng()
    steps, size, stddev = 3 * bands + 1, 40_000, rng.uniform(0.5, 2.0)
    fns = made(stages.noise.banded(bands=bands), total_steps=steps)
    coefficients = fns.derived["strategy_coefficients"]
    seed = int(rng.integers(1 << 30))
    assert whitened_p_value(noise_stream(fns, steps, stddev, size, seed), coefficients,
                            stddev) > 1e-5
    twin = _FreshDrawsAtTheCorrelatedScale(fns, coefficients, steps)
    assert whitened_p_value(noise_stream(twin, steps, stddev, size, seed), coefficients,
                            stddev) < 1e-8


def test_the_check_recovers_the_declared_strategy_from_the_stage_s_own_filter():
    """Unit impulses through Hooks.correlate give C^-1: inverted, it is the Toeplitz matrix of
    the derived coefficients, lower triangular, 4 bands, largest column norm 1 (the
    sensitivity the ledger charges: one participation moves C x by at most the clip bound)."""
    steps = 14
    fns = made(stages.noise.banded(bands=4), total_steps=steps)
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros((5,))}
    strategy = check_correlation.strategy_of(fns.hooks.correlate,
                                             fns.init(params, jax.random.key(0)), params, steps)
    np.testing.assert_allclose(strategy, toeplitz(fns.derived["strategy_coefficients"], steps),
                               atol=1e-5)
    norms = np.linalg.norm(strategy, axis=0)
    assert norms.max() == pytest.approx(1.0, abs=1e-5)
    assert check_correlation.problems(strategy, 4) == []
    assert check_correlation.problems(strategy, 3)  # one band too few declared: caught


def _twin(bands, name, coefficients=None, correlate=None, apply=None, declared=None):
    """noise.banded with one thing changed: its filter's coefficients, its filter, its apply,
    or the bands it declares (``declared``)."""
    honest = stages.noise.banded(bands=bands)
    if declared is not None:
        honest = dataclasses.replace(honest, privacy=honest.privacy._replace(
            correlation=honest.privacy.correlation._replace(bands=declared)))

    def make(facts):
        fns = honest.make(facts)
        if coefficients is not None:
            filter_ = stages.noise._correlate_fn(coefficients(fns.derived))
            fns = fns._replace(hooks=fns.hooks._replace(correlate=filter_))
            fns = fns._replace(apply=lambda v, s, ctx: _adds(filter_, v, s, ctx))
        if correlate is not None:
            fns = fns._replace(hooks=fns.hooks._replace(correlate=correlate(fns)))
        if apply is not None:
            fns = fns._replace(apply=apply(fns))
        return fns

    return dataclasses.replace(honest, name=name, make=make)


def _adds(filter_, value, state, ctx):
    noise, state = filter_(gaussian_noise(value, ctx.key, ctx.noise_stddev), state)
    return jax.tree.map(jnp.add, value, noise), state


def test_dpbench_check_refuses_a_strategy_or_a_filter_other_than_declared():
    """Each lie fails the 'correlation' check, naming it: one band more than declared, columns
    of norm 1.1, an apply that adds fresh noise instead of its filter's; a filter that keeps
    the released value (not only noise) in its state fails the 'state' check."""
    assert check.verify_stage(stages.noise.banded(bands=3))[-1] == "correlation"
    lies = {
        "more than the declared 2 band": _twin(3, "broken.three_bands", declared=2),
        "has L2 norm 1.1": _twin(3, "broken.unnormalized", coefficients=lambda d: tuple(
            1.1 * c for c in d["strategy_coefficients"])),
        "does not add its own filter": _twin(3, "broken.fresh", apply=lambda fns: (
            lambda v, s, ctx: (add_gaussian_noise(v, ctx.key, ctx.noise_stddev), s))),
    }
    for message, twin in lies.items():
        with pytest.raises(check.StageCheckError, match=message):
            check.verify_stage(twin)

    def keeps_the_value(fns):
        def apply(value, state, ctx):
            noisy, state = fns.apply(value, state, ctx)
            return noisy, {"noise": jax.tree.map(lambda b, v: b.at[0].set(v), state["noise"],
                                                 noisy)}
        return apply

    peeking = _twin(3, "broken.peek", apply=keeps_the_value)
    with pytest.raises(check.StageCheckError, match="'state' check"):
        check.check_state(check.harness_for(peeking))


def participation_patterns(sampler, n, steps) -> np.ndarray:
    """Every example's participations as a 0/1 vector over the steps: [n, steps]."""
    out = np.zeros((n, steps))
    for t in range(steps):
        b = sampler.sample(t)
        out[b.indices[b.mask], t] = 1
    return out


def test_the_release_is_as_private_as_the_ledger_says_on_its_sampler_and_not_on_a_broken_one():
    """The guarantee itself, on the stage's own strategy (recovered from its filter): whitened,
    the release is a Gaussian mechanism whose shift for an example that participates at the
    steps x is ||C x|| (in units of sigma * sensitivity). On cyclic Poisson over b parts
    every example's pattern gives ||C x||^2 <= |x|: no more than the |x| independent
    Gaussian steps the ledger composes. On the twin that redraws the partition each cycle,
    some example takes two adjacent steps and ||C x||^2 exceeds |x|: the ledger would be
    wrong, and this test says so."""
    bands, n, steps = 4, 400, 40
    fns = made(stages.noise.banded(bands=bands), total_steps=steps)
    params = {"w": jnp.zeros((2,))}
    strategy = check_correlation.strategy_of(fns.hooks.correlate,
                                             fns.init(params, jax.random.key(0)), params, steps)
    seed = int(np.random.default_rng().integers(1 << 30))

    def excess(sampler):
        x = participation_patterns(sampler, n, steps)
        shift2 = np.sum((x @ strategy.T) ** 2, axis=1)
        return float(np.max(shift2 - x.sum(axis=1)))

    assert excess(sampling.CyclicPoissonSampler(n, 50, seed=seed, parts=bands)) <= 1e-4
    assert excess(_RedrawnEachEpochSampler(n, 50, seed=seed, parts=bands)) > 0.5


def test_one_band_trains_dpsgd_bit_for_bit(tmp_path):
    """pipelines/bandmf with BANDS = 1 (cyclic Poisson over one part, noise.banded with one
    band) is pipelines/dpsgd on digits: the same sigma, epsilon and final parameters, to the
    bit."""
    records = {}
    for pipeline, extra in (("dpsgd", []), ("bandmf", ["BANDS = 1"])):
        files, bindings = golden_run(pipeline)
        config.parse_config(files, bindings + extra)
        records[pipeline] = run_lib.train(tmp_path / pipeline, gin_files=files)
    dpsgd, bandmf = records["dpsgd"], records["bandmf"]
    for key in ("noise_multiplier", "epsilon", "steps", "final_params_sha256"):
        assert dpsgd[key] == bandmf[key], key
    assert dpsgd["final_params_sha256"] is not None
    assert bandmf["per_example_strategy"] == "bookkeeping"  # the release does not change it
