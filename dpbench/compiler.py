"""The compiler: (pipeline, model, sampler, budget, mesh) -> one jitted, sharded, accounted step.

1. :func:`validate_pipeline` checks the chain of stage kinds and privacy rules and raises
   :class:`PipelineError` naming the offending stage and the broken rule.
2. It derives the sensitivity of the released sum from the clip bound and Lipschitz factors.
3. It builds the run's DpEvent from the sampler (the same object the data loader uses) and the
   mechanism stages, and calibrates the one noise multiplier to the target (epsilon, delta).
4. It lowers the step: step key = fold_in(run key, step); per-example stages under vmap inside a
   lax.scan over micro-batches (empty micro-batches skipped); masked sum; aggregate stages; the
   Gaussian release; post-processing; division by the EXPECTED batch size; optimizer; EMA.
5. It checks shapes with jax.eval_shape, then jits with shardings on the mesh and donated state.
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

from dpbench import accounting, sharding
from dpbench.stages.base import PRIVATE_KINDS, Kind, Stage, StageInfo, StepContext
from dpbench.stages.clip import clip_to_l2, zero_if_nonfinite
from dpbench.stages.noise import add_gaussian_noise


# Keys for stage initialization and for steps come from disjoint subtrees of the run key, so no
# step's noise key can coincide with a stage's initialization key.
_STEP_DOMAIN, _INIT_DOMAIN, _RELEASE_DOMAIN = 0, 1, 2
STAGE_INPUTS = sharding.STAGE_INPUTS  # the batch entry with the stages' host randomness


class PipelineError(ValueError):
    """A pipeline that breaks a privacy or typing rule; the message names the stage and rule."""


class TrainState(NamedTuple):
    params: Any
    stage_states: tuple
    ema_params: Any
    step: jax.Array   # int32 scalar: number of steps taken (empty batches count)
    key: jax.Array    # the run's base key; step keys are fold_in(key, step), never reused


@dataclasses.dataclass(frozen=True)
class ValidatedPipeline:
    stages: tuple
    clip_index: int
    release_indices: tuple
    sensitivity: float


def _describe(i: int, stage: Stage) -> str:
    return f"stage #{i} '{stage.name}'"


def validate_pipeline(stages: Sequence[Stage]) -> ValidatedPipeline:
    """Checks that private values reach the optimizer only through a declared, accounted release.

    Rules: the first stage consumes EXAMPLE; each stage consumes what the previous produced (the
    compiler itself sums BOUNDED into AGGREGATE, and divides by the expected batch size before
    the optimizer); exactly
    one clip (PER_EXAMPLE -> BOUNDED, declared l2_bound); BOUNDED/AGGREGATE transforms declare a
    Lipschitz factor; stages that read the aggregate without releasing it declare a DP cost; at
    least one Gaussian release; the last stage produces UPDATES.
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
    current = Kind.EXAMPLE
    clip_index = None
    releases = []
    sensitivity = None
    for i, stage in enumerate(stages):
        where = _describe(i, stage)
        wanted = stage.kind_in
        if current == Kind.BOUNDED and wanted == Kind.AGGREGATE:
            current = Kind.AGGREGATE  # the compiler's masked sum
        if wanted != current:
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
        if stage.kind_in == Kind.EXAMPLE and i != 0:
            raise PipelineError(f"{where}: only the first stage may consume raw examples")
        if stage.kind_in == Kind.PER_EXAMPLE and stage.kind_out == Kind.BOUNDED:
            if stage.l2_bound is None or not stage.l2_bound > 0:
                raise PipelineError(f"{where} turns per-example values into bounded ones but "
                                    "declares no positive l2_bound")
            if clip_index is not None:
                raise PipelineError(f"{where} is a second clip; a pipeline has exactly one")
            clip_index, sensitivity = i, float(stage.l2_bound)
        elif stage.kind_in in (Kind.BOUNDED, Kind.AGGREGATE) and not stage.is_release:
            if stage.kind_out != stage.kind_in:
                raise PipelineError(f"{where} maps {stage.kind_in.value} to "
                                    f"{stage.kind_out.value}; only a release may do that")
            if stage.lipschitz is None or not stage.lipschitz >= 0:
                raise PipelineError(
                    f"{where} transforms {stage.kind_in.value} values without declaring its L2 "
                    "Lipschitz factor, so the sensitivity of the release is unknown; declare "
                    "lipschitz= in its Stage")
            if stage.kind_in == Kind.AGGREGATE and stage.dp_event is None and \
                    stage.reads_private:
                raise PipelineError(
                    f"{where} reads the private aggregate before the release but declares no DP "
                    "cost (dp_event); data-dependent selection must be an accounted mechanism")
            sensitivity *= float(stage.lipschitz)
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
    return ValidatedPipeline(stages, clip_index, tuple(releases), sensitivity)


