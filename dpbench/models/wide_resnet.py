"""The field's reference model for DP image classification: a wide ResNet with GroupNorm (De et
al. 2022, "Unlocking high-accuracy differentially private image classification through scale":
WRN-16-4, 16 groups, no batch statistics), registered as model ``wrn`` by the same call a
plug-in of a user's own makes (``models.register_model``).

Its knobs are ``model.*`` like every dpbench model's: ``model.depth`` (6 n + 4),
``model.width``, ``model.group_norm_groups`` (required: 0, the default, is refused),
``model.activation`` and ``model.input_size`` (gin/model/wrn16_4.gin binds WRN-16-4; WRN-10-1
for tests). Inputs are images of at most ``model.input_size`` (32) pixels a side: smaller ones
(Fashion-MNIST's 28x28) are zero-padded to 32x32 at the centre, then every pixel is mapped from
[0, 1] to [-1, 1]; both are fixed maps of each example alone (no statistic of the data, no
privacy cost), stated in the run's privacy statement.

Every parameter sits in a layer book-keeping taps (XLA convolutions, 3x3, strided and 1x1, as
image patches times a matrix; GroupNorm's scale and bias; the dense head), so DP-SGD and the
methods that mask or transform its per-example gradients run without materializing them,
augmentation multiplicity included (compiler/taps.py, compiler/bookkeeping.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from dpbench.models import layers, registry

SIZE = 32  # the input side the network is built for (model.input_size's default)


class WideResNet(nn.Module):
    """WRN-depth-width: depth = 6 n + 4 (n blocks per stage, 3 stages of 16, 32, 64 x width
    channels); GroupNorm with ``groups`` groups after every convolution but the last."""

    num_classes: int
    depth: int = 16
    width: int = 4
    groups: int = 16
    activation: str = "relu"
    size: int = SIZE

    @nn.compact
    def __call__(self, x):
        act = layers.ACTIVATIONS[self.activation]
        height, width, size = x.shape[-3], x.shape[-2], self.size
        if height > size or width > size:
            raise ValueError(f"model 'wrn' takes images of at most {size}x{size} pixels, got "
                             f"{height}x{width} (model.input_size = {size})")
        top, left = (size - height) // 2, (size - width) // 2
        pad = [(0, 0)] * (x.ndim - 3) + [(top, size - height - top),
                                         (left, size - width - left), (0, 0)]
        x = 2.0 * jnp.pad(x, pad) - 1.0  # zero-pad to size x size, then [0, 1] -> [-1, 1]

        def norm(h):
            return nn.GroupNorm(num_groups=min(self.groups, h.shape[-1]))(h)

        x = nn.Conv(16, (3, 3), padding="SAME", name="stem")(x)
        blocks = (self.depth - 4) // 6
        for stage, channels in enumerate((16 * self.width, 32 * self.width, 64 * self.width)):
            for block in range(blocks):
                strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
                h = act(norm(x))
                shortcut = x if x.shape[-1] == channels and strides == (1, 1) else nn.Conv(
                    channels, (1, 1), strides=strides, name=f"shortcut_{stage}_{block}")(h)
                h = nn.Conv(channels, (3, 3), strides=strides, padding="SAME",
                            name=f"conv_{stage}_{block}_a")(h)
                h = nn.Conv(channels, (3, 3), padding="SAME",
                            name=f"conv_{stage}_{block}_b")(act(norm(h)))
                x = shortcut + h
        x = act(norm(x))
        x = jnp.mean(x, axis=(-3, -2))  # global average pooling
        return nn.Dense(self.num_classes, name="head")(x)


def check_knobs(knobs: dict) -> None:
    """Raises ValueError naming the ``model.*`` knob to change when the WRN cannot be built
    from ``knobs`` (model.activation is checked by make_model, for every model)."""
    depth, width, groups, size = (knobs[k] for k in ("depth", "width", "group_norm_groups",
                                                     "input_size"))
    if depth < 10 or (depth - 4) % 6:
        raise ValueError(f"model.depth must be 6 n + 4 with n >= 1 (10, 16, 22, 28, ...) for "
                         f"model 'wrn', got {depth}")
    if width < 1:
        raise ValueError(f"model.width must be >= 1 for model 'wrn', got {width}")
    if groups == 0:
        raise ValueError("model 'wrn' needs GroupNorm: bind model.group_norm_groups (a divisor "
                         "of 16; gin/model/wrn16_4.gin binds 16), whose default 0 means none")
    if groups < 1 or 16 % groups:
        raise ValueError(f"model.group_norm_groups must divide the stem's 16 channels for model "
                         f"'wrn' (1, 2, 4, 8 or 16), got {groups}")
    if size < 8:
        raise ValueError(f"model.input_size must be >= 8 for model 'wrn' (two stride-2 "
                         f"stages), got {size}")


def build(num_classes: int, knobs: dict, linearized: bool) -> nn.Module:
    """The registered builder: model.depth, width, group_norm_groups, activation (identity for
    the linearized twin) and input_size."""
    check_knobs(knobs)
    return WideResNet(num_classes, knobs["depth"], knobs["width"], knobs["group_norm_groups"],
                      "identity" if linearized else knobs["activation"], knobs["input_size"])


def describe_inputs(knobs: dict) -> list:
    size = knobs["input_size"]
    return [dict(what=f"pixels zero-padded at the centre to {size}x{size} and mapped from "
                      "[0, 1] to [-1, 1]",
                 why="fixed maps of each example alone: no privacy cost")]


registry.register_model("wrn", build, features="pixels", describe_inputs=describe_inputs)
