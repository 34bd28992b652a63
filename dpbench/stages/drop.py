"""Gradient dropping (DP-SSGD; Adamczewski, He & Park; pipelines/dpssgd/README.md).

Every step a fraction of each weight tensor's unpruned gradient coordinates is dropped BEFORE
clipping (biases are kept, as in the paper's index sets), chosen
either at random (public randomness: the stage key and the step) or as the coordinates of the
smallest-magnitude parameters (the parameters are public: they are a function of released
values). The clip then bounds only the kept coordinates, and after the release the same mask
removes the noise on the dropped ones, so only kept coordinates are noised and updated by this
step's gradient. Sensitivity and epsilon are DP-SGD's.

Frozen coordinates (paper eq. 5, the default ``freeze_dropped=True``): the dropped coordinates
keep their value this step. With momentum or Adam, masking the gradient alone is not enough
(the optimizer's state would still move them), so the optimizer's UPDATE is masked too
(its public mask applies to the updates too); the optimizer state itself evolves as with a
zero gradient there.
``freeze_dropped=False`` is the variant that masks only the gradient (momentum still moves
dropped coordinates): dpbench's DP-SSGD before 2026-11-23, kept for comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.order import float_key, smallest_mask
from dpbench.stages.base import (Hooks, Kind, Mask, Privacy, Stage, StageFns, apply_mask,
                                 register_stage)

CRITERIA = ("random", "magnitude")


def keep_smallest_dropped(keys, active, rate: float):
    """1.0 where the coordinate is kept. Of the ``active`` coordinates, exactly
    floor(rate * n_active) with the lowest uint32 ``keys`` are dropped (ties by position);
    inactive ones (pre-pruned weights) are always dropped (their gradient is zero anyway).
    n_active may depend on the (public) parameters, so the count is computed in the graph."""
    flat_keys, flat_active = keys.ravel(), active.ravel()
    n_active = jnp.sum(flat_active, dtype=jnp.int32)
    n_drop = jnp.floor(rate * n_active).astype(jnp.int32) + (flat_keys.size - n_active)
    ranked = jnp.where(flat_active, flat_keys, jnp.uint32(0))   # inactive first
    dropped = smallest_mask(ranked, n_drop)
    return (~dropped).astype(jnp.float32).reshape(keys.shape)


def drop_mask(criterion: str, rate: float, params, key, step):
    """A public keep-mask per parameter leaf (same tree as params).

    Only weight tensors (ndim >= 2) are dropped, as in the paper's index sets; biases are always
    kept. A weight that is exactly zero is treated as pre-pruned: it is not counted, so the rate
    applies to the weights that remain (otherwise magnitude dropping at the pruning rate would
    just re-drop the pruned zeros).
    """
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(key, step), len(leaves))
    masks = []
    for k, leaf in zip(keys, leaves):
        if leaf.ndim < 2:
            masks.append(jnp.ones_like(leaf))
            continue
        # uint32 keys: a value sort of integers is ~6x faster than a float argsort on CPU.
        # Random: 31 random bits + 1 (0 is reserved for inactive); magnitude: |w|'s order key.
        scores = ((jax.random.bits(k, leaf.shape, jnp.uint32) >> 1) + 1 if criterion == "random"
                  else float_key(jnp.abs(leaf)))
        masks.append(keep_smallest_dropped(scores, leaf != 0, rate).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, masks)


@register_stage("drop.gradients")
def gradients(rate: float = 0.5, criterion: str = "random",
              freeze_dropped: bool = True) -> Stage:
    """Drops ``rate`` of each weight tensor's (unpruned) per-example gradient coordinates
    before clipping; biases are never dropped. With ``freeze_dropped`` (the paper's eq. 5)
    dropped coordinates do not move this step, whatever the optimizer."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"drop.gradients.rate must lie in [0, 1), got {rate!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"drop.gradients.criterion must be one of {CRITERIA}, "
                         f"got {criterion!r}")
    if not isinstance(freeze_dropped, bool):
        raise ValueError(f"drop.gradients.freeze_dropped must be True or False, "
                         f"got {freeze_dropped!r}")

    def make(facts) -> StageFns:
        del facts

        def init(params, key):
            return {"mask_key": key, "mask": jax.tree.map(jnp.ones_like, params)}

        def begin_step(state, ctx):
            # Once per step, not per micro-batch: the mask reads only public inputs (the stage
            # key, the step, the parameters), and its sort was most of DP-SSGD's step time.
            return dict(state, mask=drop_mask(criterion, rate, ctx.params, state["mask_key"],
                                              ctx.step))

        def apply(grads, state, ctx):
            del ctx
            return apply_mask(grads, state["mask"]), state

        return StageFns(apply=apply, init=init, hooks=Hooks(begin_step=begin_step))

    where = {Mask.PER_EXAMPLE, Mask.RELEASED} | ({Mask.UPDATES} if freeze_dropped else set())
    return Stage(name="drop.gradients", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                 make=make, privacy=Privacy(public_mask=frozenset(where)),
                 options=dict(rate=rate, criterion=criterion, freeze_dropped=freeze_dropped))