@dataclasses.dataclass
class CompiledPipeline:
    """What the train loop needs: the jitted step, initial state, and the run's accounting."""

    stages: tuple
    sensitivity: float
    noise_multiplier: float
    sampler: Any
    budget: accounting.Budget
    total_steps: int
    micro_batch_size: int
    micro_steps: int
    step: Callable                     # jitted (TrainState, batch) -> (TrainState, metrics)
    init_state: Callable               # (params, key) -> TrainState (placed on the mesh)
    step_mechanisms: Callable[[float], list]  # sigma -> one step's ledger lines (count 1)
    mesh: Mesh
    pre_mechanisms: tuple = ()         # one-off releases before training (DP-SNIP)
    init_noise_multiplier: Optional[float] = None
    needs_release_batch: bool = False  # init_state needs a batch of the sampler (DP-SNIP)
    state_shapes: Any = None           # shape-only TrainState (restore targets)
    host_seed: int = 0                 # seeds the stages' public host randomness (GIP)

    def ledger(self, steps: Optional[int] = None) -> list:
        """The run's privacy ledger after ``steps`` steps: every mechanism with its count."""
        steps = self.total_steps if steps is None else steps
        return _ledger(self.pre_mechanisms, self.step_mechanisms(self.noise_multiplier), steps)

    def run_event(self, steps: Optional[int] = None) -> dp_event.DpEvent:
        return accounting.ledger_event(self.ledger(steps))

    def steps_within_budget(self) -> int:
        """The largest number of steps (<= total_steps) whose epsilon is <= the target.

        With a calibrated sigma that is total_steps; with a given noise multiplier a run stops
        there instead of spending past its budget.
        """
        if self.epsilon_after(self.total_steps) <= self.budget.epsilon:
            return self.total_steps
        low, high = 0, self.total_steps  # epsilon_after(low) <= target < epsilon_after(high)
        if self.epsilon_after(0) > self.budget.epsilon:
            return -1  # the one-off release alone exceeds the budget
        while high - low > 1:
            mid = (low + high) // 2
            if self.epsilon_after(mid) <= self.budget.epsilon:
                low = mid
            else:
                high = mid
        return low

    def epsilon_after(self, steps: int) -> float:
        if steps == 0 and not self.pre_mechanisms:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return accounting.epsilon_of(self.run_event(steps), self.budget)

    def batch_layout(self, arrays: dict) -> dict:
        """Reshapes host arrays [padded, ...] to [micro_steps, micro_batch, ...]."""
        return {k: v.reshape((self.micro_steps, self.micro_batch_size) + v.shape[1:])
                for k, v in arrays.items()}

    def stage_inputs(self, step: int, stream: int = 0) -> dict:
        """The public randomness stages draw on the host for ``step`` (GIP's exact Mallows
        draws), keyed by stage position; a function of (host_seed, stream, stage, step) only,
        so a resumed run redraws exactly what it would have drawn."""
        return {str(i): s.host_inputs(int(step), np.random.default_rng(
                    [self.host_seed, int(stream), i, int(step)]))
                for i, s in enumerate(self.stages) if s.host_inputs is not None}

    def host_batch(self, arrays: dict, step: int, stream: int = 0) -> dict:
        """The step's whole host input: the sampled examples laid out in micro-batches, plus
        the stages' public host randomness for ``step`` when the pipeline has any."""
        batch = self.batch_layout(arrays)
        inputs = self.stage_inputs(step, stream)
        if inputs:
            batch[STAGE_INPUTS] = inputs
        return batch


def _ledger(pre_mechanisms, step_mechanisms, steps: int) -> list:
    """One-off releases, then ``steps`` copies of every per-step mechanism (composition
    commutes, so a step's mechanisms are grouped by kind; see accounting.Mechanism)."""
    return list(pre_mechanisms) + [dataclasses.replace(m, count=steps)
                                   for m in step_mechanisms if steps > 0]


