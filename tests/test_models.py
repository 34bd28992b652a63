import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import models


@pytest.mark.parametrize("strides,padding", [((2, 2), "SAME"), ((2, 2), "VALID"),
                                             ((1, 1), "SAME")])
def test_patch_conv_equals_flax_conv(strides, padding):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(3, 12, 12, 2)).astype(np.float32))
    conv = nn.Conv(5, (4, 3), strides=strides, padding=padding)
    params = conv.init(jax.random.key(int(rng.integers(1 << 30))), x)
    patch = models.PatchConv(5, (4, 3), strides, padding)
    np.testing.assert_allclose(jax.jit(patch.apply)(params, x), conv.apply(params, x),
                               rtol=1e-5, atol=1e-5)
    # the gradients (parameters and input) are nn.Conv's too
    cotangent = jnp.asarray(rng.normal(size=conv.apply(params, x).shape).astype(np.float32))
    grad_patch = jax.jit(jax.grad(lambda p, x: jnp.vdot(patch.apply(p, x), cotangent),
                                  argnums=(0, 1)))(params, x)
    grad_conv = jax.grad(lambda p, x: jnp.vdot(conv.apply(p, x), cotangent),
                         argnums=(0, 1))(params, x)
    for got, want in zip(jax.tree.leaves(grad_patch), jax.tree.leaves(grad_conv)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_max_pool_2x2_stride_1_equals_flax_max_pool_with_its_gradient():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(3, 9, 7, 4)).astype(np.float32))  # no ties: continuous
    def flax_pool(h):
        return nn.max_pool(h, (2, 2), strides=(1, 1), padding="VALID")
    pooled = jax.jit(models.max_pool_2x2_stride_1)(x)
    np.testing.assert_array_equal(pooled, flax_pool(x))
    cotangent = jnp.asarray(rng.normal(size=pooled.shape).astype(np.float32))
    np.testing.assert_allclose(
        jax.jit(jax.grad(lambda h: jnp.vdot(models.max_pool_2x2_stride_1(h), cotangent)))(x),
        jax.grad(lambda h: jnp.vdot(flax_pool(h), cotangent))(x), rtol=1e-6, atol=1e-6)


def _input_shape(name):
    """28x28 Fashion-MNIST pixels, or their ScatterNet features (J=2, L=8)."""
    return (7, 7, 81) if name in models.REQUIRED_FEATURES else (28, 28, 1)


@pytest.mark.parametrize("name", models.MODELS)
def test_models_give_logits_and_their_twin_has_the_same_parameters(name):
    model = models.make_model(10, name=name)
    shape = _input_shape(name)
    params = model.init(jax.random.key(0), jnp.zeros((1,) + shape))
    assert model.apply(params, jnp.zeros((5,) + shape)).shape == (5, 10)
    twin = models.make_model(10, name=name, linearized=True)
    assert jax.tree.map(jnp.shape, twin.init(jax.random.key(0), jnp.zeros((1,) + shape))) == \
        jax.tree.map(jnp.shape, params)
    ones = jnp.ones((1,) + shape)
    if name != "tanh_cnn":  # (tanh_cnn's twin keeps its input centering: a fixed affine map)
        assert float(jnp.abs(jax.grad(lambda p: twin.apply(p, ones).sum())(params)[
            "params"]["Dense_0"]["kernel"]).sum()) > 0  # SynFlow sees a signal


def test_scatter_models_have_tramer_boneh_shapes_and_normalize_each_example_alone():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(4, 7, 7, 81)).astype(np.float32))
    for name, sizes in {
            "scatter_linear": {"Dense_0": (3969, 10)},
            "scatter_cnn": {"Conv_0": (3, 3, 81, 16), "Conv_1": (3, 3, 16, 32),
                            "Dense_0": (512, 32), "Dense_1": (32, 10)}}.items():
        model = models.make_model(10, name=name)
        params = model.init(jax.random.key(0), x)
        assert {k: v["kernel"].shape for k, v in params["params"].items()} == sizes
        full = model.apply(params, x)
        single = jnp.concatenate([model.apply(params, x[i:i + 1]) for i in range(4)])
        np.testing.assert_allclose(full, single, atol=1e-5)  # no cross-example mixing
        # GroupNorm: each example is normalized by its own statistics (27 groups of 3)
        shifted = x.at[0].set(5.0 * x[0] + 3.0)
        np.testing.assert_allclose(model.apply(params, shifted)[0], full[0], atol=1e-3)


def test_a_model_refuses_features_it_is_not_built_for():
    scatter = models.ModelConfig(name="scatter_linear")
    scatter.check_features(dict(kind="scattering", J=2, L=8))
    with pytest.raises(ValueError, match="dataset.features = 'scattering'"):
        scatter.check_features(dict(kind="pixels"))
    with pytest.raises(ValueError, match="dataset.features = 'pixels'"):
        models.ModelConfig(name="tanh_cnn").check_features(dict(kind="scattering"))
    models.ModelConfig(name="logistic").check_features(dict(kind="scattering"))


