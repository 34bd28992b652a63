"""Tramer & Boneh 2021's models on ScatterNet features (dataset.features = 'scattering'),
registered as ``scatter_linear`` and ``scatter_cnn``: a per-example GroupNorm over the feature
channels (``model.input_norm_groups``), then one linear layer or a small CNN."""

from __future__ import annotations

import flax.linen as nn

from dpbench.models import layers, registry


class ScatterLinear(nn.Module):
    """Tramer & Boneh 2021: ScatterNet features -> per-example GroupNorm -> one linear layer."""

    num_classes: int
    input_norm_groups: int = 27
    normalize: bool = True

    @nn.compact
    def __call__(self, x):
        x = layers.input_group_norm(self.input_norm_groups, self.normalize)(x)
        return nn.Dense(self.num_classes)(x.reshape(x.shape[:-3] + (-1,)))


class ScatterCNN(nn.Module):
    """Tramer & Boneh 2021's CNN on ScatterNet features (their MNIST / Fashion-MNIST one):
    per-example GroupNorm, conv 16 (3x3, stride 2) and conv 32 (3x3), tanh, then a 32-unit
    hidden layer; 7x7x81 features -> 4x4x32 -> 10 classes."""

    num_classes: int
    activation: str = "tanh"
    input_norm_groups: int = 27
    normalize: bool = True
    conv_impl: str = "patches"

    @nn.compact
    def __call__(self, x):
        act = layers.ACTIVATIONS[self.activation]
        x = layers.input_group_norm(self.input_norm_groups, self.normalize)(x)
        x = act(layers.conv_layer(self.conv_impl, 16, (3, 3), (2, 2), "SAME", "Conv_0")(x))
        x = act(layers.conv_layer(self.conv_impl, 32, (3, 3), (1, 1), "SAME", "Conv_1")(x))
        x = act(nn.Dense(32)(x.reshape(x.shape[:-3] + (-1,))))
        return nn.Dense(self.num_classes)(x)


def _scatter_inputs(knobs) -> list:
    return [dict(what=f"GroupNorm over each example's own feature channels "
                      f"({knobs['input_norm_groups']} groups, no learned scale or bias)",
                 why="computed from that one example alone, with no statistic of the data: no "
                     "privacy cost, no release")]


registry.register_model("scatter_linear", lambda n, k, lin: ScatterLinear(
    n, k["input_norm_groups"], normalize=not lin), features="scattering",
    describe_inputs=_scatter_inputs)
registry.register_model("scatter_cnn", lambda n, k, lin: ScatterCNN(
    n, k["activation"], k["input_norm_groups"], normalize=not lin, conv_impl=k["conv_impl"]),
    features="scattering", describe_inputs=_scatter_inputs)
