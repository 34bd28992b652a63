"""Phase 1 of the compiler: a validated pipeline bound to one run's public facts (``Plan``),
with the per-example strategy chosen from the stage chain."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


from dpbench.compiler import bookkeeping
from dpbench.compiler.plan import Plan
from dpbench.compiler.facts import RunFacts
from dpbench.compiler.rules import (PipelineError, ValidatedPipeline, describe_stage,
                                    validate_pipeline)
from dpbench.stages.base import Hooks, Kind, Mask, Privacy, Stage, StageFns


def _check_declaration(i: int, stage: Stage, facts: RunFacts) -> None:
    """The declaration's types and the run facts the stage needs: known, and present here."""
    where = describe_stage(i, stage)
    if not isinstance(stage.privacy, Privacy):
        raise PipelineError(f"{where}: privacy must be a dpbench Privacy, got "
                            f"{type(stage.privacy).__name__}")
    if stage.privacy.public_mask and not all(isinstance(m, Mask)
                                             for m in stage.privacy.public_mask):
        raise PipelineError(f"{where}: Privacy.public_mask must hold dpbench Mask members")
    unknown = sorted(n for n in stage.needs if n not in facts.known())
    if unknown:
        raise PipelineError(f"{where} needs run facts {unknown} that no run has; the run facts "
                            f"are {sorted(facts.known())} (compiler/facts.py: add one there)")
    for name in sorted(stage.needs):
        missing = facts.absent(name)
        if missing is not None:
            raise PipelineError(f"{where} needs the run fact {name!r}, which this run lacks: "
                                f"{missing}")


def _check_fns(i: int, stage: Stage, fns, num_per_example: int) -> None:
    where = describe_stage(i, stage)
    if not isinstance(fns, StageFns):
        raise PipelineError(f"{where}: make(facts) returned {type(fns).__name__}, not StageFns")
    hooks = fns.hooks
    if not isinstance(hooks, Hooks):
        raise PipelineError(f"{where}: StageFns.hooks must be a dpbench Hooks")
    if hooks.host_inputs is not None and i < num_per_example:
        raise PipelineError(f"{where}: host_inputs are for batch stages (after the clip)")
    if hooks.layer_clip is not None and (stage.kind_in, stage.kind_out) != (Kind.PER_EXAMPLE,
                                                                            Kind.BOUNDED):
        raise PipelineError(f"{where}: layer_clip is for a clip stage (per-example -> bounded)")
    if hooks.finish_sum is not None and i >= num_per_example:
        raise PipelineError(f"{where}: finish_sum is for per-example stages (the clip and before)")
    if (hooks.correlate is None) != (stage.privacy.correlation is None):
        raise PipelineError(f"{where}: a release with correlated noise declares both "
                            "Privacy.correlation and Hooks.correlate (its noise filter); this "
                            "stage has only one of them")
    if hooks.elementwise is not None and (stage.kind_in, stage.kind_out) != (
            Kind.PER_EXAMPLE, Kind.PER_EXAMPLE):
        raise PipelineError(f"{where}: elementwise is for a stage between the gradient and the "
                            "clip (per-example -> per-example)")


def bind(stages: Sequence[Stage], facts: RunFacts,
         validated: Optional[ValidatedPipeline] = None) -> Plan:
    """Validates the declarations, makes every stage's step functions with the run facts it
    names (``Stage.needs``), and picks the per-example strategy from the stage chain:
    book-keeping where it reproduces the chain exactly (bookkeeping.applies, or the clip's own
    layer form) and every parameter sits in a tap layer, else the materialized per-example
    gradients (vmap). ``validated``: these stages' validation, when the caller has already run
    it (the rules run once per compile)."""
    validated = validate_pipeline(stages) if validated is None else validated
    model = facts.inputs.model
    for i, stage in enumerate(validated.stages):
        _check_declaration(i, stage, facts)
    fns = tuple(stage.make(facts.for_stage(stage)) for stage in validated.stages)
    plan = Plan(stages=validated.stages, fns=fns, validated=validated, run_facts=facts,
                model=model)
    for i, (stage, made) in enumerate(zip(plan.stages, fns)):
        _check_fns(i, stage, made, plan.num_per_example)
    taps = facts.get("taps")
    if bookkeeping.applies(plan.stages, plan.num_per_example, taps) or \
            bookkeeping.applies_layer_clip(plan.stages, fns, plan.num_per_example, taps):
        plan = dataclasses.replace(plan, taps=taps, strategy="bookkeeping")
    else:
        plan = dataclasses.replace(plan, strategy_reason=bookkeeping.strategy_reason(
            plan.stages, plan.num_per_example, taps, model, facts.get("param_shapes"),
            facts.get("example_shape")))
    return plan
