"""The layers book-keeping taps, found by intercepting the model's own forward pass.

A tap is a layer whose per-example parameter gradient is a function of its input and of the
gradient of the loss with respect to its output, summed over the layer's positions:

- ``matmul`` (``kernel`` and ``bias``): y = a K + b, with ``a`` the layer's input (nn.Dense) or
  its input's image patches (PatchConv; nn.Conv with SAME or VALID padding, any strides, no
  dilation, no feature groups: 3x3, strided and 1x1 convolutions alike). Example i's kernel
  gradient is a_i^T delta_i over its positions, its bias gradient sum_t delta_it.
- ``affine`` (``scale`` and ``bias``): GroupNorm's learned per-channel map y = xhat s + b, with
  xhat the normalized input (each example's own statistics, recomputed here by a GroupNorm
  without scale and bias). Example i's scale gradient is sum_t xhat_it * delta_it, its bias
  gradient sum_t delta_it.

Book-keeping applies only when the taps hold EVERY parameter of the model, each tap layer
runs once per forward pass (a layer called twice shares its weights between two inputs, and
its gradient is no longer one input's outer product) and its kernel matches its input (a layer
lifted over an extra axis by nn.vmap or nn.scan does not): ``discover_taps`` returns None
otherwise and ``untapped_parameters`` says which parameters are why.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpbench.models import layers

MATMUL, AFFINE = "matmul", "affine"
LEAVES = {MATMUL: ("kernel", "bias"), AFFINE: ("scale", "bias")}


@dataclasses.dataclass(frozen=True)
class Tap:
    """One tap layer: its module path, kind, positions per example T, input features d (a
    matmul's patch size; an affine layer's channels) and outputs p (T x p per example)."""

    path: tuple
    positions: int
    inputs: int
    outputs: int
    output_shape: tuple  # one example's output shape (the perturbation's)
    kind: str = MATMUL
    conv: tuple = ()  # a convolution's (kernel size, strides, padding); () for other layers

    @property
    def leaves(self) -> tuple:
        return LEAVES[self.kind]

    @property
    def ghost_is_cheaper(self) -> bool:
        return self.ghost_is_cheaper_at(self.positions)

    def ghost_is_cheaper_at(self, positions: int) -> bool:
        """Gram products over T positions cost T^2 (d + p), the materialized gradient T d p,
        but the materialized gradient is then reused for the weighted sum (which the Gram route
        recomputes as (c a)^T delta) and runs as one batched matmul: Gram only at half. With
        augmentation, T counts every copy's positions (K x the layer's own)."""
        return 2 * positions ** 2 * (self.inputs + self.outputs) < \
            positions * self.inputs * self.outputs


def _conv_as_patches(module) -> bool:
    """An nn.Conv whose output is its input's image patches times its kernel, plus its bias."""
    ones = (None, 1, (1, 1), [1, 1])
    return (len(module.kernel_size) == 2 and module.padding in ("SAME", "VALID")
            and module.input_dilation in ones and module.kernel_dilation in ones
            and module.feature_group_count == 1 and module.mask is None and module.use_bias)


def _strides(module) -> tuple:
    strides = module.strides if module.strides is not None else 1
    return (strides, strides) if isinstance(strides, int) else tuple(strides)


def kind_of(module) -> Optional[str]:
    """The tap kind of a module, None when book-keeping does not tap it."""
    if isinstance(module, (nn.Dense, layers.PatchConv)) or (
            isinstance(module, nn.Conv) and _conv_as_patches(module)):
        return MATMUL
    if isinstance(module, nn.GroupNorm) and module.use_scale and module.use_bias:
        return AFFINE
    return None


def conv_geometry(module) -> tuple:
    """(kernel size, strides, padding) of a convolution tap layer, () for any other layer."""
    if isinstance(module, layers.PatchConv):
        return tuple(module.kernel_size), tuple(module.strides), module.padding
    if isinstance(module, nn.Conv):
        return tuple(module.kernel_size), _strides(module), module.padding
    return ()


def _layer_input(module, x):
    """What the layer's parameter gradient multiplies the output gradient with: a Dense's
    input, a convolution's image patches, GroupNorm's normalized input."""
    if isinstance(module, layers.PatchConv):
        return layers.image_patches(x, module.kernel_size, module.strides, module.padding)
    if isinstance(module, nn.Conv):
        return layers.image_patches(x, tuple(module.kernel_size), _strides(module),
                                    module.padding)
    if isinstance(module, nn.GroupNorm):
        plain = nn.GroupNorm(num_groups=module.num_groups, group_size=module.group_size,
                             epsilon=module.epsilon, use_scale=False, use_bias=False,
                             reduction_axes=module.reduction_axes,
                             use_fast_variance=module.use_fast_variance, parent=None)
        return plain.apply({}, x)
    return x


