"""Book-keeping per-example clipping (Bu et al., ICML 2023): the clipped sum of per-example
gradients from ONE batched forward and backward pass, without the per-example gradient tree.

For a matmul layer y = a K + b (nn.Dense; a convolution, whose ``a`` are image patches:
``taps.py``), example i's kernel gradient is a_i^T delta_i (a_i: its T x d inputs, delta_i: the
T x p gradients of its loss with respect to the layer's outputs) and its bias gradient is
sum_t delta_it; for GroupNorm's scale and bias (an affine tap) they are sum_t xhat_it * delta_it
and sum_t delta_it. One batched backward pass to zero "perturbations" added to every layer's
output gives every delta_i; each example's squared gradient norm then comes per layer from the
materialized a_i^T delta_i, or, where cheaper, from Gram products over positions (ghost norm:
sum_{t,s} (a_t.a_s)(delta_t.delta_s)). With c_i = min(1, C / ||g_i||) the clipped sum is
sum_i c_i a_i^T delta_i = (c a)^T delta: one weighted contraction per layer.

What it reproduces, exactly (the compiler uses it only for this chain, ``applies``): the
gradient of models.cross_entropy_loss (grad.per_example; with augmentation multiplicity K the
mean of K augmented copies' gradients, the copies entering as K x T positions of each layer,
drawn with the materialized strategy's keys), then per-example stages on the gradient, then
the flat L2 clip (clip.global_l2), with a non-finite example zeroed and counted as the
materialized strategy does. Public per-example masks (stages declaring ``Mask.PER_EXAMPLE``:
RS, DP-SSGD) keep the contraction form, since sum_i c_i (M * g_i) = M * sum_i c_i g_i; any
other per-example stage (Nasr's discretization) runs on per-example gradients materialized from
the layer terms, still faster than a vmapped backward pass. tests/test_bookkeeping.py checks
the same clipped sum both ways.

A clip stage that states its own book-keeping form (``Hooks.layer_clip``: GEP's embedding,
norms and both clips as contractions) gets every example's layer gradients from one batched
backward pass (``layer_grads_fn``, also handed to stages as the run fact ``layer_grads``), on a
model of matmul taps and without augmentation.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from dpbench.models import losses as model_losses
from dpbench.compiler.taps import AFFINE, Tap, forward, leaf_at as _get, untapped_parameters
from dpbench.stages.base import Kind, Mask


def _gradient_stage(stage) -> bool:
    return stage.name == "grad.per_example"


def _plain_gradient(stage) -> bool:
    return (_gradient_stage(stage) and stage.options.get("augmult") == 1
            and stage.options.get("augmentation") == "none")


def applies(stages, num_per_example: int, taps: Optional[tuple]) -> bool:
    """Book-keeping reproduces exactly [grad.per_example (augmentation multiplicity included),
    per-example stages on the gradient..., clip.global_l2] on a model whose parameters all sit
    in tap layers; anything else is materialized, except a clip with a ``layer_clip`` form
    (``applies_layer_clip``)."""
    if taps is None:
        return False
    chain = stages[:num_per_example]
    first, last, middle = chain[0], chain[-1], chain[1:-1]
    return (_gradient_stage(first)
            and last.name == "clip.global_l2" and last.kind_out == Kind.BOUNDED
            and all(s.kind_in == s.kind_out == Kind.PER_EXAMPLE for s in middle))


def strategy_reason(stages, num_per_example: int, taps: Optional[tuple], model,
                    params_shape, example_shape) -> str:
    """Why the per-example gradients are materialized ("" when book-keeping applies): no
    model given, parameters outside the tap layers (named), or a chain that book-keeping does
    not reproduce."""
    if model is None:
        return "no model given to the compiler (book-keeping needs its layers)"
    if taps is None:
        names = untapped_parameters(model, params_shape, example_shape)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (f"the model has parameters outside the layers book-keeping taps (nn.Dense, "
                f"PatchConv, nn.Conv without dilation or groups, GroupNorm with its scale and "
                f"bias), or a tap layer called more than once: {shown}")
    chain = " -> ".join(s.name for s in stages[:num_per_example])
    note = "" if _plain_gradient(stages[0]) else (
        "; a clip's layer form (GEP's) takes no augmentation")
    if any(t.kind == AFFINE for t in taps):
        note += ("; a clip's layer form (GEP's) takes matmul layers only, not GroupNorm's scale "
                 "and bias")
    return (f"the per-example chain {chain} is not the gradient, per-example stages and "
            f"clip.global_l2 (nor a clip with a layer form) that book-keeping reproduces{note}")


def applies_layer_clip(stages, fns, num_per_example: int, taps: Optional[tuple]) -> bool:
    """[grad.per_example (no augmentation), a clip stage with ``Hooks.layer_clip``] on a
    model made of matmul tap layers: the clip's own book-keeping form computes the same sum
    (GEP)."""
    return (taps is not None and num_per_example == 2 and _plain_gradient(stages[0])
            and all(t.kind != AFFINE for t in taps) and fns[1].hooks.layer_clip is not None)


def _per_example_leaves(tap: Tap, a, delta, outputs_first: bool = True) -> dict:
    """One tap's per-example parameter gradients from its inputs a (B x T x d) and output
    gradients delta (B x T x p): a matmul's kernel (B x p x d outputs-first, or B x d x p) and
    bias (B x p); an affine layer's scale and bias (B x p each)."""
    bias = jnp.sum(delta, axis=1)
    if tap.kind == AFFINE:
        return {"scale": jnp.sum(a * delta, axis=1), "bias": bias}
    spec = "btd,btp->bpd" if outputs_first else "btd,btp->bdp"
    return {"kernel": jnp.einsum(spec, a, delta), "bias": bias}


