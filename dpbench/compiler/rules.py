"""Phase 0 of the compiler: the privacy and typing rules on the stages' declarations
(kinds, bounds, costs), run once per compile; errors name the stage and the rule."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


from dpbench.stages.base import PRIVATE_KINDS, Kind, Stage


class PipelineError(ValueError):
    """A pipeline that breaks a privacy or typing rule; the message names the stage and rule."""


@dataclasses.dataclass(frozen=True)
class ValidatedPipeline:
    stages: tuple
    clip_index: int
    release_indices: tuple
    sensitivity: float


def describe_stage(i: int, stage: Stage) -> str:
    return f"stage #{i} '{stage.name}'"


def _check_transition(i: int, stage: Stage, current: Kind) -> None:
    """Raises unless ``stage`` may consume a value of kind ``current``."""
    where, wanted = describe_stage(i, stage), stage.kind_in
    if wanted == current:
        if wanted == Kind.EXAMPLE and i != 0:
            raise PipelineError(f"{where}: only the first stage may consume raw examples")
        return
    if current in (Kind.EXAMPLE, Kind.PER_EXAMPLE) and wanted in (
            Kind.AGGREGATE, Kind.RELEASED, Kind.UPDATES):
        raise PipelineError(
            f"{where} receives unbounded per-example values ({current.value}) but needs "
            f"{wanted.value}: every per-example value must pass a clip stage (e.g. "
            "@clip.global_l2()) before it is summed, noised or applied")
    if current in PRIVATE_KINDS and wanted in (Kind.RELEASED, Kind.UPDATES):
        raise PipelineError(
            f"{where} needs {wanted.value} values but receives private {current.value} "
            "values: add a release (e.g. @noise.gaussian()) before it")
    raise PipelineError(f"{where} consumes {wanted.value} but the previous stage "
                        f"produces {current.value}; reorder the pipeline")


def _check_bounded_transform(where: str, stage: Stage) -> float:
    """A BOUNDED/AGGREGATE transform: same kind out, a Lipschitz factor, a cost if it reads
    the private aggregate. Returns its Lipschitz factor."""
    if stage.kind_out != stage.kind_in:
        raise PipelineError(f"{where} maps {stage.kind_in.value} to {stage.kind_out.value}; "
                            "only a release (aggregate -> released) may change the kind")
    lipschitz = stage.privacy.lipschitz
    if lipschitz is None or not lipschitz >= 0:
        raise PipelineError(
            f"{where} transforms {stage.kind_in.value} values without declaring its L2 "
            "Lipschitz factor, so the sensitivity of the release is unknown; declare "
            "Privacy(lipschitz=...) in its Stage")
    if stage.kind_in == Kind.AGGREGATE and stage.privacy.cost is None:
        raise PipelineError(
            f"{where} reads the private aggregate before the release but declares no DP "
            "cost; data-dependent selection must be an accounted mechanism (declare "
            "Privacy(cost=...), returning dp_accounting.NoOpDpEvent() if its output ignores "
            "the private values)")
    return float(lipschitz)


def _check_one_off(stages: tuple) -> None:
    declared = [(i, s) for i, s in enumerate(stages) if s.privacy.one_off_release is not None]
    if len(declared) > 1:
        raise PipelineError(f"{describe_stage(*declared[1])}: only one stage may release private "
                            "data before training")
    for i, stage in declared:
        release = stage.privacy.one_off_release
        if not (release.l2_bound > 0 and math.isfinite(release.l2_bound)
                and 0 < release.epsilon_fraction < 1):
            raise PipelineError(f"{describe_stage(i, stage)} declares a one-off release without a "
                                "finite positive l2_bound and an epsilon_fraction in (0, 1)")


def _check_correlation(i: int, stage: Stage) -> None:
    """Correlated noise is declared by a release, with a positive whole number of bands."""
    correlation = stage.privacy.correlation
    if correlation is None:
        return
    where = describe_stage(i, stage)
    if not stage.is_release:
        raise PipelineError(f"{where} declares correlated noise (Privacy.correlation) but is "
                            "not a release (aggregate -> released); only a release adds noise")
    bands = correlation.bands
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise PipelineError(f"{where} declares correlated noise over {bands!r} bands; bands "
                            "must be a positive integer")


def validate_pipeline(stages: Sequence[Stage]) -> ValidatedPipeline:
    """Checks that private values reach the optimizer only through a declared, accounted release.

    Rules: the first stage consumes EXAMPLE; each stage consumes what the previous produced (the
    compiler itself sums BOUNDED into AGGREGATE, and divides by the expected batch size before
    the optimizer); exactly one clip (PER_EXAMPLE -> BOUNDED, declared l2_bound);
    BOUNDED/AGGREGATE transforms declare a Lipschitz factor; stages that read the aggregate
    without releasing it declare a DP cost; at most one one-off release; at least one Gaussian
    release (a stage mapping AGGREGATE to RELEASED), correlated noise declared only by one; the
    last stage produces UPDATES. (Whether a correlated release's sampler is one its privacy is
    proven for is checked where the sampler is known: ledger.check_sampler.)
    """
    stages = tuple(stages)
    if not stages:
        raise PipelineError("the pipeline has no stages; set STAGES = [@grad.per_example(), "
                            "@clip.global_l2(), @noise.gaussian(), @optimize.optax()]")
    for i, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise PipelineError(f"stage #{i} is {stage!r}, not a Stage; write it as "
                                "@module.name() in STAGES (with the parentheses)")
    if stages[0].kind_in != Kind.EXAMPLE:
        raise PipelineError(f"{describe_stage(0, stages[0])} consumes "
                            f"{stages[0].kind_in.value}, but a pipeline must start with a "
                            "per-example gradient stage (@grad.per_example())")
    current, clip_index, releases, sensitivity = Kind.EXAMPLE, None, [], None
    for i, stage in enumerate(stages):
        where = describe_stage(i, stage)
        if current == Kind.BOUNDED and stage.kind_in == Kind.AGGREGATE:
            current = Kind.AGGREGATE  # the compiler's masked sum
        _check_transition(i, stage, current)
        if stage.kind_in == Kind.PER_EXAMPLE and stage.kind_out == Kind.BOUNDED:
            bound = stage.privacy.l2_bound
            if bound is None or not bound > 0:
                raise PipelineError(f"{where} turns per-example values into bounded ones but "
                                    "declares no positive l2_bound")
            if clip_index is not None:
                raise PipelineError(f"{where} is a second clip; a pipeline has exactly one")
            clip_index, sensitivity = i, float(bound)
        elif stage.kind_in in (Kind.BOUNDED, Kind.AGGREGATE) and not stage.is_release:
            sensitivity *= _check_bounded_transform(where, stage)
        if stage.is_release:
            releases.append(i)
        _check_correlation(i, stage)
        current = stage.kind_out
    if clip_index is None:
        raise PipelineError("the pipeline has no clip stage (PER_EXAMPLE -> BOUNDED); add "
                            "@clip.global_l2() after the gradient stage")
    if not releases:
        raise PipelineError("the pipeline has no release stage; add @noise.gaussian() after "
                            "the clip")
    if current != Kind.UPDATES:
        raise PipelineError(f"the last stage '{stages[-1].name}' produces {current.value}; a "
                            "pipeline must end with an optimizer (@optimize.optax())")
    _check_one_off(stages)
    return ValidatedPipeline(stages, clip_index, tuple(releases), sensitivity)


def validated(pipeline) -> ValidatedPipeline:
    """``pipeline`` validated: a :class:`ValidatedPipeline` as it is (the rules read only the
    frozen declarations, so one validation holds for every later phase), stages by
    :func:`validate_pipeline`."""
    return pipeline if isinstance(pipeline, ValidatedPipeline) else validate_pipeline(pipeline)


def sampler_parts(stages: Sequence[Stage]) -> int:
    """How many cyclic Poisson parts the pipeline's correlated release needs (its bands; 1, a
    plain Poisson sampler, when no release correlates its noise): for the harnesses that build
    their own sampler (dpbench check, the audit)."""
    return max([s.privacy.correlation.bands for s in stages
                if isinstance(s, Stage) and s.privacy.correlation is not None] or [1])
