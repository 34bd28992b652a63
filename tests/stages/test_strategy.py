"""The banded strategy (dpbench/stages/strategy.py): its loss is the dense matrices' error, its
columns are normalized, and more bands never add error on the workload it is optimized for."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from dpbench.stages import strategy


def toeplitz(coefficients, n):
    column = np.zeros(n)
    column[:min(len(coefficients), n)] = coefficients[:n]
    return scipy.linalg.toeplitz(column, np.zeros(n))


def workload(n, kind, momentum):
    lags = np.subtract.outer(np.arange(n), np.arange(n))
    if kind == "prefix":
        return (lags >= 0).astype(float)
    return np.where(lags >= 0, (1 - momentum ** (lags + 1)) / (1 - momentum), 0.0)


@pytest.mark.parametrize("kind", strategy.WORKLOADS)
def test_the_loss_is_the_dense_workload_error_times_the_sensitivity(kind):
    """O(n b) loss == ||A C^-1||_F^2 * (largest column norm of C)^2 from the dense n x n
    matrices, for random coefficients; C^-1's coefficients are the dense inverse's column."""
    rng = np.random.default_rng()
    n, bands, momentum = int(rng.integers(8, 30)), int(rng.integers(2, 6)), rng.uniform(0, 0.95)
    c = np.concatenate([[1.0], rng.uniform(-0.4, 0.4, bands - 1)])  # c_0 dominant: C^-1 stable
    dense_c = toeplitz(c, n)
    inverse = np.linalg.inv(dense_c)
    np.testing.assert_allclose(np.asarray(strategy.inverse_coefficients(
        jnp.asarray(c, jnp.float32), n)), inverse[:, 0], rtol=1e-4, atol=1e-5)
    want = np.sum((workload(n, kind, momentum) @ inverse) ** 2) * np.max(
        np.sum(dense_c ** 2, axis=0))
    got = float(strategy.loss(jnp.asarray(c, jnp.float32), n, kind, momentum))
    assert got == pytest.approx(want, rel=1e-4)


def test_strategies_are_column_normalized_and_more_bands_never_add_error():
    """||c|| <= 1 exactly on the float32 values the noise uses and within 1e-6 of 1 (no column
    shrunk more than rounding needs), the first coefficient positive; the error ratio against
    independent noise falls with the bands (1 band: exactly DP-SGD, c = [1])."""
    n = int(np.random.default_rng().integers(60, 400))
    assert strategy.optimal_strategy(n, 1).coefficients == (1.0,)
    ratios = []
    for bands in (1, 2, 4, 8):
        chosen = strategy.optimal_strategy(n, bands, "momentum", 0.9)
        c = np.asarray(chosen.coefficients, np.float64)
        assert len(c) == bands and c[0] > 0
        assert 1 - 1e-6 <= np.sum(c ** 2) <= 1.0
        np.testing.assert_array_equal(c.astype(np.float32).astype(np.float64), c)
        ratios.append(chosen.describe()["strategy_error_vs_independent"])
    assert ratios[0] == 1.0
    assert all(later <= earlier * (1 + 1e-4) for earlier, later in zip(ratios, ratios[1:]))
    assert ratios[-1] < 0.6  # heavy-ball momentum's error halves, or better, at 8 bands


def test_the_optimum_beats_its_start_and_is_computed_once_per_question():
    n = 500
    chosen = strategy.optimal_strategy(n, 4, "prefix", 0.0)
    start = strategy.normalized(strategy.square_root_coefficients(4))
    assert chosen.loss < float(strategy.loss(jnp.asarray(start), n, "prefix", 0.0))
    assert strategy.optimal_strategy(n, 4, "prefix", 0.0) is chosen  # cached


def test_normalized_never_rounds_a_column_norm_above_one():
    rng = np.random.default_rng()
    for _ in range(200):
        c = np.asarray(strategy.normalized(rng.uniform(0.01, 1, int(rng.integers(1, 20)))))
        assert np.sum(c.astype(np.float64) ** 2) <= 1.0


@pytest.mark.parametrize("args,message", [
    ((100, 0), "bands must be a positive integer"),
    ((100, 2, "adam"), "workload must be one of"),
    ((100, 2, "momentum", 1.0), "momentum must lie in"),
])
def test_bad_strategy_questions_say_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        strategy.optimal_strategy(*args)