def test_tanh_cnn_has_papernot_shape_and_both_conv_impls_agree():
    x = jnp.asarray(np.random.default_rng().normal(size=(2, 28, 28, 1)).astype(np.float32))
    fast, xla = (models.make_model(10, name="tanh_cnn", conv_impl=c) for c in ("patches", "xla"))
    params = fast.init(jax.random.key(0), x)
    sizes = {k: v["kernel"].shape for k, v in params["params"].items()}
    assert sizes == {"Conv_0": (8, 8, 1, 16), "Conv_1": (4, 4, 16, 32), "Dense_0": (512, 32),
                     "Dense_1": (32, 10)}
    np.testing.assert_allclose(fast.apply(params, x), xla.apply(params, x), atol=1e-5)


def test_group_norm_is_per_example_and_unknown_names_fail():
    model = models.make_model(10, name="tanh_cnn", group_norm_groups=4)
    x = jnp.asarray(np.random.default_rng().normal(size=(4, 28, 28, 1)).astype(np.float32))
    params = model.init(jax.random.key(0), x)
    full = model.apply(params, x)
    single = jnp.concatenate([model.apply(params, x[i:i + 1]) for i in range(4)])
    np.testing.assert_allclose(full, single, atol=1e-5)  # no cross-example mixing
    # the GroupNorm layers are there (with their scale and bias) and normalize: the same model
    # without them gives other outputs on the same parameters' convolutions
    norms = [k for k in params["params"] if k.startswith("GroupNorm")]
    assert len(norms) == 2 and {"scale", "bias"} <= set(params["params"][norms[0]])
    plain = models.make_model(10, name="tanh_cnn")
    without = {"params": {k: v for k, v in params["params"].items() if k not in norms}}
    assert not np.allclose(plain.apply(without, x), full, atol=1e-3)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        models.make_model(10, name="vgg")


@pytest.mark.parametrize("shape,kernel,strides,padding", [
    ((3, 13, 13, 16), (4, 4), (2, 2), "VALID"),   # the tanh CNN's second layer
    ((2, 28, 28, 1), (8, 8), (2, 2), "SAME"),     # its first
    ((2, 12, 11, 2), (4, 3), (2, 2), "SAME"),     # kernel not a multiple of the stride
    ((2, 12, 11, 2), (5, 3), (3, 2), "VALID"),
    ((2, 9, 9, 3), (3, 3), (1, 1), "SAME")])
def test_image_patches_gradient_is_the_transpose_of_the_slices(shape, kernel, strides, padding):
    """image_patches is differentiated through its block form: the same linear map, so the
    same values forward and the same input gradient as autodiff of the plain slices."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    slices = models._patches_by_slices(x, kernel, strides, padding)
    np.testing.assert_array_equal(
        jax.jit(models._patches_by_blocks, static_argnums=(1, 2, 3))(x, kernel, strides,
                                                                       padding), slices)
    np.testing.assert_array_equal(jax.jit(models.image_patches, static_argnums=(1, 2, 3))(
        x, kernel, strides, padding), slices)
    cotangent = jnp.asarray(rng.normal(size=slices.shape).astype(np.float32))
    got = jax.jit(jax.grad(lambda x: jnp.vdot(
        models.image_patches(x, kernel, strides, padding), cotangent)))(x)
    want = jax.grad(lambda x: jnp.vdot(
        models._patches_by_slices(x, kernel, strides, padding), cotangent))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got.shape == x.shape and float(jnp.max(jnp.abs(got))) > 0


def test_through_a_dot_keeps_every_value():
    """Every value comes back, non-finite ones included, and a zero stays a zero."""
    rng = np.random.default_rng()
    a = (rng.normal(size=(16, 1, 40)) * 10.0 ** rng.integers(-30, 30, (16, 1, 40))).astype(
        np.float32)
    a[0, 0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    got = np.asarray(jax.jit(models.through_a_dot)(a))
    assert got.shape == a.shape and got.dtype == a.dtype
    np.testing.assert_array_equal(got, a)  # NaN == NaN here; -0 == 0
    assert np.all((got == 0) == (a == 0))


@pytest.mark.parametrize("name", ["tanh_cnn", "mlp"])
def test_per_example_loss_and_gradients_are_the_models_own(name):
    """cross_entropy_loss reads dense inputs through a dot (a speed device): its per-example
    losses and gradients under vmap(grad) are the plain model's, bit for bit."""
    rng = np.random.default_rng()
    model = models.make_model(10, name=name, hidden=(24,))
    shape = (28, 28, 1) if name == "tanh_cnn" else (8, 8, 1)
    images = jnp.asarray(rng.uniform(-1, 1, size=(6,) + shape).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 10, 6).astype(np.int32))
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), images[:1])

    def plain(params, image, label):
        return models.logits_loss(model.apply(params, image[None])[0], label)

    per_example = lambda f: jax.jit(jax.vmap(jax.value_and_grad(f), in_axes=(None, 0, 0)))
    got = per_example(models.cross_entropy_loss(model))(params, images, labels)
    want = per_example(plain)(params, images, labels)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)
    dots = lambda f: str(jax.make_jaxpr(f)(params, images[0], labels[0])).count("dot_general")
    assert dots(models.cross_entropy_loss(model)) == dots(plain) + 2  # one per Dense layer
