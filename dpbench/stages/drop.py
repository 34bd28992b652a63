"""Gradient dropping (DP-SSGD; Adamczewski, He & Park; docs/methods/dpssgd.md).

Every step a fraction of each layer's gradient coordinates is dropped BEFORE clipping, chosen
either at random (public randomness: the stage key and the step) or as the coordinates of the
smallest-magnitude parameters (the parameters are public: they are a function of released
values). The clip then bounds only the kept coordinates, and after the release the same mask
removes the noise on the dropped ones, so only kept coordinates are noised and updated by this
step's gradient. Sensitivity and epsilon are DP-SGD's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.base import Kind, Stage, StageInfo, register_stage

CRITERIA = ("random", "magnitude")


def keep_smallest_dropped(scores: jax.Array, rate: float) -> jax.Array:
    """1.0 where the coordinate is kept: drops exactly floor(rate * size) lowest scores."""
    flat = scores.ravel()
    n_drop = int(rate * flat.size)
    if n_drop == 0:
        return jnp.ones_like(scores)
    order = jnp.argsort(flat)
    keep = jnp.ones_like(flat).at[order[:n_drop]].set(0.0)
    return keep.reshape(scores.shape)


def drop_mask(criterion: str, rate: float, params, key, step):
    """A public keep-mask per parameter leaf (same tree as params)."""
    leaves, treedef = jax.tree.flatten(params)
    if criterion == "random":
        keys = jax.random.split(jax.random.fold_in(key, step), len(leaves))
        scores = [jax.random.uniform(k, leaf.shape) for k, leaf in zip(keys, leaves)]
    else:
        scores = [jnp.abs(leaf) for leaf in leaves]
    masks = [keep_smallest_dropped(s, rate).astype(leaf.dtype) for s, leaf in zip(scores, leaves)]
    return jax.tree.unflatten(treedef, masks)


@register_stage("drop.gradients")
def gradients(rate: float = 0.5, criterion: str = "random") -> Stage:
    """Drops ``rate`` of each layer's per-example gradient coordinates before clipping."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"drop.gradients.rate must lie in [0, 1), got {rate!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"drop.gradients.criterion must be one of {CRITERIA}, "
                         f"got {criterion!r}")

    def init(params, key, info):
        del params, info
        return {"mask_key": key}

    def mask_for(state, ctx):
        return drop_mask(criterion, rate, ctx.params, state["mask_key"], ctx.step)

    def apply(grads, state, ctx):
        return jax.tree.map(jnp.multiply, grads, mask_for(state, ctx))

    def after_release(released, state, ctx):
        return jax.tree.map(jnp.multiply, released, mask_for(state, ctx))

    return Stage(name="drop.gradients", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                 apply=apply, init=init, after_release=after_release,
                 options=dict(rate=rate, criterion=criterion))
