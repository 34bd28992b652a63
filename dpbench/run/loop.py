"""The one train loop: data -> sampler -> compiled step -> evaluation -> checkpoints -> run
record (``train``, what ``dpbench train`` and ``api.train`` call)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
from absl import logging

from dpbench import accounting, checkpoint, data, records
from dpbench.compiler import check as stage_check
from dpbench.compiler.rules import validate_pipeline
from dpbench.config import TrainConfig, pipeline_stages
from dpbench.run import interrupts
from dpbench.run import record as run_record
from dpbench.run.build import Run
from dpbench.run.settings import Settings
from dpbench.run.start import Progress, start as start_run


def _evaluate(apply_fn, params, split: data.Split, batch_size: int) -> float:
    correct = 0
    for start in range(0, len(split), batch_size):
        images = split.images[start:start + batch_size]
        labels = split.labels[start:start + batch_size]
        correct += int(apply_fn(params, images, labels))
    return correct / max(len(split), 1)


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became non-finite; the last good checkpoint is kept."""


def _params_finite(params) -> bool:
    return bool(jax.device_get(jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)]))))


def save_checkpoint(ckpts, compiled, state, progress: Progress, settings: Settings, done: int,
                    epsilon: float, key_saved: bool) -> None:
    """The state, the best params and the privacy ledger (the settings, the epsilon spent after
    ``done`` steps, its DpEvent, and the loop's progress) as one checkpoint."""
    ledger = dict(
        format=1, step=done, settings=settings.as_json(), settings_sha256=settings.digest(),
        epsilon_spent=epsilon, dp_event=accounting.event_to_json(compiled.run_event(done)),
        best_validation_accuracy=progress.best["validation_accuracy"],
        best_step=progress.best["step"], resumed_from=progress.resumed_from,
        nonfinite_examples=progress.nonfinite_total, fidelity=progress.fidelity,
        key_saved=key_saved)
    ckpts.save(state, best_params=progress.best["params"],
               ledger=json.loads(records.to_json(ledger)))
    progress.last_saved = done


class _Loop(NamedTuple):
    """The loop's fixed context (see :func:`train_steps`)."""

    run: Run
    config: TrainConfig
    workdir: Path
    ckpts: Any
    settings: Settings
    eval_fn: Callable
    wall_start: float
    label: str = ""  # the trial's name in a group's log lines ("" alone)


def selection_accuracy(eval_fn, params, dataset: data.Dataset, batch_size: int) -> float:
    """The score that chooses the reported model among a run's evaluated steps (its best
    step): accuracy on the validation split, carved from the training set. Never the test
    split: test accuracy is read once, on the chosen params, for the run record."""
    return _evaluate(eval_fn, params, dataset.validation, batch_size)


def _maybe_evaluate(loop: _Loop, state_of: Callable, progress: Progress, done: int,
                    end_step: int) -> None:
    """Every eval interval and at the end: validation accuracy; the best params are kept."""
    eval_every = loop.config.eval_every_steps or max(int(round(loop.run.steps_per_epoch)), 1)
    if done % eval_every and done != end_step:
        return
    params = loop.run.compiled.evaluation_params(state_of())  # the debiased EMA if there is one
    if not len(loop.run.dataset.validation):  # a refit: the last step's model is reported
        if done == end_step:
            progress.best = {"validation_accuracy": None, "step": done,
                             "params": checkpoint.to_host(params)}
        return
    val_acc = selection_accuracy(loop.eval_fn, params, loop.run.dataset,
                                 loop.config.eval_batch_size)
    logging.info("%sstep %d  validation accuracy %.4f", loop.label, done, val_acc)
    records.append_metrics(loop.workdir, dict(step=done, validation_accuracy=val_acc))
    if val_acc > progress.best["validation_accuracy"]:
        progress.best = {"validation_accuracy": val_acc, "step": done,
                         "params": checkpoint.to_host(params)}


def _record_fidelity(loop: _Loop, metrics_of: Callable, progress: Progress, done: int) -> None:
    every = loop.config.fidelity_every_steps
    if every and done % every == 0:
        metrics = metrics_of()
        row = {name: float(metrics[name]) for name in ("fidelity_cosine", "noise_to_signal")}
        progress.fidelity["cosine"].append(row["fidelity_cosine"])
        progress.fidelity["noise_to_signal"].append(row["noise_to_signal"])
        records.append_metrics(loop.workdir, dict(step=done, **row))


