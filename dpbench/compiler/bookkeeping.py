"""Book-keeping per-example clipping (Bu et al., ICML 2023): the clipped sum of per-example
gradients from ONE batched forward and backward pass, without the per-example gradient tree.

For a matmul layer y = a K + b (nn.Dense; PatchConv, whose ``a`` are image patches), example
i's kernel gradient is a_i^T delta_i (a_i: its T x d inputs, delta_i: the T x p gradients of its
loss with respect to the layer's outputs) and its bias gradient is sum_t delta_it. One batched
backward pass to zero "perturbations" added to every layer's output gives every delta_i; each
example's squared gradient norm then comes per layer from the materialized a_i^T delta_i, or,
where cheaper, from Gram products over positions (ghost norm: sum_{t,s} (a_t.a_s)(delta_t.delta_s)).
With c_i = min(1, C / ||g_i||) the clipped sum is sum_i c_i a_i^T delta_i = (c a)^T delta: one
weighted contraction per layer.

What it reproduces, exactly (the compiler uses it only for this chain, ``applies``): the
gradient of models.cross_entropy_loss (grad.per_example, no augmentation), then per-example
stages on the gradient, then the flat L2 clip (clip.global_l2), with a non-finite example
zeroed and counted as the materialized strategy does. Public per-example masks (stages
declaring ``Mask.PER_EXAMPLE``: RS, DP-SSGD) keep the contraction form, since
sum_i c_i (M * g_i) = M * sum_i c_i g_i; any other per-example stage (Nasr's discretization)
runs on per-example gradients materialized from the layer terms, still faster than a vmapped
backward pass. tests/test_bookkeeping.py checks the same clipped sum both ways.

A clip stage that states its own book-keeping form (``StageFns.layer_clip``: GEP's embedding,
norms and both clips as contractions) gets every example's layer gradients from one batched
backward pass (``layer_grads_fn``, also handed to stages as ``StageInfo.layer_grads``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpbench import models
from dpbench.stages.base import Kind, Mask


@dataclasses.dataclass(frozen=True)
class Tap:
    """One matmul layer: its module path, inputs per example (positions T x features d) and
    outputs (T x p)."""

    path: tuple
    positions: int
    inputs: int
    outputs: int
    output_shape: tuple  # one example's output shape (the perturbation's)

    @property
    def ghost_is_cheaper(self) -> bool:
        """Gram products over positions cost T^2 (d + p), the materialized gradient T d p, but
        the materialized gradient is then reused for the weighted sum (which the Gram route
        recomputes as (c a)^T delta) and runs as one batched matmul: Gram only at half."""
        return 2 * self.positions ** 2 * (self.inputs + self.outputs) < \
            self.positions * self.inputs * self.outputs


def _layer_input(module, x):
    """The matrix the layer multiplies: a Dense's input, a PatchConv's image patches."""
    if isinstance(module, models.PatchConv):
        return models.image_patches(x, module.kernel_size, module.strides, module.padding)
    return x


def _is_tap(module) -> bool:
    return isinstance(module, (nn.Dense, models.PatchConv))


def forward(model: nn.Module, params, images, perturbations: Optional[dict] = None):
    """(logits, {path: layer input}) for a batch; ``perturbations[path]`` (batch x output
    shape) is added to that tap layer's output, so its gradient is the output gradient."""
    inputs = {}

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not _is_tap(module):
            return next_fun(*args, **kwargs)
        inputs[module.path] = _layer_input(module, args[0])
        out = next_fun(*args, **kwargs)
        return out if perturbations is None else out + perturbations[module.path]

    with nn.intercept_methods(interceptor):
        logits = model.apply(params, images)
    return logits, inputs


def _tap_inputs(model: nn.Module, params_shape, example_shape) -> tuple[dict, list, bool]:
    """(tap path -> the shape of its input, for one example; the parameter leaves that no tap
    layer holds, as paths; whether the taps' kernels and biases are exactly the parameters),
    by tracing the model's forward pass (no compute)."""
    shapes = {}

    def trace(params, images):
        logits, inputs = forward(model, params, images)
        shapes.update({p: a.shape for p, a in inputs.items()})
        return logits

    x = jax.ShapeDtypeStruct((1,) + tuple(example_shape), jnp.float32)
    jax.eval_shape(trace, params_shape, x)
    covered = {path + (leaf,) for path in shapes for leaf in ("kernel", "bias")}
    leaves = [tuple(k.key for k in path[1:]) for path, _ in
              jax.tree_util.tree_flatten_with_path(params_shape)[0]]
    return shapes, [leaf for leaf in leaves if leaf not in covered], covered == set(leaves)


