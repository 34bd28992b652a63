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


def _tiny_residual_examples(rng, basis, n, embed_norm, residual_norm):
    """Gradients almost inside span(B): a huge embedding and a small residual of given norm."""
    k, p = basis.shape
    out = []
    for _ in range(n):
        z = rng.normal(size=k)
        u = rng.normal(size=p)
        u -= np.asarray(basis, np.float64).T @ (np.asarray(basis, np.float64) @ u)
        out.append(embed_norm * z / np.linalg.norm(z) @ np.asarray(basis, np.float64)
                   + residual_norm * u / np.linalg.norm(u))
    return np.asarray(out, np.float32)


def test_residual_clip_is_never_under_applied_against_tiny_residuals():
    """Adversarial gradients with ||g|| = 1e3 and a residual of 0.05 (2.5 S2): the residual's
    norm comes from ||g||^2 - ||w||^2, where float32 cancellation is ~100x the true value. The
    rigorous bound keeps every example's finished residual at norm <= 1 (exact, float64
    check); the naive difference lets some through unclipped (the bound is necessary)."""
    rng = np.random.default_rng()
    p, k, s2 = 4096, 64, 0.02
    q, _ = np.linalg.qr(rng.normal(size=(p, k)))
    basis = jnp.asarray(q.T, jnp.float32)
    eps = gep.orthonormality_error(basis)
    assert 0 < float(eps) < 0.05  # worst-case rounding of 4096-term dot products: k gamma_p
    grads = _tiny_residual_examples(rng, basis, 64, 1e3, 2.5 * s2)
    one = jax.jit(jax.vmap(lambda g: gep.embed_and_clip_one(
        {"params": {"layer": {"kernel": g}}}, {"layer": basis}, eps, 1.0, s2, False)))
    out = one(jnp.asarray(grads))
    b64 = np.asarray(basis, np.float64)
    naive_over = 0
    for i in range(len(grads)):
        rv = np.asarray(out["rv"]["layer"]["kernel"][i], np.float64)
        rw = np.asarray(out["rw"]["layer"][i], np.float64)
        finished = rv - b64.T @ rw          # this example's residual part, exactly
        assert np.linalg.norm(finished) <= 1.0
        g = grads[i].astype(np.float32)
        w = np.asarray(basis @ jnp.asarray(g))
        naive_sq = float(np.sum(np.square(g)) - np.sum(np.square(w)))  # float32 cancellation
        c = min(1.0, s2 / np.sqrt(max(naive_sq, 1e-30)))
        naive_over += np.linalg.norm(c * (g - b64.T @ w.astype(np.float64)) / s2) > 1.0
    assert naive_over > 0  # 42-53 of 64 were in each of 30 seeds: none has probability < 1e-29


def test_residual_bound_is_tight_when_the_residual_is_not_tiny():
    """On ordinary gradients (residual comparable to the gradient) the bound clips like the
    explicit residual's norm, to 1e-3."""
    rng = np.random.default_rng()
    p, k, s2 = 2048, 32, 0.02
    q, _ = np.linalg.qr(rng.normal(size=(p, k)))
    basis = jnp.asarray(q.T, jnp.float32)
    eps = gep.orthonormality_error(basis)
    grads = rng.normal(size=(16, p)).astype(np.float32)
    out = jax.vmap(lambda g: gep.embed_and_clip_one(
        {"params": {"layer": {"kernel": g}}}, {"layer": basis}, eps, 1.0, s2, False))(grads)
    b64 = np.asarray(basis, np.float64)
    for i in range(len(grads)):
        finished = (np.asarray(out["rv"]["layer"]["kernel"][i], np.float64)
                    - b64.T @ np.asarray(out["rw"]["layer"][i], np.float64))
        assert 1.0 - 1e-3 <= np.linalg.norm(finished) <= 1.0  # clipped onto the sphere


