"""Book-keeping gives the same clipped sum as materialized per-example gradients, and the
compiler picks it exactly where it reproduces the stage chain."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import accounting, compiler, models, sampling, stages
from dpbench.compiler import bookkeeping
from dpbench.compiler.taps import discover_taps
from tests.conftest import make_batch

MICRO = 8


def _compile(stage_list, model, with_model: bool, shape, n=48, batch=24, public_images=None,
             step_options=compiler.StepOptions()):
    sampler = sampling.PoissonSampler(n, batch, seed=0, pad_multiple=MICRO)
    return compiler.compile_pipeline(stage_list, compiler.RunInputs(
        loss_fn=models.cross_entropy_loss(model),
        init_params=lambda key: model.init(key, jnp.zeros((1,) + shape)), example_shape=shape,
        sampler=sampler, budget=accounting.Budget(3.0, 1e-5), total_steps=10,
        steps_per_epoch=2, noise_multiplier=1.0,
        public_images=public_images, model=model if with_model else None),
        micro_batch_size=MICRO, step_options=step_options)


def _cubic(elementwise: bool) -> stages.Stage:
    """A user's per-example stage that keeps a NaN (x -> x^3 on every coordinate): unlike
    Nasr's ternary map, it cannot hide a non-finite gradient that the sum failed to zero."""
    def apply(grads, state, ctx):
        del ctx
        return jax.tree.map(lambda g: g ** 3, grads), state

    hooks = stages.Hooks(elementwise=lambda x: x ** 3) if elementwise else stages.Hooks()
    return stages.Stage(name="user.cubic", kind_in=stages.Kind.PER_EXAMPLE,
                        kind_out=stages.Kind.PER_EXAMPLE,
                        make=lambda facts: stages.StageFns(apply=apply, hooks=hooks))


def _chain(kind):
    middle = {"dpsgd": [], "rs": [stages.sparsify.random_mask(final_rate=0.5, cooling="none")],
              "dpssgd": [stages.prune.random(sparsity=0.5),
                         stages.drop.gradients(rate=0.5, criterion="magnitude")],
              "nasr": [stages.nasr.discretize(threshold=1e-3)],
              "cubic": [_cubic(elementwise=True)],
              "cubic_general": [_cubic(elementwise=False)]}[kind]
    return ([stages.grad.per_example()] + middle +
            [stages.clip.global_l2(0.05), stages.noise.gaussian(),
             stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)])


def _sum_and_aux(compiled, state, batch):
    """(the clipped sum, its aux {"loss", "nonfinite"}) as the compiled step computes them."""
    return jax.jit(compiled.lowered.clipped_sum)(state, batch)


@pytest.mark.parametrize("name,shape,kind", [("tanh_cnn", (28, 28, 1), "dpsgd"),
                                              ("tanh_cnn", (28, 28, 1), "rs"),
                                              ("tanh_cnn", (28, 28, 1), "nasr"),
                                              ("mlp", (8, 8, 1), "dpssgd"),
                                              ("mlp", (8, 8, 1), "rs"),
                                              ("mlp", (8, 8, 1), "nasr"),
                                              ("tanh_cnn", (28, 28, 1), "cubic"),
                                              ("mlp", (8, 8, 1), "cubic_general")])
def test_same_clipped_sum_either_way(name, shape, kind):
    """Either strategy gives the same clipped sum, a non-finite example contributing exactly
    zero on both, through every kind of per-example stage (a user's NaN-keeping cubic too:
    a path that skipped the zeroing would give NaN there)."""
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
    (got, fast_aux), (want, slow_aux) = (_sum_and_aux(c, state, batch)
                                         for c in (fast, slow))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.all(np.isfinite(g)) and np.all(np.isfinite(w))
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)
    assert float(jnp.abs(jax.tree.leaves(got)[0]).sum()) > 0  # not vacuous
    # both paths detect the non-finite example (for Nasr its zeroed ternary gradient would
    # leave the sums equal even if one missed it) and sum the same finite losses
    assert float(fast_aux["nonfinite"]) == float(slow_aux["nonfinite"]) == 1.0
    np.testing.assert_allclose(fast_aux["loss"], slow_aux["loss"], rtol=1e-4)
    assert np.isfinite(float(fast_aux["loss"]))
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


