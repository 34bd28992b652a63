"""The compiler: (pipeline, model, sampler, budget, mesh) -> one jitted, sharded, accounted step.

Three named phases over a frozen plan:

1. bind (:func:`bind`): :func:`validate_pipeline` checks the stages' declarations (kinds,
   bounds, costs; errors name the stage and the rule) and derives the sensitivity; each stage's
   ``make`` gets the run's public facts and returns its step functions. Host only, no jit.
2. account (:func:`account`): the run's privacy ledger (one-off releases, the per-step Gaussian
   release, stage mechanisms such as GIP's index release) and the noise multipliers calibrated
   to the target (epsilon, delta). Host only, no jit; testable on its own.
3. lower (:func:`lower`): the step function (begin-step, clipped sum, batch stages and release,
   normalize, optimizer, public masks, EMA) and the initial state; :func:`compile_pipeline`
   checks their shapes with jax.eval_shape and jits the step with shardings on the mesh.

One clipped-sum function (:func:`masked_sum`) serves the step and the one-off release.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event
from jax.sharding import Mesh

from dpbench import accounting, bookkeeping, sharding
from dpbench.stages.base import (PRIVATE_KINDS, Kind, Mask, Stage, StageFns, StageInfo,
                                 StepContext, apply_mask)
from dpbench.stages.clip import clip_to_l2, zero_if_nonfinite
from dpbench.stages.noise import add_gaussian_noise

# Keys for stage initialization and for steps come from disjoint subtrees of the run key, so no
# step's noise key can coincide with a stage's initialization key.
_STEP_DOMAIN, _INIT_DOMAIN, _RELEASE_DOMAIN = 0, 1, 2
STAGE_INPUTS = sharding.STAGE_INPUTS  # the batch entry with the stages' host randomness
EXAMPLE_KEYS = ("image", "label")


class PipelineError(ValueError):
    """A pipeline that breaks a privacy or typing rule; the message names the stage and rule."""


class TrainState(NamedTuple):
    params: Any
    stage_states: tuple
    ema_params: Any
    step: jax.Array   # int32 scalar: number of steps taken (empty batches count)
    key: jax.Array    # the run's base key; step keys are fold_in(key, step), never reused


# ----------------------------------------------------------------------------- validation

@dataclasses.dataclass(frozen=True)
class ValidatedPipeline:
    stages: tuple
    clip_index: int
    release_indices: tuple
    sensitivity: float


def _describe(i: int, stage: Stage) -> str:
    return f"stage #{i} '{stage.name}'"


def _check_transition(i: int, stage: Stage, current: Kind) -> None:
    """Raises unless ``stage`` may consume a value of kind ``current``."""
    where, wanted = _describe(i, stage), stage.kind_in
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
                            "only a release may do that")
    if stage.lipschitz is None or not stage.lipschitz >= 0:
        raise PipelineError(
            f"{where} transforms {stage.kind_in.value} values without declaring its L2 "
            "Lipschitz factor, so the sensitivity of the release is unknown; declare "
            "lipschitz= in its Stage")
    if stage.kind_in == Kind.AGGREGATE and stage.cost is None and stage.reads_private:
        raise PipelineError(
            f"{where} reads the private aggregate before the release but declares no DP "
            "cost; data-dependent selection must be an accounted mechanism (declare cost=, "
            "or reads_private=False if its output ignores the private values)")
    return float(stage.lipschitz)


def _check_one_off(stages: tuple) -> None:
    declared = [(i, s) for i, s in enumerate(stages) if s.one_off_release is not None]
    if len(declared) > 1:
        raise PipelineError(f"{_describe(*declared[1])}: only one stage may release private "
                            "data before training")
    for i, stage in declared:
        release = stage.one_off_release
        if not (release.l2_bound > 0 and math.isfinite(release.l2_bound)
                and 0 < release.epsilon_fraction < 1):
            raise PipelineError(f"{_describe(i, stage)} declares a one-off release without a "
                                "finite positive l2_bound and an epsilon_fraction in (0, 1)")


def validate_pipeline(stages: Sequence[Stage]) -> ValidatedPipeline:
    """Checks that private values reach the optimizer only through a declared, accounted release.

    Rules: the first stage consumes EXAMPLE; each stage consumes what the previous produced (the
    compiler itself sums BOUNDED into AGGREGATE, and divides by the expected batch size before
    the optimizer); exactly one clip (PER_EXAMPLE -> BOUNDED, declared l2_bound);
    BOUNDED/AGGREGATE transforms declare a Lipschitz factor; stages that read the aggregate
    without releasing it declare a DP cost; at most one one-off release; at least one Gaussian
    release; the last stage produces UPDATES.
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
        raise PipelineError(f"{_describe(0, stages[0])} consumes {stages[0].kind_in.value}, but "
                            "a pipeline must start with a per-example gradient stage "
                            "(@grad.per_example())")
    current, clip_index, releases, sensitivity = Kind.EXAMPLE, None, [], None
    for i, stage in enumerate(stages):
        where = _describe(i, stage)
        if current == Kind.BOUNDED and stage.kind_in == Kind.AGGREGATE:
            current = Kind.AGGREGATE  # the compiler's masked sum
        _check_transition(i, stage, current)
        if stage.kind_in == Kind.PER_EXAMPLE and stage.kind_out == Kind.BOUNDED:
            if stage.l2_bound is None or not stage.l2_bound > 0:
                raise PipelineError(f"{where} turns per-example values into bounded ones but "
                                    "declares no positive l2_bound")
            if clip_index is not None:
                raise PipelineError(f"{where} is a second clip; a pipeline has exactly one")
            clip_index, sensitivity = i, float(stage.l2_bound)
        elif stage.kind_in in (Kind.BOUNDED, Kind.AGGREGATE) and not stage.is_release:
            sensitivity *= _check_bounded_transform(where, stage)
        if stage.is_release:
            if stage.kind_in != Kind.AGGREGATE or stage.kind_out != Kind.RELEASED:
                raise PipelineError(f"{where} is a release but does not map aggregate to "
                                    "released")
            releases.append(i)
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


