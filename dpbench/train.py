"""The one train loop: data -> sampler -> compiled step -> evaluation -> run record."""

from __future__ import annotations

import dataclasses
import datetime
import fractions
import json
import math
import secrets
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dpbench import (accounting, checkpoint, compiler, data, models, records, sampling,
                     sharding)
from dpbench.stages.base import Stage


@gin.configurable("pipeline")
def pipeline_stages(stages: Sequence[Stage] = gin.REQUIRED, name: str = "unnamed") -> tuple:
    """The pipeline's stages, as listed in its gin file (``pipeline.stages = %STAGES``)."""
    return name, tuple(stages)


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Run-level settings (bind as ``train.batch_size = 2048`` etc.).

    batch_size is the EXPECTED batch size B; the sampling rate is q = B / N.
    seed=None draws every key from the OS and writes none of them anywhere (for a run that is
    meant to be released); an integer seed makes a benchmark run reproducible.
    noise_multiplier=None calibrates sigma to the budget. A given number is used as is and the
    run stops at the last step whose epsilon fits the budget (the record says why), unless
    enforce_budget=False (a non-private baseline; the record then says the budget was ignored).
    A checkpoint (with the privacy ledger) is written every checkpoint_every_steps steps and at
    the end; the newest checkpoints_to_keep are kept.
    fidelity_every_steps > 0 records, every that many steps, the cosine between the released
    update and the clean mean of clipped gradients and the noise-to-signal norm ratio: they read
    private data, so the record lists them as NON-PRIVATE benchmark output (off by default).
    """

    batch_size: int = 256
    epochs: float = 30.0
    micro_batch_size: int = 64
    seed: Optional[int] = 0
    ema_decay: float = 0.0
    eval_every_steps: int = 0  # 0: once per epoch
    log_every_steps: int = 50
    eval_batch_size: int = 1000
    noise_multiplier: Optional[float] = None
    enforce_budget: bool = True
    checkpoint_every_steps: int = 200
    checkpoints_to_keep: int = 2
    fidelity_every_steps: int = 0

    def validate(self):
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"train.batch_size must be a positive integer, got "
                             f"{self.batch_size!r}")
        if not isinstance(self.epochs, (int, float)) or not self.epochs > 0:
            raise ValueError(f"train.epochs must be > 0, got {self.epochs!r}")
        if not isinstance(self.fidelity_every_steps, int) or self.fidelity_every_steps < 0:
            raise ValueError(f"train.fidelity_every_steps must be an integer >= 0 (0: off), got "
                             f"{self.fidelity_every_steps!r}")
        for name in ("checkpoint_every_steps", "log_every_steps", "checkpoints_to_keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"train.{name} must be a positive integer, got {value!r}")


def _evaluate(apply_fn, params, split: data.Split, batch_size: int) -> float:
    correct = 0
    for start in range(0, len(split), batch_size):
        images = split.images[start:start + batch_size]
        labels = split.labels[start:start + batch_size]
        correct += int(apply_fn(params, images, labels))
    return correct / max(len(split), 1)


def total_steps_for(epochs: float, dataset_size: int, batch_size: int) -> int:
    """ceil(epochs * N / B), computed exactly on the decimal the user wrote for ``epochs``
    (float rounding once made 30 * (50000 / 3000) = 500.00000000000006 into 501 steps)."""
    return int(math.ceil(fractions.Fraction(str(epochs)) * dataset_size / batch_size))


class WorkdirError(ValueError):
    """A --workdir that cannot hold a run (finished, or not writable)."""


class ResumeError(ValueError):
    """A workdir whose checkpoint was written under different settings."""


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became non-finite; the last good checkpoint is kept."""


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


def _params_finite(params) -> bool:
    return bool(jax.device_get(jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)]))))


def _truncate_metrics(workdir: Path, last_step: int) -> None:
    """Drops metric rows of steps after ``last_step`` (steps a resumed run will redo)."""
    rows = [r for r in records.read_metrics(workdir) if r.get("step", 0) <= last_step]
    records.atomic_write_text(workdir / records.METRICS_NAME,
                              "".join(json.dumps(r) + "\n" for r in rows))