def layer_grads_fn(model, taps: tuple):
    """The run fact ``layer_grads`` for this model (compiler/facts.py: only when every tap is
    a matmul layer): (params, images, labels, mask) -> ({tap path: {"bias": (b, p), "kernel":
    (b, p, d)}} nested like params["params"] (an affine tap would give "scale" and "bias", (b, p)
    each), per-example losses), every example's gradient of its own loss from one batched
    backward pass (examples outside ``mask`` get zero output gradients). Kernels are
    outputs-first, the layout XLA's CPU batched dot writes fastest; row j of a (d, p) kernel
    gradient is column j here."""
    def layer_grads(params, images, labels, mask):
        inputs, deltas, losses = _output_gradients(model, taps, params, images, labels, mask)
        b = images.shape[0]
        grads = {}
        for t in taps:
            a = inputs[t.path].reshape(b, t.positions, t.inputs)
            a = model_losses.through_a_dot(a) if t.positions == 1 else a
            delta = deltas[t.path].reshape(b, t.positions, t.outputs)
            _set(grads, t.path, _per_example_leaves(t, a, delta))
        return grads, losses

    return layer_grads


def masks_only(stages, clip_index: int) -> bool:
    """Every stage between the gradient and the clip is a public mask (Mask.PER_EXAMPLE)."""
    return all(Mask.PER_EXAMPLE in s.privacy.public_mask for s in stages[1:clip_index])