# ----------------------------------------------------------------------------- phase 1: bind

@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated pipeline bound to one run: declarations, step functions, run facts."""

    stages: tuple          # the declarations, exactly as validated
    fns: tuple             # StageFns per stage, from make(info)
    validated: ValidatedPipeline
    info: StageInfo
    model: Any = None      # the flax model, when the caller gives it (book-keeping needs it)
    taps: Optional[tuple] = None  # its matmul layers (bookkeeping.discover_taps), if all params
    strategy: str = "materialized"  # per-example strategy: "materialized" or "bookkeeping"

    @property
    def num_per_example(self) -> int:
        """Stages run per example: up to the clip, plus BOUNDED stages after it."""
        clip = self.validated.clip_index
        return clip + 1 + sum(1 for s in self.stages[clip + 1:] if s.kind_in == Kind.BOUNDED)

    @property
    def sensitivity(self) -> float:
        return self.validated.sensitivity

    def facts(self) -> list:
        """Per stage: its name, the factory's options and the run-derived public facts."""
        return [dict(name=s.name, **s.options, **f.facts) for s, f in zip(self.stages,
                                                                            self.fns)]


def _check_fns(i: int, stage: Stage, fns, num_per_example: int) -> None:
    where = _describe(i, stage)
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
    if fns.finish_sum is not None and i >= num_per_example:
        raise PipelineError(f"{where}: finish_sum is for per-example stages (the clip and before)")


def bind(stages: Sequence[Stage], info: StageInfo, model=None) -> Plan:
    """Validates the declarations, makes every stage's step functions with the run facts, and
    picks the per-example strategy from the stage chain: book-keeping where it reproduces the
    chain exactly (bookkeeping.applies) and the model is made of matmul layers, else the
    materialized per-example gradients (vmap)."""
    validated = validate_pipeline(stages)
    fns = tuple(stage.make(info) for stage in validated.stages)
    plan = Plan(stages=validated.stages, fns=fns, validated=validated, info=info, model=model)
    for i, (stage, made) in enumerate(zip(plan.stages, fns)):
        _check_fns(i, stage, made, plan.num_per_example)
    taps = None if model is None else bookkeeping.discover_taps(
        model, info.param_shapes, info.example_shape)
    if bookkeeping.applies(plan.stages, plan.num_per_example, taps):
        plan = dataclasses.replace(plan, taps=taps, strategy="bookkeeping")
    return plan


# -------------------------------------------------------------------------- phase 2: account

def _ledger(pre_mechanisms, step_mechanisms, steps: int) -> list:
    """One-off releases, then ``steps`` copies of every per-step mechanism (composition
    commutes, so a step's mechanisms are grouped by kind; see accounting.Mechanism)."""
    return list(pre_mechanisms) + [dataclasses.replace(m, count=steps)
                                   for m in step_mechanisms if steps > 0]


def _stage_costs(plan: Plan) -> list:
    """(stage, facts, DpEvent per step) for every stage that declares a cost."""
    out = []
    for stage, fns in zip(plan.stages, plan.fns):
        if stage.cost is None:
            continue
        event = stage.cost(plan.info)
        if not isinstance(event, dp_event.DpEvent):
            raise PipelineError(f"stage '{stage.name}' declares a DP cost, but its cost "
                                f"returned {event!r} instead of a dp_accounting DpEvent")
        out.append((stage, dict(stage.options, **fns.facts), event))
    return out


