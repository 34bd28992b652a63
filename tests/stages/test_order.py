import jax
import jax.numpy as jnp
import numpy as np

from dpbench.stages import order


def test_float_key_orders_like_the_floats():
    rng = np.random.default_rng()
    x = np.concatenate([rng.normal(size=500) * 10.0 ** rng.uniform(-30, 30, 500),
                        [0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38]]).astype(np.float32)
    keys = np.asarray(jax.jit(order.float_key)(jnp.asarray(x)))
    i, j = rng.integers(0, len(x), (2, 20_000))
    assert np.all((x[i] < x[j]) == (keys[i] < keys[j]))


def test_smallest_mask_is_the_stable_argsort_selection_with_ties():
    rng = np.random.default_rng()
    keys = rng.integers(0, 6, size=(9, 64)).astype(np.uint32)  # many ties
    counts = rng.integers(0, 65, size=9)
    counts[0], counts[1] = 0, 64
    ranks = np.argsort(np.argsort(keys, axis=-1, kind="stable"), axis=-1, kind="stable")
    want = ranks < counts[:, None]
    got = jax.jit(order.smallest_mask)(jnp.asarray(keys), jnp.asarray(counts))
    np.testing.assert_array_equal(got, want)
    # a scalar count applies to every row; a count beyond the row is clipped
    np.testing.assert_array_equal(order.smallest_mask(jnp.asarray(keys), 70), np.ones_like(want))
