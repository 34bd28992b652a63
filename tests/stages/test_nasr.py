import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from dpbench import compiler, stages
from dpbench.stages import nasr


def test_ternary_discretization():
    x = jnp.asarray([-0.5, -0.001, 0.0, 0.0005, 0.002])
    np.testing.assert_array_equal(nasr.ternary(x, 0.001), [-1, 0, 0, 0, 1])


def test_map_decision_is_the_closest_hypothesis_and_matches_explicit_posteriors():
    rng = np.random.default_rng()
    nu, scale = 0.3, float(rng.uniform(0.2, 2.0))
    y = jnp.asarray(rng.normal(size=5000) * 0.5)
    got = np.asarray(jax.jit(lambda v: nasr.bayes_correct(v, nu, scale))(y))
    # explicit Bayes with equal priors and the documented Gaussian likelihoods
    lik = np.stack([scipy.stats.norm.pdf(np.asarray(y), loc=c, scale=scale)
                    for c in (-nu, 0.0, nu)])
    want = np.array([-nu, 0.0, nu])[np.argmax(lik, axis=0)]
    np.testing.assert_allclose(got, want, atol=1e-7)
    np.testing.assert_allclose(got, np.where(y > nu / 2, nu, np.where(y < -nu / 2, -nu, 0)),
                               atol=1e-7)


def test_denoiser_only_accepts_released_values():
    before_noise = [stages.grad.per_example(), stages.nasr.discretize(),
                    stages.clip.global_l2(1.0), stages.nasr.nasr_bayes(),
                    stages.noise.gaussian(), stages.optimize.optax_optimizer()]
    with pytest.raises(compiler.PipelineError, match="'denoise.nasr_bayes'"):
        compiler.validate_pipeline(before_noise)
    after_noise = [stages.grad.per_example(), stages.nasr.discretize(),
                   stages.clip.global_l2(1.0), stages.noise.gaussian(),
                   stages.nasr.nasr_bayes(), stages.optimize.optax_optimizer()]
    compiler.validate_pipeline(after_noise)
    assert stages.nasr.nasr_bayes().kind_in == stages.Kind.RELEASED


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="nu"):
        stages.nasr.nasr_bayes(nu=0.0)
    with pytest.raises(ValueError, match="threshold"):
        stages.nasr.discretize(threshold=-1.0)