def step_mechanisms_of(plan: Plan, sampler) -> Callable[[float], list]:
    """sigma -> one step's ledger lines: the Gaussian release(s) of the clipped sum, then the
    per-step cost of every other mechanism a stage declares (e.g. GIP's index release)."""
    validated = plan.validated
    clip = validated.stages[validated.clip_index]
    releases = [validated.stages[i] for i in validated.release_indices]
    # Each release adds noise to every separately bounded part of the clipped value (GEP: 2):
    # k Gaussians of one batch with one sigma, each scaled to its own sensitivity, compose to
    # one Gaussian with multiplier sigma / sqrt(k).
    parts = len(releases) * clip.parts
    lipschitz = {s.name: s.lipschitz for s in validated.stages[validated.clip_index + 1:]
                 if s.lipschitz is not None and not s.is_release}
    clip_facts = dict(clip.options, **plan.fns[validated.clip_index].facts)
    others = _stage_costs(plan)

    def mechanisms(sigma: float) -> list:
        effective = sigma / math.sqrt(parts)
        gaussian = accounting.Mechanism(
            name="Gaussian release of the clipped per-example gradient sum",
            source=" + ".join([clip.name] + [r.name for r in releases]),
            schedule=accounting.EVERY_STEP, event=sampler.dp_event(effective), count=1,
            details=dict(noise_multiplier=sigma, parts=parts,
                         effective_noise_multiplier=effective, clip_stage=clip.name,
                         clip_l2_bound=clip.l2_bound, part_bounds=clip_facts.get("part_bounds"),
                         lipschitz_factors=lipschitz, l2_sensitivity=validated.sensitivity,
                         noise_stddev=sigma * validated.sensitivity))
        return [gaussian] + [accounting.Mechanism(
            name=facts.get("mechanism", f"private selection by {stage.name}"),
            source=stage.name, schedule=accounting.EVERY_STEP, event=event, count=1,
            details=facts) for stage, facts, event in others]

    return mechanisms


def _pre_mechanisms(stage: Optional[Stage], sigma: Optional[float], sampler) -> tuple:
    """The ledger line of a one-off release before training (DP-SNIP), if the pipeline has one."""
    if stage is None:
        return ()
    release = stage.one_off_release
    return (accounting.Mechanism(
        name=f"Gaussian release of {release.released}", source=stage.name,
        schedule=accounting.ONCE, event=sampler.dp_event(sigma), count=1,
        details=dict(noise_multiplier=sigma, l2_sensitivity=release.l2_bound,
                     noise_stddev=sigma * release.l2_bound,
                     epsilon_fraction=release.epsilon_fraction)),)


@dataclasses.dataclass(frozen=True)
class Accounting:
    """The run's noise and ledger; the same object answers every epsilon question."""

    noise_multiplier: float
    init_noise_multiplier: Optional[float]   # the one-off release's (DP-SNIP), if any
    pre_mechanisms: tuple
    step_mechanisms: Callable[[float], list]
    budget: accounting.Budget
    total_steps: int

    def ledger(self, steps: Optional[int] = None) -> list:
        """The run's privacy ledger after ``steps`` steps: every mechanism with its count."""
        steps = self.total_steps if steps is None else steps
        return _ledger(self.pre_mechanisms, self.step_mechanisms(self.noise_multiplier), steps)

    def run_event(self, steps: Optional[int] = None) -> dp_event.DpEvent:
        return accounting.ledger_event(self.ledger(steps))

    def event_at(self, sigma: float) -> dp_event.DpEvent:
        """The whole run's DpEvent had the training noise multiplier been ``sigma``: the
        function calibration solves (the one-off releases keep their own noise)."""
        return accounting.ledger_event(_ledger(self.pre_mechanisms, self.step_mechanisms(sigma),
                                               self.total_steps))

    def epsilon_after(self, steps: int) -> float:
        if steps == 0 and not self.pre_mechanisms:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return accounting.epsilon_of(self.run_event(steps), self.budget)

    def steps_within_budget(self) -> int:
        """The largest number of steps (<= total_steps) whose epsilon is <= the target: with a
        calibrated sigma, total_steps; with a given one the run stops there (-1: the one-off
        release alone exceeds the budget)."""
        if self.epsilon_after(self.total_steps) <= self.budget.epsilon:
            return self.total_steps
        if self.epsilon_after(0) > self.budget.epsilon:
            return -1
        low, high = 0, self.total_steps  # epsilon_after(low) <= target < epsilon_after(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.epsilon_after(mid) <= self.budget.epsilon else (
                low, mid)
        return low


