"""The model registry and the one knob system of dpbench's models.

Every model registers itself with ``register_model(name, build, ...)``, dpbench's own (one
module per family in this package) and a user's plug-in alike; ``model.name = '<name>'`` then
builds it. ``build(num_classes, knobs, linearized)`` returns the flax module: ``knobs`` are
``ModelConfig``'s fields as a dict (the gin ``model.*`` knobs), ``linearized`` asks for the
SynFlow twin (same parameters; ``knobs['activation']`` is then ``'identity'``). dpbench's own
models read their knobs from ``model.*`` only; a plug-in model may also keep knobs of its own,
a gin configurable of its own module.
"""

from __future__ import annotations

import dataclasses

from typing import Callable, Optional, Sequence

import flax.linen as nn
import gin

from dpbench.models import layers


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model. ``build(num_classes, knobs, linearized)`` returns the flax module;
    ``knobs`` are ModelConfig's fields as a dict (the module docstring). ``features``: the
    dataset.features it is built for (None: any). ``describe_inputs(knobs)``: what it does to
    its inputs before any learned layer, for the privacy statement ([{"what", "why"}]).
    ``module``: where it was registered."""

    build: Callable
    features: Optional[str] = None
    describe_inputs: Callable = lambda knobs: []
    module: str = ""


_MODELS: dict = {}


def register_model(name: str, build: Callable, *, features: Optional[str] = None,
                   describe_inputs: Optional[Callable] = None) -> Callable:
    """Registers a model under ``name`` (``model.name = '<name>'`` then builds it); a module
    that is imported again re-registers. Returns ``build``."""
    _MODELS[name] = ModelSpec(build, features, describe_inputs or (lambda knobs: []),
                              module=getattr(build, "__module__", ""))
    return build


def registered_models() -> tuple:
    return tuple(sorted(_MODELS))


def model_spec(name: str) -> ModelSpec:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(registered_models())} "
                         "(set model.name; a model of your own registers itself with "
                         "dpbench.models.register_model, its module imported by your gin file)")
    return _MODELS[name]


def make_model(num_classes: int, name: str, activation: str = "tanh",
               hidden: Sequence[int] = (256,), group_norm_groups: int = 0,
               conv_impl: str = "patches", center_inputs: bool = True,
               input_norm_groups: int = 27, depth: int = 16, width: int = 4,
               input_size: int = 32, linearized: bool = False) -> nn.Module:
    """Builds the registered model ``name`` from these knobs (ModelConfig's); raises ValueError
    naming the known models. ``linearized`` builds its twin for SynFlow (same parameters):
    identity activations, no input normalization."""
    if linearized:
        activation = "identity"
    if activation not in layers.ACTIVATIONS:
        raise ValueError(f"model.activation must be one of {sorted(layers.ACTIVATIONS)}, "
                         f"got {activation!r}")
    knobs = dict(activation=activation, hidden=tuple(hidden),
                 group_norm_groups=group_norm_groups, conv_impl=conv_impl,
                 center_inputs=center_inputs, input_norm_groups=input_norm_groups,
                 depth=depth, width=width, input_size=input_size)
    return model_spec(name).build(num_classes, knobs, linearized)


@gin.configurable("model")
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model axis of a run (bind as ``model.name = 'tanh_cnn'`` etc.); its name is passed
    on explicitly (run records, checkpoints), never read back from gin. Each model reads the
    knobs it uses and ignores the others."""

    name: str = gin.REQUIRED
    activation: str = "tanh"
    hidden: Sequence[int] = (256,)  # mlp: the hidden layers' widths
    group_norm_groups: int = 0  # tanh_cnn: 0 is no GroupNorm; wrn: required (16 in its gin)
    conv_impl: str = "patches"
    center_inputs: bool = True
    input_norm_groups: int = 27  # scatter models: GroupNorm groups over the feature channels
    depth: int = 16  # wrn: 6 n + 4 (n blocks per stage)
    width: int = 4  # wrn: the channel multiplier
    input_size: int = 32  # wrn: the side inputs are zero-padded to

    def build(self, num_classes: int) -> nn.Module:
        return make_model(num_classes, **dataclasses.asdict(self))

    def linearized(self, num_classes: int) -> nn.Module:
        """The same model with identity activations and no input normalization (same
        parameters), for SynFlow."""
        return make_model(num_classes, **dataclasses.asdict(self), linearized=True)

    def check_features(self, features: dict) -> None:
        """Raises ValueError, saying what to bind, if the dataset's examples are not what this
        model is built for (its registration's ``features``; None takes either)."""
        want = model_spec(self.name).features
        if want is not None and features.get("kind") != want:
            raise ValueError(
                f"model.name = {self.name!r} is built for {want} but the dataset's examples are "
                f"{features.get('kind')}: bind dataset.features = {want!r}" + (
                    f" (gin/model/{self.name}.gin does)" if want != "pixels" else ""))

    def describe_inputs(self) -> list:
        """What the model does to its inputs before any learned layer, for the privacy
        statement (each as {"what", "why"}), from its registration."""
        return list(model_spec(self.name).describe_inputs(dataclasses.asdict(self)))
