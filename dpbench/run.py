"""A run before its first step, in one home: its size in steps, the settings its ledger
depends on, ``build_run`` (data, model, keys, sampler, the compiled pipeline; shared with the
speed benchmark), and ``start`` (the workdir, the budget stop, restore or init), which the
train loop calls once."""

from __future__ import annotations

import dataclasses
import datetime
import fractions
import json
import math
import secrets
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dpbench import accounting, checkpoint, data, models, records, sampling, sharding
from dpbench.compiler.facts import RunInputs
from dpbench.compiler.pipeline import CompiledPipeline, account_only, compile_pipeline
from dpbench.compiler.plan import StepOptions
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
    compiled: CompiledPipeline
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
                         loss_fn=models.cross_entropy_loss(self.model), model=self.model,
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


def build_run(stages: Sequence[Stage], config: TrainConfig, budget: accounting.Budget,
              model_config: Optional[models.ModelConfig] = None) -> Run:
    """Loads the configured dataset and model, derives the keys from config.seed (from the OS
    when it is None) and compiles the pipeline for the mesh over all devices."""
    parts = _parts(config, budget, model_config)
    mesh = sharding.make_mesh()
    t0 = time.time()
    compiled = compile_pipeline(
        stages, parts.inputs(config, budget), mesh=mesh,
        micro_batch_size=config.micro_batch_size, ema_decay=config.ema_decay,
        fidelity_diagnostics=config.fidelity_every_steps > 0, host_seed=parts.seeds[3],
        step_options=StepOptions(branch_free=config.branch_free_step,
                                 conv_grads=config.conv_grads))
    dataset = parts.dataset
    return Run(dataset=dataset, model=parts.model, model_name=parts.model_config.name,
               sampler=parts.sampler, mesh=mesh, compiled=compiled,
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


# --- the run at its workdir: refused, archived, restored or started ---------------------


class WorkdirError(ValueError):
    """A --workdir that cannot hold a run (finished, or not writable)."""


class ResumeError(ValueError):
    """A workdir whose checkpoint was written under different settings."""


CHECKPOINTS = "checkpoints"
SUPERSEDED = "superseded"


def prepare_workdir(workdir: Path, overwrite: bool = False) -> None:
    """Refuses a finished run (or archives it under superseded/ with ``overwrite``) and checks
    that the workdir is writable, before any data is loaded."""
    record = workdir / records.RECORD_NAME
    if record.exists():
        if not overwrite:
            raise WorkdirError(f"{record} holds a finished run; pick a new --workdir, or pass "
                               "--overwrite to move that run into superseded/ and start again "
                               "(finished results are never deleted)")
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        archive = workdir / SUPERSEDED / stamp
        archive.mkdir(parents=True)
        for entry in workdir.iterdir():
            if entry.name != SUPERSEDED:
                entry.rename(archive / entry.name)
        logging.warning("moved the finished run in %s to %s", workdir, archive)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".write_probe"
        records.atomic_write_text(probe, "ok")
        probe.unlink()
    except OSError as e:
        raise WorkdirError(f"cannot write to --workdir {workdir}: {e}; pick a writable "
                           "directory with free space") from e


def truncate_metrics(workdir: Path, last_step: int) -> None:
    """Drops metric rows of steps after ``last_step`` (steps a resumed run will redo)."""
    rows = [r for r in records.read_metrics(workdir) if r.get("step", 0) <= last_step]
    records.atomic_write_text(workdir / records.METRICS_NAME,
                              "".join(json.dumps(r) + "\n" for r in rows))


@dataclasses.dataclass
class Progress:
    """What the loop carries besides the TrainState: model selection, diagnostics, history.
    All of it goes into every checkpoint's ledger, so a resumed run continues it exactly."""

    best: dict                      # validation_accuracy, step, params (host arrays)
    nonfinite_total: float = 0.0
    fidelity: dict = dataclasses.field(
        default_factory=lambda: {"cosine": [], "noise_to_signal": []})
    resumed_from: list = dataclasses.field(default_factory=list)
    interval_step_s: list = dataclasses.field(default_factory=list)  # s/step per log interval
    last_saved: Optional[int] = None


def budget_stop(compiled, budget, config: TrainConfig) -> tuple:
    """(the step the run ends at, why): all steps, or the last step within the budget when the
    noise multiplier was given rather than calibrated."""
    if not config.enforce_budget:
        return compiled.total_steps, "completed all steps (budget NOT enforced: not a private run)"
    end_step = compiled.steps_within_budget()
    if end_step <= 0:
        raise accounting.BudgetError(
            f"noise multiplier {compiled.noise_multiplier} spends epsilon={budget.epsilon} "
            "before the first step ends; raise train.noise_multiplier, leave it unset to "
            "calibrate it, or set train.enforce_budget = False for a non-private baseline")
    if end_step == compiled.total_steps:
        return end_step, "completed all steps"
    reason = (f"privacy budget reached: only {end_step} of {compiled.total_steps} steps fit in "
              f"epsilon={budget.epsilon} with noise multiplier {compiled.noise_multiplier}")
    logging.warning("%s; the run stops there", reason)
    return end_step, reason


def check_ledger_epsilon(ledger: dict, step: int, epsilon_now: float) -> None:
    """Refuses a resume (ResumeError) unless the epsilon a checkpoint's ledger says was spent
    after ``step`` steps is the one the accountant computes for those steps now. A ledger that
    disagrees was written under other accounting (or altered): continuing it would report an
    epsilon that no accountant certified for this run. A ledger stores an infinite epsilon (a
    non-private run) as the string 'inf' (records.to_json), so it is read back as a number."""
    if not math.isclose(epsilon_now, float(ledger["epsilon_spent"]), rel_tol=1e-9):
        raise ResumeError(f"the ledger of step {step} says epsilon {ledger['epsilon_spent']} "
                          f"was spent, the accountant now says {epsilon_now}; pick a new "
                          "--workdir")


def restore_or_init(run: Run, ckpts, settings: dict, workdir: Path, config: TrainConfig):
    """(state, progress): a fresh start, or the newest intact checkpoint of this workdir
    (same settings required, its epsilon re-checked against the accountant)."""
    latest = ckpts.latest_step()
    if latest is None:
        state = run.initial_state()
        best = {"validation_accuracy": -1.0, "step": 0,
                "params": checkpoint.to_host(state.params)}
        return state, Progress(best=best)
    ledger = ckpts.read_ledger(latest)
    changed = checkpoint.changed_settings(ledger["settings"], settings)
    if changed:
        raise ResumeError(
            f"{workdir} holds a run started with other settings; resuming it would change "
            f"its privacy accounting or model. Changed: {'; '.join(changed)}. Restore "
            "those settings, or pick a new --workdir")
    compiled, replicated = run.compiled, sharding.replicated(run.mesh)
    restored = ckpts.restore(latest, state_shapes=compiled.state_shapes,
                             best_shapes=compiled.state_shapes.params, sharding=replicated)
    state = restored.state
    if config.seed is None:
        # A release run never wrote its key: the rest of the run gets fresh OS randomness.
        state = state._replace(key=jax.device_put(run.run_key, replicated))
    epsilon_then = compiled.epsilon_after(latest)
    check_ledger_epsilon(ledger, latest, epsilon_then)
    progress = Progress(
        best={"validation_accuracy": ledger["best_validation_accuracy"],
              "step": ledger["best_step"], "params": checkpoint.to_host(restored.best_params)},
        nonfinite_total=float(ledger["nonfinite_examples"]), fidelity=ledger["fidelity"],
        resumed_from=list(ledger["resumed_from"]) + [latest], last_saved=latest)
    truncate_metrics(workdir, latest)
    logging.info("resuming %s from its checkpoint at step %d (epsilon spent %.4f)",
                 workdir, latest, epsilon_then)
    return state, progress


class Started(NamedTuple):
    """A run at the first step it takes: built, its workdir ready, its state restored or new."""

    run: Run
    settings: dict
    ckpts: Any  # checkpoint.RunCheckpoints
    state: Any  # the TrainState at its first step
    progress: Progress
    end_step: int
    stop_reason: str


def start(workdir: Path, stages: Sequence[Stage], config: TrainConfig, budget: accounting.Budget,
          pipeline_name: str, overwrite: bool = False) -> Started:
    """The one home of a run before its first step: the workdir (a finished run refused, or
    archived with ``overwrite``), the run built (``build_run``), the step the budget stops it
    at, its settings (what its checkpoints' ledger depends on) and config.gin, and its state:
    restored from the workdir's newest intact checkpoint (same settings, epsilon re-checked)
    or initialized. A run refused before training leaves no empty workdir behind."""
    created = not workdir.exists()
    prepare_workdir(workdir, overwrite)
    try:
        run = build_run(stages, config, budget)
    except BaseException:
        if created and not any(workdir.iterdir()):
            workdir.rmdir()
        raise
    compiled, sampler = run.compiled, run.sampler
    logging.info("pipeline %s: sigma=%.5f sensitivity=%g steps=%d q=%.5g padded batch=%d "
                 "(calibrated in %.1fs)", pipeline_name, compiled.noise_multiplier,
                 compiled.sensitivity, run.total_steps, sampler.sampling_rate,
                 sampler.padded_batch_size, run.compile_s)
    logging.info("per-example gradients: %s%s", compiled.plan.strategy,
                 f" ({compiled.plan.strategy_reason})" if compiled.plan.strategy_reason else "")
    end_step, stop_reason = budget_stop(compiled, budget, config)
    settings = run_settings(pipeline_name=pipeline_name, compiled=compiled,
                            dataset=run.dataset, config=config, budget=budget,
                            model_name=run.model_name)
    records.atomic_write_text(workdir / "config.gin", gin.config_str())
    ckpts = checkpoint.RunCheckpoints(workdir / CHECKPOINTS,
                                      max_to_keep=config.checkpoints_to_keep,
                                      save_key=config.seed is not None)
    state, progress = restore_or_init(run, ckpts, settings, workdir, config)
    return Started(run, settings, ckpts, state, progress, end_step, stop_reason)


def describe_features(features: dict) -> list:
    """The dataset's feature transform for the privacy statement (nothing for raw pixels)."""
    if features.get("kind") == "pixels":
        return []
    params = ", ".join(f"{k}={v}" for k, v in features.items() if k != "kind")
    return [dict(what=f"{features['kind']} features of each example ({params})",
                 why="a fixed transform of that example alone with data-independent filters: "
                     "no privacy cost, no release")]
