"""Pre-pruning before training (DP-SSGD; Adamczewski, He & Park; docs/methods/dpssgd.md).

A pruning stage computes a public parameter mask once, at initialization, zeroes the pruned
weights, and then keeps them at zero: it masks every per-example gradient before clipping and
the released gradient after the noise (so neither gradient nor noise ever reaches a pruned
weight, and momentum never builds up there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.base import Kind, Stage, register_stage


def is_prunable(leaf) -> bool:
    """Weights (kernels, ndim >= 2) are pruned; biases and norm scales are kept."""
    return leaf.ndim >= 2


def random_layer_mask(params, key, sparsity: float):
    """Per layer, exactly floor(sparsity * size) weights chosen uniformly at random are pruned."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    masks = []
    for k, leaf in zip(keys, leaves):
        if not is_prunable(leaf):
            masks.append(jnp.ones_like(leaf))
            continue
        n_prune = int(sparsity * leaf.size)
        order = jax.random.permutation(k, leaf.size)
        flat = jnp.ones((leaf.size,), leaf.dtype).at[order[:n_prune]].set(0)
        masks.append(flat.reshape(leaf.shape))
    return jax.tree.unflatten(treedef, masks)


def _masking_stage(name: str, mask_fn, options: dict) -> Stage:
    def init(params, key, info):
        del info
        return {"mask": mask_fn(params, key)}

    def mask_values(values, state, ctx=None):
        del ctx
        return jax.tree.map(jnp.multiply, values, state["mask"])

    return Stage(name=name, kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                 apply=mask_values, init=init, after_release=mask_values,
                 prepare_params=lambda params, state: mask_values(params, state),
                 options=options)


@register_stage("prune.random")
def random(sparsity: float = 0.5) -> Stage:
    """Random per-layer pre-pruning: data-free, so it costs no privacy."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"prune.random.sparsity must lie in [0, 1), got {sparsity!r}")
    return _masking_stage("prune.random",
                          lambda params, key: random_layer_mask(params, key, sparsity),
                          dict(sparsity=sparsity))
