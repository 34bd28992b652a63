"""Random sparsification before clipping (RS; Zhu & Blaschko, TMLR 2023; pipelines/rs/README.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.base import (Hooks, Kind, Mask, Privacy, Stage, StageFns, apply_mask,
                                 register_stage)

COOLING = ("linear", "none")


def sparsification_rate(epoch, num_epochs: int, final_rate: float, cooling: str):
    """Gradual cooling: the rate ramps linearly from 0 (first epoch) to final_rate (last)."""
    if cooling == "none":
        return jnp.asarray(final_rate, jnp.float32)
    return final_rate * jnp.minimum(epoch / max(num_epochs - 1, 1), 1.0).astype(jnp.float32)


def epoch_mask(mask_key: jax.Array, epoch, rate, like):
    """A public keep-mask (1 = kept) for every leaf of ``like``: each coordinate is dropped
    independently with probability ``rate``. A function of (mask_key, epoch) only."""
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(jax.random.fold_in(mask_key, epoch), len(leaves))
    masks = [jax.random.bernoulli(k, 1.0 - rate, leaf.shape).astype(leaf.dtype)
             for k, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, masks)


@register_stage("sparsify.random_mask")
def random_mask(final_rate: float = 0.5, cooling: str = "linear") -> Stage:
    """Zeroes a random fraction of every per-example gradient BEFORE clipping (PER_EXAMPLE).

    The mask is public: drawn from the stage's own key and the epoch number, never from data,
    the same for every example of an epoch and refreshed once per epoch. After the release the
    same mask is applied again, so noise stays only on the kept coordinates (post-processing).
    The clip bounds the masked gradient, so the sensitivity and epsilon equal DP-SGD's.
    """
    if not 0.0 <= final_rate < 1.0:
        raise ValueError(f"sparsify.random_mask.final_rate must lie in [0, 1), got {final_rate!r}")
    if cooling not in COOLING:
        raise ValueError(f"sparsify.random_mask.cooling must be one of {COOLING}, "
                         f"got {cooling!r}")
    options = dict(final_rate=final_rate, cooling=cooling)

    def make(facts) -> StageFns:
        steps_per_epoch = max(facts.steps_per_epoch, 1)
        num_epochs = max(-(-facts.total_steps // steps_per_epoch), 1)

        def init(params, key):
            return {"mask_key": key, "mask": jax.tree.map(jnp.ones_like, params)}

        def begin_step(state, ctx):
            # Once per step, from public inputs only (the stage key and the step's epoch).
            epoch = ctx.step // steps_per_epoch
            rate = sparsification_rate(epoch, num_epochs, final_rate, cooling)
            return dict(state, mask=epoch_mask(state["mask_key"], epoch, rate, ctx.params))

        def apply(grads, state, ctx):
            del ctx
            return apply_mask(grads, state["mask"]), state

        return StageFns(apply=apply, init=init, hooks=Hooks(begin_step=begin_step))

    return Stage(name="sparsify.random_mask", kind_in=Kind.PER_EXAMPLE,
                 kind_out=Kind.PER_EXAMPLE, make=make, needs={"steps_per_epoch", "total_steps"},
                 privacy=Privacy(public_mask=frozenset({Mask.PER_EXAMPLE, Mask.RELEASED})),
                 options=options)
