"""Clipping stages: the only way per-example values become BOUNDED."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from dpbench.stages.base import Kind, Stage, register_stage, stateless


def clip_to_l2(tree, l2_bound: float):
    """Scales ``tree`` by min(1, l2_bound / ||tree||_2) (global norm over all leaves)."""
    if math.isinf(l2_bound):
        return tree
    norm = optax.tree.norm(tree)
    # l2_bound / max(norm, l2_bound) == min(1, l2_bound / norm) and is finite for norm == 0.
    scale = l2_bound / jnp.maximum(norm, l2_bound)
    return jax.tree.map(lambda leaf: (leaf * scale).astype(leaf.dtype), tree)


def zero_if_nonfinite(tree, also_finite=True):
    """Returns (tree, 0.0) when every entry is finite (and ``also_finite``, e.g. the example's
    loss, holds), else (zeros, 1.0).

    Clipping cannot bound a NaN or an infinity; an all-zero value has norm 0, so replacing a
    non-finite per-example value by zeros keeps every clip bound intact. One reduction (the sum
    of squares is finite exactly when every entry is, barring float32 overflow of a finite
    value, which is then zeroed too: still a value of norm 0) and one select: the previous
    per-leaf isfinite/all/stack form broke XLA's fusion and cost 20 ms per 256 examples.
    """
    squares = sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(tree))
    finite = jnp.isfinite(squares) & also_finite
    cleaned = jax.tree.map(lambda leaf: jnp.where(finite, leaf, jnp.zeros_like(leaf)), tree)
    return cleaned, 1.0 - finite.astype(jnp.float32)


@register_stage("clip.global_l2")
def global_l2(l2_bound: float = 1.0) -> Stage:
    """Flat L2 clipping of one example's value: output norm <= ``l2_bound`` (PER_EXAMPLE -> BOUNDED).

    ``l2_bound = inf`` disables clipping (only meaningful with noise multiplier 0, for testing
    against non-private SGD; the compiler refuses to calibrate noise for an infinite bound).
    """
    if not isinstance(l2_bound, (int, float)) or math.isnan(l2_bound) or l2_bound <= 0:
        raise ValueError(f"clip.global_l2.l2_bound must be a positive number, got {l2_bound!r}; "
                         "set e.g. clip.global_l2.l2_bound = 1.0")

    def apply(value, state, ctx):
        del state, ctx
        return clip_to_l2(value, float(l2_bound))

    return Stage(name="clip.global_l2", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                 make=stateless(apply), l2_bound=float(l2_bound),
                 options=dict(l2_bound=float(l2_bound)))
