"""Pre-pruning before training (DP-SSGD; Adamczewski, He & Park; pipelines/dpssgd/README.md).

A pruning stage computes a public parameter mask once, at initialization, zeroes the pruned
weights, and then keeps them at zero: it masks every per-example gradient before clipping and
the released gradient after the noise (so neither gradient nor noise ever reaches a pruned
weight, and momentum never builds up there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages import order
from dpbench.stages.base import (Kind, Mask, OneOffRelease, Privacy, Stage, StageFns,
                                 apply_mask, register_stage)


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


def _mask_values(values, state, ctx=None):
    del ctx
    return apply_mask(values, state["mask"]), state


def _masking_stage(name: str, make_mask, options: dict, needs=frozenset(),
                   one_off_release=None) -> Stage:
    """A pre-pruning stage: ``make_mask(facts) -> (params, key) -> mask`` is its public mask,
    fixed at init; it masks every per-example gradient (apply), the release and the initial
    parameters (the compiler, ``Privacy.public_mask``). ``needs``: the run facts
    ``make_mask`` reads."""
    def make(facts) -> StageFns:
        mask_fn = make_mask(facts)
        return StageFns(apply=_mask_values,
                        init=lambda params, key: {"mask": mask_fn(params, key)})

    return Stage(name=name, kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE, make=make,
                 privacy=Privacy(
                     public_mask=frozenset({Mask.PER_EXAMPLE, Mask.RELEASED, Mask.PARAMS}),
                     one_off_release=one_off_release),
                 needs=needs, options=options)


@register_stage("prune.random")
def random(sparsity: float = 0.5) -> Stage:
    """Random per-layer pre-pruning: data-free, so it costs no privacy."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"prune.random.sparsity must lie in [0, 1), got {sparsity!r}")
    return _masking_stage(
        "prune.random", lambda facts: lambda params, key: random_layer_mask(params, key,
                                                                             sparsity),
        dict(sparsity=sparsity))


def synflow_mask(params, linear_apply, example_shape, sparsity: float, iterations: int):
    """SynFlow (Tanaka et al. 2020): iterative, data-free, global over prunable weights.

    Each round scores every weight by |theta * dR/dtheta| with R = sum f(1; |theta * mask|) on
    the model's linearized twin (identity activations) and an all-ones input, then keeps the
    top (1 - sparsity)^(k / iterations) fraction of prunable weights (exponential schedule).
    """
    prunable = jax.tree.map(is_prunable, params)
    mask = jax.tree.map(jnp.ones_like, params)
    ones = jnp.ones((1,) + tuple(example_shape), jnp.float32)

    def flow(abs_params):
        return jnp.sum(linear_apply(abs_params, ones))

    total = sum(int(leaf.size) for leaf, p in zip(jax.tree.leaves(params),
                                                   jax.tree.leaves(prunable)) if p)
    for k in range(1, iterations + 1):
        abs_params = jax.tree.map(lambda w, m: jnp.abs(w * m), params, mask)
        grads = jax.grad(flow)(abs_params)
        scores = jax.tree.map(lambda g, w: jnp.abs(g * w), grads, abs_params)
        flat = jnp.concatenate([jnp.ravel(s) for s, p in zip(jax.tree.leaves(scores),
                                                            jax.tree.leaves(prunable)) if p])
        keep = int(round(total * (1.0 - sparsity) ** (k / iterations)))
        threshold = order.kth_largest(flat, max(keep, 1))  # no float sort (order.py)
        mask = jax.tree.map(lambda s, m, p: jnp.where(p, (s >= threshold) * m, m).astype(m.dtype),
                            scores, mask, prunable)
    return mask


@register_stage("prune.synflow")
def synflow(sparsity: float = 0.5, iterations: int = 100) -> Stage:
    """SynFlow pre-pruning: data-free (an all-ones input and the public initial weights), so it
    costs no privacy; prunes ``sparsity`` of all weights globally."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"prune.synflow.sparsity must lie in [0, 1), got {sparsity!r}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"prune.synflow.iterations must be an integer >= 1, got {iterations!r}")
    options = dict(sparsity=sparsity, iterations=iterations)

    def make_mask(facts):
        return lambda params, key: synflow_mask(params, facts.linear_apply, facts.example_shape,
                                                sparsity, iterations)

    return _masking_stage("prune.synflow", make_mask, options,
                          needs={"linear_apply", "example_shape"})


def top_fraction_mask(scores, params, keep_fraction: float):
    """Keeps the top keep_fraction of prunable weights by score, globally; biases are kept."""
    prunable = jax.tree.map(is_prunable, params)
    flat = jnp.concatenate([jnp.ravel(s) for s, p in zip(jax.tree.leaves(scores),
                                                        jax.tree.leaves(prunable)) if p])
    keep = max(int(round(flat.size * keep_fraction)), 1)
    threshold = order.kth_largest(flat, keep)
    return jax.tree.map(lambda s, w, p: jnp.where(p, s >= threshold, True).astype(w.dtype),
                        scores, params, prunable)


def connection_scores(params, grads):
    """SNIP's per-example connection sensitivity d loss / d c at c = 1: theta * grad."""
    return jax.tree.map(jnp.multiply, params, grads)


def _needs_release(facts):
    def mask(params, key):
        raise RuntimeError("prune.dp_snip's state comes from its accounted release; the "
                           "compiler calls its OneOffRelease.init")
    return mask


@register_stage("prune.dp_snip")
def dp_snip(sparsity: float = 0.5, l2_bound: float = 1.0,
            epsilon_fraction: float = 0.1) -> Stage:
    """DP-SNIP pre-pruning (the paper's Alg. 2): each example's connection scores
    g_j = d loss / d c_j = theta_j * d loss / d theta_j (at the public initialization) are
    clipped to ``l2_bound`` as one vector, summed over one batch of the run's Poisson sampler
    and released once with Gaussian noise; the weights with the largest |released score| are
    kept. The compiler performs and accounts the release: its noise alone spends
    ``epsilon_fraction`` of epsilon, and the training sigma is calibrated on the composition,
    so its cost shows in the reported epsilon.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"prune.dp_snip.sparsity must lie in [0, 1), got {sparsity!r}")
    if not 0.0 < epsilon_fraction < 1.0:
        raise ValueError(f"prune.dp_snip.epsilon_fraction must lie in (0, 1), "
                         f"got {epsilon_fraction!r}")
    if not l2_bound > 0:
        raise ValueError(f"prune.dp_snip.l2_bound must be > 0, got {l2_bound!r}")

    def init_from_release(params, released, key):
        del key  # the released sum already holds the connection scores theta * grad
        return {"mask": top_fraction_mask(jax.tree.map(jnp.abs, released), params,
                                          1.0 - sparsity)}

    return _masking_stage(
        "prune.dp_snip", _needs_release,
        dict(sparsity=sparsity, l2_bound=l2_bound, epsilon_fraction=epsilon_fraction),
        one_off_release=OneOffRelease(
            l2_bound=l2_bound, epsilon_fraction=epsilon_fraction, value=connection_scores,
            init=init_from_release,
            released="the sum of clipped per-example connection scores theta * grad (DP-SNIP)"))
