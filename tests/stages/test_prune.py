import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from dp_accounting import dp_event

from dpbench import compiler, sampling, stages
from tests.conftest import compile_small, made, make_batch, random_data


def test_random_prune_removes_the_fraction_per_layer_and_keeps_biases():
    params = {"Dense_0": {"kernel": jnp.ones((30, 20)), "bias": jnp.ones((20,))},
              "Dense_1": {"kernel": jnp.ones((20, 4)), "bias": jnp.ones((4,))}}
    stage = stages.prune.random(sparsity=0.7)
    state = jax.jit(lambda p: made(stage).init(p, jax.random.key(3)))(params)
    mask = state["mask"]
    assert int(jnp.sum(mask["Dense_0"]["kernel"] == 0)) == int(0.7 * 600)
    assert int(jnp.sum(mask["Dense_1"]["kernel"] == 0)) == int(0.7 * 80)
    assert bool(jnp.all(mask["Dense_0"]["bias"] == 1))


def test_pruned_weights_start_at_zero_and_stay_zero_under_noise_and_momentum():
    pipeline = [stages.grad.per_example(), stages.prune.random(sparsity=0.5),
                stages.clip.global_l2(1.0), stages.noise.gaussian(),
                stages.optimize.optax_optimizer(optimizer="momentum", learning_rate=0.5)]
    compiled, init_params, _ = compile_small(pipeline, n=64, batch_size=16, micro=8,
                                             noise_multiplier=2.0, model_name="mlp")
    images, labels = random_data(64)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
    mask = jax.tree.map(np.array, state.stage_states[1]["mask"])  # the step donates state
    for step in range(4):
        b = compiled.sampler.sample(step)
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mask)):
        p, m = np.asarray(p), np.asarray(m)
        assert np.all(p[m == 0] == 0)
        assert np.any(p[m == 1] != 0)


def test_synflow_prunes_the_global_fraction_without_collapsing_a_layer():
    from dpbench import models
    from dpbench.stages import prune
    model = models.make_model(10, name="tanh_cnn")
    twin = models.make_model(10, name="tanh_cnn", activation="identity")
    params = model.init(jax.random.key(int(np.random.default_rng().integers(1 << 30))),
                        jnp.zeros((1, 28, 28, 1)))
    mask = prune.synflow_mask(params, twin.apply, (28, 28, 1), sparsity=0.8, iterations=20)
    kernels = {k: np.asarray(v["kernel"]) for k, v in mask["params"].items()}
    total = sum(m.size for m in kernels.values())
    kept = sum(m.sum() for m in kernels.values())
    assert abs(kept / total - 0.2) < 0.01
    assert all(m.sum() > 0 for m in kernels.values())  # no layer collapse
    assert all(np.all(np.asarray(v["bias"]) == 1) for v in mask["params"].values())
    # data-free and deterministic: the same weights give the same mask
    again = prune.synflow_mask(params, twin.apply, (28, 28, 1), sparsity=0.8, iterations=20)
    for a, b in zip(jax.tree.leaves(mask), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def _snip_pipeline():
    return [stages.grad.per_example(), stages.prune.dp_snip(sparsity=0.5, l2_bound=1.0,
                                                            epsilon_fraction=0.2),
            stages.clip.global_l2(1.0), stages.noise.gaussian(),
            stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)]


def test_dp_snip_release_is_in_the_ledger_and_costs_epsilon():
    from dpbench import accounting
    budget = accounting.Budget(2.0, 1e-4)
    snip, _, _ = compile_small(_snip_pipeline(), n=1000, batch_size=50, micro=10,
                               budget=budget, total_steps=100)
    base, _, _ = compile_small([s for i, s in enumerate(_snip_pipeline()) if i != 1], n=1000,
                               batch_size=50, micro=10, budget=budget, total_steps=100)
    assert snip.needs_release_batch and len(snip.accounting.pre_mechanisms) == 1
    assert snip.epsilon_after(0) > 0                       # spent before the first step
    assert 2.0 - 1e-3 < snip.epsilon_after(100) <= 2.0     # the whole run meets the target
    assert snip.noise_multiplier > base.noise_multiplier   # so training noise is larger
    # the one-off release alone spends about its share (20%) of epsilon
    alone = accounting.epsilon_of(snip.accounting.pre_mechanisms[0].event, budget)
    assert alone == pytest.approx(0.4, abs=1e-3)


