"""The clipped per-example sum, by either strategy (materialized vmap(grad), or book-keeping's
norms from activations and one re-weighted backward): both give the same clipped sum.
``masked_sum`` is the one clipped-sum loop of the step and of a one-off release."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dpbench import sharding
from dpbench.compiler import bookkeeping
from dpbench.stages.base import Kind, Mask, StepContext, apply_mask
from dpbench.stages.grad import augmented_copies
from dpbench.ops import zero_if_nonfinite
from dpbench.compiler.plan import Plan, StepOptions


EXAMPLE_KEYS = ("image", "label")


def masked_sum(per_example: Callable, batch: dict, branch_free: bool = False,
               device_partials: int = 1) -> tuple:
    """Sum over the batch's real examples of ``per_example(example, position) -> (value, aux)``.

    The batch is [micro_steps, micro_batch, ...]; micro-batches run under lax.scan (memory stays
    bounded), examples under vmap with the mesh's data axis; a micro-batch with no real example
    is skipped (it contributes exactly zero), unless ``branch_free``: then every micro-batch
    runs (one of padding only adds zeros) and the loop has no data-dependent conditional. The
    one clipped-sum function of the compiler: the step and the one-off release both use it.
    ``device_partials``: StepOptions.device_partials.
    """
    examples = {k: batch[k] for k in EXAMPLE_KEYS}
    micro_steps, micro_batch_size = batch["mask"].shape
    one = {k: jax.ShapeDtypeStruct(v.shape[2:], v.dtype) for k, v in examples.items()}
    shapes = jax.eval_shape(per_example, one, jax.ShapeDtypeStruct((), jnp.int32))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    positions = jnp.arange(micro_steps * micro_batch_size, dtype=jnp.int32).reshape(
        micro_steps, micro_batch_size)

    def compute(micro):
        example, mask, position = micro
        # with per-device partial sums the examples are already split over the data axis
        axis = None if device_partials > 1 else sharding.DATA_AXIS
        out = jax.vmap(per_example, spmd_axis_name=axis)(example, position)

        def masked(v):
            m = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
            kept = jnp.where(m, v, jnp.zeros_like(v))  # a padding slot adds exactly 0, even NaN
            if not jnp.issubdtype(v.dtype, jnp.floating):
                return jnp.sum(kept, axis=0)
            # The sum over examples as a product with ones: XLA's CPU reduce over the leading
            # axis falls off a cliff once a row outgrows the cache (32 x 39690, ScatterNet's
            # linear layer: 10 ms against 0.4 ms as a dot; docs/speed.md).
            return jnp.tensordot(jnp.ones(v.shape[0], v.dtype), kept, axes=1)

        return jax.tree.map(masked, out)

    return _scan_sum(compute, (examples, batch["mask"], positions), 1, zeros, branch_free,
                     device_partials)


def _scan_sum(compute: Callable, xs: tuple, mask_at: int, zeros, branch_free: bool,
              device_partials: int = 1):
    """The sum over micro-batches of ``compute(x)``, x a micro-batch's slice of ``xs`` (whose
    ``mask_at``-th member is its mask), under lax.scan: one with no real example is skipped by
    a lax.cond (it contributes exactly zero), or with ``branch_free`` runs and adds zeros.

    With ``device_partials`` D > 1 every micro-batch is split into D equal parts along its
    examples, ``compute`` vmapped over the parts on the mesh's data axis: the loop carries D
    partial sums, one on each device, and adds them once after the loop."""
    if device_partials > 1:
        whole = compute

        def compute(x):
            parts = jax.tree.map(lambda v: v.reshape(
                (device_partials, v.shape[0] // device_partials) + v.shape[1:]), x)
            return jax.vmap(whole, spmd_axis_name=sharding.DATA_AXIS)(parts)

        zeros = jax.tree.map(lambda z: jnp.zeros((device_partials,) + z.shape, z.dtype), zeros)

    def body(total, x):
        part = compute(x) if branch_free else jax.lax.cond(
            jnp.any(x[mask_at]), compute, lambda _: zeros, x)
        return jax.tree.map(jnp.add, total, part), None

    total = jax.lax.scan(body, zeros, xs)[0]
    return total if device_partials == 1 else jax.tree.map(lambda t: jnp.sum(t, 0), total)


def _augmented_copies(grad_stage, step_key, images, labels, positions):
    """grad.per_example's K augmented copies of each example, drawn by its own
    ``augmented_copies`` with the key the materialized strategy gives that stage
    (fold_in(fold_in(step_key, 0), position)): (b K images, example i's copies adjacent, b K
    labels, K)."""
    options = grad_stage.options
    copies = options["augmult"]
    if copies == 1 and options["augmentation"] == "none":
        return images, labels, 1

    def one(position, image):
        key = jax.random.fold_in(jax.random.fold_in(step_key, 0), position)
        return augmented_copies(key, image, copies, options["augmentation"],
                                options["crop_padding"])

    augmented = jax.vmap(one)(positions, images)
    return (augmented.reshape((-1,) + images.shape[1:]), jnp.repeat(labels, copies), copies)


def _bookkeeping_sum_fn(plan: Plan, options: StepOptions):
    """The book-keeping strategy's clipped sum (bookkeeping.clipped_sum per micro-batch, empty
    micro-batches skipped; augmented copies drawn as the gradient stage draws them). Stages
    between the gradient and the clip enter as the product of their public masks when all are
    masks, else as a transform of the per-example gradients (each stage's own apply, vmapped,
    with the same per-example keys as the materialized strategy)."""
    clip_index = plan.validated.clip_index
    middle = range(1, clip_index)
    use_masks = bookkeeping.masks_only(plan.stages, clip_index)
    scalar_maps = [plan.fns[i].hooks.elementwise for i in middle]
    elementwise = all(f is not None for f in scalar_maps)

    def clipped_sum(params, states, step, step_key, batch):
        masks = None
        for i in middle if use_masks else ():
            masks = states[i]["mask"] if masks is None else apply_mask(masks, states[i]["mask"])

        def transform_at(positions):
            if elementwise:  # the stages' scalar maps, on any layout of the coordinates
                return lambda tree: jax.tree.map(lambda x: _compose(scalar_maps, x), tree)

            def one(value, position):
                for i in middle:
                    ctx = StepContext(params=params, step=step, key=jax.random.fold_in(
                        jax.random.fold_in(step_key, i), position))
                    value = plan.fns[i].apply(value, states[i], ctx)[0]
                return value
            return lambda tree: jax.vmap(one)(tree, positions)

        def micro(images, labels, mask, positions):
            transform = None if use_masks or clip_index == 1 else transform_at(positions)
            images, labels, copies = _augmented_copies(plan.stages[0], step_key, images,
                                                       labels, positions)
            return bookkeeping.clipped_sum(plan.model, plan.taps, params, images, labels, mask,
                                           plan.stages[clip_index].privacy.l2_bound, masks,
                                           transform,
                                           elementwise, copies, options.branch_free,
                                           options.conv_grads)

        return _sum_over_micro_batches(micro, batch, options.branch_free,
                                       options.device_partials)

    return clipped_sum


def _compose(scalar_maps, x):
    for f in scalar_maps:
        x = f(x)
    return x


def _sum_over_micro_batches(micro: Callable, batch: dict, branch_free: bool,
                            device_partials: int = 1):
    """sum over micro-batches of ``micro(images, labels, mask, positions)`` under lax.scan, a
    micro-batch with no real example skipped (it contributes exactly zero) unless
    ``branch_free``, in ``device_partials`` per-device partial sums (masked_sum's)."""
    micro_steps, size = batch["mask"].shape
    positions = jnp.arange(micro_steps * size, dtype=jnp.int32).reshape(micro_steps, size)
    xs = (batch["image"], batch["label"], batch["mask"], positions)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(micro, *(x[0] for x in xs)))

    return _scan_sum(lambda x: micro(*x), xs, 2, zeros, branch_free, device_partials)


