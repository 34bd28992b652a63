import math

import jax
import numpy as np
import optax
import pytest

from dpbench import stages
from tests.conftest import made


@pytest.mark.parametrize("l2_bound", [0.1, 1.0, 7.5])
def test_clipped_norms_are_at_most_the_bound(l2_bound):
    rng = np.random.default_rng()
    stage = stages.clip.global_l2(l2_bound)
    clip = jax.jit(jax.vmap(lambda t: made(stage).apply(t, (), None)[0]))
    scales = 10.0 ** rng.uniform(-4, 4, size=(256, 1))
    tree = {"w": (rng.normal(size=(256, 30)) * scales).astype(np.float32),
            "b": (rng.normal(size=(256, 3)) * scales).astype(np.float32)}
    clipped = clip(tree)
    norms = np.asarray(jax.vmap(optax.tree.norm)(clipped))
    orig = np.asarray(jax.vmap(optax.tree.norm)(tree))
    assert np.all(norms <= l2_bound * (1 + 1e-6))
    small = orig < l2_bound
    np.testing.assert_allclose(norms[small], orig[small], rtol=1e-6)   # untouched below C
    np.testing.assert_allclose(norms[~small], l2_bound, rtol=1e-5)     # scaled onto the sphere
    assert stage.privacy.l2_bound == l2_bound


def test_zero_vector_stays_zero_and_infinite_bound_is_identity():
    zero = {"w": np.zeros(5, np.float32)}
    out = jax.jit(lambda t: made(stages.clip.global_l2(1.0)).apply(t, (), None)[0])(zero)
    assert np.all(np.isfinite(out["w"])) and np.all(out["w"] == 0)
    big = {"w": np.full(5, 1e6, np.float32)}
    out = made(stages.clip.global_l2(math.inf)).apply(big, (), None)[0]
    np.testing.assert_array_equal(out["w"], big["w"])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), "1"])
def test_non_positive_bound_is_rejected(bad):
    with pytest.raises(ValueError, match="l2_bound"):
        stages.clip.global_l2(bad)
