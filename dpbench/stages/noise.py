"""The Gaussian release: AGGREGATE -> RELEASED."""

from __future__ import annotations

from dpbench.ops import add_gaussian_noise
from dpbench.stages.base import Kind, Stage, register_stage, stateless


@register_stage("noise.gaussian")
def gaussian() -> Stage:
    """Releases the batch sum with N(0, (sigma * sensitivity)^2) noise on every coordinate.

    sigma is never set here: the compiler calibrates it to the run's (epsilon, delta) and derives
    the sensitivity from the pipeline's clip bound and Lipschitz factors. The noise is drawn once
    per step from the step's key, so the sharded step adds it once, not once per device.
    """

    def apply(value, state, ctx):
        if ctx.noise_multiplier == 0:  # non-private baseline; avoids 0 * inf with no clipping
            return value, state
        return add_gaussian_noise(value, ctx.key, ctx.noise_multiplier * ctx.sensitivity), state

    return Stage(name="noise.gaussian", kind_in=Kind.AGGREGATE, kind_out=Kind.RELEASED,
                 make=stateless(apply), is_release=True)