def _first_steps_note(state, done: int, start_step: int, end_step: int, times: list) -> None:
    """After a loop's first and second steps: how long they took and the time left, so a slow
    model on a CPU says what it is doing before its first log line. ``times`` starts as [the
    loop's start]; each call within the first two steps adds the time its step finished."""
    if done - start_step > 2 or done >= end_step:
        return
    jax.block_until_ready(state)
    times.append(time.time())
    if len(times) == 2:
        logging.info("step %d done in %.1f s (compilation included)", done, times[1] - times[0])
    else:
        per_step = times[2] - times[1]
        logging.info("one step takes %.2f s: about %.1f min for the %d steps left", per_step,
                     per_step * (end_step - done) / 60, end_step - done)


class TrialSteps:
    """One trial's side of the loop after each of its steps: fidelity, evaluation, and (at log
    / checkpoint steps) the divergence check, the log line and the checkpoint. The solo loop
    and the group loop (run/group.py) both drive it, so a trial in a group does after each
    step exactly what it does alone. ``state_of()`` and ``metrics_of()`` give the trial's
    state and metrics (a group slices them only when an action needs them). The non-finite
    count is summed on the device between log lines: by this object from each step's metrics,
    or, given ``take_nonfinite`` (a group's one sum for all its trials), read from there.
    Plain modulo tests: a periodic-actions library (clu) would add a dependency for this."""

    def __init__(self, loop: _Loop, progress: Progress, start_step: int, end_step: int,
                 notes: bool = True, take_nonfinite: Optional[Callable] = None):
        self.loop, self.progress, self.end_step = loop, progress, end_step
        self.start_step = start_step
        self.last_log_time, self.last_log_step = time.time(), start_step
        self.first_times = [self.last_log_time] if notes else None
        self.nonfinite = jnp.zeros((), jnp.float32)
        self.take_nonfinite = take_nonfinite

    def _take_nonfinite(self) -> float:
        if self.take_nonfinite is not None:
            return self.take_nonfinite()
        count, self.nonfinite = float(self.nonfinite), jnp.zeros((), jnp.float32)
        return count

    def after_step(self, state_of: Callable, metrics_of: Callable, done: int) -> None:
        loop, progress, end_step = self.loop, self.progress, self.end_step
        config, compiled = loop.config, loop.run.compiled
        if self.take_nonfinite is None:
            self.nonfinite = self.nonfinite + metrics_of()["nonfinite_examples"]
        if self.first_times is not None:
            _first_steps_note(state_of(), done, self.start_step, end_step, self.first_times)
        _record_fidelity(loop, metrics_of, progress, done)
        _maybe_evaluate(loop, state_of, progress, done, end_step)
        log_now = done % config.log_every_steps == 0 or done == end_step
        save_now = done % config.checkpoint_every_steps == 0 or done == end_step
        if not (log_now or save_now):
            return
        state, metrics = state_of(), metrics_of()
        jax.block_until_ready(state)
        now, loss = time.time(), float(metrics["train_loss"])
        progress.nonfinite_total += self._take_nonfinite()
        if (not math.isfinite(loss) or bool(metrics["all_nonfinite"])
                or (save_now and not _params_finite(state.params))):
            raise TrainingDiverged(
                f"training diverged at step {done} (train loss {loss}); the last good "
                f"checkpoint is step {progress.last_saved} in {loop.ckpts.directory}. Lower "
                "optimize.optax.learning_rate and start a new --workdir")
        epsilon = compiled.epsilon_after(done)
        if log_now:
            rate = (done - self.last_log_step) / max(now - self.last_log_time, 1e-9)
            progress.interval_step_s.append(1.0 / rate)
            self.last_log_time, self.last_log_step = now, done
            logging.info("%sstep %d/%d  %.2f steps/s  epsilon spent %.4f  loss %.4f",
                         loop.label, done, compiled.total_steps, rate, epsilon, loss)
            records.append_metrics(loop.workdir, dict(
                step=done, steps_per_s=rate, epsilon=epsilon, train_loss=loss,
                nonfinite_examples=progress.nonfinite_total, wall_s=now - loop.wall_start))
        if save_now:
            save_checkpoint(loop.ckpts, compiled, state, progress, loop.settings, done,
                             epsilon, key_saved=config.seed is not None)


