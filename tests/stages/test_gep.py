import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event

from dpbench import accounting, stages
from dpbench.stages import gep
from tests.conftest import compile_small, make_batch, random_data

N = 32


def _gep_pipeline(biased=False, s1=0.3, s2=0.1, num_basis=6):
    return [stages.grad.per_example(),
            stages.gep.embed_and_clip(num_basis=num_basis, num_anchors=16, embedding_bound=s1,
                                      residual_bound=s2, biased=biased),
            stages.noise.gaussian(),
            stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0)]


def _compile(biased=False, noise=0.0, **kw):
    public, _ = random_data(16, seed=99)
    return compile_small(_gep_pipeline(biased, **kw), n=N, batch_size=N, micro=8,
                         noise_multiplier=noise, padded_batch_size=N, model_name="mlp",
                         public_images=public)


def _run(compiled, params, images, labels, mask, key=4):
    b = compiled.sampler.sample(0)
    state, _ = compiled.step(compiled.init_state(params, jax.random.key(key)),
                             make_batch(compiled, images, labels, b.indices, mask))
    return state


def test_gep_epsilon_is_one_gaussian_with_multiplier_sigma_over_sqrt2():
    budget = accounting.Budget(3.0, 1e-5)
    for biased, factor in ((False, np.sqrt(2)), (True, 1.0)):
        compiled, _, _ = _compile(biased=biased, noise=1.3)
        one_gaussian = dp_event.SelfComposedDpEvent(compiled.sampler.dp_event(1.3 / factor), 50)
        want = accounting.epsilon_of(one_gaussian, budget)
        assert accounting.epsilon_of(compiled.run_event(50), budget) == pytest.approx(want)


def test_basis_is_orthonormal_and_independent_of_private_data():
    compiled, init_params, _ = _compile(noise=1.0)
    params = init_params(jax.random.key(0))
    images, labels = random_data(N)
    other = np.random.default_rng().normal(size=images.shape).astype(np.float32) * 50
    b = compiled.sampler.sample(0)
    s1 = _run(compiled, params, images, labels, b.mask).stage_states[1]["basis"]
    s2 = _run(compiled, params, other, (labels + 1) % 4, b.mask).stage_states[1]["basis"]
    for g in s1:
        np.testing.assert_array_equal(np.asarray(s1[g]), np.asarray(s2[g]))  # bit-identical
        basis = np.asarray(s1[g])
        np.testing.assert_allclose(basis @ basis.T, np.eye(len(basis)), atol=1e-4)


def test_anchor_chunk_is_a_speed_knob_only():
    params = None
    bases = []
    for chunk in (16, 5):  # all at once, and chunks with a remainder
        public, _ = random_data(16, seed=99)
        pipeline = _gep_pipeline()
        pipeline[1] = stages.gep.embed_and_clip(num_basis=6, num_anchors=16, embedding_bound=0.3,
                                                residual_bound=0.1, anchor_chunk=chunk)
        compiled, init_params, _ = compile_small(
            pipeline, n=N, batch_size=N, micro=8, noise_multiplier=1.0, padded_batch_size=N,
            model_name="mlp", public_images=public)
        params = init_params(jax.random.key(0)) if params is None else params
        images, labels = random_data(N)
        b = compiled.sampler.sample(0)
        bases.append(_run(compiled, params, images, labels, b.mask).stage_states[1]["basis"])
    for g in bases[0]:
        np.testing.assert_allclose(np.asarray(bases[0][g]), np.asarray(bases[1][g]), atol=1e-4)


def test_reconstruction_without_clipping_or_noise_is_the_gradient_sum():
    compiled, init_params, loss_fn = _compile(noise=0.0, s1=1e6, s2=1e6)
    params = init_params(jax.random.key(0))
    images, labels = random_data(N)
    b = compiled.sampler.sample(0)
    state = _run(compiled, params, images, labels, b.mask)
    grads = jax.vmap(jax.grad(loss_fn), (None, 0, 0))(params, images[b.indices],
                                                       labels[b.indices])
    want = jax.tree.map(lambda p, g: p - g.sum(0) / N, params, grads)
    for got, exp in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, exp, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("biased", [False, True])
def test_one_huge_example_moves_the_update_by_at_most_s1_plus_s2(biased):
    s1, s2 = 0.3, 0.1
    compiled, init_params, _ = _compile(biased=biased, noise=0.0, s1=s1, s2=s2)
    params = init_params(jax.random.key(0))
    images, labels = random_data(N)
    b = compiled.sampler.sample(0)
    without = b.mask.copy()
    without[3] = False
    flat = lambda st: np.concatenate([np.ravel(x) for x in jax.tree.leaves(st.params)])  # noqa
    base = flat(_run(compiled, params, images, labels, without))
    bound = (s1 + (0 if biased else s2)) / N
    for scale in (1e3, -1e5):
        huge = images.copy()
        huge[b.indices[3]] = scale
        assert np.linalg.norm(flat(_run(compiled, params, huge, labels, b.mask)) - base) <= \
            bound * (1 + 1e-4)


def test_basis_split_follows_sqrt_of_group_size_and_missing_public_data_is_an_error():
    ks = gep.basis_sizes({"a": 100, "b": 10_000}, 110, 512)
    assert ks == {"a": 10, "b": 100}
    with pytest.raises(ValueError, match="dataset.public_size"):
        compile_small(_gep_pipeline(), n=N, batch_size=N, micro=8, noise_multiplier=1.0,
                      padded_batch_size=N, model_name="mlp", public_images=None)
