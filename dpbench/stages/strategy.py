"""The strategy of banded correlated noise: b Toeplitz coefficients c of a lower-triangular,
b-banded strategy matrix C, optimized for a run's length and optimizer, column-normalized.

The matrix-factorization view (Choquette-Choo et al. 2023; McKenna 2024): training reads the
workload A x of the clipped gradient sums x (the parameters are A x, up to the learning rate):
A is the prefix sum for SGD, the momentum-weighted prefix sum for heavy-ball momentum. The
mechanism releases C x + z, z ~ N(0, (sigma * sensitivity)^2 I), so the model sees
x + C^-1 z; the error it adds to the parameters is A C^-1 z. With every column of C of L2
norm <= 1, one participation of an example moves C x by at most the sensitivity.

For a Toeplitz C (coefficients c_0..c_{b-1} down its bands) and a Toeplitz A, A C^-1 is
Toeplitz too: its coefficients h are A's filter applied to C^-1's, and
``||A C^-1||_F^2 = sum_k (n - k) h_k^2``, so the loss ``||A C^-1||_F^2 * ||c||^2`` (the squared
error at a fixed noise multiplier; scale-free) costs O(n b) to evaluate. It is minimized
with optax's L-BFGS from Fichtenberger et al.'s square-root coefficients, and the optimum is
normalized so the largest column norm, ||c||, is at most 1. One band is c = [1]: DP-SGD.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

WORKLOADS = ("prefix", "momentum")
ITERATIONS = 100  # L-BFGS steps; the loss settles (float32) within 50 at n 500-1612, b 4-16


class Strategy(NamedTuple):
    """A banded Toeplitz strategy: its coefficients (float32 values, ||c|| <= 1) and what they
    were optimized for, with the loss against DP-SGD's (c = [1]) on the same workload."""

    coefficients: tuple
    steps: int
    workload: str
    momentum: float
    loss: float
    identity_loss: float

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def describe(self) -> dict:
        return dict(strategy_coefficients=list(self.coefficients),
                    strategy_workload=self.workload, strategy_steps=self.steps,
                    strategy_error_vs_independent=math.sqrt(self.loss / self.identity_loss))


def inverse_coefficients(coefficients, steps: int) -> jax.Array:
    """The first ``steps`` coefficients of C^-1 (lower-triangular Toeplitz), by forward
    substitution: g_0 = 1 / c_0, g_k = -(sum_{j=1}^{b-1} c_j g_{k-j}) / c_0."""
    c = jnp.asarray(coefficients)
    bands = c.shape[0]
    if bands == 1:
        return jnp.zeros(steps, c.dtype).at[0].set(1 / c[0])

    def next_coefficient(previous, k):  # previous: g_{k-1}, ..., g_{k-b+1}
        g = jnp.where(k == 0, 1.0, -jnp.dot(c[1:], previous)) / c[0]
        return jnp.concatenate([g[None], previous[:-1]]), g

    _, g = jax.lax.scan(next_coefficient, jnp.zeros(bands - 1, c.dtype), jnp.arange(steps))
    return g


def workload_coefficients(inverse: jax.Array, workload: str, momentum: float) -> jax.Array:
    """The coefficients of A C^-1 from C^-1's: the prefix sum, after the momentum filter
    y_k = momentum * y_{k-1} + g_k for heavy-ball momentum."""
    if workload == "momentum":
        _, inverse = jax.lax.scan(lambda y, g: (momentum * y + g, momentum * y + g),
                                  jnp.zeros((), inverse.dtype), inverse)
    return jnp.cumsum(inverse)


def loss(coefficients, steps: int, workload: str, momentum: float) -> jax.Array:
    """``||A C^-1||_F^2 * ||c||^2``: the total squared error the noise adds to the workload
    at a fixed noise multiplier, for the strategy with these (unnormalized) coefficients."""
    h = workload_coefficients(inverse_coefficients(coefficients, steps), workload, momentum)
    weights = jnp.arange(steps, 0, -1, dtype=h.dtype)
    return jnp.sum(weights * h ** 2) * jnp.sum(jnp.square(jnp.asarray(coefficients)))


def square_root_coefficients(bands: int) -> np.ndarray:
    """The Toeplitz square root of the prefix sum (Fichtenberger et al. 2023), truncated to
    ``bands``: 1, 1/2, 3/8, 5/16, ..."""
    ratios = (2 * np.arange(1, bands) - 1) / (2 * np.arange(1, bands))
    return np.concatenate([[1.0], np.cumprod(ratios)])


def normalized(coefficients) -> tuple:
    """Float32 values with ||c||_2 <= 1 computed exactly (float64 of the float32 values): the
    largest column norm the accounting assumes is never exceeded by rounding."""
    c = np.asarray(coefficients, np.float64)
    c32 = (c / np.linalg.norm(c)).astype(np.float32)
    while np.sum(c32.astype(np.float64) ** 2) > 1.0:
        c32 = (c32 * np.float32(1 - 2 ** -22)).astype(np.float32)
    return tuple(float(v) for v in c32)


@functools.partial(jax.jit, static_argnames=("steps", "workload", "iterations"))
def _minimize(start, steps: int, workload: str, momentum, iterations: int):
    objective = functools.partial(loss, steps=steps, workload=workload, momentum=momentum)
    log_objective = lambda c: jnp.log(objective(c))  # scale-free steps for the line search
    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(log_objective)

    def step(carry, _):
        c, state = carry
        value, grad = value_and_grad(c, state=state)
        updates, state = solver.update(grad, state, c, value=value, grad=grad,
                                       value_fn=log_objective)
        return (optax.apply_updates(c, updates), state), None

    (c, _), _ = jax.lax.scan(step, (start, solver.init(start)), None, length=iterations)
    return c


@functools.lru_cache(maxsize=64)
def optimal_strategy(steps: int, bands: int, workload: str = "momentum",
                     momentum: float = 0.9) -> Strategy:
    """The column-normalized b-banded Toeplitz strategy of least loss for ``steps`` steps of
    ``workload`` (computed once per process for each question). A result no better than its
    start (a failed optimization) falls back to the start, which is valid and good."""
    if not isinstance(bands, int) or bands < 1:
        raise ValueError(f"noise.banded.bands must be a positive integer, got {bands!r}")
    if workload not in WORKLOADS:
        raise ValueError(f"noise.banded.workload must be one of {WORKLOADS}, got {workload!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"noise.banded.momentum must lie in [0, 1), got {momentum!r}")
    question = (int(steps), workload, float(momentum))
    identity = float(loss(jnp.ones(1), *question))
    if bands == 1:
        return Strategy((1.0,), *question, identity, identity)
    bands = min(bands, int(steps))  # bands past the run's length are never used
    start = jnp.asarray(square_root_coefficients(bands), jnp.float32)
    best = np.asarray(_minimize(start, int(steps), workload, momentum, ITERATIONS))
    candidates = [c for c in (best, np.asarray(start)) if np.all(np.isfinite(c)) and c[0] > 0]
    scored = [(float(loss(jnp.asarray(normalized(c)), *question)), c) for c in candidates]
    value, chosen = min((s for s in scored if math.isfinite(s[0])), key=lambda s: s[0])
    return Strategy(normalized(chosen), *question, value, identity)
