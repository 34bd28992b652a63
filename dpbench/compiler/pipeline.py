"""The compiled result: bind -> account -> lower, shape checks and jit on the mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import dp_event
from jax.sharding import Mesh

from dpbench import sharding
from dpbench.accounting import Budget
from dpbench.stages.base import Stage
from dpbench.compiler.bind import bind
from dpbench.compiler.facts import RunFacts, RunInputs
from dpbench.compiler.plan import Plan, StepOptions
from dpbench.compiler.ledger import Accounting, account
from dpbench.compiler.lower import STAGE_INPUTS, Lowered, lower
from dpbench.compiler.rules import ValidatedPipeline, validated as as_validated


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
    # the step as traced once for its shape check: (ClosedJaxpr, the input tree, the output
    # shapes), what a group of trials compares (compiler/group.traced_of) without a second trace
    step_program: Any = None

    @property
    def stages(self) -> tuple:
        return self.plan.stages

    def evaluation_params(self, state):
        """The parameters a run evaluates and reports (the debiased EMA when there is one)."""
        return self.lowered.evaluation_params(state)

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
    def budget(self) -> Budget:
        return self.accounting.budget

    @property
    def needs_release_batch(self) -> bool:
        return any(s.privacy.one_off_release is not None for s in self.plan.stages)

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
        return {str(i): f.hooks.host_inputs(int(step), np.random.default_rng(
                    [self.host_seed, int(stream), i, int(step)]))
                for i, f in enumerate(self.plan.fns) if f.hooks.host_inputs is not None}

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


def _check_options(options: StepOptions, mesh: Mesh) -> None:
    """Refuses a speed knob that would make a sharded step gather the batch."""
    if options.conv_grads == "convolution" and mesh.devices.size > 1:
        raise ValueError(
            f"train.conv_grads = 'convolution' on {mesh.devices.size} devices: XLA all-gathers "
            "the batch for the per-example weight-gradient convolution (a grouped convolution) "
            "and recomputes it on every device (tests/test_compiler.py measures it on 8 CPU "
            "devices); keep the default 'patches' on more than one device")


def _batch_shapes(plan: Plan, micro_steps: int, micro_batch_size: int, example_shape) -> dict:
    shape = (micro_steps, micro_batch_size)
    shapes = {"image": jax.ShapeDtypeStruct(shape + tuple(example_shape), jnp.float32),
              "label": jax.ShapeDtypeStruct(shape, jnp.int32),
              "mask": jax.ShapeDtypeStruct(shape, jnp.bool_)}
    probe = {str(i): f.hooks.host_inputs(0, np.random.default_rng(0))
             for i, f in enumerate(plan.fns) if f.hooks.host_inputs is not None}
    if probe:
        shapes[STAGE_INPUTS] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), probe)
    return shapes


def account_only(stages: Sequence[Stage] | ValidatedPipeline, inputs: RunInputs) -> Accounting:
    """The run's accounting (ledger, calibrated sigma, its DpEvent) exactly as
    :func:`compile_pipeline` computes it for the same inputs, without lowering, tracing or
    jitting the step: the rules, bind (the model's parameter shapes by eval_shape) and account.
    What a sweep's planning reads (each support point's event)."""
    checked = as_validated(stages)
    return account(bind(checked.stages, RunFacts(inputs), checked), inputs.sampler,
                   inputs.budget, inputs.total_steps, inputs.noise_multiplier)


def compile_pipeline(stages: Sequence[Stage] | ValidatedPipeline, inputs: RunInputs, *,
                     micro_batch_size: int, mesh: Optional[Mesh] = None, ema_decay: float = 0.0,
                     fidelity_diagnostics: bool = False, host_seed: int = 0,
                     step_options: StepOptions = StepOptions()) -> CompiledPipeline:
    """bind -> account -> lower, then shape checks (jax.eval_shape) and jit on the mesh.

    ``stages``: the pipeline's stages, or their :class:`ValidatedPipeline` when the caller
    validated them already (the rules run once on every path). ``inputs`` (:class:`RunInputs`)
    is what the run is compiled from; the stages read its run
    facts (compiler/facts.py). ``inputs.noise_multiplier=None`` calibrates sigma to the budget
    (the normal path); a given value is used as is. ``fidelity_diagnostics`` adds the
    non-private metrics ``fidelity_cosine`` and ``noise_to_signal``. ``host_seed`` seeds the
    stages' public host randomness. ``step_options`` (:class:`StepOptions`) choose how the
    clipped sum is lowered, for speed (the same sums). ``inputs.model`` (the flax module
    behind ``loss_fn``, a models.cross_entropy_loss) lets the compiler pick book-keeping where
    it applies.
    """
    mesh = sharding.make_mesh() if mesh is None else mesh
    sharding.limit_lapack_threads()
    validated = as_validated(stages)  # rule errors before any size error
    _check_options(step_options, mesh)
    step_options = dataclasses.replace(step_options, device_partials=mesh.devices.size)
    sampler = inputs.sampler
    micro_steps = _check_sizes(inputs.total_steps, ema_decay, micro_batch_size, mesh,
                               sampler.padded_batch_size)
    facts = RunFacts(inputs)
    plan = bind(validated.stages, facts, validated)
    acct = account(plan, sampler, inputs.budget, inputs.total_steps, inputs.noise_multiplier)
    lowered = lower(plan, acct, ema_decay=ema_decay, fidelity_diagnostics=fidelity_diagnostics,
                    options=step_options)
    batch_shapes = _batch_shapes(plan, micro_steps, micro_batch_size, inputs.example_shape)
    examples_only = {k: v for k, v in batch_shapes.items() if k != STAGE_INPUTS}
    needs_release = any(s.privacy.one_off_release is not None for s in plan.stages)
    key_shapes = jax.eval_shape(lambda: jax.random.key(0))
    state_shapes = jax.eval_shape(lowered.init_state, facts.get("param_shapes"), key_shapes,
                                  examples_only if needs_release else None)
    # Shape and dtype errors surface here, before any device memory is allocated; the jaxpr
    # traced for it is kept for grouping trials
    closed, out_shapes = jax.make_jaxpr(lowered.step, return_shape=True)(state_shapes,
                                                                         batch_shapes)
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
                            state_shapes=state_shapes, lowered=lowered, host_seed=host_seed,
                            step_program=(closed, jax.tree.structure((state_shapes,
                                                                      batch_shapes)), out_shapes))
