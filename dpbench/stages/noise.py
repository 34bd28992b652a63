"""The Gaussian release: AGGREGATE -> RELEASED."""

from __future__ import annotations

from dpbench.ops import add_gaussian_noise
from dpbench.stages.base import Kind, Stage, register_stage, stateless


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