_CONDITIONALS = ("stablehlo.case", "stablehlo.if")


@pytest.mark.parametrize("kind,with_model", [("dpsgd", True), ("rs", True), ("nasr", True),
                                             ("dpsgd", False)])
def test_a_branch_free_step_gives_the_same_sums_without_conditionals(kind, with_model):
    """train.branch_free_step (a GPU speed knob): the clipped sum of every path (book-keeping
    unmasked, masked, transformed; materialized) equals the default one, on a batch with a
    non-finite example and on one without (where the default takes its other weighted sum),
    each with a micro-batch of padding only; and its lowered step holds no conditional, where
    the default's does."""
    model, shape = models.make_model(10, name="mlp", hidden=(32,)), (8, 8, 1)
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    images[3] = np.nan
    labels = rng.integers(0, 10, 48).astype(np.int32)
    default, free = (_compile(_chain(kind), model, with_model, shape,
                              step_options=compiler.StepOptions(branch_free=f))
                     for f in (False, True))
    assert default.plan.strategy == free.plan.strategy == (
        "bookkeeping" if with_model else "materialized")
    state = default.init_state(model.init(jax.random.key(1), jnp.zeros((1,) + shape)),
                               jax.random.key(2))
    b = default.sampler.sample(0)
    assert len(b.mask) >= 2 * MICRO
    for with_nan in (True, False):
        b.indices[:4] = np.arange(4) if with_nan else np.arange(4, 8)
        mask = np.arange(len(b.mask)) < len(b.mask) - MICRO  # the last micro-batch: padding
        batch = make_batch(default, images, labels, b.indices, mask)
        (want, want_aux), (got, got_aux) = (_sum_and_aux(c, state, batch)
                                            for c in (default, free))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
        assert float(jnp.abs(jax.tree.leaves(got)[0]).sum()) > 0  # not vacuous
        assert float(got_aux["nonfinite"]) == float(want_aux["nonfinite"]) == float(with_nan)
        np.testing.assert_allclose(got_aux["loss"], want_aux["loss"], rtol=1e-5)
    hlo = {name: jax.jit(c.lowered.clipped_sum).lower(state, batch).as_text()
           for name, c in (("default", default), ("free", free))}
    assert any(op in hlo["default"] for op in _CONDITIONALS)
    assert not any(op in hlo["free"] for op in _CONDITIONALS)


class _TinyConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Conv(4, (3, 3), strides=2, padding="SAME", name="conv")(x))
        return nn.Dense(4, name="head")(x.reshape(x.shape[:-3] + (-1,)))


def test_conv_grads_reach_bookkeeping_through_compile_pipeline(monkeypatch):
    """compile_pipeline's StepOptions(conv_grads='convolution') reaches book-keeping: the
    convolution's per-example kernels come from _conv_kernels, and the step's clipped sum is
    the patches' (tests/test_wide_resnet.py compares the two on every WRN layer kind)."""
    model, shape = _TinyConv(), (8, 8, 1)
    formed = set()
    conv_kernels = bookkeeping._conv_kernels
    monkeypatch.setattr(bookkeeping, "_conv_kernels", lambda x, delta, tap, b: formed.add(
        tap.path) or conv_kernels(x, delta, tap, b))
    patches, convolution = (_compile(_chain("dpsgd"), model, True, shape,
                                     step_options=compiler.StepOptions(conv_grads=how))
                            for how in ("patches", "convolution"))
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    labels = rng.integers(0, 4, 48).astype(np.int32)
    state = patches.init_state(model.init(jax.random.key(1), jnp.zeros((1,) + shape)),
                               jax.random.key(2))
    b = patches.sampler.sample(0)
    batch = make_batch(patches, images, labels, b.indices, b.mask)
    formed.clear()  # compile_pipeline traced the step (eval_shape) once already
    want, _ = _sum_and_aux(patches, state, batch)
    assert formed == set()
    got, _ = _sum_and_aux(convolution, state, batch)
    assert formed == {("conv",)}
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(jax.tree.leaves(want)[0]).sum()) > 0
    with pytest.raises(ValueError, match="train.conv_grads must be one of"):
        compiler.StepOptions(conv_grads="im2col")


