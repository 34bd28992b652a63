"""The tanh CNN of Papernot et al. 2021 ("Tempered sigmoid activations"), registered as
``tanh_cnn``: the board's reference model for 28x28 images."""

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

    @nn.compact
    def __call__(self, x):
        act = layers.ACTIVATIONS[self.activation]
        if self.center_inputs:
            x = 2.0 * x - 1.0  # [0, 1] -> [-1, 1]: a fixed map, no statistics of private data

        def norm(h):
            return nn.GroupNorm(num_groups=self.group_norm_groups)(h) if self.group_norm_groups \
                else h

        x = act(norm(layers.conv_layer(self.conv_impl, 16, (8, 8), (2, 2), "SAME", "Conv_0")(x)))
        x = layers.max_pool_2x2_stride_1(x)
        x = act(norm(layers.conv_layer(self.conv_impl, 32, (4, 4), (2, 2), "VALID", "Conv_1")(x)))
        x = layers.max_pool_2x2_stride_1(x)
        x = x.reshape(x.shape[:-3] + (-1,))
        x = act(nn.Dense(32)(x))
        return nn.Dense(self.num_classes)(x)


def _describe_inputs(knobs: dict) -> list:
    if not knobs["center_inputs"]:
        return []
    return [dict(what="pixels mapped from [0, 1] to [-1, 1]", why="a fixed map: no privacy cost")]


registry.register_model("tanh_cnn", lambda n, k, lin: TanhCNN(
    n, k["activation"], k["group_norm_groups"], k["conv_impl"], k["center_inputs"]),
    features="pixels", describe_inputs=_describe_inputs)
