"""GEP and B-GEP: gradient embedding perturbation (Yu et al., ICLR 2021; docs/methods/gep.md).

Every step (``begin_step``, public inputs only): anchor gradients of ``num_anchors`` examples of
the dataset's declared PUBLIC split with random labels, at the current (public) parameters; per
parameter group (one group per layer) one or more power iterations from a random start give an
orthonormal basis B_g with k_g rows, the total ``num_basis`` split across groups by the square
root of the group size.

Per example (this stage is the pipeline's clip): embedding w = concat_g(B_g g_g) clipped to S1,
residual r = g - B^T w clipped to S2; the output is (w / S1, r / S2), two parts each of L2 norm
<= 1. One Gaussian release with noise sigma on every coordinate of both parts is the paper's
two releases with sigma_1 = sigma S1 and sigma_2 = sigma S2; together they have L2 sensitivity
sqrt(2), i.e. one Gaussian with multiplier sigma / sqrt(2), which is what the compiler accounts
(``parts = 2``). After the release: reconstruct S1 * w~ B + S2 * r~ (post-processing).
B-GEP (``biased = True``) releases only the embedding (``parts = 1``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpbench.stages.base import Kind, Stage, StageFns, StageInfo, register_stage
from dpbench.stages.clip import clip_to_l2


def _groups(tree):
    """Parameter groups (one per layer): flax {'params': {layer: {...}}} -> layer subtrees."""
    if isinstance(tree, dict) and set(tree) == {"params"}:
        return dict(tree["params"])
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def _ungroup(groups, like):
    if isinstance(like, dict) and set(like) == {"params"}:
        return {"params": dict(groups)}
    return jax.tree.unflatten(jax.tree.structure(like), [groups[str(i)] for i in range(
        len(groups))])


def _flat(subtree):
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(subtree)])


def _unflat(vector, like):
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for leaf in leaves:
        out.append(vector[start:start + leaf.size].reshape(leaf.shape))
        start += leaf.size
    return jax.tree.unflatten(treedef, out)


def basis_sizes(group_sizes: dict, num_basis: int, num_anchors: int) -> dict:
    """Splits num_basis across groups in proportion to sqrt(group size); >= 1 per group."""
    roots = {g: math.sqrt(p) for g, p in group_sizes.items()}
    total = sum(roots.values())
    return {g: int(max(1, min(round(num_basis * roots[g] / total), num_anchors,
                              group_sizes[g]))) for g in group_sizes}


def power_basis(anchor_grads, key, k: int, iterations: int):
    """Orthonormal rows B (k x p) spanning the top principal directions of anchor_grads (m x p)."""
    basis = jax.random.normal(key, (k, anchor_grads.shape[1]), anchor_grads.dtype)
    for _ in range(iterations):
        basis = (anchor_grads @ basis.T).T @ anchor_grads  # B = (G_a B^T)^T G_a
        q, _ = jnp.linalg.qr(basis.T)
        basis = q.T
    return basis


def anchor_basis(anchors, ctx, ks: dict, num_classes: int, iterations: int, chunk: int):
    """Per group, an orthonormal basis (ks[g] rows) of the anchor gradients at the current
    (public) parameters, the anchors labelled at random: public inputs only."""
    label_key, basis_key = jax.random.split(ctx.key)
    labels = jax.random.randint(label_key, (anchors.shape[0],), 0, num_classes)
    anchor_grad = jax.grad(ctx.loss_fn)
    grads = jax.lax.map(lambda xy: anchor_grad(ctx.params, *xy), (anchors, labels),
                        batch_size=chunk)
    grouped = _groups(grads)
    basis = {}
    for i, g in enumerate(sorted(ks)):
        matrix = jax.vmap(_flat)(grouped[g])  # m x p_g
        basis[g] = power_basis(matrix, jax.random.fold_in(basis_key, i), ks[g], iterations)
    return basis


def embed_and_clip_one(grads, basis: dict, embedding_bound: float, residual_bound: float,
                       biased: bool) -> dict:
    """One example: embedding w = concat_g(B_g g_g) clipped to S1 and residual r = g - B^T w
    clipped to S2, each scaled to norm <= 1: {"w": w / S1[, "r": r / S2]} (r keyed by group)."""
    grouped = _groups(grads)
    embed, residual = [], {}
    for g in sorted(basis):
        vector = _flat(grouped[g])
        w = basis[g] @ vector
        embed.append(w)
        residual[g] = _unflat(vector - basis[g].T @ w, grouped[g])
    w = clip_to_l2(jnp.concatenate(embed), embedding_bound) / embedding_bound
    if biased:
        return {"w": w}
    r = clip_to_l2(residual, residual_bound)
    return {"w": w, "r": jax.tree.map(lambda x: x / residual_bound, r)}


def reconstruct(released: dict, basis: dict, like, embedding_bound: float,
                residual_bound: float, biased: bool):
    """Public post-processing of the release: S1 * w~ B + S2 * r~, in parameter shape."""
    w = released["w"] * embedding_bound
    out, start = {}, 0
    groups_like = _groups(like)
    for g in sorted(basis):
        k = basis[g].shape[0]
        out[g] = _unflat(basis[g].T @ w[start:start + k], groups_like[g])
        start += k
    if not biased:
        r = released["r"]  # keyed by group, as embed_and_clip_one built it
        out = {g: jax.tree.map(lambda a, b: a + residual_bound * b, out[g], r[g]) for g in out}
    return _ungroup(out, like)


@register_stage("gep.embed_and_clip")
def embed_and_clip(num_basis: int = 200, num_anchors: int = 512, embedding_bound: float = 0.1,
                   residual_bound: float = 0.02, power_iterations: int = 1,
                   biased: bool = False, anchor_chunk: int = 64) -> Stage:
    """GEP's projection and the two clips (PER_EXAMPLE -> BOUNDED, two parts of norm <= 1).

    anchor_chunk: anchor gradients are computed that many at a time (a speed knob only: the
    basis is the same; 64 at a time was 2x faster than all 512 at once on 2 CPU cores).
    """
    for name, value in (("num_basis", num_basis), ("num_anchors", num_anchors),
                        ("power_iterations", power_iterations), ("anchor_chunk", anchor_chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gep.embed_and_clip.{name} must be an integer >= 1, got {value!r}")
    for name, value in (("embedding_bound", embedding_bound),
                        ("residual_bound", residual_bound)):
        if not value > 0 or math.isinf(value):
            raise ValueError(f"gep.embed_and_clip.{name} must be a finite number > 0, "
                             f"got {value!r}")
    options = dict(num_basis=num_basis, num_anchors=num_anchors,
                   embedding_bound=embedding_bound, residual_bound=residual_bound,
                   power_iterations=power_iterations, biased=biased)
    name = "gep.embed_and_clip"

    def make(info: StageInfo) -> StageFns:
        if info.public_images is None or len(info.public_images) < num_anchors:
            have = 0 if info.public_images is None else len(info.public_images)
            raise ValueError(f"GEP needs {num_anchors} public anchor examples but the dataset "
                             f"declares {have}; set dataset.public_size >= {num_anchors} "
                             "(carved from train, disjoint from the private set)")
        anchors = np.asarray(info.public_images[:num_anchors], np.float32)
        sizes = {g: sum(math.prod(x.shape) for x in jax.tree.leaves(sub))
                 for g, sub in _groups(info.param_shapes).items()}
        ks = basis_sizes(sizes, num_basis, num_anchors)

        def init(params, key):
            del params, key
            return {"anchors": jnp.asarray(anchors),
                    "basis": {g: jnp.zeros((ks[g], sizes[g]), jnp.float32) for g in ks}}

        def begin_step(state, ctx):
            return dict(state, basis=anchor_basis(
                state["anchors"], ctx, ks, info.num_classes, power_iterations, anchor_chunk))

        def apply(grads, state, ctx):
            del ctx
            return embed_and_clip_one(grads, state["basis"], embedding_bound, residual_bound,
                                      biased)

        def after_release(released, state, ctx):
            return reconstruct(released, state["basis"], ctx.params, embedding_bound,
                               residual_bound, biased)

        return StageFns(apply=apply, init=init, begin_step=begin_step,
                        after_release=after_release, facts=dict(basis_per_group=ks, part_bounds=(
                            {"embedding": embedding_bound} if biased else
                            {"embedding": embedding_bound, "residual": residual_bound})))

    return Stage(name=name, kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED, make=make,
                 l2_bound=1.0, parts=1 if biased else 2, options=options)
