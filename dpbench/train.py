"""The one train loop: data -> sampler -> compiled step -> evaluation -> run record."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dpbench import (accounting, checkpoint, data, numerics, records, run_record, sharding,
                     stage_check)
from dpbench.compiler.rules import validate_pipeline
from dpbench.config import TrainConfig, pipeline_stages
from dpbench.run import Run, build_run, run_settings


def _evaluate(apply_fn, params, split: data.Split, batch_size: int) -> float:
    correct = 0
    for start in range(0, len(split), batch_size):
        images = split.images[start:start + batch_size]
        labels = split.labels[start:start + batch_size]
        correct += int(apply_fn(params, images, labels))
    return correct / max(len(split), 1)


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


def _budget_stop(compiled, budget, config: TrainConfig) -> tuple:
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


def _restore_or_init(run: Run, ckpts, settings: dict, workdir: Path, config: TrainConfig):
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
    _truncate_metrics(workdir, latest)
    logging.info("resuming %s from its checkpoint at step %d (epsilon spent %.4f)",
                 workdir, latest, epsilon_then)
    return state, progress


def _save_checkpoint(ckpts, compiled, state, progress: Progress, settings: dict, done: int,
                     epsilon: float, key_saved: bool) -> None:
    ledger = dict(
        format=1, step=done, settings=settings,
        settings_sha256=checkpoint.settings_digest(settings), epsilon_spent=epsilon,
        dp_event=accounting.event_to_json(compiled.run_event(done)),
        best_validation_accuracy=progress.best["validation_accuracy"],
        best_step=progress.best["step"], resumed_from=progress.resumed_from,
        nonfinite_examples=progress.nonfinite_total, fidelity=progress.fidelity,
        key_saved=key_saved)
    ckpts.save(state, best_params=progress.best["params"],
               ledger=json.loads(records.to_json(ledger)))
    progress.last_saved = done


class _Loop(NamedTuple):
    """The loop's fixed context (see :func:`_train_loop`)."""

    run: Run
    config: TrainConfig
    workdir: Path
    ckpts: Any
    settings: dict
    eval_fn: Callable
    wall_start: float


def selection_accuracy(eval_fn, params, dataset: data.Dataset, batch_size: int) -> float:
    """The score that chooses the reported model among a run's evaluated steps (its best
    step): accuracy on the validation split, carved from the training set. Never the test
    split: test accuracy is read once, on the chosen params, for the run record."""
    return _evaluate(eval_fn, params, dataset.validation, batch_size)


def _maybe_evaluate(loop: _Loop, state, progress: Progress, done: int, end_step: int) -> None:
    """Every eval interval and at the end: validation accuracy; the best params are kept."""
    eval_every = loop.config.eval_every_steps or max(int(round(loop.run.steps_per_epoch)), 1)
    if done % eval_every and done != end_step:
        return
    params = loop.run.compiled.evaluation_params(state)  # the debiased EMA when there is one
    if not len(loop.run.dataset.validation):  # a refit: the last step's model is reported
        if done == end_step:
            progress.best = {"validation_accuracy": None, "step": done,
                             "params": checkpoint.to_host(params)}
        return
    val_acc = selection_accuracy(loop.eval_fn, params, loop.run.dataset,
                                 loop.config.eval_batch_size)
    logging.info("step %d  validation accuracy %.4f", done, val_acc)
    records.append_metrics(loop.workdir, dict(step=done, validation_accuracy=val_acc))
    if val_acc > progress.best["validation_accuracy"]:
        progress.best = {"validation_accuracy": val_acc, "step": done,
                         "params": checkpoint.to_host(params)}


def _record_fidelity(loop: _Loop, metrics, progress: Progress, done: int) -> None:
    every = loop.config.fidelity_every_steps
    if every and done % every == 0:
        row = {name: float(metrics[name]) for name in ("fidelity_cosine", "noise_to_signal")}
        progress.fidelity["cosine"].append(row["fidelity_cosine"])
        progress.fidelity["noise_to_signal"].append(row["noise_to_signal"])
        records.append_metrics(loop.workdir, dict(step=done, **row))