def discover_taps(model: nn.Module, params_shape, example_shape) -> Optional[tuple]:
    """The model's tap layers, or None when some parameter is not a tap layer's kernel or bias
    (e.g. GroupNorm's scale): then book-keeping does not apply."""
    shapes, _, exact = _tap_inputs(model, params_shape, example_shape)
    if not exact:  # a parameter outside the taps, or a tap without a bias
        return None
    taps = []
    for path, shape in shapes.items():
        kernel = _get(params_shape["params"], path + ("kernel",)).shape
        d, p = math.prod(kernel[:-1]), kernel[-1]
        positions = math.prod(shape[1:-1]) if len(shape) > 2 else 1
        taps.append(Tap(path, positions, d, p, tuple(shape[1:-1]) + (p,)))
    return tuple(sorted(taps, key=lambda t: t.path))


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _plain_gradient(stage) -> bool:
    return (stage.name == "grad.per_example" and stage.options.get("augmult") == 1
            and stage.options.get("augmentation") == "none")


def applies(stages, num_per_example: int, taps: Optional[tuple]) -> bool:
    """Book-keeping reproduces exactly [grad.per_example (no augmentation), per-example stages
    on the gradient..., clip.global_l2] on a model made of tap layers; anything else
    (augmentation, GroupNorm) is materialized, except a clip with a ``layer_clip`` form
    (``applies_layer_clip``)."""
    if taps is None:
        return False
    chain = stages[:num_per_example]
    first, last, middle = chain[0], chain[-1], chain[1:-1]
    return (_plain_gradient(first)
            and last.name == "clip.global_l2" and last.kind_out == Kind.BOUNDED
            and all(s.kind_in == s.kind_out == Kind.PER_EXAMPLE for s in middle))


def untapped_parameters(model: nn.Module, params_shape, example_shape) -> list:
    """The parameters (as 'Layer/leaf' paths) that no tap layer holds: why book-keeping does
    not apply to a model (``discover_taps`` is None)."""
    untapped = _tap_inputs(model, params_shape, example_shape)[1]
    return sorted("/".join(map(str, leaf)) for leaf in untapped) or [
        "(a tap layer without a bias)"]


def strategy_reason(stages, num_per_example: int, taps: Optional[tuple], model,
                    params_shape, example_shape) -> str:
    """Why the per-example gradients are materialized ("" when book-keeping applies): no
    model given, parameters outside the tap layers (named), augmentation, or a chain that
    book-keeping does not reproduce."""
    if model is None:
        return "no model given to the compiler (book-keeping needs its layers)"
    if taps is None:
        names = untapped_parameters(model, params_shape, example_shape)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (f"the model has parameters outside the layers book-keeping taps (nn.Dense and "
                f"PatchConv): {shown}")
    if not _plain_gradient(stages[0]):
        return ("augmentation (grad.per_example with augmult > 1 or an augmentation): "
                "book-keeping takes one position per example")
    chain = " -> ".join(s.name for s in stages[:num_per_example])
    return (f"the per-example chain {chain} is not the gradient, per-example stages and "
            "clip.global_l2 (nor a clip with a layer form) that book-keeping reproduces")


def applies_layer_clip(stages, fns, num_per_example: int, taps: Optional[tuple]) -> bool:
    """[grad.per_example (no augmentation), a clip stage with ``StageFns.layer_clip``] on a
    model made of tap layers: the clip's own book-keeping form computes the same sum (GEP)."""
    return (taps is not None and num_per_example == 2 and _plain_gradient(stages[0])
            and fns[1].layer_clip is not None)


def layer_grads_fn(model: nn.Module, taps: tuple):
    """``StageInfo.layer_grads`` for this model: (params, images, labels, mask) ->
    ({tap path: {"bias": (b, p), "kernel": (b, p, d)}} nested like params["params"], per-example
    losses), every example's gradient of its own loss from one batched backward pass (examples
    outside ``mask`` get zero output gradients). Kernels are outputs-first, the layout XLA's CPU
    batched dot writes fastest; row j of a (d, p) kernel gradient is column j here."""
    def layer_grads(params, images, labels, mask):
        inputs, deltas, losses = _output_gradients(model, taps, params, images, labels, mask)
        b = images.shape[0]
        grads = {}
        for t in taps:
            a = inputs[t.path].reshape(b, t.positions, t.inputs)
            a = models.through_a_dot(a) if t.positions == 1 else a
            delta = deltas[t.path].reshape(b, t.positions, t.outputs)
            _set(grads, t.path, {"bias": jnp.sum(delta, axis=1),
                                 "kernel": jnp.einsum("btd,btp->bpd", a, delta)})
        return grads, losses

    return layer_grads


