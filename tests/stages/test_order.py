import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def _argsort_selection(keys, counts):
    ranks = np.argsort(np.argsort(keys, axis=-1, kind="stable"), axis=-1, kind="stable")
    return ranks < np.clip(counts, 0, keys.shape[-1])[:, None]


@pytest.mark.parametrize("impl", ["_smallest_by_search", "_smallest_by_sort"])
def test_both_thresholds_select_the_stable_argsort_set(impl):
    """The CPU's bitwise search and the accelerators' sort give the same set as a stable
    argsort, on random 32-bit keys, on keys with many ties, at the ends of the key range, all
    equal, or sharing their high bits, for counts 0, 1 and the row length."""
    rng = np.random.default_rng()
    fn = jax.jit(lambda k, c: getattr(order, impl)(k, c[:, None]))
    rows = [rng.integers(0, 2**32, size=(6, 97), dtype=np.uint64).astype(np.uint32),
            rng.integers(0, 4, size=(6, 97)).astype(np.uint32),
            rng.choice(np.array([0, 1, 2**31, 2**32 - 2, 2**32 - 1], np.uint32), size=(6, 97)),
            np.full((6, 97), 0xABCD1234, np.uint32),  # every key equal: no bit to search
            # a shared high prefix, then 9 bits (GIP's Mallows priorities are 0..256)
            (0xABCD0000 + rng.integers(0, 257, size=(6, 97))).astype(np.uint32)]
    for keys in rows:
        counts = rng.integers(1, 97, size=6)
        counts[:3] = 0, 1, 97
        want = _argsort_selection(keys, counts)
        np.testing.assert_array_equal(fn(jnp.asarray(keys), jnp.asarray(counts, jnp.int32)), want)


def test_signed_keys_keep_their_order_and_the_cpu_path_does_not_sort():
    rng = np.random.default_rng()
    keys = rng.integers(-2**31, 2**31, size=(5, 40), dtype=np.int64).astype(np.int32)
    keys[:, :8] = keys[:, 8:16]  # ties across the sign
    counts = rng.integers(0, 41, size=5)
    got = jax.jit(order.smallest_mask)(jnp.asarray(keys), jnp.asarray(counts))
    np.testing.assert_array_equal(got, _argsort_selection(keys, counts))
    per_row = jax.vmap(order.smallest_mask)(jnp.asarray(keys), jnp.asarray(counts))
    np.testing.assert_array_equal(per_row, got)
    hlo = jax.jit(order.smallest_mask).lower(jnp.asarray(keys), 3).as_text()
    assert "sort" not in hlo  # on CPU the threshold comes from the search (the fast path)
    with pytest.raises(TypeError, match="integer keys"):
        order.smallest_mask(jnp.zeros((2, 3), jnp.float32), 1)


def test_kth_largest_is_the_sorted_value_and_keys_map_back_to_their_floats():
    """SynFlow's and DP-SNIP's thresholds: the count-th largest score, as a float sort reads
    it, with ties, zeros (pruned weights) and infinities among the scores."""
    rng = np.random.default_rng()
    x = np.abs(rng.normal(size=3000) * 10.0 ** rng.uniform(-20, 20, 3000)).astype(np.float32)
    x[:600] = 0.0
    x[600:900] = x[900:1200]
    x[1200] = np.inf
    fn = order.kth_largest
    for count in (1, 2, 1500, 2399, 2400, 2401, 3000, int(rng.integers(1, 3001))):
        assert float(fn(jnp.asarray(x), count)) == np.sort(x)[::-1][count - 1], count
    y = np.concatenate([x, -x, [-np.inf, -0.0, 1e-45, -1e-45]]).astype(np.float32)
    back = order.float_from_key(order.float_key(jnp.asarray(y)))
    np.testing.assert_array_equal(np.asarray(back).view(np.uint32), y.view(np.uint32))