def _train_loop(loop: _Loop, state, progress: Progress, start_step: int, end_step: int):
    """Steps ``start_step .. end_step - 1`` with the periodic actions: fidelity, evaluation,
    and (at log / checkpoint steps) the divergence check, the log line and the checkpoint.
    Plain modulo tests: a periodic-actions library (clu) would add a dependency for this."""
    run, config, compiled = loop.run, loop.config, loop.run.compiled
    last_log_time, last_log_step = time.time(), start_step
    nonfinite_device = jnp.zeros((), jnp.float32)
    for step in range(start_step, end_step):
        state, metrics = compiled.step(state, run.host_batch(step))
        nonfinite_device = nonfinite_device + metrics["nonfinite_examples"]
        done = step + 1
        _record_fidelity(loop, metrics, progress, done)
        _maybe_evaluate(loop, state, progress, done, end_step)
        log_now = done % config.log_every_steps == 0 or done == end_step
        save_now = done % config.checkpoint_every_steps == 0 or done == end_step
        if not (log_now or save_now):
            continue
        jax.block_until_ready(state)
        now, loss = time.time(), float(metrics["train_loss"])
        progress.nonfinite_total += float(nonfinite_device)
        nonfinite_device = jnp.zeros((), jnp.float32)
        if (not math.isfinite(loss) or bool(metrics["all_nonfinite"])
                or (save_now and not _params_finite(state.params))):
            raise TrainingDiverged(
                f"training diverged at step {done} (train loss {loss}); the last good "
                f"checkpoint is step {progress.last_saved} in {loop.ckpts.directory}. Lower "
                "optimize.optax.learning_rate and start a new --workdir")
        epsilon = compiled.epsilon_after(done)
        if log_now:
            rate = (done - last_log_step) / max(now - last_log_time, 1e-9)
            progress.interval_step_s.append(1.0 / rate)
            last_log_time, last_log_step = now, done
            logging.info("step %d/%d  %.2f steps/s  epsilon spent %.4f  loss %.4f",
                         done, compiled.total_steps, rate, epsilon, loss)
            records.append_metrics(loop.workdir, dict(
                step=done, steps_per_s=rate, epsilon=epsilon, train_loss=loss,
                nonfinite_examples=progress.nonfinite_total, wall_s=now - loop.wall_start))
        if save_now:
            _save_checkpoint(loop.ckpts, compiled, state, progress, loop.settings, done,
                             epsilon, key_saved=config.seed is not None)
    return state


def train(workdir: str | Path, config: Optional[TrainConfig] = None,
          budget: Optional[accounting.Budget] = None, gin_files: Sequence[str] = (),
          overwrite: bool = False) -> dict:
    """Trains the configured pipeline and writes metrics and the run record into ``workdir``.

    A workdir holding checkpoints of an unfinished run is resumed from its newest intact
    checkpoint (same settings required); one holding a finished run is refused unless
    ``overwrite``.
    """
    wall_start, workdir = time.time(), Path(workdir)
    config = TrainConfig() if config is None else config
    config.validate()
    budget = accounting.Budget() if budget is None else budget
    pipeline_name, stages = pipeline_stages()
    validate_pipeline(stages)  # fail on a bad pipeline before loading any data
    # a stage that is not dpbench's own: its declaration verified on synthetic data first
    verified = stage_check.verify_pipeline(stages)
    created = not workdir.exists()
    prepare_workdir(workdir, overwrite)
    try:
        run = build_run(stages, config, budget)
    except BaseException:
        if created and not any(workdir.iterdir()):
            workdir.rmdir()  # refused before training: no empty workdir left behind
        raise
    compiled, sampler = run.compiled, run.sampler
    logging.info("pipeline %s: sigma=%.5f sensitivity=%g steps=%d q=%.5g padded batch=%d "
                 "(calibrated in %.1fs)", pipeline_name, compiled.noise_multiplier,
                 compiled.sensitivity, run.total_steps, sampler.sampling_rate,
                 sampler.padded_batch_size, run.compile_s)
    logging.info("per-example gradients: %s%s", compiled.plan.strategy,
                 f" ({compiled.plan.strategy_reason})" if compiled.plan.strategy_reason else "")
    end_step, stop_reason = _budget_stop(compiled, budget, config)
    settings = run_settings(pipeline_name=pipeline_name, compiled=compiled,
                            dataset=run.dataset, config=config, budget=budget,
                            model_name=run.model_name)
    records.atomic_write_text(workdir / "config.gin", gin.config_str())
    ckpts = checkpoint.RunCheckpoints(workdir / CHECKPOINTS,
                                      max_to_keep=config.checkpoints_to_keep,
                                      save_key=config.seed is not None)
    state, progress = _restore_or_init(run, ckpts, settings, workdir, config)
    start_step = int(jax.device_get(state.step))
    eval_fn = jax.jit(lambda p, x, y: jnp.sum(jnp.argmax(run.model.apply(p, x), -1) == y))
    loop = _Loop(run, config, workdir, ckpts, settings, eval_fn, wall_start)
    state = _train_loop(loop, state, progress, start_step, end_step)
    if start_step == end_step:
        logging.info("the checkpoint at step %d already holds the whole run", end_step)
    ckpts.close()
    record = _run_record(loop, state, progress, pipeline_name, gin_files, budget, end_step,
                         stop_reason, verified)
    records.atomic_write_text(workdir / "operative_config.gin", gin.operative_config_str())
    records.atomic_write_text(workdir / records.RECORD_NAME, records.to_json(record))
    logging.info("done: test accuracy %.4f (best validation %s at step %d), epsilon %.4f",
                 record["test_accuracy"], "none (refit)" if record["validation_accuracy"] is None
                 else f"{record['validation_accuracy']:.4f}", record["best_step"],
                 record["epsilon"])
    logging.info("privacy: %s", record["privacy_statement"]["statement"])
    return record