def account(plan: Plan, sampler, budget: accounting.Budget, total_steps: int,
            noise_multiplier: Optional[float] = None) -> Accounting:
    """The ledger and the noise. ``noise_multiplier=None`` calibrates sigma to the budget: a
    one-off release (DP-SNIP) first gets the noise that alone spends its share of epsilon, then
    the training sigma is calibrated on the composition of everything. A given sigma is used as
    is (tests, non-private baselines); its epsilon may then exceed the target."""
    step_mechanisms = step_mechanisms_of(plan, sampler)
    one_off = next((s for s in plan.stages if s.one_off_release is not None), None)
    if noise_multiplier is not None:
        sigma = float(noise_multiplier)
        if sigma < 0 or (sigma > 0 and math.isinf(plan.sensitivity)):
            raise ValueError(f"noise multiplier {sigma} with sensitivity {plan.sensitivity} "
                             "gives no valid noise scale")
        init_sigma = sigma if one_off is not None else None
        return Accounting(sigma, init_sigma, _pre_mechanisms(one_off, init_sigma, sampler),
                          step_mechanisms, budget, total_steps)
    if math.isinf(plan.sensitivity):
        raise PipelineError("the clip bound is infinite, so no noise can make the release "
                            "private; set clip.global_l2.l2_bound to a finite value")
    budget.validate(sampler.dataset_size)
    init_sigma = None
    if one_off is not None:
        share = one_off.one_off_release.epsilon_fraction
        init_sigma = accounting.calibrate_noise_multiplier(
            sampler.dp_event, dataclasses.replace(budget, epsilon=share * budget.epsilon))
    draft = Accounting(math.nan, init_sigma, _pre_mechanisms(one_off, init_sigma, sampler),
                       step_mechanisms, budget, total_steps)
    sigma = accounting.calibrate_noise_multiplier(draft.event_at, budget)
    return dataclasses.replace(draft, noise_multiplier=sigma)


# ---------------------------------------------------------------------------- phase 3: lower

def masked_sum(per_example: Callable, batch: dict) -> tuple:
    """Sum over the batch's real examples of ``per_example(example, position) -> (value, aux)``.

    The batch is [micro_steps, micro_batch, ...]; micro-batches run under lax.scan (memory stays
    bounded), examples under vmap with the mesh's data axis; a micro-batch with no real example
    is skipped (it contributes exactly zero). The one clipped-sum function of the compiler:
    the step and the one-off release both use it.
    """
    examples = {k: batch[k] for k in EXAMPLE_KEYS}
    micro_steps, micro_batch_size = batch["mask"].shape
    one = {k: jax.ShapeDtypeStruct(v.shape[2:], v.dtype) for k, v in examples.items()}
    shapes = jax.eval_shape(per_example, one, jax.ShapeDtypeStruct((), jnp.int32))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    positions = jnp.arange(micro_steps * micro_batch_size, dtype=jnp.int32).reshape(
        micro_steps, micro_batch_size)

    def compute(micro):
        example, mask, position = micro
        out = jax.vmap(per_example, spmd_axis_name=sharding.DATA_AXIS)(example, position)

        def masked(v):
            m = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
            kept = jnp.where(m, v, jnp.zeros_like(v))  # a padding slot adds exactly 0, even NaN
            if not jnp.issubdtype(v.dtype, jnp.floating):
                return jnp.sum(kept, axis=0)
            # The sum over examples as a product with ones: XLA's CPU reduce over the leading
            # axis falls off a cliff once a row outgrows the cache (32 x 39690, ScatterNet's
            # linear layer: 10 ms against 0.4 ms as a dot; WORKSPACE "Speed").
            return jnp.tensordot(jnp.ones(v.shape[0], v.dtype), kept, axes=1)

        return jax.tree.map(masked, out)

    def body(total, micro):
        part = jax.lax.cond(jnp.any(micro[1]), compute, lambda _: zeros, micro)
        return jax.tree.map(jnp.add, total, part), None

    total, _ = jax.lax.scan(body, zeros, (examples, batch["mask"], positions))
    return total


def _post_release(plan: Plan, value, states, ctx, upto: int):
    """Public post-processing declared by stages before position ``upto``, in pipeline order:
    their public masks (Mask.RELEASED) and after_release hooks (GEP's reconstruction)."""
    for j in range(upto):
        if Mask.RELEASED in plan.stages[j].public_mask:
            value = apply_mask(value, states[j]["mask"])
        if plan.fns[j].after_release is not None:
            value = plan.fns[j].after_release(value, states[j], ctx)
    return value


class Lowered(NamedTuple):
    step: Callable        # (TrainState, batch) -> (TrainState, metrics), not yet jitted
    init_state: Callable  # (params, key, release_batch=None) -> TrainState
    # (TrainState, batch) -> the noise-free clipped sum at the step's begin-step state: what the
    # release's sensitivity bounds (for tests and audits; never released as is).
    clipped_sum: Callable


def lower(plan: Plan, acct: Accounting, *, loss_fn: Callable, expected_batch_size: float,
          ema_decay: float = 0.0, fidelity_diagnostics: bool = False) -> Lowered:
    """The step function and the initial state of a bound, accounted pipeline."""
    step = _make_step(plan, acct, loss_fn, float(expected_batch_size), ema_decay,
                      fidelity_diagnostics)
    begin_step, clipped_sum = _begin_step_fn(plan, loss_fn), _clipped_sum_fn(plan, loss_fn)

    def clipped_sum_at(state: TrainState, batch: dict):
        key = _step_key(state)
        return clipped_sum(state.params, begin_step(state, key), state.step, key, batch)[0]

    return Lowered(step=step, init_state=_make_init_state(plan, acct, loss_fn, ema_decay),
                   clipped_sum=clipped_sum_at)