def forward(model: nn.Module, params, images, perturbations: Optional[dict] = None,
            calls: Optional[collections.Counter] = None, raw_convs: bool = False,
            geometry: Optional[dict] = None):
    """(logits, {path: layer input}) for a batch; ``perturbations[path]`` (batch x output
    shape) is added to that tap layer's output, so its gradient is the output gradient;
    ``calls`` counts each tap layer's calls, ``geometry`` gets each one's conv_geometry.
    ``raw_convs``: a convolution's input as it is, not its image patches."""
    inputs = {}

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or kind_of(module) is None:
            return next_fun(*args, **kwargs)
        if geometry is not None:
            geometry[module.path] = conv_geometry(module)
        raw = raw_convs and conv_geometry(module)
        inputs[module.path] = args[0] if raw else _layer_input(module, args[0])
        if calls is not None:
            calls[module.path] += 1
        out = next_fun(*args, **kwargs)
        return out if perturbations is None else out + perturbations[module.path]

    with nn.intercept_methods(interceptor):
        logits = model.apply(params, images)
    return logits, inputs


def _param_paths(params_shape) -> list:
    return [tuple(k.key for k in path[1:]) for path, _ in
            jax.tree_util.tree_flatten_with_path(params_shape)[0]]


def _traced(model: nn.Module, params_shape, example_shape) -> tuple[dict, collections.Counter]:
    """(tap path -> (one batch's layer input shape, the layer's conv_geometry), calls per tap
    path), by tracing the model's forward pass on one example (no compute)."""
    shapes, calls, geometry = {}, collections.Counter(), {}

    def trace(params, images):
        logits, inputs = forward(model, params, images, calls=calls, geometry=geometry)
        shapes.update({p: (a.shape, geometry[p]) for p, a in inputs.items()})
        return logits

    x = jax.ShapeDtypeStruct((1,) + tuple(example_shape), jnp.float32)
    jax.eval_shape(trace, params_shape, x)
    return shapes, calls


def _kind_and_sizes(path: tuple, input_shape: tuple, leaves: set, params_shape):
    """(kind, d, p) of a called tap layer from its parameters, or None when they do not match
    its input: a missing bias or scale, or a kernel whose input size is not the input's last
    axis (a layer lifted over an extra axis, whose per-example gradient is not a_i^T delta_i)."""
    kind = MATMUL if (path + ("kernel",)) in leaves else AFFINE
    if not all(path + (leaf,) in leaves for leaf in LEAVES[kind]):
        return None
    first = leaf_at(params_shape["params"], path + (LEAVES[kind][0],)).shape
    if len(first) not in ((2, 4) if kind == MATMUL else (1,)):  # Dense, conv; GroupNorm
        return None
    d, p = (math.prod(first[:-1]), first[-1]) if kind == MATMUL else (first[-1], first[-1])
    return (kind, d, p) if input_shape[-1] == d else None


def untapped_parameters(model: nn.Module, params_shape, example_shape) -> list:
    """The parameters (as 'Layer/leaf' paths) that no tap layer holds, or that a tap layer
    called more than once or not matching its input holds: why book-keeping does not apply
    (``discover_taps`` None)."""
    shapes, calls = _traced(model, params_shape, example_shape)
    leaves = set(_param_paths(params_shape))
    usable = {path for path, (shape, _) in shapes.items() if calls[path] == 1 and
              _kind_and_sizes(path, shape, leaves, params_shape) is not None}
    untapped = sorted("/".join(map(str, leaf)) for leaf in leaves if leaf[:-1] not in usable)
    repeated = sorted(f"{'/'.join(map(str, path))} (called {calls[path]} times)"
                      for path in shapes if calls[path] > 1)
    return untapped + repeated or ["(no parameter outside a usable tap layer)"]


def discover_taps(model: nn.Module, params_shape, example_shape) -> Optional[tuple]:
    """The model's tap layers, or None when some parameter is not a tap layer's, a tap layer
    lacks a parameter of its kind (a Dense without bias), its kernel does not match its input
    (a layer lifted over an extra axis) or it runs more than once."""
    shapes, calls = _traced(model, params_shape, example_shape)
    leaves = set(_param_paths(params_shape))
    taps, covered = [], set()
    for path, (shape, conv) in shapes.items():
        sizes = _kind_and_sizes(path, shape, leaves, params_shape)
        if calls[path] != 1 or sizes is None:
            return None
        kind, d, p = sizes
        covered.update(path + (leaf,) for leaf in LEAVES[kind])
        positions = math.prod(shape[1:-1]) if len(shape) > 2 else 1
        taps.append(Tap(path, positions, d, p, tuple(shape[1:-1]) + (p,), kind, conv))
    if covered != leaves:
        return None
    return tuple(sorted(taps, key=lambda t: t.path))


def leaf_at(tree, path):
    for key in path:
        tree = tree[key]
    return tree
