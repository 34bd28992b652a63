"""The one train loop: one compiled step for every trial it trains, then each trial's periodic
actions (``train_members``; a solo run is a group of one, run/trials.py). A trial enters it as a
:class:`Member` (run/trials.begin) and leaves it through ``finish`` (its test accuracy and run
record)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
from absl import logging

from dpbench import accounting, checkpoint, data, records
from dpbench.run import interrupts
from dpbench.run import record as run_record


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


def is_due(done: int, every: int, end_step: Optional[int] = None) -> bool:
    """Whether a periodic action runs after step ``done``: every ``every`` steps (never when
    ``every`` is 0) and, given ``end_step``, after the last. The one rule of every periodic
    action (evaluation, log line, checkpoint, fidelity)."""
    return done == end_step or (every > 0 and done % every == 0)


def save_checkpoint(ckpts, compiled, state, progress, settings, done: int, epsilon: float,
                    key_saved: bool) -> None:
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


class Member(NamedTuple):
    """One trial at its first step: everything the loop and its end read of it (the loop
    imports none of the modules that build it: run/trials.begin makes it)."""

    run: Any              # run/build.Run
    config: Any           # config.TrainConfig
    workdir: Path
    started: Any          # run/start.Started: settings, checkpoints, state, progress, end step
    start_step: int
    verified: dict        # what an outside stage's declaration passed
    eval_fn: Callable
    wall_start: float
    gin_files: tuple = ()
    operative_config: str = ""
    label: str = ""       # the trial's name in a group's log lines ("" alone)

    @property
    def ckpts(self):
        return self.started.ckpts

    @property
    def progress(self):  # run/start.Progress
        return self.started.progress

    @property
    def end_step(self) -> int:
        return self.started.end_step


def selection_accuracy(eval_fn, params, dataset: data.Dataset, batch_size: int) -> float:
    """The score that chooses the reported model among a run's evaluated steps (its best
    step): accuracy on the validation split, carved from the training set. Never the test
    split: test accuracy is read once, on the chosen params, for the run record."""
    return _evaluate(eval_fn, params, dataset.validation, batch_size)


def _maybe_evaluate(member: Member, state_of: Callable, done: int) -> None:
    """Every eval interval and at the end: validation accuracy; the best params are kept."""
    run, config, progress = member.run, member.config, member.progress
    eval_every = config.eval_every_steps or max(int(round(run.steps_per_epoch)), 1)
    if not is_due(done, eval_every, member.end_step):
        return
    params = run.compiled.evaluation_params(state_of())  # the debiased EMA if there is one
    if not len(run.dataset.validation):  # a refit: the last step's model is reported
        if done == member.end_step:
            progress.best = {"validation_accuracy": None, "step": done,
                             "params": checkpoint.to_host(params)}
        return
    val_acc = selection_accuracy(member.eval_fn, params, run.dataset, config.eval_batch_size)
    logging.info("%sstep %d  validation accuracy %.4f", member.label, done, val_acc)
    records.append_metrics(member.workdir, dict(step=done, validation_accuracy=val_acc))
    if val_acc > progress.best["validation_accuracy"]:
        progress.best = {"validation_accuracy": val_acc, "step": done,
                         "params": checkpoint.to_host(params)}


def _record_fidelity(member: Member, metrics_of: Callable, done: int) -> None:
    # not forced at the end: a diagnostic on its own grid
    if is_due(done, member.config.fidelity_every_steps):
        metrics, fidelity = metrics_of(), member.progress.fidelity
        row = {name: float(metrics[name]) for name in ("fidelity_cosine", "noise_to_signal")}
        fidelity["cosine"].append(row["fidelity_cosine"])
        fidelity["noise_to_signal"].append(row["noise_to_signal"])
        records.append_metrics(member.workdir, dict(step=done, **row))


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
    / checkpoint steps) the divergence check, the log line and the checkpoint. ``state_of()``
    and ``metrics_of()`` give the trial's state and metrics (a group slices them only when an
    action needs them); ``take_nonfinite()`` reads and zeroes the trial's non-finite example
    count, summed on the device since its last log line."""

    def __init__(self, member: Member, take_nonfinite: Callable, notes: bool = True):
        self.member, self.take_nonfinite = member, take_nonfinite
        self.last_log_time, self.last_log_step = time.time(), member.start_step
        self.first_times = [self.last_log_time] if notes else None

    def after_step(self, state_of: Callable, metrics_of: Callable, done: int) -> None:
        member = self.member
        config, compiled, progress = member.config, member.run.compiled, member.progress
        end_step = member.end_step
        if self.first_times is not None:
            _first_steps_note(state_of(), done, member.start_step, end_step, self.first_times)
        _record_fidelity(member, metrics_of, done)
        _maybe_evaluate(member, state_of, done)
        log_now = is_due(done, config.log_every_steps, end_step)
        save_now = is_due(done, config.checkpoint_every_steps, end_step)
        if not (log_now or save_now):
            return
        state, metrics = state_of(), metrics_of()
        jax.block_until_ready(state)
        now, loss = time.time(), float(metrics["train_loss"])
        progress.nonfinite_total += self.take_nonfinite()
        if (not math.isfinite(loss) or bool(metrics["all_nonfinite"])
                or (save_now and not _params_finite(state.params))):
            raise TrainingDiverged(
                f"training diverged at step {done} (train loss {loss}); the last good "
                f"checkpoint is step {progress.last_saved} in {member.ckpts.directory}. Lower "
                "optimize.optax.learning_rate and start a new --workdir")
        epsilon = compiled.epsilon_after(done)
        if log_now:
            rate = (done - self.last_log_step) / max(now - self.last_log_time, 1e-9)
            progress.interval_step_s.append(1.0 / rate)
            self.last_log_time, self.last_log_step = now, done
            logging.info("%sstep %d/%d  %.2f steps/s  epsilon spent %.4f  loss %.4f",
                         member.label, done, compiled.total_steps, rate, epsilon, loss)
            records.append_metrics(member.workdir, dict(
                step=done, steps_per_s=rate, epsilon=epsilon, train_loss=loss,
                nonfinite_examples=progress.nonfinite_total, wall_s=now - member.wall_start))
        if save_now:
            save_checkpoint(member.ckpts, compiled, state, progress, member.started.settings,
                            done, epsilon, key_saved=config.seed is not None)


