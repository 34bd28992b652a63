"""Per-example gradient stage: the entry point of every pipeline (EXAMPLE -> PER_EXAMPLE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.base import Kind, Stage, StageFns, register_stage

AUGMENTATIONS = ("none", "crop_flip", "crop")


def augment_image(key: jax.Array, image: jax.Array, augmentation: str, crop_padding: int):
    """Returns a randomly augmented copy of one (H, W, C) image; a pure function of (key, image)."""
    if augmentation == "none":
        return image
    height, width = image.shape[:2]
    crop_key, flip_key = jax.random.split(key)
    padded = jnp.pad(image, ((crop_padding, crop_padding), (crop_padding, crop_padding), (0, 0)),
                     mode="reflect")
    offsets = jax.random.randint(crop_key, (2,), 0, 2 * crop_padding + 1)
    image = jax.lax.dynamic_slice(padded, (offsets[0], offsets[1], 0), image.shape)
    if augmentation == "crop_flip":
        image = jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1, :], image)
    del height, width
    return image


def augmented_copies(key: jax.Array, image: jax.Array, copies: int, augmentation: str,
                     crop_padding: int) -> jax.Array:
    """The ``copies`` augmented copies (K, H, W, C) of one image that grad.per_example
    averages over, drawn from ``key`` split K ways: the one draw both per-example strategies
    use (book-keeping's clipped sum must see the same copies)."""
    return jax.vmap(lambda k: augment_image(k, image, augmentation, crop_padding))(
        jax.random.split(key, copies))


@register_stage("grad.per_example")
def per_example(augmult: int = 1, augmentation: str = "none", crop_padding: int = 4) -> Stage:
    """The gradient of the loss on ONE example (the compiler vmaps it over the batch).

    With augmentation multiplicity ``augmult`` = K > 1 (De et al. 2022), the example is augmented
    K times and the K gradients are averaged before any clipping, so the output is still a
    function of this one example only. Returns ``(grads, {'loss': loss})``: the gradient stage
    has no state, and returns its per-example record in its place.
    """
    if not isinstance(augmult, int) or augmult < 1:
        raise ValueError(f"grad.per_example.augmult must be an integer >= 1, got {augmult!r}")
    if augmentation not in AUGMENTATIONS:
        raise ValueError(f"grad.per_example.augmentation must be one of {AUGMENTATIONS}, "
                         f"got {augmentation!r}")
    if augmult > 1 and augmentation == "none":
        raise ValueError("grad.per_example.augmult > 1 needs an augmentation "
                         "(set grad.per_example.augmentation = 'crop_flip' or 'crop')")

    def make(facts):
        return StageFns(apply=lambda example, state, ctx: apply(facts.loss_fn, example, ctx))

    def apply(loss_fn, example, ctx):
        value_and_grad = jax.value_and_grad(loss_fn)
        if augmult == 1 and augmentation == "none":
            loss, grads = value_and_grad(ctx.params, example["image"], example["label"])
            return grads, {"loss": loss}
        images = augmented_copies(ctx.key, example["image"], augmult, augmentation,
                                  crop_padding)
        losses, grads = jax.vmap(lambda im: value_and_grad(ctx.params, im, example["label"]))(
            images)
        return jax.tree.map(lambda g: g.mean(axis=0), grads), {"loss": losses.mean()}

    return Stage(name="grad.per_example", kind_in=Kind.EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                 make=make, needs={"loss_fn"},
                 options=dict(augmult=augmult, augmentation=augmentation,
                              crop_padding=crop_padding))