def test_random_start_is_independent_fair_signs():
    """32 signs per random word: every entry +-1, fair, and neither neighbours in a row (bits of
    one word), nor rows, nor the same bit of consecutive words are correlated."""
    k, p = 64, 3000 + 7  # p not a multiple of 32: the last word is cut
    key = jax.random.key(np.random.default_rng().integers(2**31))
    x = np.asarray(jax.jit(gep.random_start, static_argnums=(1, 2))(key, k, p))
    assert x.shape == (k, p) and set(np.unique(x)) == {-1.0, 1.0}
    five_sigma = lambda n: 5 / np.sqrt(n)  # noqa: E731 (a mean of n fair signs)
    # every product below is itself i.i.d. fair signs: false failures 2.2e-5 in all (exact
    # binomial tails; 1.9e-5 of it the 32 bit positions)
    assert abs(x.mean()) < five_sigma(x.size)
    assert np.all(np.abs(x.reshape(k, -1)[:, :p - p % 32].reshape(k, -1, 32).mean(axis=(0, 1)))
                  < five_sigma(k * (p // 32)))  # every bit position is fair
    for a, b in ((x[:, 1:], x[:, :-1]), (x[1:], x[:-1]), (x[:, 32:], x[:, :-32])):
        assert abs(np.mean(a * b)) < five_sigma(a.size)
    other = np.asarray(gep.random_start(jax.random.fold_in(key, 1), k, p))
    assert abs(np.mean(x * other)) < five_sigma(x.size)


GROUP_SHAPES = {"Dense_0": {"kernel": (20, 8), "bias": (8,)},  # two parameter groups
                "Dense_1": {"kernel": (8, 4), "bias": (4,)}}


def _perturbed_bases(rng, rows: dict, perturbation: float) -> dict:
    """Per group, orthonormal rows moved off orthonormality by a random perturbation (float32)."""
    out = {}
    for g, k in rows.items():
        p = sum(int(np.prod(s)) for s in GROUP_SHAPES[g].values())
        q, _ = np.linalg.qr(rng.normal(size=(p, k)))
        out[g] = jnp.asarray(q.T + perturbation * rng.normal(size=(k, p)) / np.sqrt(p),
                             jnp.float32)
    return out


def _adversarial_gradients(rng, bases: dict, n: int):
    """Per example and group, v_g = s_g B_g^T u_g with u_g the top eigenvector of B_g B_g^T
    (eigenvalue lambda > 1), s_g log-uniform over 1e-2..1e3, plus a little noise: then
    ||v||^2 - ||B v||^2 < 0 while the true residual is s sqrt(lambda) (lambda - 1) per group,
    so a bound without the orthonormality error clips nothing. Flat vectors per group."""
    out = {g: [] for g in bases}
    for g, basis in bases.items():
        b64 = np.asarray(basis, np.float64)
        _, vectors = np.linalg.eigh(b64 @ b64.T)
        top = b64.T @ vectors[:, -1]
        for _ in range(n):
            scale = 10.0 ** rng.uniform(-2, 3)
            out[g].append(scale * (top + 1e-3 * rng.normal(size=top.shape)))
    return {g: np.asarray(v, np.float32) for g, v in out.items()}


def _as_params(flat: dict):
    """Flat per-group vectors (leaves in tree order, as gep._flat) -> a batched params tree."""
    tree = {}
    for g, vectors in flat.items():
        tree[g], start = {}, 0
        for name in sorted(GROUP_SHAPES[g]):  # jax.tree.leaves order: bias, then kernel
            shape = GROUP_SHAPES[g][name]
            size = int(np.prod(shape))
            tree[g][name] = jnp.asarray(vectors[:, start:start + size].reshape((-1,) + shape))
            start += size
    return {"params": tree}


def check_released_parts_stay_within_the_declared_bounds(embed_one):
    """``embed_one`` (gep.embed_and_clip_one's signature) on adversarial gradients and a basis
    that is NOT orthonormal, with the stage's own orthonormality error: removing any one
    example from the batch moves the released embedding sum and the released residual sum
    (finish_residual's linear map, here in exact float64) by at most the declared bound of
    each part (the stage's l2_bound: S1 and S2 in parameter units)."""
    s1, s2 = 0.1, 0.02
    stage = stages.gep.embed_and_clip(embedding_bound=s1, residual_bound=s2)
    assert stage.privacy.parts == 2 and stage.privacy.l2_bound == 1.0
    rng = np.random.default_rng()
    bases = _perturbed_bases(rng, {"Dense_0": 6, "Dense_1": 3}, perturbation=0.1)
    eps = gep.basis_orthonormality_error(bases)
    assert float(eps) > 1e-2  # far from orthonormal: eps is what keeps the bound rigorous
    # (these two 'not vacuous' checks: over 2,000 seeds eps >= 0.047, and the largest raw
    # residual >= 730 S2; it falls under 100 S2 w.p. < 1e-8, from the 48 scales' law)
    flat = _adversarial_gradients(rng, bases, n=48)
    raw = np.sqrt(sum(np.sum(np.square(v - (v @ b.T) @ b), 1) for v, b in (
        (flat[g].astype(np.float64), np.asarray(bases[g], np.float64)) for g in bases)))
    assert np.max(raw) > 100 * s2  # not vacuous: unclipped residuals far above S2
    out = jax.jit(jax.vmap(lambda grads: embed_one(grads, bases, eps, s1, s2, False)))(
        _as_params(flat))
    embedding_moves = np.linalg.norm(np.asarray(out["w"], np.float64), axis=1)
    assert np.max(embedding_moves) <= stage.privacy.l2_bound * (1 + 1e-6)
    residual_sq = 0.0
    for g, basis in bases.items():  # one example's part of sum c (v - B^T w) / S2, exactly
        rv = np.concatenate([np.asarray(x, np.float64).reshape(len(x), -1)
                             for x in jax.tree.leaves(out["rv"][g])], axis=1)
        rw = np.asarray(out["rw"][g], np.float64)
        residual_sq = residual_sq + np.sum(np.square(rv - rw @ np.asarray(basis, np.float64)),
                                           axis=1)
    worst = float(np.sqrt(np.max(residual_sq)))
    assert worst <= stage.privacy.l2_bound * (1 + 1e-6), \
        f"one example moves the released residual sum by {worst} > {stage.privacy.l2_bound}"


def _embed_and_clip_ignoring_the_orthonormality_error(grads, basis, eps, embedding_bound,
                                                       residual_bound, biased):
    """BROKEN twin of gep.embed_and_clip_one: the residual bound as if the basis were exactly
    orthonormal (eps = 0), i.e. ||v||^2 - ||w||^2."""
    return gep.embed_and_clip_one(grads, basis, jnp.zeros_like(eps), embedding_bound,
                                  residual_bound, biased)


@pytest.mark.parametrize("embed_one", [gep.embed_and_clip_one,
                                       _embed_and_clip_ignoring_the_orthonormality_error],
                         ids=["gep", "twin_ignoring_orthonormality_error"])
def test_residual_bound_holds_for_a_non_orthonormal_basis(embed_one):
    """Guarantee: GEP's residual clip stays rigorous when the basis is not orthonormal (its
    orthonormality error enters the bound): adversarial gradients along the top eigenvector
    of B B^T move neither released part by more than its declared bound. A twin that ignores
    the error lets them through unclipped."""
    if embed_one is gep.embed_and_clip_one:
        check_released_parts_stay_within_the_declared_bounds(embed_one)
        return
    with pytest.raises(AssertionError, match="moves the released residual sum"):
        check_released_parts_stay_within_the_declared_bounds(embed_one)


# --- Book-keeping form (Hooks.layer_clip) and the r-step basis -------------------------

def _compile_with_model(model_name, shape, biased=False, refresh=1, n=48, batch=24):
    """GEP compiled as run.train compiles it: with the model, so book-keeping where it
    applies (``with_model``), else the per-example (vmapped) path."""
    from dpbench import compiler, models, sampling

    model = models.make_model(10, name=model_name, hidden=(32,))
    public = np.random.default_rng(5).uniform(size=(40,) + shape).astype(np.float32)

    def build(with_model):
        stage_list = [stages.grad.per_example(),
                      stages.gep.embed_and_clip(num_basis=20, num_anchors=40, embedding_bound=0.05,
                                                residual_bound=0.01, biased=biased,
                                                anchor_chunk=16, basis_refresh_every=refresh),
                      stages.noise.gaussian(),
                      stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)]
        return compiler.compile_pipeline(stage_list, compiler.RunInputs(
            loss_fn=models.cross_entropy_loss(model),
            init_params=lambda key: model.init(key, jnp.zeros((1,) + shape)),
            example_shape=shape, sampler=sampling.PoissonSampler(n, batch, seed=0, pad_multiple=8),
            budget=accounting.Budget(3.0, 1e-5), total_steps=10, steps_per_epoch=2,
            noise_multiplier=1.0, public_images=public, num_classes=10,
            model=model if with_model else None), micro_batch_size=8)
    return model, build


@pytest.mark.parametrize("model_name,shape,biased", [("tanh_cnn", (16, 16, 1), False),
                                                     ("mlp", (8, 8, 1), True)])
def test_book_keeping_gives_the_release_of_per_example_gradients(model_name, shape, biased):
    """Same clipped sum (embedding, and residual after finish_sum) from one batched backward
    pass as from vmapped per-example gradients, a non-finite example left out and counted by
    both; the basis of the batched anchor gradients is the vmapped one's."""
    model, build = _compile_with_model(model_name, shape, biased)
    fast, slow = build(True), build(False)
    assert (fast.plan.strategy, slow.plan.strategy) == ("bookkeeping", "materialized")
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    labels = rng.integers(0, 10, 48).astype(np.int32)
    images[3] = np.nan
    params = model.init(jax.random.key(1), jnp.zeros((1,) + shape))
    state = fast.init_state(params, jax.random.key(2))
    b = fast.sampler.sample(0)
    b.mask[:4] = True
    b.indices[:4] = np.arange(4)
    batch = make_batch(fast, images, labels, b.indices, b.mask)
    got = jax.jit(fast.lowered.clipped_sum)(state, batch)[0]
    want = jax.jit(slow.lowered.clipped_sum)(state, batch)[0]
    assert set(got) == set(want) == ({"w"} if biased else {"w", "r"})
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(w))))
    assert float(jnp.abs(got["w"]).sum()) > 0
    # The embedding sums agree, so do the two bases (a row's sign would flip its coordinate).
    if model_name != "mlp":
        return  # the whole step once (compiling the CNN's two steps costs suite time)
    fast_state, fast_metrics = fast.step(state, batch)
    slow_state, slow_metrics = slow.step(slow.init_state(params, jax.random.key(2)), batch)
    assert float(fast_metrics["nonfinite_examples"]) == float(
        slow_metrics["nonfinite_examples"]) == 1.0
    for g in fast_state.stage_states[1]["basis"]:  # same span (rows' signs may differ)
        one, other = (np.asarray(s.stage_states[1]["basis"][g], np.float64)
                      for s in (fast_state, slow_state))
        np.testing.assert_allclose(one.T @ one, other.T @ other, atol=1e-4)