class Stepping(Protocol):
    """How the loop steps its members: ``step(at, ends)`` takes one compiled step of every
    member whose ``at`` is before its end (the others are left as they were);
    ``state_of(i)`` / ``metrics_of(i)`` give member i's state and last metrics;
    ``take_nonfinite(i)`` reads and zeroes its non-finite count. A trial alone and a group
    (run/group.Grouped) each implement it."""

    def step(self, at: list, ends) -> None: ...

    def state_of(self, i: int): ...

    def metrics_of(self, i: int): ...

    def take_nonfinite(self, i: int) -> float: ...


class Alone:
    """One trial on its own compiled step (no trace, no stacking: the cost of a run)."""

    def __init__(self, member: Member):
        self.run, self.state, self.metrics = member.run, member.started.state, None
        self.nonfinite = jnp.zeros((), jnp.float32)

    def step(self, at: list, ends) -> None:
        self.state, self.metrics = self.run.compiled.step(self.state, self.run.host_batch(at[0]))
        self.nonfinite = self.nonfinite + self.metrics["nonfinite_examples"]

    def state_of(self, i: int):
        return self.state

    def metrics_of(self, i: int):
        return self.metrics

    def take_nonfinite(self, i: int) -> float:
        count, self.nonfinite = float(self.nonfinite), jnp.zeros((), jnp.float32)
        return count


def train_members(members: Sequence[Member], stepping: Stepping) -> list:
    """THE loop: steps every member from its start to its end step, one ``stepping.step`` for
    all of them per step, each followed by every member's own periodic actions. A member that
    diverges stops alone (its checkpoints closed; the others go on). Returns per member None
    (trained to its end step) or the TrainingDiverged that stopped it."""
    at = [m.start_step for m in members]
    ends = [m.end_step for m in members]
    sides = [TrialSteps(m, lambda i=i: stepping.take_nonfinite(i), notes=(i == 0))
             for i, m in enumerate(members)]
    outcomes: list = [None] * len(members)
    with interrupts.between_steps() as ctrl_c:
        while any(a < e for a, e in zip(at, ends)):
            stepping.step(at, ends)
            for i, member in enumerate(members):
                if at[i] >= ends[i]:
                    continue
                at[i] += 1
                try:
                    sides[i].after_step(lambda i=i: stepping.state_of(i),
                                        lambda i=i: stepping.metrics_of(i), at[i])
                except TrainingDiverged as e:
                    logging.warning("%s%s", member.label, e)
                    outcomes[i], ends[i] = e, at[i]
                    member.ckpts.close()
            ctrl_c.check()
    return outcomes


def finish(member: Member, state, group: dict) -> dict:
    """The trial's end: the checkpoints closed, the test split read once on the chosen
    params, the run record (with ``group``: how many trials shared its step) and the
    operative config written (the record last)."""
    run, config, progress = member.run, member.config, member.progress
    if member.start_step == member.end_step:
        logging.info("%sthe checkpoint at step %d already holds the whole run", member.label,
                     member.end_step)
    member.ckpts.close()
    test_accuracy = _evaluate(member.eval_fn, progress.best["params"], run.dataset.test,
                              config.eval_batch_size)
    record = run_record.run_record(
        member.started.settings, run, config, state, progress, end_step=member.end_step,
        stop_reason=member.started.stop_reason, test_accuracy=test_accuracy,
        gin_files=list(member.gin_files), verified=member.verified,
        wall_time_s=time.time() - member.wall_start)
    record["group"] = group
    records.atomic_write_text(member.workdir / records.OPERATIVE_CONFIG_NAME,
                              member.operative_config)
    records.atomic_write_text(member.workdir / records.RECORD_NAME, records.to_json(record))
    logging.info("%sdone: test accuracy %.4f (best validation %s at step %d), epsilon %.4f",
                 member.label, record["test_accuracy"],
                 "none (refit)" if record["validation_accuracy"] is None
                 else f"{record['validation_accuracy']:.4f}", record["best_step"],
                 record["epsilon"])
    logging.info("%sprivacy: %s", member.label, record["privacy_statement"]["statement"])
    return record