def _step_key(state: TrainState) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(state.key, _STEP_DOMAIN), state.step)


def _make_step(plan, acct, loss_fn, expected_batch_size, ema_decay, fidelity_diagnostics):
    begin_step = _begin_step_fn(plan, loss_fn)
    clipped_sum = _clipped_sum_fn(plan, loss_fn)
    batch_stages = _batch_stages_fn(plan, acct, expected_batch_size)

    def step_fn(state: TrainState, batch: dict):
        key = _step_key(state)
        states = begin_step(state, key)                     # public inputs only, once per step
        clipped, aux = clipped_sum(state.params, states, state.step, key, batch)
        updates, states, released, ctx = batch_stages(clipped, state, states, key,
                                                      batch.get(STAGE_INPUTS, {}))
        for j, stage in enumerate(plan.stages):             # masked coordinates do not move
            if Mask.UPDATES in stage.public_mask:
                updates = apply_mask(updates, states[j]["mask"])
        params = optax.apply_updates(state.params, updates)
        ema = state.ema_params if ema_decay == 0 else jax.tree.map(
            lambda e, p: ema_decay * e + (1 - ema_decay) * p, state.ema_params, params)
        metrics = _diagnostics(aux, batch["mask"], updates)
        if fidelity_diagnostics:
            metrics.update(_fidelity(plan, clipped, released, states, ctx, expected_batch_size))
        return TrainState(params, tuple(states), ema, state.step + 1, state.key), metrics

    return step_fn


def _begin_step_fn(plan: Plan, loss_fn: Callable):
    """Per-example stages' begin_step, once per step, from public inputs only (params, public
    data, the step key): GEP's basis, DP-SSGD's drop mask, RS's epoch mask."""
    # Its key: position `padded` in the stage's per-example key space, which no example uses.
    padded = plan.info.padded_batch_size

    def begin_step(state: TrainState, step_key) -> list:
        states = list(state.stage_states)
        for i in range(plan.num_per_example):
            fn = plan.fns[i].begin_step
            if fn is not None:
                ctx = StepContext(params=state.params, step=state.step, loss_fn=loss_fn,
                                  key=jax.random.fold_in(jax.random.fold_in(step_key, i), padded))
                states[i] = fn(states[i], ctx)
        return states

    return begin_step


def _bookkeeping_sum_fn(plan: Plan, loss_fn: Callable):
    """The book-keeping strategy's clipped sum (bookkeeping.clipped_sum per micro-batch, empty
    micro-batches skipped). Stages between the gradient and the clip enter as the product of
    their public masks when all are masks, else as a transform of the per-example gradients
    (each stage's own apply, vmapped, with the same per-example keys as the materialized
    strategy)."""
    clip_index = plan.validated.clip_index
    middle = range(1, clip_index)
    use_masks = bookkeeping.masks_only(plan.stages, clip_index)
    elementwise = all(plan.stages[i].elementwise for i in middle)

    def clipped_sum(params, states, step, step_key, batch):
        masks = None
        for i in middle if use_masks else ():
            masks = states[i]["mask"] if masks is None else apply_mask(masks, states[i]["mask"])

        def transform_at(positions):
            def one(value, position):
                for i in middle:
                    ctx = StepContext(params=params, step=step, loss_fn=loss_fn, key=jax.random.
                                      fold_in(jax.random.fold_in(step_key, i), position))
                    value = plan.fns[i].apply(value, states[i], ctx)
                return value
            return lambda tree: jax.vmap(one)(tree, positions)

        def micro(images, labels, mask, positions):
            transform = None if use_masks or clip_index == 1 else transform_at(positions)
            return bookkeeping.clipped_sum(plan.model, plan.taps, params, images, labels, mask,
                                           plan.stages[clip_index].l2_bound, masks, transform,
                                           elementwise)

        micro_steps, size = batch["mask"].shape
        positions = jnp.arange(micro_steps * size, dtype=jnp.int32).reshape(micro_steps, size)
        xs = (batch["image"], batch["label"], batch["mask"], positions)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             jax.eval_shape(micro, *(x[0] for x in xs)))

        def body(total, x):
            part = jax.lax.cond(jnp.any(x[2]), lambda x: micro(*x), lambda _: zeros, x)
            return jax.tree.map(jnp.add, total, part), None

        return jax.lax.scan(body, zeros, xs)[0]

    return clipped_sum


