"""Nasr, Shokri & Houmansadr: gradient discretization + Bayesian error correction
(pipelines/nasr/README.md). Micro-batch size mu = 1 (per example), the paper's default.

Discretization (per example, before clipping): each gradient coordinate becomes +1 if > tau,
-1 if < -tau, else 0; the clip then scales the ternary vector to L2 norm <= C.

Error correction (post-processing of the RELEASED sum, per coordinate): with Y = X + Z,
Z ~ N(0, s^2), s = sigma * C, three hypotheses about the clipped sum X: down (X < -nu), up
(X > nu), stop (|X| <= nu), with equal priors (the paper's choice without public data). The
likelihoods we use take each hypothesis at its boundary/center value:
    P(Y | up)   = phi((Y - nu) / s),  P(Y | down) = phi((Y + nu) / s),  P(Y | stop) = phi(Y / s)
(phi the standard normal density). The coordinate becomes +nu, -nu or 0 for the hypothesis with
the largest posterior, i.e. +nu if Y > nu/2, -nu if Y < -nu/2, else 0. It reads only the
released value and public constants, so it costs no privacy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.stages.base import Hooks, Kind, Stage, StageFns, register_stage, stateless


def ternary(x, threshold):
    return jnp.where(x > threshold, 1.0, jnp.where(x < -threshold, -1.0, 0.0)).astype(x.dtype)


@register_stage("discretize.ternary")
def discretize(threshold: float = 0.001) -> Stage:
    """Maps one example's gradient to {-1, 0, +1} per coordinate (PER_EXAMPLE, before clip)."""
    if not threshold >= 0:
        raise ValueError(f"discretize.ternary.threshold must be >= 0, got {threshold!r}")

    def scalar(g):
        return ternary(g, threshold)

    def apply(grads, state, ctx):
        del ctx
        return jax.tree.map(scalar, grads), state

    return Stage(name="discretize.ternary", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                 make=lambda facts: StageFns(apply=apply, hooks=Hooks(elementwise=scalar)),
                 options=dict(threshold=threshold))


def log_likelihoods(y, nu, scale):
    """Unnormalized Gaussian log-likelihoods of (down, stop, up) for released values y."""
    return jnp.stack([-0.5 * ((y + nu) / scale) ** 2, -0.5 * (y / scale) ** 2,
                      -0.5 * ((y - nu) / scale) ** 2])


def bayes_correct(y, nu, scale, log_priors=(0.0, 0.0, 0.0)):
    """The MAP hypothesis per coordinate, as -nu, 0 or +nu."""
    posterior = log_likelihoods(y, nu, scale) + jnp.asarray(log_priors).reshape(
        (3,) + (1,) * y.ndim)
    return jnp.asarray([-nu, 0.0, nu], y.dtype)[jnp.argmax(posterior, axis=0)]


@register_stage("denoise.nasr_bayes")
def nasr_bayes(nu: float = 0.01) -> Stage:
    """Bayesian error correction of the released sum (RELEASED -> RELEASED, post-processing)."""
    if not nu > 0:
        raise ValueError(f"denoise.nasr_bayes.nu must be > 0, got {nu!r}")

    def apply(released, state, ctx):
        scale = max(ctx.noise_stddev, 1e-12)
        return jax.tree.map(lambda y: bayes_correct(y, nu, scale), released), state

    return Stage(name="denoise.nasr_bayes", kind_in=Kind.RELEASED, kind_out=Kind.RELEASED,
                 make=stateless(apply), options=dict(nu=nu))