def test_dp_snip_prunes_from_the_release_and_needs_a_sampler_batch():
    compiled, init_params, _ = compile_small(_snip_pipeline(), n=64, batch_size=16, micro=8,
                                             noise_multiplier=1.0, model_name="mlp")
    images, labels = random_data(64)
    params = init_params(jax.random.key(0))
    with pytest.raises(ValueError, match="release_batch"):
        compiled.init_state(params, jax.random.key(1))
    from dpbench import sampling
    b = compiled.sampler.sample(sampling.PRE_TRAINING_STEP)
    state = compiled.init_state(params, jax.random.key(1),
                                make_batch(compiled, images, labels, b.indices, b.mask))
    mask = jax.tree.map(np.asarray, state.stage_states[1]["mask"])
    kernels = [m for m in jax.tree.leaves(mask) if m.ndim >= 2]
    kept = sum(m.sum() for m in kernels) / sum(m.size for m in kernels)
    assert abs(kept - 0.5) < 0.01
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mask)):
        assert np.all(np.asarray(p)[m == 0] == 0)


def test_dp_snip_clips_each_examples_connection_scores_theta_times_grad():
    """The paper's Alg. 2: what is clipped (per example) and released is theta * grad, so each
    example's contribution has L2 norm <= the clip bound; |theta| * clip(grad) would not be."""
    bound = 0.05
    stage = stages.prune.dp_snip(l2_bound=bound)
    rng = np.random.default_rng()
    params = {"w": jnp.asarray(rng.normal(size=(6, 5)) * 3.0, jnp.float32)}
    grads = {"w": jnp.asarray(rng.normal(size=(6, 5)) * 10.0, jnp.float32)}
    release = stage.privacy.one_off_release
    scores = jax.jit(release.value)(params, grads)
    np.testing.assert_allclose(scores["w"], params["w"] * grads["w"], rtol=1e-6)
    from dpbench.ops import clip_to_l2
    clipped = jax.jit(lambda v: clip_to_l2(v, release.l2_bound))(scores)
    assert float(jnp.linalg.norm(clipped["w"])) <= bound * (1 + 1e-6)
    # the old order (clip the gradient, then multiply by |theta|) exceeds the bound here
    old = jnp.abs(params["w"]) * clip_to_l2(grads, bound)["w"]
    assert float(jnp.linalg.norm(old)) > bound


def test_dp_snip_released_sum_is_the_sum_of_clipped_connection_scores():
    """Through the compiler's one-off release with noise 0: the state's mask keeps the
    largest |sum_b clip(theta * grad_b)|, computed here independently."""
    compiled, init_params, loss_fn = compile_small(
        [stages.grad.per_example(), stages.prune.dp_snip(sparsity=0.5, l2_bound=0.01),
         stages.clip.global_l2(1.0), stages.noise.gaussian(),
         stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)],
        n=64, batch_size=16, micro=8, noise_multiplier=0.0, model_name="mlp")
    images, labels = random_data(64)
    params = init_params(jax.random.key(0))
    from dpbench import sampling
    from dpbench.ops import clip_to_l2
    b = compiled.sampler.sample(sampling.PRE_TRAINING_STEP)
    state = compiled.init_state(params, jax.random.key(1),
                                make_batch(compiled, images, labels, b.indices, b.mask))
    total = jax.tree.map(jnp.zeros_like, params)
    for idx in b.indices[b.mask]:
        g = jax.grad(loss_fn)(params, jnp.asarray(images[idx]), jnp.asarray(labels[idx]))
        score = clip_to_l2(jax.tree.map(jnp.multiply, params, g), 0.01)
        total = jax.tree.map(jnp.add, total, score)
    want = stages.prune.top_fraction_mask(jax.tree.map(jnp.abs, total), params, 0.5)
    got = state.stage_states[1]["mask"]
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert np.mean(np.asarray(w) == np.asarray(g)) > 0.99  # float ties at the threshold


def _ledger_noise_multiplier(event) -> float:
    """The Gaussian noise multiplier of a sampled-Gaussian DpEvent (what the accountant reads)."""
    if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        return event.noise_multiplier
    assert isinstance(event, dp_event.PoissonSampledDpEvent)
    return event.event.noise_multiplier


@pytest.fixture(scope="module")
def calibrated_snip():
    """A DP-SNIP pipeline compiled once with its noise calibrated to the budget (so the release's
    sigma differs from training's), at a fresh random score clip bound far from 1 (where a
    forgotten sensitivity would not show): (compiled, init_params, loss_fn)."""
    l2_bound = float(np.random.default_rng().uniform(0.05, 0.5))
    pipeline = _snip_pipeline()
    pipeline[1] = stages.prune.dp_snip(sparsity=0.5, l2_bound=l2_bound, epsilon_fraction=0.2)
    compiled, init_params, loss_fn = compile_small(pipeline, n=64, batch_size=16, micro=8,
                                                   model_name="mlp")
    assert compiled.init_noise_multiplier != compiled.noise_multiplier
    return compiled, init_params, loss_fn