class _SharedDense(nn.Module):
    """One Dense layer called twice (shared weights): its gradient is the sum of two outer
    products, which book-keeping's one-input form would get wrong."""

    @nn.compact
    def __call__(self, x):
        layer = nn.Dense(8, name="shared")
        x = x.reshape(x.shape[:-3] + (-1,))
        return nn.Dense(4, name="head")(jnp.tanh(layer(jnp.tanh(x[..., :8]))) +
                                        layer(x[..., 8:16]))


class _Lifted(nn.Module):
    """Three Dense layers lifted over a leading axis (nn.vmap): their kernel (3, 8, 4) is not
    the input's 8 features, so the layer is no tap."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[:-3] + (-1,))[..., :8]
        stack = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=None, out_axes=0, axis_size=3)(4, name="stack")
        return nn.Dense(4, name="head")(jnp.tanh(stack(x)).sum(0))


class _LayerNormed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(name="norm")(x.reshape(x.shape[:-3] + (-1,)))
        return nn.Dense(4, name="head")(x)


def test_the_compiler_picks_bookkeeping_only_where_it_reproduces_the_chain():
    """Augmentation and GroupNorm's scale and bias are book-kept; a layer it does not tap
    (LayerNorm), a tap layer called twice or lifted over an extra axis, or GEP's layer form
    with augmentation are not."""
    model = models.make_model(10, name="mlp", hidden=(16,))
    shape = (8, 8, 1)
    augmented = [stages.grad.per_example(augmult=2, augmentation="crop")] + _chain("dpsgd")[1:]
    assert _compile(augmented, model, True, shape).plan.strategy == "bookkeeping"
    normed = models.make_model(10, name="tanh_cnn", group_norm_groups=4)
    assert _compile(_chain("dpsgd"), normed, True, (28, 28, 1)).plan.strategy == "bookkeeping"
    assert _compile(_chain("dpsgd"), model, True, shape).plan.strategy == "bookkeeping"
    for other in (_SharedDense(), _LayerNormed(), _Lifted()):
        assert _compile(_chain("dpsgd"), other, True, shape).plan.strategy == "materialized"
    gep = [stages.grad.per_example(augmult=2, augmentation="crop"),
           stages.gep.embed_and_clip(num_basis=4, num_anchors=8)] + _chain("dpsgd")[2:]
    public = np.random.default_rng().uniform(size=(8,) + shape).astype(np.float32)
    plan = _compile(gep, model, True, shape, public_images=public).plan
    assert plan.strategy == "materialized" and "takes no augmentation" in plan.strategy_reason


def test_a_materialized_plan_says_why():
    """The record and the log say which per-example strategy ran and, for the materialized
    one, why: parameters outside the tap layers (named), a tap layer called twice (named), a
    chain book-keeping does not reproduce, or no model; book-keeping needs no reason."""
    model = models.make_model(10, name="mlp", hidden=(16,))
    shape = (8, 8, 1)
    reason = _compile(_chain("dpsgd"), _LayerNormed(), True, shape).plan.strategy_reason
    assert "norm/bias, norm/scale" in reason and "GroupNorm with its scale and bias" in reason
    reason = _compile(_chain("dpsgd"), _SharedDense(), True, shape).plan.strategy_reason
    assert "shared (called 2 times)" in reason
    reason = _compile(_chain("dpsgd"), _Lifted(), True, shape).plan.strategy_reason
    assert "stack/bias, stack/kernel" in reason and "head" not in reason
    assert _compile(_chain("dpsgd"), model, True, shape).plan.strategy_reason == ""
    assert "no model" in _compile(_chain("dpsgd"), model, False, shape).plan.strategy_reason


class _ThreePathNet(nn.Module):
    """Tap layers whose shapes force each of book-keeping's per-layer norm paths: a
    convolution over many positions (materialized a^T delta), one over few positions and many
    channels (Gram / ghost products), and a dense layer (positions == 1)."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(models.PatchConv(16, (3, 3), name="Conv_many_positions")(x))  # T 64, d 18
        x = jnp.tanh(models.PatchConv(32, (4, 4), (4, 4), "VALID",
                                      name="Conv_few_positions")(x))            # T 4, d 256
        return nn.Dense(4, name="Dense")(x.reshape(x.shape[:-3] + (-1,)))


