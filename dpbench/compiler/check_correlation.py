"""The ``correlation`` check of ``dpbench check``: a release that declares correlated noise
(``Privacy.correlation``) is verified, not trusted. Its noise filter (``Hooks.correlate``) is
run on unit impulses for every step of the run: the responses are C^-1, inverted here to C,
which must be lower triangular with at most the declared bands and every column of L2 norm
<= 1 (what the accounting assumes); and its ``apply`` must add exactly that filter of the
step's fresh Gaussian draw. Deterministic: no statistics, no private data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpbench.ops import gaussian_noise
from dpbench.stages.base import StepContext

TOLERANCE = 1e-4  # float32 forward substitution, inverted in float64


def strategy_of(correlate, state0, like, steps: int) -> np.ndarray:
    """C (steps x steps) recovered from the filter: column s of C^-1 is the noise the filter
    adds at every step when step s's fresh draw is 1 on the first coordinate of ``like``'s
    first leaf and every other draw is 0."""
    first = jax.tree.leaves(like)[0]
    unit = jax.tree.map(jnp.zeros_like, like)
    leaves, treedef = jax.tree.flatten(unit)
    leaves[0] = jnp.zeros_like(first).reshape(-1).at[0].set(1).reshape(first.shape)
    impulse, zero = treedef.unflatten(leaves), unit
    run = jax.jit(correlate)
    inverse = np.zeros((steps, steps))
    for s in range(steps):
        state = state0
        for t in range(steps):
            noise, state = run(impulse if t == s else zero, state)
            inverse[t, s] = float(jax.tree.leaves(noise)[0].reshape(-1)[0])
    return np.linalg.inv(inverse)


def problems(strategy: np.ndarray, bands: int) -> list:
    """What in C breaks the declaration: entries above the diagonal or beyond the bands, a
    column of norm > 1."""
    out, scale = [], max(np.abs(strategy).max(), 1e-30)
    rows, cols = np.indices(strategy.shape)
    if np.abs(strategy[cols > rows]).max(initial=0) > TOLERANCE * scale:
        out.append("its strategy C is not lower triangular (the noise reads future draws)")
    beyond = np.abs(strategy[rows - cols >= bands]).max(initial=0)
    if beyond > TOLERANCE * scale:
        out.append(f"its strategy C has more than the declared {bands} band(s) (an entry "
                   f"{beyond:.3g} {bands} or more steps below the diagonal)")
    norms = np.linalg.norm(strategy, axis=0)
    if norms.max() > 1 + TOLERANCE:
        out.append(f"a column of its strategy C has L2 norm {norms.max():.6g} > 1, so one "
                   "participation moves the release by more than the sensitivity accounted")
    return out


def adds_its_filter(fns, state, params, noise_stddev: float) -> bool:
    """``apply`` on a zero value adds exactly ``correlate`` of the step's fresh draw, for two
    steps from ``state``."""
    zero = jax.tree.map(jnp.zeros_like, params)
    for step in range(2):
        ctx = StepContext(params=params, step=jnp.asarray(step), key=jax.random.key(11 + step),
                          noise_stddev=noise_stddev)
        added, after = fns.apply(zero, state, ctx)
        want, want_after = fns.hooks.correlate(gaussian_noise(zero, ctx.key, noise_stddev),
                                               state)
        if not all(np.array_equal(a, b) for a, b in zip(
                jax.tree.leaves((added, after)), jax.tree.leaves((want, want_after)))):
            return False
        state = after
    return True
