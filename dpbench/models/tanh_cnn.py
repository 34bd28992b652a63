"""The tanh CNN of Papernot et al. 2021 ("Tempered sigmoid activations"), registered as
``tanh_cnn``: the board's reference model for 28x28 images; and its wider twins for board v4's
dimension ladder, ``tanh_cnn_x1`` (itself), ``tanh_cnn_x2``, ``tanh_cnn_x4`` and ``tanh_cnn_x8``:
every layer's channels and hidden units times 1, 2, 4 or 8 (the same architecture; about 26k,
0.1M, 0.4M and 1.6M parameters on 10 classes)."""

from __future__ import annotations

import flax.linen as nn

from dpbench.models import layers, registry


class TanhCNN(nn.Module):
    """Papernot et al. 2021 ("Tempered sigmoid activations") CNN for 28x28 inputs."""

    num_classes: int
    activation: str = "tanh"
    group_norm_groups: int = 0  # 0: no normalization
    conv_impl: str = "patches"
    center_inputs: bool = True
    width_multiplier: int = 1  # the ladder's rungs: channels and hidden units times this

    @nn.compact
    def __call__(self, x):
        act = layers.ACTIVATIONS[self.activation]
        if self.center_inputs:
            x = 2.0 * x - 1.0  # [0, 1] -> [-1, 1]: a fixed map, no statistics of private data

        def norm(h):
            return nn.GroupNorm(num_groups=self.group_norm_groups)(h) if self.group_norm_groups \
                else h

        x = act(norm(layers.conv_layer(self.conv_impl, 16 * self.width_multiplier, (8, 8), (2, 2), "SAME", "Conv_0")(x)))
        x = layers.max_pool_2x2_stride_1(x)
        x = act(norm(layers.conv_layer(self.conv_impl, 32 * self.width_multiplier, (4, 4), (2, 2), "VALID", "Conv_1")(x)))
        x = layers.max_pool_2x2_stride_1(x)
        x = x.reshape(x.shape[:-3] + (-1,))
        x = act(nn.Dense(32 * self.width_multiplier)(x))
        return nn.Dense(self.num_classes)(x)


def _describe_inputs(knobs: dict) -> list:
    if not knobs["center_inputs"]:
        return []
    return [dict(what="pixels mapped from [0, 1] to [-1, 1]", why="a fixed map: no privacy cost")]


def _tanh_cnn(width_multiplier: int):
    return lambda n, k, lin: TanhCNN(n, k["activation"], k["group_norm_groups"], k["conv_impl"],
                                     k["center_inputs"], width_multiplier)


registry.register_model("tanh_cnn", _tanh_cnn(1), features="pixels",
                        describe_inputs=_describe_inputs)
for _multiplier in (1, 2, 4, 8):  # x1: the tanh CNN under the ladder's name (its own group)
    registry.register_model(f"tanh_cnn_x{_multiplier}", _tanh_cnn(_multiplier),
                            features="pixels", describe_inputs=_describe_inputs)
