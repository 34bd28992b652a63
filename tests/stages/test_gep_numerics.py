import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench.stages import gep_numerics


def _rows_with_spectrum(rng, k, p, smallest):
    """k x p rows with singular values spaced log-evenly from 1 down to ``smallest``."""
    u, _ = np.linalg.qr(rng.standard_normal((k, k)))
    v, _ = np.linalg.qr(rng.standard_normal((p, k)))
    return jnp.asarray((u * np.logspace(0, np.log10(smallest), k)) @ v.T, jnp.float32)


@pytest.mark.parametrize("smallest", [1e-1, 1e-7], ids=["cholesky_qr2", "householder_fallback"])
def test_orthonormal_rows_span_the_input_and_are_orthonormal(smallest):
    """Both paths (CholeskyQR2, and Householder where Cholesky fails in float32) give rows
    that are orthonormal to float32 accuracy and span the input: the projection onto them
    keeps every input row."""
    rng = np.random.default_rng()
    rows = _rows_with_spectrum(rng, 40, 3000, smallest)
    q = jax.jit(gep_numerics.orthonormal_rows)(rows)
    assert np.all(np.isfinite(np.asarray(q)))
    gram = np.asarray(q @ q.T, np.float64)
    assert np.abs(gram - np.eye(40)).max() < 1e-4
    top = rows[:5]  # well above the float32 noise floor at any spectrum
    projected = (top @ q.T) @ q
    assert np.abs(np.asarray(projected - top)).max() < 1e-4 * np.abs(np.asarray(top)).max()


def test_cholesky_pass_reports_its_failure():
    """The fallback rests on the pass saying when float32 Cholesky broke down."""
    rng = np.random.default_rng()
    _, ok = gep_numerics._cholesky_pass(_rows_with_spectrum(rng, 40, 3000, 1e-1))
    _, failed = gep_numerics._cholesky_pass(_rows_with_spectrum(rng, 40, 3000, 1e-7))
    assert bool(ok) and not bool(failed)
