"""The Gaussian releases: AGGREGATE -> RELEASED, with independent noise (``noise.gaussian``)
or with noise correlated across steps by a banded strategy (``noise.banded``, BandMF)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpbench.ops import add_gaussian_noise, gaussian_noise
from dpbench.stages import strategy
from dpbench.stages.base import (Correlation, Hooks, Kind, Privacy, Stage, StageFns,
                                 register_stage, stateless)


@register_stage("noise.gaussian")
def gaussian() -> Stage:
    """Releases the batch sum with N(0, (sigma * sensitivity)^2) noise on every coordinate.

    A release by its kinds (aggregate -> released). sigma is never set here: the compiler
    calibrates it to the run's (epsilon, delta) and derives
    the sensitivity from the pipeline's clip bound and Lipschitz factors. The noise is drawn once
    per step from the step's key, so the sharded step adds it once, not once per device.
    """

    def apply(value, state, ctx):
        if ctx.noise_stddev == 0:  # the non-private baseline (sigma 0)
            return value, state
        return add_gaussian_noise(value, ctx.key, ctx.noise_stddev), state

    return Stage(name="noise.gaussian", kind_in=Kind.AGGREGATE, kind_out=Kind.RELEASED,
                 make=stateless(apply))


EQUIVALENCE = (
    "Choquette-Choo et al. 2023, '(Amplified) Banded Matrix Factorization' (NeurIPS): with a "
    "b-banded lower-triangular strategy C whose columns have L2 norm <= 1 and cyclic Poisson "
    "sampling over b parts, releasing C x + z is as private as DP-SGD with the same noise "
    "multiplier at the part's sampling rate over ceil(steps / b) steps")


def _correlate_fn(coefficients: tuple):
    """z -> w = C^-1 z one step at a time (forward substitution): w_t = (z_t - sum_{j>=1}
    c_j w_{t-j}) / c_0, the state the last b - 1 noise vectors w_{t-1}, ..., w_{t-b+1} (noise
    only: nothing private enters it)."""
    c0, rest = coefficients[0], coefficients[1:]

    def one_leaf(fresh, previous):  # previous: [b - 1, *shape], newest first
        total = fresh
        for j, c in enumerate(rest):
            total = total - c * previous[j]
        noise = total / c0
        return noise, jnp.concatenate([noise[None], previous[:-1]])

    def correlate(fresh, state):
        if not rest:  # one band: independent noise, exactly the draw (DP-SGD bit for bit)
            return fresh, state
        leaves, treedef = jax.tree.flatten(fresh)
        pairs = [one_leaf(f, p) for f, p in zip(leaves, treedef.flatten_up_to(state["noise"]))]
        return (treedef.unflatten([p[0] for p in pairs]),
                {"noise": treedef.unflatten([p[1] for p in pairs])})

    return correlate


@register_stage("noise.banded")
def banded(bands: int = 4, workload: str = "momentum", momentum: float = 0.9) -> Stage:
    """Releases the batch sum with noise correlated across steps (banded matrix factorization,
    BandMF): the noise added at step t is (C^-1 z)_t, z the steps' fresh N(0, (sigma *
    sensitivity)^2) draws, C the ``bands``-banded Toeplitz strategy optimized for the run's
    length and ``workload`` (``'momentum'``: heavy-ball SGD with this ``momentum``, which
    should be the optimizer's; ``'prefix'``: plain SGD), every column of norm <= 1
    (stages/strategy.py). Its state is the noise of the last ``bands`` - 1 steps.

    Guarantees: with ``bands`` = 1 it is ``noise.gaussian`` bit for bit. With more it declares
    a ``Correlation``: the compiler accounts it as DP-SGD at the cyclic Poisson sampler's rate
    over ceil(steps / bands) participations, and refuses any other sampler (bind
    ``sampler.parts`` to ``bands``).
    """
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"noise.banded.bands must be a positive integer, got {bands!r}")
    if workload not in strategy.WORKLOADS:
        raise ValueError(f"noise.banded.workload must be one of {strategy.WORKLOADS}, got "
                         f"{workload!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"noise.banded.momentum must lie in [0, 1), got {momentum!r}")

    def make(facts) -> StageFns:
        chosen = strategy.optimal_strategy(facts.total_steps, bands, workload, momentum)
        coefficients = chosen.coefficients + (0.0,) * (bands - chosen.bands)
        correlate = _correlate_fn(coefficients)

        def init(params, key):
            del key
            if bands == 1:
                return {}
            return {"noise": jax.tree.map(
                lambda p: jnp.zeros((bands - 1,) + jnp.shape(p), jnp.result_type(p)), params)}

        def apply(value, state, ctx):
            if ctx.noise_stddev == 0:  # the non-private baseline (sigma 0)
                return value, state
            noise, state = correlate(gaussian_noise(value, ctx.key, ctx.noise_stddev), state)
            return jax.tree.map(jnp.add, value, noise), state

        derived = dict(chosen.describe(), mechanism="banded matrix factorization (BandMF)")
        return StageFns(apply=apply, init=init, hooks=Hooks(correlate=correlate),
                        derived=derived)

    return Stage(name="noise.banded", kind_in=Kind.AGGREGATE, kind_out=Kind.RELEASED,
                 make=make, needs={"total_steps"},
                 privacy=Privacy(correlation=Correlation(bands=bands, equivalence=EQUIVALENCE)),
                 options=dict(bands=bands, workload=workload, momentum=momentum))