def not_covered(dataset: data.Dataset, config: TrainConfig) -> list:
    """What a run touches that its epsilon does not protect, each with why (for the privacy
    statement): the splits carved from the training set, tuning, the non-private diagnostics,
    and, for a seeded benchmark run, the noise itself."""
    items = [dict(what=f"the validation split ({len(dataset.validation)} examples carved from "
                       "the training set)",
                  why="it chooses the reported model (the best validation step) and, in a "
                      "sweep, the configuration; its individuals are not protected")]
    if dataset.public is not None:
        items.append(dict(what=f"the public split ({len(dataset.public)} examples carved from "
                               "the training set)",
                          why="declared public and read without noise (e.g. GEP's anchor "
                              "gradients); its individuals are not protected"))
    items += [
        dict(what="the test split", why="its accuracy is reported without noise"),
        dict(what="hyperparameter tuning",
             why="choosing among several runs on the same private data costs privacy beyond "
                 "this one run's epsilon, which does not include it"),
        dict(what="the non-private diagnostics",
             why="train loss, update norm, non-finite counts" + (
                 " and the fidelity metrics" if config.fidelity_every_steps else "") +
                 " are computed from private batches without noise, and so is the decision "
                 "to stop a diverged run")]
    if config.seed is not None:
        items.append(dict(what=f"this run as a release (train.seed = {config.seed})",
                          why="a benchmark run derives all its noise from the recorded seed, "
                              "so anyone holding the record can regenerate the noise; a model "
                              "meant to be released needs train.seed = None"))
    return items


def run_settings(*, pipeline_name, compiled, dataset, config: TrainConfig, budget,
                 model_name) -> dict:
    """Every setting a checkpoint's privacy ledger (and its model) depends on: resuming under a
    change to any of them is refused."""
    settings = dict(
        pipeline=pipeline_name,
        stages=[dict(name=s.name, **s.options) for s in compiled.stages],
        dataset=dataset.name, dataset_size=len(dataset.train),
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

    def initial_state(self):
        """The step's state at step 0, after any one-off accounted release before training
        (DP-SNIP), which runs on a batch of the run's own sampler."""
        release_batch = None
        if self.compiled.needs_release_batch:
            pre = self.sampler.sample(sampling.PRE_TRAINING_STEP)
            release_batch = sharding.put_batch(self.compiled.batch_layout({
                "image": self.dataset.train.images[pre.indices],
                "label": self.dataset.train.labels[pre.indices], "mask": pre.mask}), self.mesh)
        return self.compiled.init_state(self.init_params(self.params_key), self.run_key,
                                        release_batch)


def build_run(stages: Sequence[Stage], config: TrainConfig, budget: accounting.Budget) -> Run:
    """Loads the configured dataset and model, derives the keys from config.seed (from the OS
    when it is None) and compiles the pipeline for the mesh over all devices."""
    dataset = data.load_dataset()
    n = len(dataset.train)
    budget.validate(n)
    model_name = gin.query_parameter("model.name")
    model = models.make_model(dataset.num_classes)
    loss_fn = models.cross_entropy_loss(model)
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
        stages, loss_fn=loss_fn, init_params=init_params, example_shape=example_shape,
        sampler=sampler, budget=budget, total_steps=total_steps,
        steps_per_epoch=max(int(round(steps_per_epoch)), 1),
        micro_batch_size=config.micro_batch_size, mesh=mesh, ema_decay=config.ema_decay,
        noise_multiplier=config.noise_multiplier,
        public_images=None if dataset.public is None else dataset.public.images,
        num_classes=dataset.num_classes,
        linear_apply=models.linearized(dataset.num_classes).apply,
        fidelity_diagnostics=config.fidelity_every_steps > 0, host_seed=int(seeds[3]))
    return Run(dataset=dataset, model=model, model_name=model_name, sampler=sampler, mesh=mesh,
               compiled=compiled, params_key=params_key, run_key=run_key,
               init_params=init_params, total_steps=total_steps,
               steps_per_epoch=steps_per_epoch, compile_s=time.time() - t0)