def _step_mechanisms(validated: ValidatedPipeline, sampler, info: StageInfo):
    """sigma -> one step's ledger lines: the Gaussian release(s) of the clipped sum, then the
    per-step cost of every other mechanism a stage declares (e.g. GIP's index release)."""
    clip = validated.stages[validated.clip_index]
    releases = [validated.stages[i] for i in validated.release_indices]
    # Each release adds noise to every separately bounded part of the clipped value (GEP: 2):
    # k Gaussians of one batch with one sigma, each scaled to its own sensitivity, compose to
    # one Gaussian with multiplier sigma / sqrt(k).
    parts = len(releases) * clip.parts
    lipschitz = {s.name: s.lipschitz for s in validated.stages[validated.clip_index + 1:]
                 if s.lipschitz is not None and not s.is_release}
    others = [(s, s.dp_event(info)) for s in validated.stages if s.dp_event is not None]
    for stage, event in others:
        if not isinstance(event, dp_event.DpEvent):
            raise PipelineError(f"stage '{stage.name}' declares a DP cost, but its dp_event "
                                f"returned {event!r} instead of a dp_accounting DpEvent")

    def mechanisms(sigma: float) -> list:
        effective = sigma / math.sqrt(parts)
        gaussian = accounting.Mechanism(
            name="Gaussian release of the clipped per-example gradient sum",
            source=" + ".join([clip.name] + [r.name for r in releases]),
            schedule=accounting.EVERY_STEP, event=sampler.dp_event(effective), count=1,
            details=dict(noise_multiplier=sigma, parts=parts, effective_noise_multiplier=effective,
                         clip_stage=clip.name, clip_l2_bound=clip.l2_bound,
                         part_bounds=clip.options.get("part_bounds"),
                         lipschitz_factors=lipschitz, l2_sensitivity=validated.sensitivity,
                         noise_stddev=sigma * validated.sensitivity))
        return [gaussian] + [accounting.Mechanism(
            name=stage.options.get("mechanism", f"private selection by {stage.name}"),
            source=stage.name,
            schedule=accounting.EVERY_STEP, event=event, count=1, details=dict(stage.options))
            for stage, event in others]

    return mechanisms


def _pre_mechanisms(stage: Optional[Stage], sigma: Optional[float], sampler) -> tuple:
    """The ledger line of a one-off release before training (DP-SNIP), if the pipeline has one."""
    if stage is None:
        return ()
    release = stage.init_release
    return (accounting.Mechanism(
        name=f"Gaussian release of {release.released}", source=stage.name,
        schedule=accounting.ONCE, event=sampler.dp_event(sigma), count=1,
        details=dict(noise_multiplier=sigma, l2_sensitivity=release.l2_bound,
                     noise_stddev=sigma * release.l2_bound,
                     epsilon_fraction=release.epsilon_fraction)),)