def train_steps(loop: _Loop, state, progress: Progress, start_step: int, end_step: int):
    """Steps ``start_step .. end_step - 1``, each followed by the trial's periodic actions."""
    run = loop.run
    trial = TrialSteps(loop, progress, start_step, end_step)
    with interrupts.between_steps() as ctrl_c:
        for step in range(start_step, end_step):
            state, metrics = run.compiled.step(state, run.host_batch(step))
            trial.after_step(lambda: state, lambda: metrics, step + 1)
            ctrl_c.check()
    return state


def eval_fn_for(model) -> Callable:
    """The jitted count of correct predictions of ``model`` on a batch (shared by the trials
    of a group, whose model is one)."""
    return jax.jit(lambda p, x, y: jnp.sum(jnp.argmax(model.apply(p, x), -1) == y))


def begin(workdir: Path, config: TrainConfig, overwrite: bool, wall_start: float,
          eval_fn: Optional[Callable] = None, label: str = ""):
    """A configured trial (its gin parsed) up to its first step: the pipeline validated once,
    an outside stage verified, the workdir started (``run.start``). Returns (loop, started,
    start step, verified)."""
    config.validate()
    pipeline_name, stages = pipeline_stages()
    pipeline = validate_pipeline(stages)  # once, before any data is loaded
    # a stage that is not dpbench's own: its declaration verified on synthetic data first
    verified = stage_check.verify_pipeline(pipeline.stages)
    started = start_run(workdir, pipeline, config, pipeline_name, overwrite)
    run = started.run
    eval_fn = eval_fn_for(run.model) if eval_fn is None else eval_fn
    loop = _Loop(run, config, workdir, started.ckpts, started.settings, eval_fn, wall_start,
                 label)
    start_step = int(jax.device_get(started.state.step))
    return loop, started, start_step, verified


def finish(loop: _Loop, started, state, progress: Progress, start_step: int, gin_files,
           verified: dict, operative_config: str, group: Optional[dict] = None) -> dict:
    """The trial's end: the checkpoints closed, the test split read once on the chosen
    params, the run record and the operative config written (the record last)."""
    run, config, end_step = loop.run, loop.config, started.end_step
    if start_step == end_step:
        logging.info("%sthe checkpoint at step %d already holds the whole run", loop.label,
                     end_step)
    loop.ckpts.close()
    test_accuracy = _evaluate(loop.eval_fn, progress.best["params"], run.dataset.test,
                              config.eval_batch_size)
    record = run_record.run_record(
        started.settings, run, config, state, progress, end_step=end_step,
        stop_reason=started.stop_reason, test_accuracy=test_accuracy, gin_files=gin_files,
        verified=verified, wall_time_s=time.time() - loop.wall_start)
    if group is not None:
        record["group"] = group
    records.atomic_write_text(loop.workdir / records.OPERATIVE_CONFIG_NAME, operative_config)
    records.atomic_write_text(loop.workdir / records.RECORD_NAME, records.to_json(record))
    logging.info("%sdone: test accuracy %.4f (best validation %s at step %d), epsilon %.4f",
                 loop.label, record["test_accuracy"],
                 "none (refit)" if record["validation_accuracy"] is None
                 else f"{record['validation_accuracy']:.4f}", record["best_step"],
                 record["epsilon"])
    logging.info("%sprivacy: %s", loop.label, record["privacy_statement"]["statement"])
    return record


def train(workdir: str | Path, config: Optional[TrainConfig] = None,
          gin_files: Sequence[str] = (), overwrite: bool = False) -> dict:
    """Trains the configured pipeline (its budget: ``budget.*`` in gin) and writes metrics and
    the run record into ``workdir``.

    A workdir holding checkpoints of an unfinished run is resumed from its newest intact
    checkpoint (same settings required); one holding a finished run is refused unless
    ``overwrite``.
    """
    wall_start, workdir = time.time(), Path(workdir)
    config = TrainConfig() if config is None else config
    loop, started, start_step, verified = begin(workdir, config, overwrite, wall_start)
    state = train_steps(loop, started.state, started.progress, start_step, started.end_step)
    return finish(loop, started, state, started.progress, start_step, gin_files, verified,
                  gin.operative_config_str())