def test_the_residual_bound_takes_the_bases_own_orthonormality_error():
    """The eps that enters the S2 residual bound (the stage state's ``orth_error``, set at each
    basis refresh) bounds the float32 basis's actual ||B B^T - I||_2, computed in float64
    after a real step: float32 leaves the basis only nearly orthonormal (the actual error is
    not 0), and the S2 clip stays sound only with that error in its bound."""
    model, build = _compile_with_model("mlp", (8, 8, 1))
    compiled = build(False)
    images, labels = random_data(48, (8, 8, 1), num_classes=10,
                                 seed=int(np.random.default_rng().integers(1 << 30)))
    state = compiled.init_state(model.init(jax.random.key(1), jnp.zeros((1, 8, 8, 1))),
                                jax.random.key(2))
    b = compiled.sampler.sample(0)
    new, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
    gep_state = new.stage_states[1]
    actual = max(np.linalg.norm(np.asarray(basis, np.float64) @ np.asarray(basis, np.float64).T
                                - np.eye(basis.shape[0]), 2)
                 for basis in gep_state["basis"].values())
    assert actual > 0
    assert float(gep_state["orth_error"]) >= actual


def _via_layer_form(grads, basis, eps, embedding_bound, residual_bound, biased):
    """gep.embed_and_clip_one's signature, computed by the book-keeping form for a batch of
    one example (its sum is its own value): what the compiler runs for a matmul model."""
    kernel_shapes = {g: grads["params"][g]["kernel"].shape for g in basis}
    layered = {g: {"bias": grads["params"][g]["bias"][None],
                   "kernel": grads["params"][g]["kernel"].T[None]} for g in basis}
    columns = {g: gep.tap_columns(basis[g], kernel_shapes[g]) for g in basis}
    total, finite = gep.embed_and_clip_layers(layered, jnp.ones((1,), bool), columns,
                                              kernel_shapes, eps, embedding_bound,
                                              residual_bound, biased)
    return total


