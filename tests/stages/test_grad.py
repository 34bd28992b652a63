import jax
import jax.numpy as jnp
import numpy as np

from dpbench import stages
from dpbench.stages.base import StepContext
from tests.conftest import made, small_model


def _per_example_grads(stage, params, loss_fn, images, labels, key):
    def one(image, label, k):
        ctx = StepContext(params=params, step=jnp.zeros((), jnp.int32), key=k)
        grads, _ = made(stage, loss_fn=loss_fn).apply({"image": image, "label": label}, (), ctx)
        return grads
    keys = jax.random.split(key, images.shape[0])
    return jax.jit(jax.vmap(one))(images, labels, keys)


def test_vmapped_grads_equal_a_per_example_loop():
    rng = np.random.default_rng()
    _, loss_fn, init_params = small_model(name="mlp")
    params = init_params(jax.random.key(int(rng.integers(1 << 30))))
    images = rng.normal(size=(6, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 4, 6).astype(np.int32)
    batched = _per_example_grads(stages.grad.per_example(), params, loss_fn, images, labels,
                                 jax.random.key(0))
    for i in range(6):
        expected = jax.jit(jax.grad(loss_fn))(params, images[i], labels[i])
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(expected)):
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


def test_changing_one_example_leaves_the_others_bit_identical():
    rng = np.random.default_rng()
    _, loss_fn, init_params = small_model(name="mlp")
    params = init_params(jax.random.key(1))
    images = rng.normal(size=(8, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 4, 8).astype(np.int32)
    stage = stages.grad.per_example(augmult=2, augmentation="crop")
    before = _per_example_grads(stage, params, loss_fn, images, labels, jax.random.key(3))
    changed = images.copy()
    changed[5] = 1e3 * rng.normal(size=changed[5].shape)
    labels2 = labels.copy()
    labels2[5] = (labels[5] + 1) % 4
    after = _per_example_grads(stage, params, loss_fn, changed, labels2, jax.random.key(3))
    others = np.arange(8) != 5
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(b)[others], np.asarray(a)[others])
        assert not np.array_equal(np.asarray(b)[5], np.asarray(a)[5])


def test_augmult_averages_k_augmented_gradients():
    _, loss_fn, init_params = small_model()
    params = init_params(jax.random.key(0))
    image = np.random.default_rng().normal(size=(8, 8, 1)).astype(np.float32)
    stage = stages.grad.per_example(augmult=3, augmentation="crop_flip", crop_padding=2)
    key = jax.random.key(7)
    ctx = StepContext(params=params, step=jnp.zeros((), jnp.int32), key=key)
    got, _ = jax.jit(lambda e: made(stage, loss_fn=loss_fn).apply(e, (), ctx))(
        {"image": image, "label": 1})
    keys = jax.random.split(key, 3)
    grads = [jax.grad(loss_fn)(params, stages.grad.augment_image(k, image, "crop_flip", 2), 1)
             for k in keys]
    want = jax.tree.map(lambda *g: sum(g) / 3, *grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