def _layer_clip_sum_fn(plan: Plan, options: StepOptions):
    """The clip stage's own book-keeping form (``Hooks.layer_clip``, GEP): per micro-batch,
    every example's layer gradients from one batched backward pass, clipped and summed by the
    stage's contractions; an example whose loss or value is not finite is left out and counted,
    as the materialized strategy zeroes and counts it. Then the stage's ``finish_sum``."""
    clip_index = plan.validated.clip_index
    fns, layer_grads = plan.fns[clip_index], plan.run_facts.get("layer_grads")

    def clipped_sum(params, states, step, step_key, batch):
        del step, step_key  # the layer form reads no key (checked: same sum as vmapped apply)
        clip = fns.hooks.layer_clip(states[clip_index])               # once per step

        def micro(images, labels, mask, positions):
            del positions
            grads, losses = layer_grads(params, images, labels, mask)
            candidates = mask & jnp.isfinite(losses)
            total, finite = clip(grads, candidates)
            keep = candidates & finite
            return total, {"loss": jnp.sum(jnp.where(keep, losses, 0.0)),
                           "nonfinite": jnp.sum(mask & ~keep).astype(jnp.float32)}

        total, aux = _sum_over_micro_batches(micro, batch, options.branch_free,
                                             options.device_partials)
        if fns.hooks.finish_sum is not None:
            total = fns.hooks.finish_sum(total, states[clip_index])
        return total, aux

    return clipped_sum


