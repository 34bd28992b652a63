"""A run built before its first step: ``build_run`` loads the configured data and model,
derives the keys from the seed, makes the sampler and compiles the pipeline on the mesh
(shared with the speed benchmark); ``run_event`` is the same run's DpEvent without lowering
anything (the sweep's support events)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpbench import accounting, data, models, numerics, sampling, sharding
from dpbench.compiler.facts import RunInputs
from dpbench.compiler.pipeline import CompiledPipeline, account_only, compile_pipeline
from dpbench.compiler.plan import StepOptions
from dpbench.compiler.rules import ValidatedPipeline
from dpbench.config import TrainConfig
from dpbench.models import losses
from dpbench.run.settings import branch_free, total_steps_for
from dpbench.stages.base import Stage


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a run builds before its first step: the data, model, sampler, keys and the
    compiled pipeline (sigma calibrated). train() and the speed benchmark build it the same way."""

    dataset: data.Dataset
    model: object
    model_name: str
    sampler: object  # sampling.PoissonSampler or ShuffleSampler
    mesh: jax.sharding.Mesh
    compiled: CompiledPipeline
    budget: accounting.Budget  # the target (epsilon, delta) its sigma was calibrated to
    params_key: jax.Array
    run_key: jax.Array
    init_params: Callable
    total_steps: int
    steps_per_epoch: float
    compile_s: float
    inputs: tuple = ()  # what happens to an example before the model's first learned layer

    def host_batch(self, step: int, stage_inputs: bool = True) -> dict:
        """The sampler's batch for ``step`` (and the stages' host randomness), on the mesh."""
        drawn = self.sampler.sample(step)
        return sharding.put_batch(self.compiled.host_batch(
            self.dataset.train.images[drawn.indices], self.dataset.train.labels[drawn.indices],
            drawn.mask, step if stage_inputs else None), self.mesh)

    def initial_state(self):
        """The step's state at step 0, after any one-off accounted release before training
        (DP-SNIP), which runs on a batch of the run's own sampler."""
        release_batch = None
        if self.compiled.needs_release_batch:
            release_batch = self.host_batch(sampling.PRE_TRAINING_STEP, stage_inputs=False)
        return self.compiled.init_state(self.init_params(self.params_key), self.run_key,
                                        release_batch)


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What a run is built from, before anything is compiled."""

    dataset: data.Dataset
    model: object
    model_config: models.ModelConfig
    sampler: object
    seeds: tuple
    total_steps: int
    steps_per_epoch: float

    def init_params(self, key):
        return self.model.init(key, jnp.zeros((1,) + tuple(self.dataset.input_shape),
                                              jnp.float32))

    def inputs(self, config: TrainConfig, budget: accounting.Budget) -> RunInputs:
        """What the run is compiled from (compile_pipeline and account_only alike): the one
        place a run's parts become the compiler's inputs, from which every run fact derives."""
        dataset = self.dataset
        return RunInputs(init_params=self.init_params, example_shape=dataset.input_shape,
                         loss_fn=losses.cross_entropy_loss(self.model), model=self.model,
                         sampler=self.sampler, budget=budget, total_steps=self.total_steps,
                         steps_per_epoch=max(int(round(self.steps_per_epoch)), 1),
                         noise_multiplier=config.noise_multiplier,
                         public_images=None if dataset.public is None else dataset.public.images,
                         num_classes=dataset.num_classes,
                         linear_apply=self.model_config.linearized(dataset.num_classes).apply)


def _parts(config: TrainConfig, budget: accounting.Budget,
           model_config: Optional[models.ModelConfig]) -> _Parts:
    """The configured dataset and model, the seeds (from config.seed, from the OS when it is
    None) and the sampler."""
    dataset = data.load_dataset()
    n = len(dataset.train)
    budget.validate(n)
    model_config = models.ModelConfig() if model_config is None else model_config
    model_config.check_features(dataset.features)
    seed = config.seed if config.seed is not None else secrets.randbits(63)
    seeds = tuple(int(s) for s in np.random.SeedSequence(seed).generate_state(4))
    sampler = sampling.make_sampler(n, config.batch_size, seed=seeds[2],
                                    pad_multiple=config.micro_batch_size)
    return _Parts(dataset=dataset, model=model_config.build(dataset.num_classes),
                  model_config=model_config, sampler=sampler, seeds=seeds,
                  total_steps=total_steps_for(config.epochs, n, config.batch_size),
                  steps_per_epoch=n / config.batch_size)


def step_micro_batch_size(config: TrainConfig, padded_batch_size: int,
                          backend: Optional[str] = None) -> int:
    """The micro-batch the step runs: ``train.micro_batch_size``, or on an accelerator
    ``train.accelerator_micro_batch_size`` when set (0: the whole padded batch). The padded
    batch is planned with ``micro_batch_size`` either way, so the sampler and its DpEvent do
    not depend on the device."""
    wanted = config.accelerator_micro_batch_size
    backend = jax.default_backend() if backend is None else backend
    if wanted is None or backend == "cpu":
        return config.micro_batch_size
    wanted = wanted or padded_batch_size
    if padded_batch_size % wanted:
        divisors = [d for d in range(1, padded_batch_size + 1) if padded_batch_size % d == 0]
        raise ValueError(
            f"train.accelerator_micro_batch_size ({wanted}) must divide the padded batch "
            f"({padded_batch_size}, planned with train.micro_batch_size = "
            f"{config.micro_batch_size}); 0 takes the whole padded batch, and its divisors of at "
            f"least {config.micro_batch_size} are {[d for d in divisors if d >= config.micro_batch_size]}")
    return wanted


def build_run(stages: Sequence[Stage] | ValidatedPipeline, config: TrainConfig,
              budget: Optional[accounting.Budget] = None,
              model_config: Optional[models.ModelConfig] = None) -> Run:
    """Loads the configured dataset and model, derives the keys from config.seed (from the OS
    when it is None) and compiles the pipeline for the mesh over all devices, its sigma
    calibrated to ``budget`` (default: the configured one, ``budget.*`` in gin)."""
    budget = accounting.Budget() if budget is None else budget
    numerics.use_precision_policy()  # before anything is traced: the clip's norms at float32
    parts = _parts(config, budget, model_config)
    mesh = sharding.make_mesh()
    t0 = time.time()
    compiled = compile_pipeline(
        stages, parts.inputs(config, budget), mesh=mesh,
        micro_batch_size=step_micro_batch_size(config, parts.sampler.padded_batch_size), ema_decay=config.ema_decay,
        fidelity_diagnostics=config.fidelity_every_steps > 0, host_seed=parts.seeds[3],
        step_options=StepOptions(branch_free=branch_free(config),
                                 conv_grads=config.conv_grads))
    dataset = parts.dataset
    return Run(dataset=dataset, model=parts.model, model_name=parts.model_config.name,
               sampler=parts.sampler, mesh=mesh, compiled=compiled, budget=budget,
               params_key=jax.random.key(parts.seeds[0]),
               run_key=jax.random.key(parts.seeds[1]), init_params=parts.init_params,
               total_steps=parts.total_steps, steps_per_epoch=parts.steps_per_epoch,
               compile_s=time.time() - t0,
               inputs=tuple(describe_features(dataset.features) +
                            parts.model_config.describe_inputs()))


def run_event(stages: Sequence[Stage], config: TrainConfig, budget: accounting.Budget):
    """The DpEvent a run with these settings would have, from the compiler's own accounting
    (``account_only``: the data, the sampler and sigma's calibration, but no mesh, no lowered
    or traced step, no jit). Equal to ``build_run(...).compiled.run_event()``."""
    parts = _parts(config, budget, None)
    return account_only(stages, parts.inputs(config, budget)).run_event()


def describe_features(features: dict) -> list:
    """The dataset's feature transform for the privacy statement (nothing for raw pixels)."""
    if features.get("kind") == "pixels":
        return []
    params = ", ".join(f"{k}={v}" for k, v in features.items() if k != "kind")
    return [dict(what=f"{features['kind']} features of each example ({params})",
                 why="a fixed transform of that example alone with data-independent filters: "
                     "no privacy cost, no release")]
