"""Models (flax.linen). Never BatchNorm: it mixes examples and breaks per-example sensitivity;
GroupNorm is the only normalization offered."""

from __future__ import annotations

import dataclasses

from typing import Sequence

import flax.linen as nn
import gin
import jax.numpy as jnp
from jax import lax

MODELS = ("tanh_cnn", "mlp", "logistic")
# "identity" builds the linearized twin of a model (SynFlow scores: data-free, no nonlinearity).
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu, "identity": lambda x: x}


def image_patches(x, kernel_size: tuple, strides: tuple, padding: str):
    """The (kh, kw, C)-ordered patches of NHWC images x, as strided slices of the padded input.

    Same values as lax.conv_general_dilated_patches (up to the feature order), but its gradient
    is pads and adds: XLA's CPU transpose of conv_general_dilated_patches is a convolution that
    made the tanh CNN's backward pass about 20x slower (tools/ probe, 2 CPU cores).
    """
    kh, kw = kernel_size
    sh, sw = strides
    pads = lax.padtype_to_pads(x.shape[-3:-1], (kh, kw), (sh, sw), padding)
    if any(lo or hi for lo, hi in pads):
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + list(pads) + [(0, 0)])
    out_h = (x.shape[-3] - kh) // sh + 1
    out_w = (x.shape[-2] - kw) // sw + 1
    return jnp.concatenate(
        [x[..., i:i + sh * (out_h - 1) + 1:sh, j:j + sw * (out_w - 1) + 1:sw, :]
         for i in range(kh) for j in range(kw)], axis=-1)


class PatchConv(nn.Module):
    """A 2-D convolution computed as image patches times a matrix; same parameters as nn.Conv.

    XLA's CPU convolutions are slow under vmap for per-example gradients; as patches + matmul
    the per-example gradient is a batched outer product. Outputs equal nn.Conv's to float
    rounding.
    """

    features: int
    kernel_size: tuple
    strides: tuple = (1, 1)
    padding: str = "SAME"

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (kh, kw, cin, self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        patches = image_patches(x, self.kernel_size, self.strides, self.padding)
        return patches @ kernel.reshape(kh * kw * cin, self.features) + bias


def max_pool_2x2_stride_1(x):
    """nn.max_pool(x, (2, 2), strides=(1, 1), padding='VALID') as the maximum of four shifted
    views: same values, and a gradient of selects instead of XLA's slow CPU select-and-scatter."""
    return jnp.maximum(jnp.maximum(x[..., :-1, :-1, :], x[..., 1:, :-1, :]),
                       jnp.maximum(x[..., :-1, 1:, :], x[..., 1:, 1:, :]))


def conv_layer(conv_impl: str, features: int, kernel_size: tuple, strides: tuple, padding: str,
               name: str) -> nn.Module:
    if conv_impl == "patches":
        return PatchConv(features, kernel_size, strides, padding, name=name)
    if conv_impl == "xla":
        return nn.Conv(features, kernel_size, strides=strides, padding=padding, name=name)
    raise ValueError(f"model.conv_impl must be 'patches' or 'xla', got {conv_impl!r}")


class TanhCNN(nn.Module):
    """Papernot et al. 2021 ("Tempered sigmoid activations") CNN for 28x28 inputs."""

    num_classes: int
    activation: str = "tanh"
    group_norm_groups: int = 0  # 0: no normalization
    conv_impl: str = "patches"
    center_inputs: bool = True

    @nn.compact
    def __call__(self, x):
        act = ACTIVATIONS[self.activation]
        if self.center_inputs:
            x = 2.0 * x - 1.0  # [0, 1] -> [-1, 1]: a fixed map, no statistics of private data

        def norm(h):
            return nn.GroupNorm(num_groups=self.group_norm_groups)(h) if self.group_norm_groups \
                else h

        x = act(norm(conv_layer(self.conv_impl, 16, (8, 8), (2, 2), "SAME", "Conv_0")(x)))
        x = max_pool_2x2_stride_1(x)
        x = act(norm(conv_layer(self.conv_impl, 32, (4, 4), (2, 2), "VALID", "Conv_1")(x)))
        x = max_pool_2x2_stride_1(x)
        x = x.reshape(x.shape[:-3] + (-1,))
        x = act(nn.Dense(32)(x))
        return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
    num_classes: int
    hidden: Sequence[int] = (256,)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[:-3] + (-1,))
        for width in self.hidden:
            x = ACTIVATIONS[self.activation](nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class Logistic(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(x.reshape(x.shape[:-3] + (-1,)))


def make_model(num_classes: int, name: str, activation: str = "tanh",
               hidden: Sequence[int] = (256,), group_norm_groups: int = 0,
               conv_impl: str = "patches", center_inputs: bool = True) -> nn.Module:
    """Builds the model ``name``; raises ValueError naming the known models."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"model.activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {activation!r}")
    if name == "tanh_cnn":
        return TanhCNN(num_classes, activation, group_norm_groups, conv_impl, center_inputs)
    if name == "mlp":
        return MLP(num_classes, tuple(hidden), activation)
    if name == "logistic":
        return Logistic(num_classes)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (set model.name)")


@gin.configurable("model")
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model axis of a run (bind as ``model.name = 'tanh_cnn'`` etc.); its name is passed
    on explicitly (run records, checkpoints), never read back from gin."""

    name: str = gin.REQUIRED
    activation: str = "tanh"
    hidden: Sequence[int] = (256,)
    group_norm_groups: int = 0
    conv_impl: str = "patches"
    center_inputs: bool = True

    def build(self, num_classes: int) -> nn.Module:
        return make_model(num_classes, **dataclasses.asdict(self))

    def linearized(self, num_classes: int) -> nn.Module:
        """The same model with identity activations (same parameters), for SynFlow."""
        return make_model(num_classes, **dict(dataclasses.asdict(self), activation="identity"))


def cross_entropy_loss(model: nn.Module):
    """The per-example loss ``loss(params, image, label)`` for ONE (H, W, C) image."""
    import optax

    def loss(params, image, label):
        logits = model.apply(params, image[None])[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)

    return loss


def accuracy(model: nn.Module, params, images, labels) -> jnp.ndarray:
    return jnp.mean(jnp.argmax(model.apply(params, images), axis=-1) == labels)
