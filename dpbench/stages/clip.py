"""Clipping stages: the only way per-example values become BOUNDED."""

from __future__ import annotations

import math

from dpbench.ops import clip_to_l2
from dpbench.stages.base import Kind, Privacy, Stage, register_stage, stateless


@register_stage("clip.global_l2")
def global_l2(l2_bound: float = 1.0) -> Stage:
    """Flat L2 clipping of one example's value: output norm <= ``l2_bound``
    (PER_EXAMPLE -> BOUNDED).

    ``l2_bound = inf`` disables clipping (only meaningful with noise multiplier 0, for testing
    against non-private SGD; the compiler refuses to calibrate noise for an infinite bound).
    """
    if not isinstance(l2_bound, (int, float)) or math.isnan(l2_bound) or l2_bound <= 0:
        raise ValueError(f"clip.global_l2.l2_bound must be a positive number, got {l2_bound!r}; "
                         "set e.g. clip.global_l2.l2_bound = 1.0")

    def apply(value, state, ctx):
        del ctx
        return clip_to_l2(value, float(l2_bound)), state

    return Stage(name="clip.global_l2", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                 make=stateless(apply), privacy=Privacy(l2_bound=float(l2_bound)),
                 options=dict(l2_bound=float(l2_bound)))