def _run_record(loop: _Loop, state, progress: Progress, pipeline_name: str, gin_files,
                budget, end_step: int, stop_reason: str, verified: dict) -> dict:
    """The run record: settings, privacy statement, accuracies, timings, versions;
    ``verified`` maps each outside stage to the checks it passed before training."""
    run, config = loop.run, loop.config
    compiled, dataset, best = run.compiled, run.dataset, progress.best
    test_acc = _evaluate(loop.eval_fn, best["params"], dataset.test, config.eval_batch_size)
    epsilon = compiled.epsilon_after(end_step)
    steady = progress.interval_step_s[1:] or progress.interval_step_s  # first holds compile
    sources = [dict(source, checks_passed=verified[source["stage"]])  # what dpbench verified
               for source in stage_check.stage_sources(s.name for s in compiled.plan.stages)]
    return dict(
        pipeline=pipeline_name, gin_files=list(gin_files), stages=compiled.plan.facts(),
        dataset=dataset.name, features=dataset.features, model=run.model_name,
        dataset_size=len(dataset.train), validation_size=len(dataset.validation),
        public_size=0 if dataset.public is None else len(dataset.public),
        target_epsilon=budget.epsilon, epsilon=epsilon, delta=budget.delta,
        accountant=budget.accountant, noise_multiplier=compiled.noise_multiplier,
        l2_sensitivity=compiled.sensitivity, batch_size=config.batch_size,
        epochs=config.epochs, steps=end_step, planned_steps=run.total_steps,
        stop_reason=stop_reason, budget_enforced=config.enforce_budget,
        per_example_strategy=compiled.plan.strategy,
        per_example_strategy_reason=compiled.plan.strategy_reason or None,
        sampling=run.sampler.describe(),
        seed=config.seed,  # None for a release run: its OS-drawn seed is never written
        ema_decay=config.ema_decay, validation_accuracy=best["validation_accuracy"],
        best_step=best["step"], test_accuracy=test_acc,
        wall_time_s=time.time() - loop.wall_start,
        final_params_sha256=records.tree_sha256(state.params),
        final_params_fingerprint=numerics.params_fingerprint(state.params),
        host_numerics=numerics.host_numerics(),
        resumed_from_steps=progress.resumed_from, nonfinite_examples=progress.nonfinite_total,
        fidelity=run_record.fidelity_summary(config, progress.fidelity),
        dp_event=accounting.event_to_json(compiled.run_event(end_step)),
        settings_sha256=checkpoint.settings_digest(loop.settings), calibration_s=run.compile_s,
        median_step_s=float(np.median(steady)) if steady else None,
        versions=records.versions(), git_commit=records.git_commit(),
        git_dirty=records.git_dirty(),
        stage_sources=sources,
        devices=[str(d) for d in run.mesh.devices.flat],
        privacy_statement=run_record.privacy_statement(run, budget, config, end_step, epsilon,
                                                       sources),
        non_private_outputs=["train_loss, update_norm and nonfinite_examples in metrics.jsonl "
                             "are diagnostics computed from private batches; they are not "
                             "released by the accounted mechanism"] + (
            ["fidelity (fidelity_cosine, noise_to_signal) compares the release with the clean "
             "clipped gradient: non-private benchmark output"]
            if config.fidelity_every_steps else []))
