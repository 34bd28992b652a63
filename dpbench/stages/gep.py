"""GEP and B-GEP: gradient embedding perturbation (Yu et al., ICLR 2021; pipelines/gep/README.md).

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

Where the run has the run fact ``layer_grads`` (a model of matmul layers, no augmentation) the
batch's embedding and clips run in book-keeping form (``layer_clip``, gep_layers.py) and the
anchor gradients of one power iteration come from batched backward passes; the float32 bound
that keeps the residual clip rigorous is in gep_numerics.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpbench.stages.base import Hooks, Kind, Privacy, Stage, StageFns, register_stage
from dpbench.ops import clip_to_l2
from dpbench.stages.gep_layers import (anchor_basis_from_layers, embed_and_clip_layers,  # noqa: F401
                                       parameter_rows, tap_columns)
from dpbench.stages.gep_numerics import (basis_orthonormality_error, orthonormal_rows,  # noqa: F401
                                         orthonormality_error, random_start, residual_sq_upper)


def layer_groups(tree):
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
    basis = random_start(key, k, anchor_grads.shape[1])
    for _ in range(iterations):
        basis = orthonormal_rows((anchor_grads @ basis.T).T @ anchor_grads)  # (G_a B^T)^T G_a
    return basis


def anchor_basis(anchors, ctx, ks: dict, num_classes: int, iterations: int, chunk: int,
                 loss_fn):
    """Per group, an orthonormal basis (ks[g] rows) of the anchor gradients at the current
    (public) parameters, the anchors labelled at random: public inputs only. ``loss_fn``:
    the run fact (one example's loss).

    With one power iteration (the paper's light setting) the m x p anchor gradient matrix is
    never formed: (G_a B0^T)^T G_a = sum over chunks of (G_c B0^T)^T G_c, so each chunk of
    ``chunk`` anchor gradients is used while it is in cache (memory traffic was most of the
    basis' cost)."""
    label_key, basis_key = jax.random.split(ctx.key)
    labels = jax.random.randint(label_key, (anchors.shape[0],), 0, num_classes)
    anchor_grad = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))
    groups = sorted(ks)
    if iterations != 1:
        grads = jax.lax.map(lambda xy: jax.grad(loss_fn)(ctx.params, *xy),
                            (anchors, labels), batch_size=chunk)
        grouped = layer_groups(grads)
        return {g: power_basis(jax.vmap(_flat)(grouped[g]), jax.random.fold_in(basis_key, i),
                               ks[g], iterations) for i, g in enumerate(groups)}
    sizes = {g: sum(math.prod(x.shape) for x in jax.tree.leaves(sub))
             for g, sub in layer_groups(ctx.params).items()}
    starts = {g: random_start(jax.random.fold_in(basis_key, i), ks[g], sizes[g])
              for i, g in enumerate(groups)}
    m = anchors.shape[0]
    usable = m - m % chunk
    chunks = (anchors[:usable].reshape((-1, chunk) + anchors.shape[1:]),
              labels[:usable].reshape(-1, chunk))

    def accumulate(acc, xs, size):
        grouped = layer_groups(anchor_grad(ctx.params, *xs))
        for g in groups:
            matrix = jax.vmap(_flat)(grouped[g])                  # chunk x p_g
            acc[g] = acc[g] + (matrix @ starts[g].T).T @ matrix   # k_g x p_g
        return acc

    total = {g: jnp.zeros_like(starts[g]) for g in groups}
    total, _ = jax.lax.scan(lambda acc, xs: (accumulate(acc, xs, chunk), None), total, chunks)
    if usable < m:  # the last, partial chunk
        total = accumulate(total, (anchors[usable:], labels[usable:]), m - usable)
    return {g: orthonormal_rows(total[g]) for g in groups}


def embed_and_clip_one(grads, basis: dict, eps, embedding_bound: float,
                       residual_bound: float, biased: bool) -> dict:
    """One example: embedding w = concat_g(B_g g_g) clipped to S1, scaled to norm <= 1; and the
    residual r = g - B^T w clipped to S2 WITHOUT forming it: its norm is bounded from
    ||g||^2 - ||w||^2 (``residual_sq_upper``) and the example contributes c * g / S2 and
    c * w / S2, c = min(1, S2 / ||r||_upper); ``finish_sum`` forms sum c (g - B^T w) / S2 on the
    batch sum (linear, public B), each example's part of norm <= 1."""
    grouped = layer_groups(grads)
    vectors = {g: _flat(grouped[g]) for g in sorted(basis)}
    embed = {g: basis[g] @ vectors[g] for g in sorted(basis)}
    w_all = jnp.concatenate([embed[g] for g in sorted(basis)])
    w = clip_to_l2(w_all, embedding_bound) / embedding_bound
    if biased:
        return {"w": w}
    k = sum(b.shape[0] for b in basis.values())
    p = sum(b.shape[1] for b in basis.values())
    p_max = max(b.shape[1] for b in basis.values())
    a = sum(jnp.sum(jnp.square(v)) for v in vectors.values())
    upper = residual_sq_upper(a, jnp.sum(jnp.square(w_all)), k, p, p_max, eps)
    scale = residual_bound / jnp.maximum(jnp.sqrt(upper), residual_bound) / residual_bound
    return {"w": w, "rv": {g: _unflat(vectors[g] * scale, grouped[g]) for g in vectors},
            "rw": {g: embed[g] * scale for g in embed}}


def finish_residual(total: dict, basis: dict) -> dict:
    """The summed residual part: sum c (g - B^T w) / S2 = sum c g / S2 - B^T (sum c w / S2)."""
    if "rv" not in total:
        return total
    r = {g: jax.tree.map(jnp.subtract, total["rv"][g],
                         _unflat(basis[g].T @ total["rw"][g], total["rv"][g]))
         for g in sorted(basis)}
    return {"w": total["w"], "r": r}


def reconstruct(released: dict, basis: dict, like, embedding_bound: float,
                residual_bound: float, biased: bool):
    """Public post-processing of the release: S1 * w~ B + S2 * r~, in parameter shape."""
    w = released["w"] * embedding_bound
    out, start = {}, 0
    groups_like = layer_groups(like)
    for g in sorted(basis):
        k = basis[g].shape[0]
        out[g] = _unflat(basis[g].T @ w[start:start + k], groups_like[g])
        start += k
    if not biased:
        r = released["r"]  # keyed by group, as embed_and_clip_one built it
        out = {g: jax.tree.map(lambda a, b: a + residual_bound * b, out[g], r[g]) for g in out}
    return _ungroup(out, like)


def _check_options(integers: dict, bounds: dict) -> None:
    for name, value in integers.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gep.embed_and_clip.{name} must be an integer >= 1, got {value!r}")
    for name, value in bounds.items():
        if not value > 0 or math.isinf(value):
            raise ValueError(f"gep.embed_and_clip.{name} must be a finite number > 0, "
                             f"got {value!r}")


def _anchor_images(facts, num_anchors: int):
    if len(facts.public_images) < num_anchors:
        have = len(facts.public_images)
        raise ValueError(f"GEP needs {num_anchors} public anchor examples but the dataset "
                         f"declares {have}; set dataset.public_size >= {num_anchors} "
                         "(carved from train, disjoint from the private set)")
    return np.asarray(facts.public_images[:num_anchors], np.float32)


def _layer_kernel_shapes(facts, grouped: dict) -> dict:
    """{group: kernel shape} where the book-keeping form applies (the run has layer gradients
    and every parameter group is one matmul layer: {bias, kernel}, tap path (group,)), else {}."""
    if facts.layer_grads is None or not all(isinstance(sub, dict) and set(sub) == {"bias", "kernel"}
                                           for sub in grouped.values()):
        return {}
    return {g: tuple(sub["kernel"].shape) for g, sub in grouped.items()}


# the run facts GEP reads (layer_grads may be None: then its per-example form alone runs)
NEEDS = frozenset({"public_images", "param_shapes", "num_classes", "loss_fn", "layer_grads"})


def _statement_note(num_anchors: int, refresh_every: int) -> str:
    """The basis' public inputs and how often it is computed, for the privacy statement."""
    every = "every step" if refresh_every == 1 else f"every {refresh_every} steps (kept in between)"
    return (f"its projection basis is computed from {num_anchors} public anchor examples' "
            f"gradients at the current parameters {every}: public inputs and post-processing of "
            "earlier releases, no privacy cost")


@register_stage("gep.embed_and_clip")
def embed_and_clip(num_basis: int = 200, num_anchors: int = 512, embedding_bound: float = 0.1,
                   residual_bound: float = 0.02, power_iterations: int = 1,
                   biased: bool = False, anchor_chunk: int = 64,
                   basis_refresh_every: int = 1) -> Stage:
    """GEP's projection and the two clips (PER_EXAMPLE -> BOUNDED, two parts of norm <= 1).

    anchor_chunk: anchor gradients are computed that many at a time (a speed knob only: the
    basis is the same; 64 at a time was 2x faster than all 512 at once on 2 CPU cores).
    basis_refresh_every: r; the anchor basis is recomputed at steps 0, r, 2r, ... and kept in
    between (r = 1, every step, is the paper's setting). Free in privacy: the basis is a
    function of public anchors and of parameters that are post-processing of earlier releases.
    """
    _check_options(dict(num_basis=num_basis, num_anchors=num_anchors,
                        power_iterations=power_iterations, anchor_chunk=anchor_chunk,
                        basis_refresh_every=basis_refresh_every),
                   dict(embedding_bound=embedding_bound, residual_bound=residual_bound))
    options = dict(num_basis=num_basis, num_anchors=num_anchors,
                   embedding_bound=embedding_bound, residual_bound=residual_bound,
                   power_iterations=power_iterations, biased=biased,
                   basis_refresh_every=basis_refresh_every)
    name = "gep.embed_and_clip"
    part_bounds = {"embedding": embedding_bound, **({} if biased else {"residual": residual_bound})}

    def make(facts) -> StageFns:
        anchors = _anchor_images(facts, num_anchors)
        grouped = layer_groups(facts.param_shapes)
        sizes = {g: sum(math.prod(x.shape) for x in jax.tree.leaves(sub))
                 for g, sub in grouped.items()}
        ks = basis_sizes(sizes, num_basis, num_anchors)
        kernel_shapes = _layer_kernel_shapes(facts, grouped)
        layered = bool(kernel_shapes)

        def refresh(state, ctx):
            if layered and power_iterations == 1:  # batched anchor passes (book-keeping)
                basis = anchor_basis_from_layers(state["anchors"], ctx, ks, kernel_shapes,
                                                 facts.num_classes, anchor_chunk,
                                                 facts.layer_grads)
            else:
                basis = anchor_basis(state["anchors"], ctx, ks, facts.num_classes,
                                     power_iterations, anchor_chunk, facts.loss_fn)
            return dict(state, basis=basis, orth_error=basis_orthonormality_error(basis))

        def init(params, key):
            del params, key
            return {"anchors": jnp.asarray(anchors),
                    "basis": {g: jnp.zeros((ks[g], sizes[g]), jnp.float32) for g in ks},
                    "orth_error": jnp.zeros((), jnp.float32)}

        def begin_step(state, ctx):
            if basis_refresh_every == 1:
                return refresh(state, ctx)
            return jax.lax.cond(ctx.step % basis_refresh_every == 0,
                                lambda s: refresh(s, ctx), lambda s: s, state)

        def layer_clip(state):
            columns = {g: tap_columns(state["basis"][g], kernel_shapes[g]) for g in ks}
            return lambda grads, keep: embed_and_clip_layers(
                grads, keep, columns, kernel_shapes, state["orth_error"], embedding_bound,
                residual_bound, biased)

        def apply(grads, state, ctx):
            del ctx
            return embed_and_clip_one(grads, state["basis"], state["orth_error"],
                                      embedding_bound, residual_bound, biased), state

        def after_release(released, state, ctx):
            return reconstruct(released, state["basis"], ctx.params, embedding_bound,
                               residual_bound, biased)

        hooks = Hooks(begin_step=begin_step, after_release=after_release,
                      finish_sum=lambda total, state: finish_residual(total, state["basis"]),
                      layer_clip=layer_clip if layered else None)
        return StageFns(apply=apply, init=init, hooks=hooks, derived=dict(
            basis_per_group=ks, part_bounds=part_bounds,
            statement_note=_statement_note(num_anchors, basis_refresh_every)))

    return Stage(name=name, kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED, make=make,
                 privacy=Privacy(l2_bound=1.0, parts=1 if biased else 2), needs=NEEDS,
                 options=options)