def masks_only(stages, clip_index: int) -> bool:
    """Every stage between the gradient and the clip is a public mask (Mask.PER_EXAMPLE)."""
    return all(Mask.PER_EXAMPLE in s.public_mask for s in stages[1:clip_index])


def _layer_terms(a, delta, kernel_mask, bias_mask, tap: Tap):
    """One layer, per example: (squared norm of its masked gradient, its materialized UNmasked
    kernel gradient B x p x d or None when the norm came from ghost products, its masked bias
    gradient B x p)."""
    bias = jnp.sum(delta, axis=1)
    if bias_mask is not None:
        bias = bias * bias_mask
    bias_sq = jnp.sum(jnp.square(bias), axis=1)
    if tap.positions == 1:  # dense: ||(a delta^T) * M||^2 = (a^2 M^2) . delta^2, no a delta^T
        a2, d2 = jnp.square(a[:, 0]), jnp.square(delta[:, 0])
        if kernel_mask is None:
            return jnp.sum(a2, 1) * jnp.sum(d2, 1) + bias_sq, None, bias
        return jnp.sum((a2 @ jnp.square(kernel_mask)) * d2, 1) + bias_sq, None, bias
    if kernel_mask is None and tap.ghost_is_cheaper:     # Gram products over positions
        gram_a = jnp.einsum("btd,bsd->bts", a, a)
        gram_d = jnp.einsum("btp,bsp->bts", delta, delta)
        return jnp.sum(gram_a * gram_d, axis=(1, 2)) + bias_sq, None, bias
    # Materialized (reused for the weighted sum) outputs-first, B x p x d: XLA's CPU batched
    # dot writes that layout about twice as fast as B x d x p (tanh CNN's convolutions).
    # The mask is the same for every example, so the kernel stays unmasked: the norm weighs its
    # squares by the mask's and the weighted sum is masked once (_weighted_sums), which saves
    # writing and re-reading a masked B x p x d copy.
    kernel = jnp.einsum("btd,btp->bpd", a, delta)
    squares = jnp.square(kernel)
    if kernel_mask is not None:
        squares = squares * jnp.square(kernel_mask.T)
    return jnp.sum(squares, axis=(1, 2)) + bias_sq, kernel, bias


