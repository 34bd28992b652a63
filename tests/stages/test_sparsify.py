import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import stages
from dpbench.stages.base import StageInfo, StepContext
from tests.conftest import compile_small, dpsgd_stages, make_batch, random_data


def _built(final_rate=0.6, cooling="linear", steps_per_epoch=10, total_steps=50):
    stage = stages.sparsify.random_mask(final_rate=final_rate, cooling=cooling)
    info = StageInfo(total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                     expected_batch_size=8, dataset_size=80, param_shapes=None)
    return stage.build(stage, info)


def _ctx(step):
    return StepContext(params=None, step=jnp.asarray(step, jnp.int32), key=jax.random.key(0))


def test_rate_ramps_linearly_from_zero_to_the_final_rate():
    rates = [float(stages.sparsify.sparsification_rate(e, 5, 0.8, "linear")) for e in range(5)]
    np.testing.assert_allclose(rates, [0.0, 0.2, 0.4, 0.6, 0.8], atol=1e-6)
    assert float(stages.sparsify.sparsification_rate(0, 5, 0.8, "none")) == pytest.approx(0.8)


def test_mask_drops_the_scheduled_fraction_is_per_epoch_and_data_independent():
    stage = _built(final_rate=0.6)
    state = stage.init(None, jax.random.key(3), None)
    ones = {"w": jnp.ones((200_000,))}
    apply = jax.jit(lambda g, s: stage.apply(g, state, _ctx(s)))
    last_epoch = apply(ones, 45)["w"]
    assert abs(float(jnp.mean(last_epoch == 0)) - 0.6) < 0.01          # epoch 4 of 5: rate 0.6
    assert float(jnp.mean(apply(ones, 3)["w"] == 0)) == 0.0             # epoch 0: rate 0
    # same epoch -> same mask, whatever the (private) values; new epoch -> new mask
    other = {"w": jnp.asarray(np.random.default_rng().normal(size=200_000), jnp.float32)}
    np.testing.assert_array_equal(apply(other, 41)["w"] == 0, last_epoch == 0)
    assert not np.array_equal(apply(ones, 35)["w"] == 0, apply(ones, 45)["w"] == 0)


def test_noise_survives_only_on_kept_coordinates():
    stage = _built(final_rate=0.5, cooling="none")
    state = stage.init(None, jax.random.key(1), None)
    noisy = {"w": jnp.ones((10_000,))}
    kept = jax.jit(lambda r: stage.after_release(r, state, _ctx(12)))(noisy)["w"]
    mask = stage.apply({"w": jnp.ones((10_000,))}, state, _ctx(12))["w"]
    np.testing.assert_array_equal(kept, mask)


def test_rs_batch_sum_sensitivity_stays_within_the_clip_bound_for_huge_neighbours():
    """Sum with one example replaced by an adversarially huge one moves by <= C."""
    rs = [stages.grad.per_example(), stages.sparsify.random_mask(final_rate=0.7),
          stages.clip.global_l2(0.5), stages.noise.gaussian(),
          stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0)]
    n = 32
    compiled, init_params, _ = compile_small(rs, n=n, batch_size=n, micro=8,
                                             noise_multiplier=0.0, padded_batch_size=n)
    images, labels = random_data(n)
    params = init_params(jax.random.key(0))
    b = compiled.sampler.sample(0)

    def update(imgs, mask):
        state = compiled.init_state(params, jax.random.key(4))
        new, _ = compiled.step(state, make_batch(compiled, imgs, labels, b.indices, mask))
        return np.concatenate([np.ravel(np.asarray(a) - np.asarray(p)) for a, p in zip(
            jax.tree.leaves(new.params), jax.tree.leaves(params))])

    without = b.mask.copy()
    without[7] = False  # the add/remove neighbour: example 7 absent
    base = update(images, without)
    for scale in (1e2, 1e4, -1e6):
        neighbour = images.copy()
        neighbour[b.indices[7]] = scale * np.sign(np.random.default_rng().normal(size=images[0].shape))
        # update = lr * sum / B, so adding any one example moves it by at most lr * C / B
        assert np.linalg.norm(update(neighbour, b.mask) - base) <= 0.5 / n * (1 + 1e-5)


def test_the_sensitivity_check_catches_a_missing_clip():
    """The same measurement on an unclipped pipeline exceeds the bound: the test can fail."""
    unclipped = [stages.grad.per_example(), stages.sparsify.random_mask(final_rate=0.7),
                 stages.clip.global_l2(float("inf")), stages.noise.gaussian(),
                 stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0)]
    n = 32
    compiled, init_params, _ = compile_small(unclipped, n=n, batch_size=n, micro=8,
                                             noise_multiplier=0.0, padded_batch_size=n)
    images, labels = random_data(n)
    params = init_params(jax.random.key(0))
    b = compiled.sampler.sample(0)
    without = b.mask.copy()
    without[7] = False
    huge = images.copy()
    huge[b.indices[7]] = 1e4
    moved = []
    for imgs, mask in ((images, without), (huge, b.mask)):
        state, _ = compiled.step(compiled.init_state(params, jax.random.key(4)),
                                 make_batch(compiled, imgs, labels, b.indices, mask))
        moved.append(np.concatenate([np.ravel(np.asarray(a)) for a in
                                     jax.tree.leaves(state.params)]))
    assert np.linalg.norm(moved[1] - moved[0]) > 0.5 / n