def _clipped_sum_fn(plan: Plan, loss_fn: Callable):
    """(params, states, step, step_key, batch) -> (sum of clipped per-example values,
    {"loss": sum of finite losses, "nonfinite": count}) over the batch's real examples."""
    if plan.strategy == "bookkeeping":
        return _bookkeeping_sum_fn(plan, loss_fn)
    clip_index = plan.validated.clip_index

    def clipped_sum(params, states, step, step_key, batch):
        def per_example(example, position):
            value, aux = example, {}
            nonfinite = jnp.zeros((), jnp.float32)
            for i in range(plan.num_per_example):
                ctx = StepContext(params=params, step=step, loss_fn=loss_fn, key=jax.random.
                                  fold_in(jax.random.fold_in(step_key, i), position))
                if plan.stages[i].kind_in == Kind.EXAMPLE:
                    value, aux = plan.fns[i].apply(value, states[i], ctx)
                else:
                    value = plan.fns[i].apply(value, states[i], ctx)
                if i == clip_index:
                    # A non-finite input leaves the clip non-finite (NaN norm, or inf * 0): such
                    # a value would turn the sum into NaN. Zero has norm 0, so replacing it keeps
                    # the clip's bound (and the sensitivity) intact. Checked on the clip's
                    # OUTPUT: one fused pass (before the clip it cost 20 ms of a 45 ms step).
                    # An example whose loss is non-finite counts too (a stage such as Nasr's
                    # discretization can map a NaN gradient to a finite value), and is zeroed.
                    value, nonfinite = zero_if_nonfinite(value, jnp.isfinite(aux["loss"]))
            # The loss diagnostic skips examples whose gradient was zeroed as non-finite.
            loss = jnp.where(nonfinite > 0, 0.0, aux["loss"])
            return value, {"loss": loss, "nonfinite": nonfinite}

        total, aux = masked_sum(per_example, batch)
        for i in range(plan.num_per_example):  # public linear maps of the sum (GEP's residual)
            if plan.fns[i].finish_sum is not None:
                total = plan.fns[i].finish_sum(total, states[i])
        return total, aux

    return clipped_sum


def _batch_stages_fn(plan: Plan, acct: Accounting, expected_batch_size: float):
    """The stages after the per-example ones, in order: aggregate stages, the release (then
    the public post-processing of earlier stages), released stages, the division by the
    EXPECTED batch size, the optimizer. Returns (updates, states, released, release ctx)."""
    first = plan.num_per_example

    def batch_stages(value, state: TrainState, states: list, step_key, host_inputs):
        released = release_ctx = None
        for i in range(first, len(plan.stages)):
            stage = plan.stages[i]
            if stage.kind_out == Kind.UPDATES and released is None:
                # Divide by the EXPECTED batch size: the realized one is private.
                value = jax.tree.map(lambda v: v / expected_batch_size, value)
                released = value
            ctx = StepContext(params=state.params, step=state.step,
                              key=jax.random.fold_in(step_key, i),
                              noise_multiplier=acct.noise_multiplier,
                              sensitivity=plan.sensitivity, host_inputs=host_inputs.get(str(i)))
            value, states[i] = plan.fns[i].apply(value, state.stage_states[i], ctx)
            if stage.is_release:
                release_ctx = ctx
                value = _post_release(plan, value, states, ctx, upto=i)
        return value, states, released, release_ctx

    return batch_stages


def _diagnostics(aux: dict, mask, updates) -> dict:
    """Non-private diagnostics computed from the private batch; never fed back into training."""
    count = jnp.sum(mask)
    nonfinite = aux["nonfinite"]
    return {
        "train_loss": aux["loss"] / jnp.maximum(count - nonfinite, 1),
        # True when every real example of the batch had a non-finite gradient.
        "all_nonfinite": (count > 0) & (nonfinite >= count),
        "update_norm": optax.tree.norm(updates),
        "nonfinite_examples": nonfinite,  # per-example gradients zeroed before the clip
    }


def _fidelity(plan: Plan, clean, released, states, ctx, expected_batch_size: float) -> dict:
    """Cosine between the released update and the clean mean of clipped per-example gradients,
    and the norm of their difference relative to the clean one (NON-PRIVATE benchmark output:
    the clean sum never leaves this function except through them). The clean sum is mapped to
    parameter space by the per-example stages' public post-processing (masks, GEP's
    reconstruction); selection and noise are excluded."""
    clean = _post_release(plan, clean, states, ctx, upto=plan.num_per_example)
    clean = jax.tree.map(lambda v: v / expected_batch_size, clean)
    flat_clean = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(clean)])
    flat_released = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(released)])
    clean_norm = jnp.linalg.norm(flat_clean)
    tiny = jnp.finfo(flat_clean.dtype).tiny
    return {
        "fidelity_cosine": jnp.dot(flat_clean, flat_released) / jnp.maximum(
            clean_norm * jnp.linalg.norm(flat_released), tiny),
        "noise_to_signal": jnp.linalg.norm(flat_released - flat_clean) / jnp.maximum(
            clean_norm, tiny),
    }


def _one_off_release(plan: Plan, acct: Accounting, loss_fn, i: int, params, key, batch):
    """Stage i's one-off release: each example's declared value (release_value of its
    gradient, e.g. DP-SNIP's connection scores) clipped, the masked sum, Gaussian noise."""
    release, fns = plan.stages[i].one_off_release, plan.fns[i]

    def per_example(example, position):
        del position
        grads = jax.grad(loss_fn)(params, example["image"], example["label"])
        value = clip_to_l2(fns.release_value(params, grads), release.l2_bound)
        return zero_if_nonfinite(value)[0]  # a non-finite value is zeroed, as in the step

    total = masked_sum(per_example, batch)
    return add_gaussian_noise(total, key, acct.init_noise_multiplier * release.l2_bound)


