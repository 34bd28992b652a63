"""The training loss and accuracy of a model's logits: the one per-example loss the
materialized path differentiates (``cross_entropy_loss``) and book-keeping's batched pass
reads (``logits_loss``, ``through_a_dot``)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


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