def _weighted_sums(terms: dict, scale, zero_bad: bool) -> dict:
    """Per layer sum_i scale_i g_i: from the materialized per-example kernel gradients where
    there are some, else as (scale a)^T delta, then times the kernel mask (public, the same for
    every example); ``zero_bad`` first zeroes examples with a zero scale (a non-finite
    gradient: NaN * 0 is NaN)."""
    out = {}
    for path, (a, delta, kernel, bias, kmask) in terms.items():
        if zero_bad:
            good = scale > 0
            a, delta, bias = (jnp.where(good.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
                              for x in (a, delta, bias))
            kernel = None if kernel is None else jnp.where(good[:, None, None], kernel, 0.0)
        if kernel is not None:
            k = jnp.einsum("b,bpd->pd", scale, kernel).T
        else:
            k = jnp.einsum("btd,btp->dp", a * scale[:, None, None], delta)
        k = k if kmask is None else k * kmask
        out[path] = (k, jnp.einsum("b,bp->p", scale, bias))
    return out


def _output_gradients(model: nn.Module, taps: tuple, params, images, labels, mask):
    """One batched forward and backward pass: (layer inputs, output gradients of each example's
    own loss, the per-example losses)."""
    perturbations = {t.path: jnp.zeros((images.shape[0],) + t.output_shape) for t in taps}

    def total_loss(perturbations):
        logits, inputs = forward(model, params, images, perturbations)
        losses = models.logits_loss(logits, labels)
        return jnp.sum(jnp.where(mask, losses, 0.0)), (inputs, losses)

    (_, (inputs, losses)), deltas = jax.value_and_grad(total_loss, has_aux=True)(perturbations)
    return inputs, deltas, losses


def _clip_scale(squares, losses, mask, l2_bound: float):
    finite = jnp.isfinite(squares) & jnp.isfinite(losses)
    keep = mask & finite
    scale = jnp.where(keep, l2_bound / jnp.maximum(jnp.sqrt(jnp.where(keep, squares, 0.0)),
                                                   l2_bound), 0.0)
    diagnostics = {"loss": jnp.sum(jnp.where(keep, losses, 0.0)),
                   "nonfinite": jnp.sum(mask & ~finite).astype(jnp.float32)}
    return scale, finite, diagnostics


def clipped_sum(model: nn.Module, taps: tuple, params, images, labels, mask, l2_bound: float,
                masks: Optional[dict] = None, transform=None, elementwise: bool = False):
    """For one micro-batch: (sum_i c_i h(g_i) as a params-shaped tree, {"loss", "nonfinite"}),
    with g_i the gradient of example i's loss, h the per-example stages between the gradient and
    the clip, c_i = min(1, C / ||h(g_i)||) for a finite value of a real example (mask_i), else 0.

    ``masks`` (params-shaped): h is a public mask multiply (the product of the Mask.PER_EXAMPLE
    stages' masks); dense layers then need no per-example gradient at all. ``transform``: any
    other h, applied to the per-example gradient tree materialized from the layer terms
    (batched over examples, e.g. Nasr's discretization vmapped); ``elementwise``: h is one
    scalar function on every coordinate, so it may see the kernels outputs-first (faster)."""
    inputs, deltas, losses = _output_gradients(model, taps, params, images, labels, mask)
    if transform is not None:
        return _transformed_sum(taps, params, inputs, deltas, losses, mask, l2_bound, transform,
                                elementwise)
    b = images.shape[0]
    terms, squares = {}, 0.0
    for t in taps:
        kmask = None if masks is None else _get(masks["params"], t.path + ("kernel",)).reshape(
            t.inputs, t.outputs)
        bmask = None if masks is None else _get(masks["params"], t.path + ("bias",))
        a = inputs[t.path].reshape(b, t.positions, t.inputs)
        delta = deltas[t.path].reshape(b, t.positions, t.outputs)
        sq, kernel, bias = _layer_terms(a, delta, kmask, bmask, t)
        squares = squares + sq
        terms[t.path] = (a, delta, kernel, bias, kmask)
    scale, finite, diagnostics = _clip_scale(squares, losses, mask, l2_bound)
    # Zeroing non-finite examples costs a pass over every per-example term: only when needed.
    sums = jax.lax.cond(jnp.all(finite), lambda: _weighted_sums(terms, scale, False),
                        lambda: _weighted_sums(terms, scale, True))
    grads = {}
    for t in taps:
        kernel, bias = sums[t.path]
        kernel_shape = _get(params["params"], t.path + ("kernel",)).shape
        _set(grads, t.path, {"kernel": kernel.reshape(kernel_shape), "bias": bias})
    return {"params": grads}, diagnostics


def per_example_squared_norms(values, b: int):
    """Every example's squared L2 norm over EVERY leaf of a tree batched over ``b`` examples
    (kernels and biases alike): what the transformed path clips by."""
    return sum(jnp.sum(jnp.square(v).reshape(b, -1), axis=1) for v in jax.tree.leaves(values))


def _transformed_sum(taps, params, inputs, deltas, losses, mask, l2_bound: float, transform,
                     elementwise: bool):
    """The per-example gradients materialized from the layer terms, ``transform``ed, clipped
    by a norm and summed by one weighted contraction per leaf. An ``elementwise`` transform
    gets each kernel outputs-first (B x p x d, the fast layout; a transpose to kernel shape
    costs what it saves), and the sum is transposed back once."""
    b = mask.shape[0]
    grads = {}
    for t in taps:
        a = inputs[t.path].reshape(b, t.positions, t.inputs)
        a = models.through_a_dot(a) if t.positions == 1 else a  # Nasr: 0.75x
        delta = deltas[t.path].reshape(b, t.positions, t.outputs)
        kernel_shape = _get(params["params"], t.path + ("kernel",)).shape
        kernel = (jnp.einsum("btd,btp->bpd", a, delta) if elementwise else
                  jnp.einsum("btd,btp->bdp", a, delta).reshape((b,) + kernel_shape))
        _set(grads, t.path, {"kernel": kernel, "bias": jnp.sum(delta, axis=1)})
    values = transform({"params": grads})
    squares = per_example_squared_norms(values, b)
    scale, finite, diagnostics = _clip_scale(squares, losses, mask, l2_bound)

    def weighted(zero_bad: bool):
        def one(v):
            if zero_bad:
                v = jnp.where((scale > 0).reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0)
            return jnp.tensordot(scale, v, axes=1)
        return jax.tree.map(one, values)

    sums = jax.lax.cond(jnp.all(finite), lambda: weighted(False), lambda: weighted(True))
    if elementwise:
        for t in taps:
            leaf = _get(sums["params"], t.path)
            leaf["kernel"] = leaf["kernel"].T.reshape(
                _get(params["params"], t.path + ("kernel",)).shape)
    return sums, diagnostics


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