def compile_pipeline(stages: Sequence[Stage], *, loss_fn: Callable, init_params: Callable,
                     example_shape: tuple, sampler, budget: accounting.Budget, total_steps: int,
                     steps_per_epoch: int, micro_batch_size: int, mesh: Optional[Mesh] = None,
                     ema_decay: float = 0.0, noise_multiplier: Optional[float] = None,
                     public_images=None, num_classes: int = 0,
                     linear_apply: Optional[Callable] = None,
                     fidelity_diagnostics: bool = False, host_seed: int = 0) -> CompiledPipeline:
    """Validates, accounts and lowers a pipeline (see the module docstring).

    ``noise_multiplier=None`` calibrates sigma to the budget (the normal path). A given value is
    used as is (for tests and non-private baselines); the reported epsilon is then the
    accountant's for that sigma, which may exceed the target.
    ``fidelity_diagnostics`` adds the non-private metrics ``fidelity_cosine`` and
    ``noise_to_signal`` (released update vs the clean mean of clipped gradients) to each step.
    ``host_seed`` seeds the public randomness stages draw on the host (``Stage.host_inputs``).
    """
    mesh = sharding.make_mesh() if mesh is None else mesh
    validated = validate_pipeline(stages)
    if total_steps <= 0:
        raise ValueError(f"the run has {total_steps} steps; set train.epochs > 0")
    if not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"train.ema_decay must lie in [0, 1), got {ema_decay!r}")
    num_devices = mesh.devices.size
    if micro_batch_size <= 0 or micro_batch_size % num_devices:
        raise ValueError(f"train.micro_batch_size ({micro_batch_size}) must be a positive "
                         f"multiple of the device count ({num_devices})")
    padded = sampler.padded_batch_size
    if padded % micro_batch_size:
        raise ValueError(f"the sampler's padded batch size {padded} is not a multiple of the "
                         f"micro-batch size {micro_batch_size}")
    micro_steps = padded // micro_batch_size

    key_shapes = jax.eval_shape(lambda: jax.random.key(0))
    param_shapes = jax.eval_shape(init_params, key_shapes)
    info = StageInfo(total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                     expected_batch_size=sampler.expected_batch_size,
                     dataset_size=sampler.dataset_size, param_shapes=param_shapes,
                     target_epsilon=budget.epsilon if noise_multiplier is None else None,
                     public_images=public_images, num_classes=num_classes,
                     linear_apply=linear_apply, example_shape=tuple(example_shape))
    built = tuple(s.build(s, info) if s.build is not None else s for s in validated.stages)
    # The rules again on what will actually run: a build may not change a declaration unseen.
    validated = validate_pipeline(built)
    init_releases = [(i, s) for i, s in enumerate(built) if s.init_release is not None]
    if len(init_releases) > 1:
        raise PipelineError(f"stage #{init_releases[1][0]} '{init_releases[1][1].name}': only "
                            "one stage may release private data before training")
    step_mechanisms = _step_mechanisms(validated, sampler, info)
    init_release = init_releases[0][1] if init_releases else None
    if noise_multiplier is None:
        if math.isinf(validated.sensitivity):
            raise PipelineError("the clip bound is infinite, so no noise can make the release "
                                "private; set clip.global_l2.l2_bound to a finite value")
        budget.validate(sampler.dataset_size)
        # A one-off release (DP-SNIP) gets the noise that alone spends its share of epsilon;
        # the training sigma is then calibrated on the composition of everything.
        init_sigma = None
        if init_release is not None:
            share = init_release.init_release.epsilon_fraction
            init_sigma = accounting.calibrate_noise_multiplier(
                sampler.dp_event, dataclasses.replace(budget, epsilon=share * budget.epsilon))
        pre_mechanisms = _pre_mechanisms(init_release, init_sigma, sampler)
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: accounting.ledger_event(_ledger(pre_mechanisms, step_mechanisms(s),
                                                      total_steps)), budget)
    else:
        sigma = float(noise_multiplier)
        if sigma < 0 or (sigma > 0 and math.isinf(validated.sensitivity)):
            raise ValueError(f"noise multiplier {sigma} with sensitivity "
                             f"{validated.sensitivity} gives no valid noise scale")
        init_sigma = sigma if init_release is not None else None
        pre_mechanisms = _pre_mechanisms(init_release, init_sigma, sampler)

    n_per_example = validated.clip_index + 1 + sum(
        1 for s in built[validated.clip_index + 1:] if s.kind_in == Kind.BOUNDED)
    per_example_stages = built[:n_per_example]
    batch_stages = built[n_per_example:]
    expected_batch_size = float(sampler.expected_batch_size)
    sensitivity = validated.sensitivity

    def per_example_fn(params, stage_states, step, step_key, example, position):
        value, aux = example, {}
        nonfinite = jnp.zeros((), jnp.float32)
        for i, stage in enumerate(per_example_stages):
            ctx = StepContext(params=params, step=step,
                              key=jax.random.fold_in(jax.random.fold_in(step_key, i), position),
                              loss_fn=loss_fn)
            if i == validated.clip_index:
                # A non-finite gradient would turn the clipped sum into NaN; zero has norm 0,
                # so replacing it keeps the clip's bound (and the sensitivity) intact.
                value, nonfinite = zero_if_nonfinite(value)
            if stage.kind_in == Kind.EXAMPLE:
                value, aux = stage.apply(value, stage_states[i], ctx)
            else:
                value = stage.apply(value, stage_states[i], ctx)
        return value, dict(aux, nonfinite=nonfinite)

    def masked_sum(params, stage_states, step, step_key, batch):
        example_shapes = {k: jax.ShapeDtypeStruct(v.shape[2:], v.dtype)
                          for k, v in batch.items() if k not in ("mask", STAGE_INPUTS)}
        value_shapes = jax.eval_shape(per_example_fn, params, stage_states, step, step_key,
                                      example_shapes, jnp.zeros((), jnp.int32))[0]
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), value_shapes)
        positions = jnp.arange(padded, dtype=jnp.int32).reshape(micro_steps, micro_batch_size)
        examples = {k: v for k, v in batch.items() if k not in ("mask", STAGE_INPUTS)}

        def compute(micro):
            example, mask, position = micro
            values, aux = jax.vmap(per_example_fn, in_axes=(None, None, None, None, 0, 0),
                                   spmd_axis_name=sharding.DATA_AXIS)(
                params, stage_states, step, step_key, example, position)

            def masked(v):
                m = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
                return jnp.sum(jnp.where(m, v, jnp.zeros_like(v)), axis=0)

            # The loss diagnostic skips examples whose gradient was zeroed as non-finite.
            loss = jnp.where(aux["nonfinite"] > 0, 0.0, aux["loss"])
            return jax.tree.map(masked, values), (masked(loss), masked(aux["nonfinite"]))

        no_diagnostics = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

        def body(carry, micro):
            total, diagnostics = carry
            # A micro-batch with no real example contributes exactly zero: skip its compute.
            part, part_diagnostics = jax.lax.cond(
                jnp.any(micro[1]), compute, lambda _: (zeros, no_diagnostics), micro)
            return (jax.tree.map(jnp.add, total, part),
                    jax.tree.map(jnp.add, diagnostics, part_diagnostics)), None

        (total, (loss_sum, nonfinite)), _ = jax.lax.scan(
            body, (zeros, no_diagnostics), (examples, batch["mask"], positions))
        return total, loss_sum, nonfinite

    def step_fn(state: TrainState, batch: dict):
        step_key = jax.random.fold_in(jax.random.fold_in(state.key, _STEP_DOMAIN), state.step)
        states = list(state.stage_states)
        for i, stage in enumerate(per_example_stages):
            if stage.begin_step is not None:
                # Once per step, from public inputs only (params, public data, the step key).
                ctx = StepContext(params=state.params, step=state.step,
                                  key=jax.random.fold_in(jax.random.fold_in(step_key, i), padded),
                                  loss_fn=loss_fn)
                states[i] = stage.begin_step(states[i], ctx)
        value, loss_sum, nonfinite = masked_sum(state.params, tuple(states), state.step,
                                                step_key, batch)
        new_states = states
        host_inputs = batch.get(STAGE_INPUTS, {})
        clean = value  # the noise-free clipped sum: only for the opt-in fidelity diagnostics
        released = release_ctx = None
        normalized = False
        for offset, stage in enumerate(batch_stages):
            i = n_per_example + offset
            if stage.kind_out == Kind.UPDATES and not normalized:
                # Divide by the EXPECTED batch size: the realized one is private.
                value = jax.tree.map(lambda v: v / expected_batch_size, value)
                normalized = True
                released = value
            ctx = StepContext(params=state.params, step=state.step,
                              key=jax.random.fold_in(step_key, i),
                              noise_multiplier=sigma, sensitivity=sensitivity,
                              host_inputs=host_inputs.get(str(i)))
            value, new_states[i] = stage.apply(value, state.stage_states[i], ctx)
            if stage.is_release:
                release_ctx = ctx
                # Public post-processing declared by earlier stages (their state is public).
                for j, earlier in enumerate(built[:i]):
                    if earlier.after_release is not None:
                        value = earlier.after_release(value, new_states[j], ctx)
        for j, stage in enumerate(built):
            if stage.after_update is not None:
                # Public post-processing of the optimizer's output (DP-SSGD freezes the
                # coordinates it dropped this step, momentum included).
                value = stage.after_update(value, new_states[j], release_ctx)
        params = optax.apply_updates(state.params, value)
        if ema_decay > 0:
            ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p,
                               state.ema_params, params)
        else:
            ema = state.ema_params
        count = jnp.sum(batch["mask"])
        metrics = {
            # Diagnostics computed from the private batch; never fed back into training.
            "train_loss": loss_sum / jnp.maximum(count - nonfinite, 1),
            # True when every real example of the batch had a non-finite gradient.
            "all_nonfinite": (count > 0) & (nonfinite >= count),
            "update_norm": optax.tree.norm(value),
            "nonfinite_examples": nonfinite,  # per-example gradients zeroed before the clip
        }
        if fidelity_diagnostics:
            metrics.update(_fidelity(clean, released, new_states, release_ctx))
        return TrainState(params, tuple(new_states), ema, state.step + 1, state.key), metrics

    def _fidelity(clean, released, stage_states, ctx):
        """Cosine between the released update and the clean mean of clipped per-example
        gradients, and the norm of their difference relative to the clean one (NON-PRIVATE
        benchmark output: the clean sum never leaves this function except through them)."""
        for j, stage in enumerate(per_example_stages):
            if stage.after_release is not None:  # to parameter space (GEP's reconstruction)
                clean = stage.after_release(clean, stage_states[j], ctx)
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

    def release_fn(params, key, batch, init_release):
        """The one-off release: each example's declared value (init_release.per_example of its
        gradient, e.g. DP-SNIP's connection scores) clipped, masked sum, Gaussian noise."""
        def one(image, label):
            grads, _ = zero_if_nonfinite(jax.grad(loss_fn)(params, image, label))
            value, _ = zero_if_nonfinite(init_release.per_example(params, grads))
            return clip_to_l2(value, init_release.l2_bound)

        def micro_sum(total, micro):
            values = jax.vmap(one)(micro["image"], micro["label"])
            m = micro["mask"]
            return jax.tree.map(lambda t, v: t + jnp.sum(jnp.where(
                m.reshape(m.shape + (1,) * (v.ndim - 1)), v, 0.0), axis=0), total, values), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        total, _ = jax.lax.scan(micro_sum, zeros, {k: batch[k] for k in ("image", "label",
                                                                         "mask")})
        return add_gaussian_noise(total, key, init_sigma * init_release.l2_bound)

    def init_state_fn(params, key, release_batch=None):
        init_root = jax.random.fold_in(key, _INIT_DOMAIN)
        states = []
        for i, stage in enumerate(built):
            stage_key = jax.random.fold_in(init_root, i)
            if stage.init_release is not None:
                if release_batch is None:
                    raise ValueError(f"stage '{stage.name}' releases private data before "
                                     "training: pass init_state(..., release_batch=...) with a "
                                     "batch drawn by the run's sampler")
                released = release_fn(params, jax.random.fold_in(
                    jax.random.fold_in(key, _RELEASE_DOMAIN), i), release_batch,
                    stage.init_release)
                states.append(stage.init_release.init(params, released, stage_key))
            else:
                states.append(stage.init(params, stage_key, info))
        states = tuple(states)
        for stage, stage_state in zip(built, states):
            if stage.prepare_params is not None:
                params = stage.prepare_params(params, stage_state)
        return TrainState(params=params, stage_states=states,
                          ema_params=params if ema_decay > 0 else (),
                          step=jnp.zeros((), jnp.int32), key=key)

    replicated = sharding.replicated(mesh)
    batch_shard = sharding.batch_sharding(mesh)

    def init_state(params, key, release_batch=None):
        # Copy: the step donates its state, which must not invalidate the caller's arrays.
        state = jax.tree.map(lambda x: jnp.array(x, copy=True),
                             init_state_fn(params, key, release_batch))
        return jax.device_put(state, replicated)

    batch_shapes = {"image": jax.ShapeDtypeStruct((micro_steps, micro_batch_size) +
                                                  tuple(example_shape), jnp.float32),
                    "label": jax.ShapeDtypeStruct((micro_steps, micro_batch_size), jnp.int32),
                    "mask": jax.ShapeDtypeStruct((micro_steps, micro_batch_size), jnp.bool_)}
    batch_in_sharding = batch_shard
    probe_inputs = {str(i): s.host_inputs(0, np.random.default_rng(0))
                    for i, s in enumerate(built) if s.host_inputs is not None}
    if probe_inputs:
        # Public host randomness is replicated on every device; examples are sharded.
        batch_shapes[STAGE_INPUTS] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), probe_inputs)
        batch_in_sharding = {k: replicated if k == STAGE_INPUTS else batch_shard
                             for k in batch_shapes}
    state_shapes = jax.eval_shape(
        init_state_fn, param_shapes, key_shapes,
        {k: v for k, v in batch_shapes.items() if k != STAGE_INPUTS} if init_releases else None)
    # Shape and dtype errors surface here, before any device memory is allocated.
    jax.eval_shape(step_fn, state_shapes, batch_shapes)
    jitted = jax.jit(step_fn, in_shardings=(replicated, batch_in_sharding),
                     out_shardings=(replicated, replicated), donate_argnums=(0,))
    return CompiledPipeline(
        stages=built, sensitivity=sensitivity, noise_multiplier=sigma, sampler=sampler,
        budget=budget, total_steps=total_steps, micro_batch_size=micro_batch_size,
        micro_steps=micro_steps, step=jitted, init_state=init_state,
        step_mechanisms=step_mechanisms, mesh=mesh, pre_mechanisms=pre_mechanisms,
        init_noise_multiplier=init_sigma, needs_release_batch=bool(init_releases),
        state_shapes=state_shapes, host_seed=host_seed)