def train(workdir: str | Path, config: Optional[TrainConfig] = None,
          budget: Optional[accounting.Budget] = None, gin_files: Sequence[str] = (),
          overwrite: bool = False) -> dict:
    """Trains the configured pipeline and writes metrics and the run record into ``workdir``.

    A workdir holding checkpoints of an unfinished run is resumed from its newest intact
    checkpoint (same settings required); one holding a finished run is refused unless
    ``overwrite``.
    """
    wall_start = time.time()
    workdir = Path(workdir)
    config = TrainConfig() if config is None else config
    config.validate()
    budget = accounting.Budget() if budget is None else budget
    pipeline_name, stages = pipeline_stages()
    compiler.validate_pipeline(stages)  # fail on a bad pipeline before loading any data
    prepare_workdir(workdir, overwrite)
    run = build_run(stages, config, budget)
    dataset, model, sampler, compiled, mesh = (run.dataset, run.model, run.sampler,
                                               run.compiled, run.mesh)
    n, total_steps, steps_per_epoch = len(dataset.train), run.total_steps, run.steps_per_epoch
    model_name, calibration_s = run.model_name, run.compile_s
    logging.info("pipeline %s: sigma=%.5f sensitivity=%g steps=%d q=%.5g padded batch=%d "
                 "(calibrated in %.1fs)", pipeline_name, compiled.noise_multiplier,
                 compiled.sensitivity, total_steps, sampler.sampling_rate,
                 sampler.padded_batch_size, calibration_s)

    stop_reason = "completed all steps"
    end_step = total_steps
    if config.enforce_budget:
        end_step = compiled.steps_within_budget()
        if end_step <= 0:
            raise accounting.BudgetError(
                f"noise multiplier {compiled.noise_multiplier} spends epsilon="
                f"{budget.epsilon} before the first step ends; raise train.noise_multiplier, "
                "leave it unset to calibrate it, or set train.enforce_budget = False for a "
                "non-private baseline")
        if end_step < total_steps:
            stop_reason = (f"privacy budget reached: only {end_step} of {total_steps} steps fit "
                           f"in epsilon={budget.epsilon} with noise multiplier "
                           f"{compiled.noise_multiplier}")
            logging.warning("%s; the run stops there", stop_reason)
    else:
        stop_reason = "completed all steps (budget NOT enforced: not a private run)"

    settings = run_settings(pipeline_name=pipeline_name, compiled=compiled, dataset=dataset,
                            config=config, budget=budget, model_name=model_name)
    records.atomic_write_text(workdir / "config.gin", gin.config_str())
    ckpts = checkpoint.RunCheckpoints(workdir / CHECKPOINTS,
                                      max_to_keep=config.checkpoints_to_keep,
                                      save_key=config.seed is not None)
    replicated = sharding.replicated(mesh)
    resumed_from = []
    latest = ckpts.latest_step()
    if latest is None:
        state = run.initial_state()
        best = {"validation_accuracy": -1.0, "step": 0,
                "params": checkpoint.to_host(state.params)}
        nonfinite_total = 0.0
        fidelity = {"cosine": [], "noise_to_signal": []}
    else:
        ledger = ckpts.read_ledger(latest)
        changed = checkpoint.changed_settings(ledger["settings"], settings)
        if changed:
            raise ResumeError(
                f"{workdir} holds a run started with other settings; resuming it would change "
                f"its privacy accounting or model. Changed: {'; '.join(changed)}. Restore "
                "those settings, or pick a new --workdir")
        restored = ckpts.restore(latest, state_shapes=compiled.state_shapes,
                                 best_shapes=compiled.state_shapes.params, sharding=replicated)
        state = restored.state
        if config.seed is None:
            # A release run never wrote its key: the rest of the run gets fresh OS randomness.
            state = state._replace(key=jax.device_put(run.run_key, replicated))
        epsilon_then = compiled.epsilon_after(latest)
        if not math.isclose(epsilon_then, ledger["epsilon_spent"], rel_tol=1e-9):
            raise ResumeError(f"the ledger of step {latest} says epsilon "
                              f"{ledger['epsilon_spent']} was spent, the accountant now says "
                              f"{epsilon_then}; pick a new --workdir")
        best = {"validation_accuracy": ledger["best_validation_accuracy"],
                "step": ledger["best_step"],
                "params": checkpoint.to_host(restored.best_params)}
        nonfinite_total = float(ledger["nonfinite_examples"])
        fidelity = ledger["fidelity"]
        resumed_from = list(ledger["resumed_from"]) + [latest]
        _truncate_metrics(workdir, latest)
        logging.info("resuming %s from its checkpoint at step %d (epsilon spent %.4f)",
                     workdir, latest, epsilon_then)
    start_step = int(jax.device_get(state.step))
    last_saved = latest

    def save_checkpoint(done: int, epsilon: float) -> None:
        ledger = dict(
            format=1, step=done, settings=settings,
            settings_sha256=checkpoint.settings_digest(settings), epsilon_spent=epsilon,
            dp_event=accounting.event_to_json(compiled.run_event(done)),
            best_validation_accuracy=best["validation_accuracy"], best_step=best["step"],
            resumed_from=resumed_from, nonfinite_examples=nonfinite_total,
            fidelity=fidelity, key_saved=config.seed is not None)
        ckpts.save(state, best_params=best["params"],
                   ledger=json.loads(records.to_json(ledger)))

    eval_fn = jax.jit(lambda p, x, y: jnp.sum(jnp.argmax(model.apply(p, x), -1) == y))
    eval_every = config.eval_every_steps or max(int(round(steps_per_epoch)), 1)
    interval_step_s = []  # seconds per step over each log interval (first one holds compile)
    last_log_time, last_log_step = time.time(), start_step
    nonfinite_device = jnp.zeros((), jnp.float32)
    for step in range(start_step, end_step):
        indices = sampler.sample(step)
        batch = compiled.host_batch({
            "image": dataset.train.images[indices.indices],
            "label": dataset.train.labels[indices.indices],
            "mask": indices.mask}, step)
        batch = sharding.put_batch(batch, mesh)
        state, metrics = compiled.step(state, batch)
        nonfinite_device = nonfinite_device + metrics["nonfinite_examples"]
        done = step + 1
        if config.fidelity_every_steps and done % config.fidelity_every_steps == 0:
            row = {name: float(metrics[name]) for name in ("fidelity_cosine", "noise_to_signal")}
            fidelity["cosine"].append(row["fidelity_cosine"])
            fidelity["noise_to_signal"].append(row["noise_to_signal"])
            records.append_metrics(workdir, dict(step=done, **row))
        if done % eval_every == 0 or done == end_step:
            params = state.ema_params if config.ema_decay > 0 else state.params
            val_acc = _evaluate(eval_fn, params, dataset.validation, config.eval_batch_size)
            logging.info("step %d  validation accuracy %.4f", done, val_acc)
            records.append_metrics(workdir, dict(step=done, validation_accuracy=val_acc))
            if val_acc > best["validation_accuracy"]:
                best = {"validation_accuracy": val_acc, "step": done,
                        "params": checkpoint.to_host(params)}
        log_now = done % config.log_every_steps == 0 or done == end_step
        save_now = done % config.checkpoint_every_steps == 0 or done == end_step
        if not (log_now or save_now):
            continue
        jax.block_until_ready(state)
        now = time.time()
        loss = float(metrics["train_loss"])
        nonfinite_total += float(nonfinite_device)
        nonfinite_device = jnp.zeros((), jnp.float32)
        if (not math.isfinite(loss) or bool(metrics["all_nonfinite"])
                or (save_now and not _params_finite(state.params))):
            raise TrainingDiverged(
                f"training diverged at step {done} (train loss {loss}); the last good "
                f"checkpoint is step {last_saved} in {ckpts.directory}. Lower "
                "optimize.optax.learning_rate and start a new --workdir")
        epsilon = compiled.epsilon_after(done)
        if log_now:
            rate = (done - last_log_step) / max(now - last_log_time, 1e-9)
            interval_step_s.append(1.0 / rate)
            last_log_time, last_log_step = now, done
            logging.info("step %d/%d  %.2f steps/s  epsilon spent %.4f  loss %.4f",
                         done, total_steps, rate, epsilon, loss)
            records.append_metrics(workdir, dict(
                step=done, steps_per_s=rate, epsilon=epsilon, train_loss=loss,
                nonfinite_examples=nonfinite_total, wall_s=now - wall_start))
        if save_now:
            save_checkpoint(done, epsilon)
            last_saved = done
    if start_step == end_step:
        logging.info("the checkpoint at step %d already holds the whole run", end_step)
    test_acc = _evaluate(eval_fn, best["params"], dataset.test, config.eval_batch_size)
    epsilon = compiled.epsilon_after(end_step)
    steady = interval_step_s[1:] or interval_step_s
    sampler_info = sampler.describe()
    statement = records.privacy_statement(
        epsilon=epsilon, delta=budget.delta,
        mechanisms=[accounting.mechanism_fields(m) for m in compiled.ledger(end_step)
                    if m.count > 0],
        sampler=dict(sampler_info, dataset_size=n), steps=end_step,
        accountant=budget.accountant, accountant_version=accounting.accountant_version(),
        accountant_settings=accounting.accountant_settings(budget),
        accounting_note=accounting.accounting_note(compiled.run_event(end_step), budget),
        not_covered=not_covered(dataset, config))
    record = dict(
        pipeline=pipeline_name, gin_files=list(gin_files),
        stages=[dict(name=s.name, **s.options) for s in compiled.stages],
        dataset=dataset.name, model=model_name,
        dataset_size=n, validation_size=len(dataset.validation),
        public_size=0 if dataset.public is None else len(dataset.public),
        target_epsilon=budget.epsilon, epsilon=epsilon, delta=budget.delta,
        accountant=budget.accountant, noise_multiplier=compiled.noise_multiplier,
        l2_sensitivity=compiled.sensitivity, batch_size=config.batch_size,
        epochs=config.epochs, steps=end_step, planned_steps=total_steps,
        stop_reason=stop_reason, budget_enforced=config.enforce_budget, sampling=sampler_info,
        seed=config.seed,  # None for a release run: its OS-drawn seed is never written
        ema_decay=config.ema_decay,
        validation_accuracy=best["validation_accuracy"], best_step=best["step"],
        test_accuracy=test_acc, wall_time_s=time.time() - wall_start,
        final_params_sha256=records.tree_sha256(state.params),
        resumed_from_steps=resumed_from, nonfinite_examples=nonfinite_total,
        fidelity=None if not config.fidelity_every_steps else dict(
            every_steps=config.fidelity_every_steps, samples=len(fidelity["cosine"]),
            cosine_mean=float(np.mean(fidelity["cosine"])) if fidelity["cosine"] else None,
            noise_to_signal_mean=(float(np.mean(fidelity["noise_to_signal"]))
                                  if fidelity["noise_to_signal"] else None),
            non_private=True),
        dp_event=accounting.event_to_json(compiled.run_event(end_step)),
        settings_sha256=checkpoint.settings_digest(settings),
        calibration_s=calibration_s,
        median_step_s=float(np.median(steady)) if steady else None,
        versions=records.versions(), git_commit=records.git_commit(),
        devices=[str(d) for d in mesh.devices.flat], privacy_statement=statement,
        non_private_outputs=["train_loss, update_norm and nonfinite_examples in metrics.jsonl "
                             "are diagnostics computed from private batches; they are not "
                             "released by the accounted mechanism"] + (
            ["fidelity (fidelity_cosine, noise_to_signal) compares the release with the clean "
             "clipped gradient: non-private benchmark output"]
            if config.fidelity_every_steps else []))
    ckpts.close()
    records.atomic_write_text(workdir / "operative_config.gin", gin.operative_config_str())
    records.atomic_write_text(workdir / records.RECORD_NAME, records.to_json(record))
    logging.info("done: test accuracy %.4f (best validation %.4f at step %d), epsilon %.4f",
                 test_acc, best["validation_accuracy"], best["step"], epsilon)
    logging.info("privacy: %s", statement["statement"])
    return record
