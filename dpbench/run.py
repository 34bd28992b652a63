"""A run before its first step: its size in steps, the settings its ledger depends on, and
``build_run`` (data, model, keys, sampler, the compiled pipeline), shared by the train loop
and the speed benchmark."""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
import secrets
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpbench import accounting, compiler, data, models, records, sampling, sharding
from dpbench.config import TrainConfig
from dpbench.stages.base import Stage



def total_steps_for(epochs: float, dataset_size: int, batch_size: int) -> int:
    """ceil(epochs * N / B), computed exactly on the decimal the user wrote for ``epochs``
    (float rounding once made 30 * (50000 / 3000) = 500.00000000000006 into 501 steps)."""
    return int(math.ceil(fractions.Fraction(str(epochs)) * dataset_size / batch_size))


def run_settings(*, pipeline_name, compiled, dataset, config: TrainConfig, budget,
                 model_name) -> dict:
    """Every setting a checkpoint's privacy ledger (and its model) depends on: resuming under a
    change to any of them is refused."""
    settings = dict(
        pipeline=pipeline_name,
        stages=compiled.plan.facts(),
        dataset=dataset.name, features=dataset.features, dataset_size=len(dataset.train),
        validation_size=len(dataset.validation),
        public_size=0 if dataset.public is None else len(dataset.public),
        model=model_name, batch_size=config.batch_size,
        micro_batch_size=config.micro_batch_size, epochs=config.epochs,
        total_steps=compiled.total_steps, sampler=compiled.sampler.describe(), seed=config.seed,
        target_epsilon=budget.epsilon, delta=budget.delta, accountant=budget.accountant,
        accountant_version=accounting.accountant_version(),
        noise_multiplier=compiled.noise_multiplier,
        init_noise_multiplier=compiled.init_noise_multiplier,
        l2_sensitivity=compiled.sensitivity, ema_decay=config.ema_decay,
        enforce_budget=config.enforce_budget)
    return json.loads(records.to_json(settings))  # the form the ledger stores


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a run builds before its first step: the data, model, sampler, keys and the
    compiled pipeline (sigma calibrated). train() and the speed benchmark build it the same way."""

    dataset: data.Dataset
    model: object
    model_name: str
    sampler: object  # sampling.PoissonSampler or ShuffleSampler
    mesh: jax.sharding.Mesh
    compiled: compiler.CompiledPipeline
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


def build_run(stages: Sequence[Stage], config: TrainConfig, budget: accounting.Budget,
              model_config: Optional[models.ModelConfig] = None) -> Run:
    """Loads the configured dataset and model, derives the keys from config.seed (from the OS
    when it is None) and compiles the pipeline for the mesh over all devices."""
    dataset = data.load_dataset()
    n = len(dataset.train)
    budget.validate(n)
    model_config = models.ModelConfig() if model_config is None else model_config
    model_config.check_features(dataset.features)
    model = model_config.build(dataset.num_classes)
    example_shape = dataset.input_shape

    seed = config.seed if config.seed is not None else secrets.randbits(63)
    seeds = np.random.SeedSequence(seed).generate_state(4)
    params_key, run_key = jax.random.key(int(seeds[0])), jax.random.key(int(seeds[1]))
    mesh = sharding.make_mesh()
    sampler = sampling.make_sampler(n, config.batch_size, seed=int(seeds[2]),
                                    pad_multiple=config.micro_batch_size)
    steps_per_epoch = n / config.batch_size
    total_steps = total_steps_for(config.epochs, n, config.batch_size)

    def init_params(key):
        return model.init(key, jnp.zeros((1,) + tuple(example_shape), jnp.float32))

    t0 = time.time()
    compiled = compiler.compile_pipeline(
        stages, loss_fn=models.cross_entropy_loss(model), init_params=init_params,
        example_shape=example_shape, sampler=sampler, budget=budget, total_steps=total_steps,
        steps_per_epoch=max(int(round(steps_per_epoch)), 1),
        micro_batch_size=config.micro_batch_size, mesh=mesh, ema_decay=config.ema_decay,
        noise_multiplier=config.noise_multiplier,
        public_images=None if dataset.public is None else dataset.public.images,
        num_classes=dataset.num_classes,
        linear_apply=model_config.linearized(dataset.num_classes).apply,
        fidelity_diagnostics=config.fidelity_every_steps > 0, host_seed=int(seeds[3]),
        model=model)
    return Run(dataset=dataset, model=model, model_name=model_config.name, sampler=sampler,
               mesh=mesh, compiled=compiled, params_key=params_key, run_key=run_key,
               init_params=init_params, total_steps=total_steps,
               steps_per_epoch=steps_per_epoch, compile_s=time.time() - t0,
               inputs=tuple(describe_features(dataset.features) + model_config.describe_inputs()))


def describe_features(features: dict) -> list:
    """The dataset's feature transform for the privacy statement (nothing for raw pixels)."""
    if features.get("kind") == "pixels":
        return []
    params = ", ".join(f"{k}={v}" for k, v in features.items() if k != "kind")
    return [dict(what=f"{features['kind']} features of each example ({params})",
                 why="a fixed transform of that example alone with data-independent filters: "
                     "no privacy cost, no release")]