def _make_init_state(plan: Plan, acct: Accounting, loss_fn: Callable, ema_decay: float):
    def init_state(params, key, release_batch=None) -> TrainState:
        init_root = jax.random.fold_in(key, _INIT_DOMAIN)
        states = []
        for i, (stage, fns) in enumerate(zip(plan.stages, plan.fns)):
            stage_key = jax.random.fold_in(init_root, i)
            if stage.one_off_release is None:
                states.append(fns.init(params, stage_key))
                continue
            if release_batch is None:
                raise ValueError(f"stage '{stage.name}' releases private data before "
                                 "training: pass init_state(..., release_batch=...) with a "
                                 "batch drawn by the run's sampler")
            release_key = jax.random.fold_in(jax.random.fold_in(key, _RELEASE_DOMAIN), i)
            released = _one_off_release(plan, acct, loss_fn, i, params, release_key,
                                        release_batch)
            states.append(fns.init_from_release(params, released, stage_key))
        for stage, state in zip(plan.stages, states):
            if Mask.PARAMS in stage.public_mask:  # e.g. pre-pruning zeroes its weights once
                params = apply_mask(params, state["mask"])
        return TrainState(params=params, stage_states=tuple(states),
                          ema_params=params if ema_decay > 0 else (),
                          step=jnp.zeros((), jnp.int32), key=key)

    return init_state


# ------------------------------------------------------------------------ the compiled result

@dataclasses.dataclass
class CompiledPipeline:
    """What the train loop needs: the jitted step, the initial state, and the run's accounting
    (``accounting``: ledger, epsilon, budget stop)."""

    plan: Plan
    accounting: Accounting
    sampler: Any
    micro_batch_size: int
    micro_steps: int
    step: Callable                     # jitted (TrainState, batch) -> (TrainState, metrics)
    init_state: Callable               # (params, key, release_batch=None) -> TrainState
    mesh: Mesh
    state_shapes: Any                  # shape-only TrainState (restore targets)
    lowered: Lowered                   # the unjitted functions (clipped_sum for tests/audits)
    host_seed: int = 0                 # seeds the stages' public host randomness (GIP)

    @property
    def stages(self) -> tuple:
        return self.plan.stages

    @property
    def sensitivity(self) -> float:
        return self.plan.sensitivity

    @property
    def noise_multiplier(self) -> float:
        return self.accounting.noise_multiplier

    @property
    def init_noise_multiplier(self) -> Optional[float]:
        return self.accounting.init_noise_multiplier

    @property
    def total_steps(self) -> int:
        return self.accounting.total_steps

    @property
    def budget(self) -> accounting.Budget:
        return self.accounting.budget

    @property
    def needs_release_batch(self) -> bool:
        return any(s.one_off_release is not None for s in self.plan.stages)

    def ledger(self, steps: Optional[int] = None) -> list:
        return self.accounting.ledger(steps)

    def run_event(self, steps: Optional[int] = None) -> dp_event.DpEvent:
        return self.accounting.run_event(steps)

    def epsilon_after(self, steps: int) -> float:
        return self.accounting.epsilon_after(steps)

    def steps_within_budget(self) -> int:
        return self.accounting.steps_within_budget()

    def stage_inputs(self, step: int, stream: int = 0) -> dict:
        """The public randomness stages draw on the host for ``step`` (GIP's exact Mallows
        draws), keyed by stage position; a function of (host_seed, stream, stage, step) only,
        so a resumed run redraws exactly what it would have drawn."""
        return {str(i): f.host_inputs(int(step), np.random.default_rng(
                    [self.host_seed, int(stream), i, int(step)]))
                for i, f in enumerate(self.plan.fns) if f.host_inputs is not None}

    def host_batch(self, images, labels, mask, step: Optional[int], stream: int = 0) -> dict:
        """The step's whole host input: the sampled examples laid out in micro-batches
        [micro_steps, micro_batch, ...], plus the stages' public host randomness for ``step``
        when the pipeline has any (``step=None``: examples only, for the one-off release).
        The ONE host-batch function (train, audit, benchmark)."""
        shape = (self.micro_steps, self.micro_batch_size)
        batch = {"image": images.reshape(shape + images.shape[1:]),
                 "label": labels.reshape(shape), "mask": mask.reshape(shape)}
        inputs = {} if step is None else self.stage_inputs(step, stream)
        if inputs:
            batch[STAGE_INPUTS] = inputs
        return batch


