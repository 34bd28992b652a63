"""Models (flax.linen). Never BatchNorm: it mixes examples and breaks per-example sensitivity;
GroupNorm is the only normalization offered."""

from __future__ import annotations

import dataclasses
import functools

from typing import Callable, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
from jax import lax

# dpbench's own models (more register themselves: ``register_model``, e.g. dpbench.wide_resnet)
MODELS = ("tanh_cnn", "mlp", "logistic", "scatter_linear", "scatter_cnn")
# The features (dataset.features) a built-in model needs when not pixels (mlp, logistic: any).
REQUIRED_FEATURES = {"scatter_linear": "scattering", "scatter_cnn": "scattering"}
# "identity" builds the linearized twin of a model (SynFlow scores: data-free, no nonlinearity).
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu, "identity": lambda x: x}


def _patches_by_slices(x, kernel_size: tuple, strides: tuple, padding: str):
    """(kh, kw, C)-ordered patches as kh * kw strided slices of the padded input."""
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


def _patches_by_blocks(x, kernel_size: tuple, strides: tuple, padding: str):
    """The same patches (same values, same order) through space-to-depth: the padded input cut
    into sh x sw blocks, each patch ceil(kh/sh) x ceil(kw/sw) whole blocks (a few offsets past
    the kernel are dropped). Slower forward than the slices for these small images, but its
    transpose (the input gradient) adds ceil(kh/sh) * ceil(kw/sw) block-shifted arrays instead
    of kh * kw padded ones: 4 instead of 16 for the tanh CNN's second layer (4.4x faster)."""
    kh, kw = kernel_size
    sh, sw = strides
    (top, bottom), (left, right) = lax.padtype_to_pads(x.shape[-3:-1], (kh, kw), (sh, sw),
                                                       padding)
    out_h = (x.shape[-3] + top + bottom - kh) // sh + 1
    out_w = (x.shape[-2] + left + right - kw) // sw + 1
    qh, qw = -(-kh // sh), -(-kw // sw)                    # patch size in blocks
    rows, cols = sh * (out_h - 1 + qh), sw * (out_w - 1 + qw)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(top, max(0, rows - x.shape[-3] - top)),
                                               (left, max(0, cols - x.shape[-2] - left)),
                                               (0, 0)])[..., :rows, :cols, :]
    lead, c = x.shape[:-3], x.shape[-1]
    blocks = jnp.swapaxes(x.reshape(lead + (rows // sh, sh, cols // sw, sw, c)), -4, -3)
    blocks = blocks.reshape(lead + (rows // sh, cols // sw, sh * sw * c))
    p = jnp.stack([blocks[..., a:a + out_h, b:b + out_w, :]
                   for a in range(qh) for b in range(qw)], axis=-2)
    p = p.reshape(lead + (out_h, out_w, qh, qw, sh, sw, c))
    n = len(lead) + 2
    p = jnp.transpose(p, tuple(range(n)) + (n, n + 2, n + 1, n + 3, n + 4))
    p = p.reshape(lead + (out_h, out_w, qh * sh, qw * sw, c))[..., :kh, :kw, :]
    return p.reshape(lead + (out_h, out_w, kh * kw * c))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def image_patches(x, kernel_size: tuple, strides: tuple, padding: str):
    """The (kh, kw, C)-ordered patches of NHWC images x.

    Same values as lax.conv_general_dilated_patches (up to the feature order). Computed as
    strided slices of the padded input; differentiated through ``_patches_by_blocks``, the
    same linear map written with fewer, larger pieces. Why not XLA's own: its CPU transpose of
    conv_general_dilated_patches is a convolution that made the tanh CNN's backward pass
    about 20x slower; the slices' transpose is kh * kw pads and adds, the blocks' fewer.
    """
    return _patches_by_slices(x, kernel_size, strides, padding)


@image_patches.defjvp
def _image_patches_jvp(kernel_size, strides, padding, primals, tangents):
    # Linear: the tangent is the same map; reverse mode transposes this form.
    (x,), (t,) = primals, tangents
    by_blocks = _patches_by_blocks if strides != (1, 1) else _patches_by_slices
    return (_patches_by_slices(x, kernel_size, strides, padding),
            by_blocks(t, kernel_size, strides, padding))


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


def input_group_norm(groups: int, enabled: bool = True):
    """GroupNorm over each example's own channels with no learned scale or bias (Tramer &
    Boneh's normalization of ScatterNet features): it reads no other example and no statistic
    of the data, so it costs no privacy. Disabled in a linearized twin (a constant input would
    normalize to zero)."""
    if not enabled:
        return lambda x: x
    return nn.GroupNorm(num_groups=groups, use_scale=False, use_bias=False, epsilon=1e-5)


class ScatterLinear(nn.Module):
    """Tramer & Boneh 2021: ScatterNet features -> per-example GroupNorm -> one linear layer."""

    num_classes: int
    input_norm_groups: int = 27
    normalize: bool = True

    @nn.compact
    def __call__(self, x):
        x = input_group_norm(self.input_norm_groups, self.normalize)(x)
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
        act = ACTIVATIONS[self.activation]
        x = input_group_norm(self.input_norm_groups, self.normalize)(x)
        x = act(conv_layer(self.conv_impl, 16, (3, 3), (2, 2), "SAME", "Conv_0")(x))
        x = act(conv_layer(self.conv_impl, 32, (3, 3), (1, 1), "SAME", "Conv_1")(x))
        x = act(nn.Dense(32)(x.reshape(x.shape[:-3] + (-1,))))
        return nn.Dense(self.num_classes)(x)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model. ``build(num_classes, knobs, linearized)`` returns the flax module;
    ``knobs`` are ModelConfig's fields as a dict (a plug-in's own knobs are gin configurables of
    its own module). ``features``: the dataset.features it is built for (None: any).
    ``describe_inputs(knobs)``: what it does to its inputs before any learned layer, for the
    privacy statement ([{"what", "why"}]). ``module``: where it was registered."""

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
               input_norm_groups: int = 27, linearized: bool = False) -> nn.Module:
    """Builds the registered model ``name``; raises ValueError naming the known models.
    ``linearized`` builds its twin for SynFlow (same parameters): identity activations, no
    input normalization."""
    if linearized:
        activation = "identity"
    if activation not in ACTIVATIONS:
        raise ValueError(f"model.activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {activation!r}")
    knobs = dict(activation=activation, hidden=tuple(hidden),
                 group_norm_groups=group_norm_groups, conv_impl=conv_impl,
                 center_inputs=center_inputs, input_norm_groups=input_norm_groups)
    return model_spec(name).build(num_classes, knobs, linearized)


def _scatter_inputs(knobs) -> list:
    return [dict(what=f"GroupNorm over each example's own feature channels "
                      f"({knobs['input_norm_groups']} groups, no learned scale or bias)",
                 why="computed from that one example alone, with no statistic of the data: no "
                     "privacy cost, no release")]


register_model("scatter_linear", lambda n, k, lin: ScatterLinear(
    n, k["input_norm_groups"], normalize=not lin), features="scattering",
    describe_inputs=_scatter_inputs)
register_model("scatter_cnn", lambda n, k, lin: ScatterCNN(
    n, k["activation"], k["input_norm_groups"], normalize=not lin, conv_impl=k["conv_impl"]),
    features="scattering", describe_inputs=_scatter_inputs)
register_model("tanh_cnn", lambda n, k, lin: TanhCNN(
    n, k["activation"], k["group_norm_groups"], k["conv_impl"], k["center_inputs"]),
    features="pixels", describe_inputs=lambda k: [dict(
        what="pixels mapped from [0, 1] to [-1, 1]", why="a fixed map: no privacy cost")]
    if k["center_inputs"] else [])
register_model("mlp", lambda n, k, lin: MLP(n, tuple(k["hidden"]), k["activation"]))
register_model("logistic", lambda n, k, lin: Logistic(n))


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
    input_norm_groups: int = 27  # scatter models: GroupNorm groups over the feature channels

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


def logits_loss(logits, labels):
    """The training loss of logits against integer labels, per example: the one definition
    used by cross_entropy_loss (per-example gradients) and by book-keeping (a batched pass)."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def through_a_dot(x):
    """``x`` in value (a -0 may come back +0), as the output of a dot over a padded axis of 2:
    x * 1 + 0 * 0. Why: XLA's CPU pipeline removes optimization barriers before fusion, but a
    dot's output is a buffer that fusion cannot look through, while an elementwise consumer of
    a dense layer's outer product a delta^T (a per-example kernel gradient, or a transform of
    one) otherwise recomputes a's producer (the tanh CNN's 2x2 max-pool, four reads) once per
    output column of the layer (docs/speed.md)."""
    padded = jnp.stack([x, jnp.zeros_like(x)], axis=-2)
    return jnp.einsum("...kd,k->...d", padded, jnp.asarray([1.0, 0.0], x.dtype))


def _dense_inputs_through_a_dot(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, nn.Dense):
        return next_fun(through_a_dot(args[0]), *args[1:], **kwargs)
    return next_fun(*args, **kwargs)


def cross_entropy_loss(model: nn.Module):
    """The per-example loss ``loss(params, image, label)`` for ONE (H, W, C) image. Its value
    and gradient are the model's own; each Dense layer reads its input through
    ``through_a_dot``, which under vmap(grad) keeps XLA from recomputing that input per output
    column of the layer while writing the per-example kernel gradients (GEP's step at B=1024:
    0.81x its time)."""

    def loss(params, image, label):
        with nn.intercept_methods(_dense_inputs_through_a_dot):
            logits = model.apply(params, image[None])[0]
        return logits_loss(logits, label)

    return loss


def accuracy(model: nn.Module, params, images, labels) -> jnp.ndarray:
    return jnp.mean(jnp.argmax(model.apply(params, images), axis=-1) == labels)
