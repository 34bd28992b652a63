"""The dense models, registered as ``mlp`` (``model.hidden`` widths, ``model.activation``) and
``logistic`` (one linear layer); they take any features."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from dpbench.models import layers, registry


class MLP(nn.Module):
    num_classes: int
    hidden: Sequence[int] = (256,)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[:-3] + (-1,))
        for width in self.hidden:
            x = layers.ACTIVATIONS[self.activation](nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class Logistic(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(x.reshape(x.shape[:-3] + (-1,)))


registry.register_model("mlp", lambda n, k, lin: MLP(n, tuple(k["hidden"]), k["activation"]))
registry.register_model("logistic", lambda n, k, lin: Logistic(n))