def check_one_off_release_noise_matches_the_ledger(release_fn, snip, releases=64):
    """``release_fn`` (compiler.one_off_release's signature) releases DP-SNIP's scores on one
    sampler batch of fresh data ``releases`` times with fresh keys; the clean sum is the same
    every time, so the spread across releases is the noise alone. Its stddev must be the
    ledger's noise multiplier times the ledger's L2 sensitivity (a two-sided chi-square test on
    ~70,000 degrees of freedom: it tells 0.95x apart)."""
    compiled, init_params, loss_fn = snip
    rng = np.random.default_rng()
    (line,) = compiled.accounting.pre_mechanisms
    assert line.details["l2_sensitivity"] == compiled.stages[1].privacy.one_off_release.l2_bound
    declared = _ledger_noise_multiplier(line.event) * line.details["l2_sensitivity"]
    images, labels = random_data(64, seed=int(rng.integers(1 << 30)))
    b = compiled.sampler.sample(sampling.PRE_TRAINING_STEP)
    batch = make_batch(compiled, images, labels, b.indices, b.mask, step=None)
    params = init_params(jax.random.key(int(rng.integers(1 << 30))))
    release = jax.jit(jax.vmap(lambda key: release_fn(
        compiled.plan, compiled.accounting, loss_fn, 1, params, key, batch)))
    out = release(jax.random.split(jax.random.key(int(rng.integers(1 << 30))), releases))
    flat = np.concatenate([np.asarray(v, np.float64).reshape(releases, -1)
                           for v in jax.tree.leaves(out)], axis=1)
    spread = flat - flat.mean(axis=0)
    dof = flat.shape[1] * (releases - 1)
    assert dof > 50_000
    statistic = float(np.sum(np.square(spread))) / declared ** 2  # chi2(dof) under H0
    cdf = scipy.stats.chi2.cdf(statistic, dof)
    measured = declared * np.sqrt(statistic / dof)
    # an exact chi-square law: false failures 1e-6; the 0.95x twin sits > 15 sds off
    assert 2 * min(cdf, 1 - cdf) > 1e-6, \
        f"released noise stddev {measured:.6g}, the ledger declares {declared:.6g}"


def _release_with_sigma_only(plan, acct, loss_fn, i, params, key, batch):
    """BROKEN twin of compiler.one_off_release: noise stddev sigma, the sensitivity forgotten."""
    release = plan.stages[i].privacy.one_off_release
    acct = dataclasses.replace(acct, init_noise_multiplier=acct.init_noise_multiplier
                               / release.l2_bound)
    return compiler.one_off_release(plan, acct, loss_fn, i, params, key, batch)


def _release_with_five_percent_less_noise(plan, acct, loss_fn, i, params, key, batch):
    """BROKEN twin of compiler.one_off_release: noise stddev 0.95 sigma * sensitivity."""
    acct = dataclasses.replace(acct, init_noise_multiplier=0.95 * acct.init_noise_multiplier)
    return compiler.one_off_release(plan, acct, loss_fn, i, params, key, batch)


def _release_at_the_training_sigma(plan, acct, loss_fn, i, params, key, batch):
    """BROKEN twin of compiler.one_off_release: the training steps' sigma, not the release's."""
    acct = dataclasses.replace(acct, init_noise_multiplier=acct.noise_multiplier)
    return compiler.one_off_release(plan, acct, loss_fn, i, params, key, batch)


@pytest.mark.parametrize("release_fn", [compiler.one_off_release, _release_with_sigma_only,
                                        _release_with_five_percent_less_noise,
                                        _release_at_the_training_sigma],
                         ids=["compiler", "twin_sigma_only", "twin_0.95x", "twin_training_sigma"])
def test_dp_snip_release_adds_noise_at_the_scale_declared_to_the_ledger(release_fn,
                                                                         calibrated_snip):
    """Guarantee: DP-SNIP's one-off release adds Gaussian noise of stddev sigma * sensitivity,
    both as declared in its ledger line (the event's noise multiplier, the line's L2
    sensitivity = the clip bound of the scores). Twins with sigma alone, 0.95x, or
    the training steps' sigma must fail."""
    if release_fn is compiler.one_off_release:
        check_one_off_release_noise_matches_the_ledger(release_fn, calibrated_snip)
        return
    with pytest.raises(AssertionError, match="released noise stddev"):
        check_one_off_release_noise_matches_the_ledger(release_fn, calibrated_snip)