def _path(tap, masked: bool, transformed: bool) -> str:
    """Which of book-keeping's routes computes this layer's per-example norm (bookkeeping.py:
    _layer_terms for a public mask or none, per_example_squared_norms for a transform)."""
    if transformed:
        return "transformed"
    if tap.positions == 1:
        return "dense, masked" if masked else "dense"
    return "materialized" if masked or not tap.ghost_is_cheaper else "ghost (Gram)"


def _odd_cubic(tree):
    return jax.tree.map(lambda v: 2.0 * v + 50.0 * v ** 3, tree)  # elementwise, like Nasr's


NORM_CASES = {  # case -> (masked, transform, elementwise, the paths it must exercise)
    "unmasked": (False, None, False, {"dense", "ghost (Gram)", "materialized"}),
    "masked": (True, None, False, {"dense, masked", "materialized"}),
    "transformed": (False, _odd_cubic, False, {"transformed"}),
    "transformed_elementwise": (False, _odd_cubic, True, {"transformed"}),
}


def _random_mask(rng, shape):
    """A public 0/1 mask that keeps at least one coordinate (a bias mask too)."""
    mask = rng.integers(0, 2, shape).astype(np.float32)
    mask.flat[0] = 1.0
    return jnp.asarray(mask)


class _WideNet(nn.Module):
    """The wide ResNet's layer kinds at test size: a 3x3 convolution, a strided 3x3 and a
    strided 1x1 one (XLA's nn.Conv, as patches), GroupNorm's scale and bias (an affine tap) and
    a dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), padding="SAME", name="conv")(x)
        h = nn.relu(nn.GroupNorm(num_groups=4, name="norm")(x))
        shortcut = nn.Conv(16, (1, 1), strides=(2, 2), name="shortcut")(h)
        x = shortcut + nn.Conv(16, (3, 3), strides=2, padding="SAME", name="strided")(h)
        x = nn.relu(nn.GroupNorm(num_groups=4, name="final_norm")(x))
        return nn.Dense(4, name="head")(jnp.mean(x, axis=(-3, -2)))


MODELS = {"three_path": (_ThreePathNet(), (8, 8, 2)), "wide": (_WideNet(), (8, 8, 2))}
COPIES = {"three_path": 1, "wide": 2}  # the wide net's examples come as 2 augmented copies
_init_params = {name: jax.jit(model.init) for name, (model, _) in MODELS.items()}


@functools.partial(jax.jit, static_argnames=("name", "transform"))
def _reference_gradients(params, images, labels, masks, name, transform):
    """vmap(grad) per-example gradients (the mean over an example's copies, images
    b x K x ...), after the public mask or the transform."""
    loss = models.cross_entropy_loss(MODELS[name][0])
    per_copy = jax.vmap(jax.grad(loss), in_axes=(None, 0, None))
    grads = jax.vmap(lambda ims, y: jax.tree.map(lambda g: g.mean(0), per_copy(params, ims, y)),
                     in_axes=(0, 0))(images, labels)
    if masks is not None:
        grads = jax.tree.map(jnp.multiply, grads, masks)
    return grads if transform is None else transform(grads)


def _bias_shares(grads, taps) -> dict:
    """Per tap kind, the smallest share over examples of its layers' biases in the squared
    norm (what a norm that dropped them would miss)."""
    total = sum(np.sum(np.square(v).reshape(len(v), -1), 1) for v in jax.tree.leaves(grads))
    shares = {}
    for t in taps:
        bias = np.sum(np.square(grads["params"][t.path[0]]["bias"]), 1)
        shares[t.kind] = shares.get(t.kind, 0.0) + bias / total
    return {kind: float(np.min(share)) for kind, share in shares.items()}


def check_per_example_norms_include_every_parameter(case: str, name: str = "three_path"):
    """Book-keeping's clipped sum with one example at a time (one-hot masks) and a bound far
    below every gradient's norm is C h(g_i) / n_i, n_i the norm it computed: n_i must be the
    norm of the vmap(grad) gradient h(g_i) over every parameter, biases included."""
    masked, transform, elementwise, paths = NORM_CASES[case]
    rng = np.random.default_rng()
    (model, shape), copies = MODELS[name], COPIES[name]
    batch, bound = 6, 1e-4
    # Unit-scale inputs for the wide net: a layer before a GroupNorm has a gradient inversely
    # proportional to its input's scale, which would drown the other layers' biases.
    spread = 0.1 if name == "three_path" else 1.0
    for _ in range(20):  # fresh draws until every kind's biases weigh in the norm (see below)
        params = _init_params[name](jax.random.key(int(rng.integers(1 << 30))),
                                    jnp.zeros((1,) + shape))
        images = jnp.asarray(rng.normal(size=(batch, copies) + shape) * spread, jnp.float32)
        labels = jnp.asarray(rng.integers(0, 4, batch), jnp.int32)
        masks = jax.tree.map(lambda v: _random_mask(rng, v.shape), params) if masked else None
        want = jax.tree.map(lambda v: np.asarray(v, np.float64), _reference_gradients(
            params, images, labels, masks, name, transform))
        taps = discover_taps(model, params, shape)
        shares = _bias_shares(want, taps)
        # Dropped biases move n_i by > 25 x rtol. A draw below it is redrawn (observed: the
        # smallest share in 40 draws 3.5e-4, GroupNorm's biases), so the check cannot pass
        # vacuously and a rare draw does not fail it.
        if min(shares.values()) > 1e-4:
            break
    assert min(shares.values()) > 1e-4, shares
    if name == "three_path":
        assert {_path(t, masked, transform is not None) for t in taps} == paths
    else:
        assert {t.kind for t in taps} == {"matmul", "affine"} and len(taps) == 6
    one_at_a_time = jax.jit(jax.vmap(lambda onehot: bookkeeping.clipped_sum(
        model, taps, params, images.reshape((-1,) + shape), jnp.repeat(labels, copies), onehot,
        bound, masks=masks, transform=transform, elementwise=elementwise, copies=copies)[0]))
    got = one_at_a_time(jnp.eye(batch, dtype=bool))
    flat = lambda tree: np.concatenate(  # noqa: E731
        [np.asarray(v, np.float64).reshape(batch, -1) for v in jax.tree.leaves(tree)], axis=1)
    got_flat, want_flat = flat(got), flat(want)
    want_norms = np.linalg.norm(want_flat, axis=1)
    assert np.all(want_norms > 100 * bound)  # every example is clipped
    got_norms = bound * want_norms / np.linalg.norm(got_flat, axis=1)  # the n_i it divided by
    np.testing.assert_allclose(got_norms, want_norms, rtol=2e-6,  # observed: <= 1.8e-7
                               err_msg="the norms book-keeping clipped by are not vmap(grad)'s")
    cosines = np.sum(got_flat * want_flat, 1) / (np.linalg.norm(got_flat, axis=1) * want_norms)
    assert np.all(cosines > 1 - 1e-6)


_REAL_LAYER_TERMS = bookkeeping._layer_terms
_REAL_AFFINE_TERMS = bookkeeping._affine_terms
_REAL_SQUARED_NORMS = bookkeeping.per_example_squared_norms


def _layer_terms_without_the_bias(a, delta, kernel_mask, bias_mask, tap, kernel=None):
    """BROKEN twin of bookkeeping._layer_terms: the layer's per-example norm leaves its bias
    gradient out (on every path: dense, Gram, materialized)."""
    squares, kernel, bias = _REAL_LAYER_TERMS(a, delta, kernel_mask, bias_mask, tap, kernel)
    return squares - jnp.sum(jnp.square(bias), axis=1), kernel, bias


def _affine_terms_without_the_bias(a, delta, scale_mask, bias_mask, tap):
    """BROKEN twin of bookkeeping._affine_terms: GroupNorm's bias left out of the norm."""
    squares, scale, bias = _REAL_AFFINE_TERMS(a, delta, scale_mask, bias_mask, tap)
    return squares - jnp.sum(jnp.square(bias), axis=1), scale, bias


