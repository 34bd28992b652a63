"""Book-keeping gives the same clipped sum as materialized per-example gradients, and the
compiler picks it exactly where it reproduces the stage chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import accounting, compiler, models, sampling, stages
from tests.conftest import make_batch

MICRO = 8


def _compile(stage_list, model, with_model: bool, shape, n=48, batch=24):
    sampler = sampling.PoissonSampler(n, batch, seed=0, pad_multiple=MICRO)
    return compiler.compile_pipeline(
        stage_list, loss_fn=models.cross_entropy_loss(model),
        init_params=lambda key: model.init(key, jnp.zeros((1,) + shape)), example_shape=shape,
        sampler=sampler, budget=accounting.Budget(3.0, 1e-5), total_steps=10,
        steps_per_epoch=2, micro_batch_size=MICRO, noise_multiplier=1.0,
        model=model if with_model else None)


def _chain(kind):
    middle = {"dpsgd": [], "rs": [stages.sparsify.random_mask(final_rate=0.5, cooling="none")],
              "dpssgd": [stages.prune.random(sparsity=0.5),
                         stages.drop.gradients(rate=0.5, criterion="magnitude")],
              "nasr": [stages.nasr.discretize(threshold=1e-3)]}[kind]
    return ([stages.grad.per_example()] + middle +
            [stages.clip.global_l2(0.05), stages.noise.gaussian(),
             stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)])


@pytest.mark.parametrize("name,shape,kind", [("tanh_cnn", (28, 28, 1), "dpsgd"),
                                              ("tanh_cnn", (28, 28, 1), "rs"),
                                              ("tanh_cnn", (28, 28, 1), "nasr"),
                                              ("mlp", (8, 8, 1), "dpssgd"),
                                              ("mlp", (8, 8, 1), "rs"),
                                              ("mlp", (8, 8, 1), "nasr")])
def test_same_clipped_sum_either_way(name, shape, kind):
    model = models.make_model(10, name=name, hidden=(32,))
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    labels = rng.integers(0, 10, 48).astype(np.int32)
    images[3] = np.nan  # a non-finite example: zeroed and counted by both
    fast = _compile(_chain(kind), model, True, shape)
    slow = _compile(_chain(kind), model, False, shape)
    assert (fast.plan.strategy, slow.plan.strategy) == ("bookkeeping", "materialized")
    state = fast.init_state(model.init(jax.random.key(1), jnp.zeros((1,) + shape)),
                            jax.random.key(2))
    b = fast.sampler.sample(0)
    b.mask[:] = b.mask | (np.arange(len(b.mask)) < 4)
    b.indices[:4] = np.arange(4)  # example 3 (non-finite) is in the batch
    batch = make_batch(fast, images, labels, b.indices, b.mask)
    got = jax.jit(fast.lowered.clipped_sum)(state, batch)
    want = jax.jit(slow.lowered.clipped_sum)(state, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)
    assert float(jnp.abs(jax.tree.leaves(got)[0]).sum()) > 0  # not vacuous
    if kind != "rs" or name != "mlp":
        return  # the whole step once (compiling two more steps per case costs suite time)
    _, fast_metrics = fast.step(state, batch)
    state2 = slow.init_state(model.init(jax.random.key(1), jnp.zeros((1,) + shape)),
                             jax.random.key(2))
    _, slow_metrics = slow.step(state2, batch)
    assert float(fast_metrics["nonfinite_examples"]) == float(
        slow_metrics["nonfinite_examples"]) == 1.0
    np.testing.assert_allclose(fast_metrics["train_loss"], slow_metrics["train_loss"],
                               rtol=1e-4)


def test_the_compiler_picks_bookkeeping_only_where_it_reproduces_the_chain():
    model = models.make_model(10, name="mlp", hidden=(16,))
    shape = (8, 8, 1)
    augmented = [stages.grad.per_example(augmult=2, augmentation="crop")] + _chain("dpsgd")[1:]
    assert _compile(augmented, model, True, shape).plan.strategy == "materialized"
    normed = models.make_model(10, name="tanh_cnn", group_norm_groups=4)  # GroupNorm: not taps
    assert _compile(_chain("dpsgd"), normed, True, (28, 28, 1)).plan.strategy == "materialized"
    assert _compile(_chain("dpsgd"), model, True, shape).plan.strategy == "bookkeeping"