def _layer_terms(a, delta, kernel_mask, bias_mask, tap: Tap, kernel=None):
    """One matmul layer, per example (T = a's positions, augmentation copies included):
    (squared norm of its masked gradient, its materialized UNmasked kernel gradient B x p x d
    or None when the norm came from ghost products, its masked bias gradient B x p).
    ``kernel``: that per-example kernel gradient already formed (_conv_kernels)."""
    bias = jnp.sum(delta, axis=1)
    if bias_mask is not None:
        bias = bias * bias_mask
    bias_sq = jnp.sum(jnp.square(bias), axis=1)
    if kernel is None and a.shape[1] == 1:  # dense: ||(a d^T) * M||^2 = (a^2 M^2) . d^2
        a2, d2 = jnp.square(a[:, 0]), jnp.square(delta[:, 0])
        if kernel_mask is None:
            return jnp.sum(a2, 1) * jnp.sum(d2, 1) + bias_sq, None, bias
        return jnp.sum((a2 @ jnp.square(kernel_mask)) * d2, 1) + bias_sq, None, bias
    if kernel is None and kernel_mask is None and tap.ghost_is_cheaper_at(a.shape[1]):
        gram_a = jnp.einsum("btd,bsd->bts", a, a)  # Gram over positions
        gram_d = jnp.einsum("btp,bsp->bts", delta, delta)
        return jnp.sum(gram_a * gram_d, axis=(1, 2)) + bias_sq, None, bias
    # Materialized (reused for the weighted sum) outputs-first, B x p x d: XLA's CPU batched
    # dot writes that layout about twice as fast as B x d x p (tanh CNN's convolutions).
    # The mask is the same for every example, so the kernel stays unmasked: the norm weighs its
    # squares by the mask's and the weighted sum is masked once (_weighted_sums), which saves
    # writing and re-reading a masked B x p x d copy.
    if kernel is None:
        kernel = jnp.einsum("btd,btp->bpd", a, delta)
    squares = jnp.square(kernel)
    if kernel_mask is not None:
        squares = squares * jnp.square(kernel_mask.T)
    return jnp.sum(squares, axis=(1, 2)) + bias_sq, kernel, bias


