"""Phase 1 of the compiler: a validated pipeline bound to one run's public facts (``Plan``),
with the per-example strategy chosen from the stage chain."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


from dpbench.compiler import bookkeeping
from dpbench.compiler.plan import Plan
from dpbench.compiler.taps import MATMUL, discover_taps
from dpbench.compiler.rules import (PipelineError, ValidatedPipeline, describe_stage,
                                    validate_pipeline)
from dpbench.stages.base import Kind, Mask, Stage, StageFns, StageInfo


def _check_fns(i: int, stage: Stage, fns, num_per_example: int) -> None:
    where = describe_stage(i, stage)
    if not isinstance(fns, StageFns):
        raise PipelineError(f"{where}: make(info) returned {type(fns).__name__}, not StageFns")
    if stage.one_off_release is not None and (fns.release_value is None
                                              or fns.init_from_release is None):
        raise PipelineError(f"{where} declares a one-off release but make() gives no "
                            "release_value and init_from_release")
    if stage.public_mask and not all(isinstance(m, Mask) for m in stage.public_mask):
        raise PipelineError(f"{where}: public_mask must hold dpbench Mask members")
    if fns.host_inputs is not None and i < num_per_example:
        raise PipelineError(f"{where}: host_inputs are for batch stages (after the clip)")
    if fns.layer_clip is not None and (stage.kind_in, stage.kind_out) != (Kind.PER_EXAMPLE,
                                                                           Kind.BOUNDED):
        raise PipelineError(f"{where}: layer_clip is for a clip stage (per-example -> bounded)")
    if fns.finish_sum is not None and i >= num_per_example:
        raise PipelineError(f"{where}: finish_sum is for per-example stages (the clip and before)")


def bind(stages: Sequence[Stage], info: StageInfo, model=None,
         validated: Optional[ValidatedPipeline] = None) -> Plan:
    """Validates the declarations, makes every stage's step functions with the run facts, and
    picks the per-example strategy from the stage chain: book-keeping where it reproduces the
    chain exactly (bookkeeping.applies, or the clip's own layer form) and every parameter sits
    in a tap layer, else the materialized per-example gradients (vmap). Stages are made with
    ``info.layer_grads`` set where every tap is a matmul layer (its documented form: kernels
    and biases). ``validated``: these stages' validation, when the caller has already run it
    (the rules run once per compile)."""
    validated = validate_pipeline(stages) if validated is None else validated
    taps = None if model is None else discover_taps(
        model, info.param_shapes, info.example_shape)
    if taps is not None and all(t.kind == MATMUL for t in taps):
        info = info._replace(layer_grads=bookkeeping.layer_grads_fn(model, taps))
    fns = tuple(stage.make(info) for stage in validated.stages)
    plan = Plan(stages=validated.stages, fns=fns, validated=validated, info=info, model=model)
    for i, (stage, made) in enumerate(zip(plan.stages, fns)):
        _check_fns(i, stage, made, plan.num_per_example)
    if bookkeeping.applies(plan.stages, plan.num_per_example, taps) or \
            bookkeeping.applies_layer_clip(plan.stages, fns, plan.num_per_example, taps):
        plan = dataclasses.replace(plan, taps=taps, strategy="bookkeeping")
    else:
        plan = dataclasses.replace(plan, strategy_reason=bookkeeping.strategy_reason(
            plan.stages, plan.num_per_example, taps, model, info.param_shapes,
            info.example_shape))
    return plan