def _check_sizes(total_steps, ema_decay, micro_batch_size, mesh, padded) -> int:
    """Returns the number of micro-batches; raises ValueError on sizes that cannot run."""
    if total_steps <= 0:
        raise ValueError(f"the run has {total_steps} steps; set train.epochs > 0")
    if not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"train.ema_decay must lie in [0, 1), got {ema_decay!r}")
    num_devices = mesh.devices.size
    if micro_batch_size <= 0 or micro_batch_size % num_devices:
        raise ValueError(f"train.micro_batch_size ({micro_batch_size}) must be a positive "
                         f"multiple of the device count ({num_devices})")
    if padded % micro_batch_size:
        raise ValueError(f"the sampler's padded batch size {padded} is not a multiple of the "
                         f"micro-batch size {micro_batch_size}")
    return padded // micro_batch_size


def _batch_shapes(plan: Plan, micro_steps: int, micro_batch_size: int, example_shape) -> dict:
    shape = (micro_steps, micro_batch_size)
    shapes = {"image": jax.ShapeDtypeStruct(shape + tuple(example_shape), jnp.float32),
              "label": jax.ShapeDtypeStruct(shape, jnp.int32),
              "mask": jax.ShapeDtypeStruct(shape, jnp.bool_)}
    probe = {str(i): f.host_inputs(0, np.random.default_rng(0))
             for i, f in enumerate(plan.fns) if f.host_inputs is not None}
    if probe:
        shapes[STAGE_INPUTS] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), probe)
    return shapes


def compile_pipeline(stages: Sequence[Stage], *, loss_fn: Callable, init_params: Callable,
                     example_shape: tuple, sampler, budget: accounting.Budget, total_steps: int,
                     steps_per_epoch: int, micro_batch_size: int, mesh: Optional[Mesh] = None,
                     ema_decay: float = 0.0, noise_multiplier: Optional[float] = None,
                     public_images=None, num_classes: int = 0,
                     linear_apply: Optional[Callable] = None,
                     fidelity_diagnostics: bool = False, host_seed: int = 0,
                     model=None) -> CompiledPipeline:
    """bind -> account -> lower, then shape checks (jax.eval_shape) and jit on the mesh.

    ``noise_multiplier=None`` calibrates sigma to the budget (the normal path); a given value
    is used as is. ``fidelity_diagnostics`` adds the non-private metrics ``fidelity_cosine``
    and ``noise_to_signal``. ``host_seed`` seeds the stages' public host randomness.
    ``model`` (the flax module behind ``loss_fn``, a models.cross_entropy_loss) lets the
    compiler pick book-keeping where it applies.
    """
    mesh = sharding.make_mesh() if mesh is None else mesh
    sharding.limit_lapack_threads()
    validate_pipeline(stages)  # rule errors before any size error
    micro_steps = _check_sizes(total_steps, ema_decay, micro_batch_size, mesh,
                               sampler.padded_batch_size)
    key_shapes = jax.eval_shape(lambda: jax.random.key(0))
    param_shapes = jax.eval_shape(init_params, key_shapes)
    info = StageInfo(total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                     expected_batch_size=sampler.expected_batch_size,
                     dataset_size=sampler.dataset_size, param_shapes=param_shapes,
                     target_epsilon=budget.epsilon if noise_multiplier is None else None,
                     public_images=public_images, num_classes=num_classes,
                     linear_apply=linear_apply, example_shape=tuple(example_shape),
                     padded_batch_size=sampler.padded_batch_size)
    plan = bind(stages, info, model)
    acct = account(plan, sampler, budget, total_steps, noise_multiplier)
    lowered = lower(plan, acct, loss_fn=loss_fn, expected_batch_size=sampler.expected_batch_size,
                    ema_decay=ema_decay, fidelity_diagnostics=fidelity_diagnostics)
    batch_shapes = _batch_shapes(plan, micro_steps, micro_batch_size, example_shape)
    examples_only = {k: v for k, v in batch_shapes.items() if k != STAGE_INPUTS}
    needs_release = any(s.one_off_release is not None for s in plan.stages)
    state_shapes = jax.eval_shape(lowered.init_state, param_shapes, key_shapes,
                                  examples_only if needs_release else None)
    # Shape and dtype errors surface here, before any device memory is allocated.
    jax.eval_shape(lowered.step, state_shapes, batch_shapes)
    replicated, batch_shard = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    batch_sharding = {k: replicated if k == STAGE_INPUTS else batch_shard for k in batch_shapes}
    jitted = jax.jit(lowered.step, in_shardings=(replicated, batch_sharding),
                     out_shardings=(replicated, replicated), donate_argnums=(0,))

    def init_state(params, key, release_batch=None):
        # Copy: the step donates its state, which must not invalidate the caller's arrays.
        state = jax.tree.map(lambda x: jnp.array(x, copy=True),
                             lowered.init_state(params, key, release_batch))
        return jax.device_put(state, replicated)

    return CompiledPipeline(plan=plan, accounting=acct, sampler=sampler,
                            micro_batch_size=micro_batch_size, micro_steps=micro_steps,
                            step=jitted, init_state=init_state, mesh=mesh,
                            state_shapes=state_shapes, lowered=lowered, host_seed=host_seed)