def _squared_norms_without_biases_beside(sibling: str):
    """BROKEN twin of bookkeeping.per_example_squared_norms: the bias leaves of the layers of
    one kind (those with a ``sibling`` leaf: kernel for matmul layers, scale for affine ones)
    left out."""
    def squared_norms(values, b):
        kept = []
        for path, v in jax.tree_util.tree_flatten_with_path(values)[0]:
            layer = values
            for key in path[:-1]:
                layer = layer[key.key]
            if not (path[-1].key == "bias" and sibling in layer):
                kept.append(v)
        return _REAL_SQUARED_NORMS(kept, b)
    return squared_norms


TWINS = {"twin_without_matmul_biases": ("_layer_terms", _layer_terms_without_the_bias, "kernel"),
         "twin_without_affine_biases": ("_affine_terms", _affine_terms_without_the_bias, "scale")}


@pytest.mark.parametrize("norms", ["bookkeeping"] + sorted(TWINS))
@pytest.mark.parametrize("case", sorted(NORM_CASES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_example_norms_include_the_biases_on_every_path(name, case, norms, monkeypatch):
    """Guarantee: book-keeping clips each example by the norm of its WHOLE gradient (every
    kernel, scale and bias) on every path (dense, Gram/ghost, materialized, masked,
    transformed; convolutions strided and 1x1, GroupNorm's affine map, augmentation copies),
    as the vmap(grad) gradients give it. A twin whose norm drops one kind of layer's biases
    must fail the same check."""
    if norms == "bookkeeping":
        check_per_example_norms_include_every_parameter(case, name)
        return
    if name == "three_path" and norms == "twin_without_affine_biases":
        pytest.skip("the three-path net has no affine layer")
    terms, broken, sibling = TWINS[norms]
    monkeypatch.setattr(bookkeeping, terms, broken)
    monkeypatch.setattr(bookkeeping, "per_example_squared_norms",
                        _squared_norms_without_biases_beside(sibling))
    with pytest.raises(AssertionError, match="not vmap\\(grad\\)'s"):
        check_per_example_norms_include_every_parameter(case, name)


class _SanitizedHidden(nn.Module):
    """A model whose loss stays finite on a NaN input (its hidden layer's non-finite outputs
    are replaced by 0) while the first layer's kernel gradient, input x output gradient, is
    NaN: what a fused forward pass that drops a NaN gives (seen on the WRN with Nasr)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="first")(x.reshape(x.shape[:-3] + (-1,)))
        return nn.Dense(4, name="head")(jnp.where(jnp.isfinite(h), jnp.tanh(h), 0.0))


@pytest.mark.parametrize("with_model", [True, False])
def test_a_nan_example_is_counted_when_a_stage_maps_its_gradient_to_finite_values(with_model):
    """An example whose GRADIENT is not finite is zeroed and counted even when its loss is
    finite and a per-example stage (Nasr's ternary) would map the gradient to finite values:
    both strategies, one example alone in the batch."""
    model, shape = _SanitizedHidden(), (8, 8, 1)
    compiled = _compile(_chain("nasr"), model, with_model, shape)
    assert compiled.plan.strategy == ("bookkeeping" if with_model else "materialized")
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    images[3] = np.nan
    labels = rng.integers(0, 4, 48).astype(np.int32)
    params = model.init(jax.random.key(1), jnp.zeros((1,) + shape))
    loss = models.cross_entropy_loss(model)(params, jnp.asarray(images[3]), labels[3])
    assert np.isfinite(float(loss))  # the loss alone cannot tell
    state = compiled.init_state(params, jax.random.key(2))
    b = compiled.sampler.sample(0)
    b.indices[:6] = np.arange(6)
    only = np.zeros_like(b.mask)
    only[3] = True
    total, aux = _sum_and_aux(compiled, state, make_batch(compiled, images, labels, b.indices,
                                                          only))
    assert float(aux["nonfinite"]) == 1.0 and float(aux["loss"]) == 0.0
    assert all(float(jnp.abs(v).sum()) == 0.0 for v in jax.tree.leaves(total))