def test_the_book_keeping_form_keeps_both_bounds_against_adversarial_examples():
    """The S1 / S2 guarantee of the layer form itself: adversarial gradients along the top
    eigenvector of a non-orthonormal basis move neither released part by more than its bound."""
    check_released_parts_stay_within_the_declared_bounds(_via_layer_form)


def test_the_r_step_basis_is_kept_between_refreshes_and_stated():
    """basis_refresh_every = 2: the basis of step 1 is step 0's, step 2 computes a new one (the
    parameters moved); the privacy statement says how often, and the accounting is the
    paper setting's (the basis is public)."""
    from dpbench import records

    model, build = _compile_with_model("mlp", (8, 8, 1), refresh=2)
    compiled, every_step = build(True), _compile_with_model("mlp", (8, 8, 1))[1](True)
    rng = np.random.default_rng()
    images = rng.uniform(size=(48, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 10, 48).astype(np.int32)
    state = compiled.init_state(model.init(jax.random.key(1), jnp.zeros((1, 8, 8, 1))),
                                jax.random.key(2))
    bases = []
    for t in range(3):
        b = compiled.sampler.sample(t)
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask,
                                                   step=t))
        bases.append({g: np.asarray(v) for g, v in state.stage_states[1]["basis"].items()})
    for g in bases[0]:
        np.testing.assert_array_equal(bases[0][g], bases[1][g])
        assert not np.allclose(bases[1][g], bases[2][g])
    lines = [accounting.mechanism_fields(m) for m in compiled.ledger(3)]
    assert "every 2 steps (kept in between)" in records._describe_mechanism(lines[0])
    assert "every step" in records._describe_mechanism(
        accounting.mechanism_fields(every_step.ledger(3)[0]))
    assert compiled.run_event(3) == every_step.run_event(3)
