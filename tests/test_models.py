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


@pytest.mark.parametrize("name", models.MODELS)
def test_models_give_logits_for_28x28(name):
    model = models.make_model(10, name=name)
    params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    assert model.apply(params, jnp.zeros((5, 28, 28, 1))).shape == (5, 10)


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
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        models.make_model(10, name="vgg")
