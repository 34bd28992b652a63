import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import stages
from dpbench.stages.base import Mask, StepContext
from tests.conftest import made, moved_and_mask_after_an_empty_step


def _built(final_rate=0.6, cooling="linear", steps_per_epoch=10, total_steps=50):
    stage = stages.sparsify.random_mask(final_rate=final_rate, cooling=cooling)
    return made(stage, total_steps=total_steps, steps_per_epoch=steps_per_epoch)


def _ctx(step, n=200_000):
    return StepContext(params={"w": jnp.zeros((n,))}, step=jnp.asarray(step, jnp.int32),
                       key=jax.random.key(0))


def _at(fns, state, step, n=200_000):
    """The state after the step's begin_step (the epoch mask), as the compiled step makes it."""
    return fns.hooks.begin_step(state, _ctx(step, n))


def test_rate_ramps_linearly_from_zero_to_the_final_rate():
    rates = [float(stages.sparsify.sparsification_rate(e, 5, 0.8, "linear")) for e in range(5)]
    np.testing.assert_allclose(rates, [0.0, 0.2, 0.4, 0.6, 0.8], atol=1e-6)
    assert float(stages.sparsify.sparsification_rate(0, 5, 0.8, "none")) == pytest.approx(0.8)


def test_mask_drops_the_scheduled_fraction_is_per_epoch_and_data_independent():
    fns = _built(final_rate=0.6)
    state = fns.init({"w": jnp.zeros((200_000,))}, jax.random.key(3))
    ones = {"w": jnp.ones((200_000,))}
    apply = jax.jit(lambda g, s: fns.apply(g, _at(fns, state, s), _ctx(s))[0])
    last_epoch = apply(ones, 45)["w"]
    assert abs(float(jnp.mean(last_epoch == 0)) - 0.6) < 0.01          # epoch 4 of 5: rate 0.6
    assert float(jnp.mean(apply(ones, 3)["w"] == 0)) == 0.0             # epoch 0: rate 0
    # same epoch -> same mask, whatever the (private) values; new epoch -> new mask
    other = {"w": jnp.asarray(np.random.default_rng().normal(size=200_000), jnp.float32)}
    np.testing.assert_array_equal(apply(other, 41)["w"] == 0, last_epoch == 0)
    assert not np.array_equal(apply(ones, 35)["w"] == 0, apply(ones, 45)["w"] == 0)
    # with a constant rate too: a new epoch draws a new mask (not only a different rate),
    # about half of the coordinates change their state at rate 0.5
    flat = _built(final_rate=0.5, cooling="none")
    flat_state = flat.init({"w": jnp.zeros((200_000,))}, jax.random.key(3))
    dropped = {s: np.asarray(flat.apply(ones, _at(flat, flat_state, s), _ctx(s))[0]["w"] == 0)
               for s in (12, 19, 22)}
    np.testing.assert_array_equal(dropped[12], dropped[19])               # epoch 1 twice
    assert abs(float(np.mean(dropped[12] != dropped[22])) - 0.5) < 0.01   # epoch 1 vs 2


def test_noise_survives_only_on_kept_coordinates():
    """The compiler masks the release with RS's epoch mask: a compiled step on an empty batch
    (its update is the noise alone) moves exactly the kept coordinates."""
    stage = stages.sparsify.random_mask(final_rate=0.5, cooling="none")
    # the compiler masks the release with it, and may clip masked gradients without them
    assert stage.privacy.public_mask == {Mask.RELEASED, Mask.PER_EXAMPLE}
    moved, kept = moved_and_mask_after_an_empty_step(stage)
    np.testing.assert_array_equal(moved, kept)
    assert 0.3 < kept.mean() < 0.7  # both kinds of coordinate are there
