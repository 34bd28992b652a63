import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import stages
from dpbench.stages.base import Mask, StepContext
from tests.conftest import (compile_small, made, make_batch, moved_and_mask_after_an_empty_step,
                            random_data)


def _ctx(params, step):
    return StepContext(params=params, step=jnp.asarray(step, jnp.int32), key=jax.random.key(0))


def _at_step(stage, state, params, step):
    """The stage's state after its once-per-step begin_step (as the compiled step runs it)."""
    return made(stage).hooks.begin_step(state, _ctx(params, step))


@pytest.mark.parametrize("criterion", ["random", "magnitude"])
def test_drops_exactly_the_rate_per_layer(criterion):
    rng = np.random.default_rng()
    params = {"a": jnp.asarray(rng.normal(size=(40, 25)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32)}
    stage = stages.drop.gradients(rate=0.6, criterion=criterion)
    state = made(stage).init(params, jax.random.key(1))
    ones = jax.tree.map(jnp.ones_like, params)
    out = jax.jit(lambda g: made(stage).apply(g, _at_step(stage, state, params, 3),
                                        _ctx(params, 3))[0])(ones)
    assert int(jnp.sum(out["a"] == 0)) == int(0.6 * 1000)
    assert int(jnp.sum(out["b"] == 0)) == 0  # biases are never dropped
    if criterion == "magnitude":
        dropped = np.abs(np.asarray(params["a"]))[np.asarray(out["a"]) == 0]
        kept = np.abs(np.asarray(params["a"]))[np.asarray(out["a"]) != 0]
        assert dropped.max() <= kept.min()


@pytest.mark.parametrize("criterion", ["random", "magnitude"])
def test_the_rate_applies_to_the_weights_left_after_pre_pruning(criterion):
    """Regression: with half the weights pruned to zero, magnitude dropping at rate 0.5 used to
    drop exactly the pruned zeros, i.e. nothing more."""
    rng = np.random.default_rng()
    weights = rng.normal(size=(40, 50)).astype(np.float32)
    pruned = rng.permutation(2000) < 1000
    weights.ravel()[pruned] = 0.0
    params = {"w": jnp.asarray(weights)}
    stage = stages.drop.gradients(rate=0.5, criterion=criterion)
    state = made(stage).init(params, jax.random.key(1))
    out = jax.jit(lambda g: made(stage).apply(g, _at_step(stage, state, params, 2),
                                        _ctx(params, 2))[0])({"w": jnp.ones((40, 50))})
    kept = np.asarray(out["w"]).ravel() != 0
    assert not np.any(kept & pruned)          # pruned weights are never updated
    assert kept.sum() == 1000 - int(0.5 * 1000)  # half of the remaining ones are dropped


def test_random_mask_is_fresh_each_step_and_independent_of_private_values():
    params = {"w": jnp.ones((50, 100))}
    stage = stages.drop.gradients(rate=0.5, criterion="random")
    state = made(stage).init(params, jax.random.key(2))
    apply = jax.jit(lambda g, s: made(stage).apply(g, _at_step(stage, state, params, s),
                                             _ctx(params, s))[0])
    ones = {"w": jnp.ones((50, 100))}
    private = {"w": jnp.asarray(np.random.default_rng().normal(size=(50, 100)) + 5,
                                jnp.float32)}
    np.testing.assert_array_equal(apply(ones, 4)["w"] == 0, apply(private, 4)["w"] == 0)
    assert not np.array_equal(apply(ones, 4)["w"] == 0, apply(ones, 5)["w"] == 0)


def test_noise_is_removed_on_dropped_coordinates():
    """The compiler masks the release with the drop mask: a compiled step on an empty batch
    (its update is the noise alone) moves exactly the kept coordinates."""
    stage = stages.drop.gradients(rate=0.3, criterion="magnitude")
    assert Mask.RELEASED in stage.privacy.public_mask  # the compiler masks the release with it
    moved, kept = moved_and_mask_after_an_empty_step(stage)
    np.testing.assert_array_equal(moved, kept)
    assert 0.5 < kept.mean() < 0.9  # rate 0.3 dropped, the rest kept


def test_bad_rate_and_criterion_are_rejected():
    with pytest.raises(ValueError, match="rate"):
        stages.drop.gradients(rate=1.0)
    with pytest.raises(ValueError, match="criterion"):
        stages.drop.gradients(criterion="gradient")
    with pytest.raises(ValueError, match="freeze_dropped"):
        stages.drop.gradients(freeze_dropped="yes")


def _momentum_dpssgd(freeze_dropped):
    return [stages.grad.per_example(),
            stages.drop.gradients(rate=0.5, criterion="random", freeze_dropped=freeze_dropped),
            stages.clip.global_l2(1.0), stages.noise.gaussian(),
            stages.optimize.optax_optimizer(optimizer="momentum", learning_rate=0.5)]


@pytest.mark.parametrize("freeze_dropped", [True, False])
def test_dropped_coordinates_are_frozen_even_with_momentum(freeze_dropped):
    """Paper eq. 5: theta[I_ns] keeps its value. After steps that build momentum, a step's
    dropped weights must not move; masking only the gradient (the variant) lets them move."""
    n = 64
    compiled, init_params, _ = compile_small(_momentum_dpssgd(freeze_dropped), n=n,
                                             batch_size=32, micro=8, noise_multiplier=0.5,
                                             model_name="mlp")
    images, labels = random_data(n)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
    for step in range(3):
        before = jax.tree.map(np.asarray, jax.device_get(state.params))
        b = compiled.sampler.sample(step)
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
    after = jax.tree.map(np.asarray, jax.device_get(state.params))
    keep = jax.tree.map(np.asarray, jax.device_get(state.stage_states[1]["mask"]))
    moved_dropped = [np.any(a[k == 0] != p[k == 0]) for a, p, k in zip(
        jax.tree.leaves(after), jax.tree.leaves(before), jax.tree.leaves(keep))]
    assert any(np.any(k == 0) for k in jax.tree.leaves(keep))  # this step dropped something
    assert any(moved_dropped) is (not freeze_dropped)
    kept_moved = [np.any(a[k == 1] != p[k == 1]) for a, p, k in zip(
        jax.tree.leaves(after), jax.tree.leaves(before), jax.tree.leaves(keep))]
    assert all(kept_moved)  # kept coordinates still train