def clipped_sum_fn(plan: Plan, options: StepOptions = StepOptions()):
    """(params, states, step, step_key, batch) -> (sum of clipped per-example values,
    {"loss": sum of finite losses, "nonfinite": count}) over the batch's real examples,
    lowered as ``options`` say (the same sum either way)."""
    if plan.strategy == "bookkeeping":
        if plan.fns[plan.validated.clip_index].hooks.layer_clip is not None:
            return _layer_clip_sum_fn(plan, options)
        return _bookkeeping_sum_fn(plan, options)
    clip_index = plan.validated.clip_index
    # A stage between the gradient and the clip that is not a public mask (Nasr's ternary) may
    # map a non-finite gradient to finite values, and a loss can be finite where the gradient
    # is not: then the gradient's own finiteness is checked too (a mask keeps a NaN a NaN).
    check_gradient = any(Mask.PER_EXAMPLE not in s.privacy.public_mask
                         for s in plan.stages[1:clip_index])

    def clipped_sum(params, states, step, step_key, batch):
        def per_example(example, position):
            value, aux = example, {}
            nonfinite = jnp.zeros((), jnp.float32)
            gradient_finite = jnp.asarray(True)
            for i in range(plan.num_per_example):
                ctx = StepContext(params=params, step=step, key=jax.random.fold_in(
                    jax.random.fold_in(step_key, i), position))
                # One apply shape, (value, state): a per-example stage's state is read-only,
                # and the gradient stage returns its per-example record ({"loss"}) there.
                value, returned = plan.fns[i].apply(value, states[i], ctx)
                if plan.stages[i].kind_in == Kind.EXAMPLE:
                    aux = returned
                    if check_gradient:
                        gradient_finite = jnp.isfinite(sum(
                            jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(value)))
                if i == clip_index:
                    # A non-finite input leaves the clip non-finite (NaN norm, or inf * 0): such
                    # a value would turn the sum into NaN. Zero has norm 0, so replacing it keeps
                    # the clip's bound (and the sensitivity) intact. Checked on the clip's
                    # OUTPUT: one fused pass (before the clip it cost 20 ms of a 45 ms step).
                    # An example whose loss is non-finite counts too (a stage such as Nasr's
                    # discretization can map a NaN gradient to a finite value), and is zeroed.
                    value, nonfinite = zero_if_nonfinite(
                        value, jnp.isfinite(aux["loss"]) & gradient_finite)
            # The loss diagnostic skips examples whose gradient was zeroed as non-finite.
            loss = jnp.where(nonfinite > 0, 0.0, aux["loss"])
            return value, {"loss": loss, "nonfinite": nonfinite}

        total, aux = masked_sum(per_example, batch, options.branch_free,
                                options.device_partials)
        for i in range(plan.num_per_example):  # public linear maps of the sum (GEP's residual)
            if plan.fns[i].hooks.finish_sum is not None:
                total = plan.fns[i].hooks.finish_sum(total, states[i])
        return total, aux

    return clipped_sum
