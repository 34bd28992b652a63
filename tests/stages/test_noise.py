import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from dpbench import stages
from dpbench.stages.base import StepContext
from tests.conftest import made


def std_test_pvalue(samples, stddev):
    """Two-sided chi-square test of H0: samples ~ N(0, stddev^2) i.i.d."""
    n = samples.size
    stat = float(np.sum(np.square(samples.astype(np.float64)))) / stddev ** 2
    cdf = scipy.stats.chi2.cdf(stat, n)
    return 2 * min(cdf, 1 - cdf)


def _release(sigma, l2_bound, key):
    stage = stages.noise.gaussian()
    zeros = {"a": jnp.zeros((300, 300)), "b": jnp.zeros((20000,))}
    ctx = StepContext(params=None, step=jnp.zeros((), jnp.int32), key=key,
                      noise_stddev=sigma * l2_bound)
    out, _ = jax.jit(lambda v: made(stage).apply(v, (), ctx))(zeros)
    return out


def test_noise_stddev_is_sigma_times_sensitivity_and_rejects_5_percent_error():
    rng = np.random.default_rng()
    sigma, l2_bound = rng.uniform(0.5, 3), rng.uniform(0.1, 2)
    out = _release(sigma, l2_bound, jax.random.key(int(rng.integers(1 << 30))))
    samples = np.concatenate([np.ravel(v) for v in jax.tree.leaves(out)])
    # an exact chi-square test: false failures are the threshold, 1e-5 (at 1e-4 it sat on the
    # limit, with no room for float32 sampling); the 0.95x / 1.05x twins sit > 20 sds off
    assert std_test_pvalue(samples, sigma * l2_bound) > 1e-5
    assert std_test_pvalue(samples, 0.95 * sigma * l2_bound) < 1e-6
    assert std_test_pvalue(samples, 1.05 * sigma * l2_bound) < 1e-6


def test_every_leaf_gets_independent_noise():
    out = _release(1.0, 1.0, jax.random.key(0))
    a = np.ravel(out["a"])[:20000]
    b = np.ravel(out["b"])
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.04
    assert not np.allclose(a, b)


def test_noise_is_fresh_for_a_different_key():
    one = _release(1.0, 1.0, jax.random.key(0))["b"]
    two = _release(1.0, 1.0, jax.random.key(1))["b"]
    assert abs(np.corrcoef(one, two)[0, 1]) < 0.04
