"""GEP in book-keeping form: the anchor basis and the batch's embedding and two clips from every
example's layer gradients of one batched backward pass (the run fact layer_grads: per matmul layer
a bias b x p and an outputs-first kernel b x p x d), the sums as one weighted contraction per
layer. Same values as the per-example path (gep.embed_and_clip_one) up to float rounding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpbench.stages.gep_numerics import orthonormal_rows, random_start, residual_sq_upper


def tap_columns(rows, kernel_shape: tuple):
    """A group's rows in parameter order (k x (p + d p): the bias, then the (d, p) kernel
    row-major, as ``_flat``) -> as columns in the layout of ``the run fact layer_grads``: (bias
    p x k, kernel outputs-first (p d) x k). Columns, not rows: the embedding's contraction
    then reads them as they lie (as rows, XLA's CPU dot copied the rows' transpose on every
    micro-batch: 0.65 ms each for the tanh CNN's dense layer)."""
    d, p = math.prod(kernel_shape[:-1]), kernel_shape[-1]
    k = rows.shape[0]
    return rows[:, :p].T, rows[:, p:].reshape(k, d, p).transpose(2, 1, 0).reshape(p * d, k)


def _embed(bias, kernel, columns):
    """Per example bias . B_bias + vec(kernel) . B_kernel: (b x p, b x p x d) -> b x k. One
    contracting axis (p d) written out: with two, XLA's CPU dot copied both operands into
    (d, p) order on every call."""
    b = kernel.shape[0]
    return bias @ columns[0] + kernel.reshape(b, -1) @ columns[1]


def parameter_rows(bias_rows, kernel_rows):
    """(bias k x p, kernel outputs-first k x p x d) -> k x (p + d p) in parameter order."""
    k = bias_rows.shape[0]
    return jnp.concatenate([bias_rows, kernel_rows.transpose(0, 2, 1).reshape(k, -1)], axis=1)


def anchor_basis_from_layers(anchors, ctx, ks: dict, kernel_shapes: dict, num_classes: int,
                             chunk: int, layer_grads):
    """``anchor_basis`` with one power iteration, the anchor gradients from ``layer_grads``
    (one batched backward pass per chunk, the run fact layer_grads): the same random start and
    labels, the same product sum over chunks of (G_c B0^T)^T G_c, in the kernels'
    outputs-first layout, turned back to parameter order once. Public inputs only."""
    label_key, basis_key = jax.random.split(ctx.key)
    labels = jax.random.randint(label_key, (anchors.shape[0],), 0, num_classes)
    groups = sorted(ks)
    sizes = {g: kernel_shapes[g][-1] + math.prod(kernel_shapes[g]) for g in groups}
    starts = {g: tap_columns(random_start(jax.random.fold_in(basis_key, i), ks[g], sizes[g]),
                             kernel_shapes[g]) for i, g in enumerate(groups)}
    m = anchors.shape[0]
    usable = m - m % chunk

    def accumulate(acc, images, labels):
        grads, _ = layer_grads(ctx.params, images, labels, jnp.ones(labels.shape, bool))
        out = {}
        for g in groups:
            bias, kernel = grads[g]["bias"], grads[g]["kernel"]   # c x p, c x p x d
            u = _embed(bias, kernel, starts[g])                      # c x k
            c = kernel.shape[0]
            out[g] = (acc[g][0] + u.T @ bias,
                      acc[g][1] + (u.T @ kernel.reshape(c, -1)).reshape(acc[g][1].shape))
        return out

    total = {g: (jnp.zeros((ks[g], kernel_shapes[g][-1])), jnp.zeros(
        (ks[g], kernel_shapes[g][-1], math.prod(kernel_shapes[g][:-1])))) for g in groups}
    chunks = (anchors[:usable].reshape((-1, chunk) + anchors.shape[1:]),
              labels[:usable].reshape(-1, chunk))
    total, _ = jax.lax.scan(lambda acc, xs: (accumulate(acc, *xs), None), total, chunks)
    if usable < m:  # the last, partial chunk
        total = accumulate(total, anchors[usable:], labels[usable:])
    return {g: orthonormal_rows(parameter_rows(*total[g])) for g in groups}


def embed_and_clip_layers(grads, keep, columns: dict, kernel_shapes: dict, eps,
                          embedding_bound: float, residual_bound: float, biased: bool):
    """``embed_and_clip_one`` for a batch in book-keeping form: (the sum over the examples with
    ``keep`` of what it returns for each, per-example finiteness). ``grads``:
    the run fact layer_grads' per-example bias (b x p) and outputs-first kernel (b x p x d) per
    group; ``columns``: the basis per group as ``tap_columns``. The embedding, both norms and the
    two clip factors are per example; the sums are one weighted contraction per leaf. The
    residual bound sees the same float32 quantities as the per-example path (||v||^2 and
    ||w||^2 of the materialized per-example gradient and its embedding), so it is as rigorous."""
    groups = sorted(columns)
    embed = {g: _embed(grads[g]["bias"], grads[g]["kernel"], columns[g]) for g in groups}
    w_all = jnp.concatenate([embed[g] for g in groups], axis=1)
    w_sq = jnp.sum(jnp.square(w_all), axis=1)
    v_sq = sum(jnp.sum(jnp.square(grads[g]["bias"]), axis=1)
               + jnp.sum(jnp.square(grads[g]["kernel"]), axis=(1, 2)) for g in groups)
    finite = jnp.isfinite(v_sq) & jnp.isfinite(w_sq)
    kept = keep & finite
    # clip_to_l2(w, S1) / S1 = w / max(||w||, S1)
    w_scale = jnp.where(kept, 1.0 / jnp.maximum(jnp.sqrt(jnp.where(kept, w_sq, 0.0)),
                                                embedding_bound), 0.0)
    if not biased:
        k = w_all.shape[1]
        sizes = [kernel_shapes[g][-1] + math.prod(kernel_shapes[g]) for g in groups]
        upper = residual_sq_upper(jnp.where(kept, v_sq, 0.0), jnp.where(kept, w_sq, 0.0), k,
                                  sum(sizes), max(sizes), eps)
        r_scale = jnp.where(kept, residual_bound / jnp.maximum(jnp.sqrt(upper), residual_bound)
                            / residual_bound, 0.0)

    def sums(zero_bad: bool):
        g_, e_, w_ = grads, embed, w_all
        if zero_bad:  # NaN * 0 is NaN: a left-out non-finite example is zeroed first
            zero = lambda x: jnp.where(kept.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)  # noqa
            g_, e_, w_ = jax.tree.map(zero, grads), jax.tree.map(zero, embed), zero(w_all)
        out = {"w": w_scale @ w_}
        if biased:
            return out
        out["rv"] = {g: {"bias": r_scale @ g_[g]["bias"],
                         "kernel": jnp.einsum("b,bpd->pd", r_scale, g_[g]["kernel"]).T.reshape(
                             kernel_shapes[g])} for g in groups}
        out["rw"] = {g: r_scale @ e_[g] for g in groups}
        return out

    total = jax.lax.cond(jnp.all(finite), lambda: sums(False), lambda: sums(True))
    return total, finite