def _conv_kernels(x, delta, tap: Tap, b: int):
    """A convolution tap's per-example kernel gradients, outputs-first (b x p x d), from its
    raw input x (b K images) and output gradient (b K outputs): each example's weight gradient
    over its K copies as XLA computes a convolution's, vmapped over the examples (a grouped
    convolution), so no image patches are formed. Same values as the patches' a^T delta."""
    kernel_size, strides, padding = tap.conv
    xs = x.reshape((b, -1) + x.shape[1:])
    ds = delta.reshape((b, -1) + delta.shape[1:])
    zeros = jnp.zeros(tuple(kernel_size) + (x.shape[-1], tap.outputs), x.dtype)

    def one(xi, di):
        def conv(kernel):
            return jax.lax.conv_general_dilated(xi, kernel, strides, padding,
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.vjp(conv, zeros)[1](di)[0]

    return jnp.swapaxes(jax.vmap(one)(xs, ds).reshape(b, -1, tap.outputs), 1, 2)


def _affine_terms(a, delta, scale_mask, bias_mask, tap: Tap):
    """One affine layer (GroupNorm's scale and bias), per example: (squared norm of its masked
    gradient, its masked scale gradient B x p, its masked bias gradient B x p)."""
    leaves = _per_example_leaves(tap, a, delta)
    scale, bias = leaves["scale"], leaves["bias"]
    scale = scale if scale_mask is None else scale * scale_mask
    bias = bias if bias_mask is None else bias * bias_mask
    return jnp.sum(jnp.square(scale), 1) + jnp.sum(jnp.square(bias), 1), scale, bias


def _weighted_sums(terms: dict, scale, zero_bad: bool) -> dict:
    """Per layer sum_i scale_i g_i: from the materialized per-example gradients where there
    are some, else as (scale a)^T delta, then times the kernel mask (public, the same for
    every example); ``zero_bad`` first zeroes examples with a zero scale (a non-finite
    gradient: NaN * 0 is NaN)."""
    out = {}
    for path, (a, delta, first, bias, kmask) in terms.items():
        if zero_bad:
            good = scale > 0
            a, delta, bias = (jnp.where(good.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
                              for x in (a, delta, bias))
            first = None if first is None else jnp.where(
                good.reshape((-1,) + (1,) * (first.ndim - 1)), first, 0.0)
        if first is not None and first.ndim == 2:  # an affine layer's scale, masked already
            out[path] = (jnp.einsum("b,bp->p", scale, first), jnp.einsum("b,bp->p", scale, bias))
            continue
        if first is not None:
            k = jnp.einsum("b,bpd->pd", scale, first).T
        else:
            k = jnp.einsum("btd,btp->dp", a * scale[:, None, None], delta)
        k = k if kmask is None else k * kmask
        out[path] = (k, jnp.einsum("b,bp->p", scale, bias))
    return out


def _output_gradients(model, taps: tuple, params, images, labels, mask, copies: int = 1,
                      raw_convs: bool = False):
    """One batched forward and backward pass over the b x ``copies`` images (an example's
    augmented copies adjacent): (layer inputs (a convolution's raw input with ``raw_convs``,
    else its image patches), output gradients of each example's own loss, the mean over its
    copies, the per-example losses)."""
    perturbations = {t.path: jnp.zeros((images.shape[0],) + t.output_shape) for t in taps}

    def total_loss(perturbations):
        logits, inputs = forward(model, params, images, perturbations, raw_convs=raw_convs)
        losses = model_losses.logits_loss(logits, labels)
        if copies > 1:
            losses = losses.reshape(-1, copies).mean(axis=1)
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


def _example_rows(inputs, deltas, tap: Tap, b: int):
    """A tap's inputs (b x T' x d) and output gradients (b x T' x p) per example, T' = its
    positions times the example's augmentation copies (adjacent in the batch)."""
    return (inputs[tap.path].reshape(b, -1, tap.inputs),
            deltas[tap.path].reshape(b, -1, tap.outputs))


def clipped_sum(model, taps: tuple, params, images, labels, mask, l2_bound: float,
                masks: Optional[dict] = None, transform=None, elementwise: bool = False,
                copies: int = 1, branch_free: bool = False, conv_grads: str = "patches"):
    """For one micro-batch: (sum_i c_i h(g_i) as a params-shaped tree, {"loss", "nonfinite"}),
    with g_i the gradient of example i's loss, h the per-example stages between the gradient and
    the clip, c_i = min(1, C / ||h(g_i)||) for a finite value of a real example (mask_i), else 0.

    ``copies``: the images are b x K augmented copies (example i's K adjacent), labels likewise,
    ``mask`` per example; g_i is the mean of its copies' gradients (grad.per_example's
    augmentation multiplicity), the copies entering as extra positions of each layer.
    ``masks`` (params-shaped): h is a public mask multiply (the product of the Mask.PER_EXAMPLE
    stages' masks); dense layers then need no per-example gradient at all. ``transform``: any
    other h, applied to the per-example gradient tree materialized from the layer terms
    (batched over examples, e.g. Nasr's discretization vmapped); ``elementwise``: h is one
    scalar function on every coordinate, so it may see the kernels outputs-first (faster).
    ``branch_free``: always the weighted sum that zeroes non-finite examples (the same sum when
    all are finite), instead of choosing it by a data-dependent conditional. ``conv_grads``
    'convolution': a convolution's per-example kernel gradients by _conv_kernels, not from its
    image patches (not for a ``transform``, which reads the patches)."""
    raw_convs = conv_grads == "convolution" and transform is None
    inputs, deltas, losses = _output_gradients(model, taps, params, images, labels, mask,
                                               copies, raw_convs)
    if transform is not None:
        return _transformed_sum(taps, params, inputs, deltas, losses, mask, l2_bound, transform,
                                elementwise, branch_free)
    b = mask.shape[0]
    terms, squares = {}, 0.0
    for t in taps:
        first, second = t.leaves
        fmask, bmask = (None, None) if masks is None else (
            _get(masks["params"], t.path + (first,)), _get(masks["params"], t.path + (second,)))
        kernel = None
        if raw_convs and t.conv:  # its raw input, one row of channels per position
            kernel = _conv_kernels(inputs[t.path], deltas[t.path], t, b)
            x = inputs[t.path]
            a, delta = x.reshape(b, -1, x.shape[-1]), deltas[t.path].reshape(b, -1, t.outputs)
        else:
            a, delta = _example_rows(inputs, deltas, t, b)
        if t.kind == AFFINE:
            sq, materialized, bias = _affine_terms(a, delta, fmask, bmask, t)
            fmask = None
        else:
            fmask = None if fmask is None else fmask.reshape(t.inputs, t.outputs)
            sq, materialized, bias = _layer_terms(a, delta, fmask, bmask, t, kernel)
        squares = squares + sq
        terms[t.path] = (a, delta, materialized, bias, fmask)
    scale, finite, diagnostics = _clip_scale(squares, losses, mask, l2_bound)
    # Zeroing non-finite examples costs a pass over every per-example term: only when needed.
    sums = _weighted_sums(terms, scale, True) if branch_free else jax.lax.cond(
        jnp.all(finite), lambda: _weighted_sums(terms, scale, False),
        lambda: _weighted_sums(terms, scale, True))
    grads = {}
    for t in taps:
        first, bias = sums[t.path]
        name = t.leaves[0]
        first = first.reshape(_get(params["params"], t.path + (name,)).shape)
        _set(grads, t.path, {name: first, "bias": bias})
    return {"params": grads}, diagnostics


def per_example_squared_norms(values, b: int):
    """Every example's squared L2 norm over EVERY leaf of a tree batched over ``b`` examples
    (kernels and biases alike): what the transformed path clips by."""
    return sum(jnp.sum(jnp.square(v).reshape(b, -1), axis=1) for v in jax.tree.leaves(values))


def _transformed_sum(taps, params, inputs, deltas, losses, mask, l2_bound: float, transform,
                     elementwise: bool, branch_free: bool = False):
    """The per-example gradients materialized from the layer terms, ``transform``ed, clipped
    by a norm and summed by one weighted contraction per leaf. An ``elementwise`` transform
    gets each kernel outputs-first (B x p x d, the fast layout; a transpose to kernel shape
    costs what it saves), and the sum is transposed back once."""
    b = mask.shape[0]
    grads = {}
    for t in taps:
        a, delta = _example_rows(inputs, deltas, t, b)
        a = model_losses.through_a_dot(a) if t.positions == 1 else a  # Nasr: 0.75x
        leaves = _per_example_leaves(t, a, delta, outputs_first=elementwise)
        if t.kind != AFFINE and not elementwise:
            leaves["kernel"] = leaves["kernel"].reshape(
                (b,) + _get(params["params"], t.path + ("kernel",)).shape)
        _set(grads, t.path, leaves)
    values = transform({"params": grads})
    squares = per_example_squared_norms(values, b)
    # A transform may map a non-finite gradient to finite values (Nasr's ternary), and a loss
    # can be finite where the gradient is not: the raw gradient's own norm is checked too.
    raw_finite = jnp.isfinite(per_example_squared_norms(grads, b))
    scale, finite, diagnostics = _clip_scale(jnp.where(raw_finite, squares, jnp.nan), losses,
                                             mask, l2_bound)

    def weighted(zero_bad: bool):
        def one(v):
            if zero_bad:
                v = jnp.where((scale > 0).reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0)
            return jnp.tensordot(scale, v, axes=1)
        return jax.tree.map(one, values)

    sums = weighted(True) if branch_free else jax.lax.cond(
        jnp.all(finite), lambda: weighted(False), lambda: weighted(True))
    if elementwise:
        for t in taps:
            if t.kind == AFFINE:
                continue
            leaf = _get(sums["params"], t.path)
            leaf["kernel"] = leaf["kernel"].T.reshape(
                _get(params["params"], t.path + ("kernel",)).shape)
    return sums, diagnostics


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
