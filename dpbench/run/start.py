"""A run at its workdir, up to its first step: the workdir (a finished run refused, or
archived with ``overwrite``), the run built, the step the budget stops it at, its settings,
and its state restored from the newest intact checkpoint (same settings, epsilon re-checked)
or initialized (``start``, which the train loop calls once)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import gin
import jax
from absl import logging

from dpbench import accounting, checkpoint, records, sharding
from dpbench.compiler.rules import ValidatedPipeline
from dpbench.config import TrainConfig
from dpbench.run import build
from dpbench.run.settings import Settings
from dpbench.stages.base import Stage


class WorkdirError(ValueError):
    """A --workdir that cannot hold a run (finished, or not writable)."""


class ResumeError(ValueError):
    """A workdir whose checkpoint was written under different settings."""


CHECKPOINTS = records.CHECKPOINTS_DIR
SUPERSEDED = records.SUPERSEDED_DIR


def saved_steps(workdir: Path) -> list:
    """The steps of the whole checkpoints in ``workdir``, read from its files alone."""
    return checkpoint.manifested_steps(Path(workdir) / CHECKPOINTS)


def prepare_workdir(workdir: Path, overwrite: bool = False) -> None:
    """Refuses a finished run (or archives it under superseded/ with ``overwrite``) and checks
    that the workdir is writable, before any data is loaded."""
    record = workdir / records.RECORD_NAME
    if record.exists():
        if not overwrite:
            raise WorkdirError(f"{record} holds a finished run; pick a new --workdir, or pass "
                               "--overwrite (api.train: overwrite=True) to move that run into "
                               "superseded/ and start again (finished results are never "
                               "deleted)")
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


def restore_or_init(run: build.Run, ckpts, settings: Settings, workdir: Path,
                    config: TrainConfig):
    """(state, progress): a fresh start, or the newest intact checkpoint of this workdir
    (same settings required, its epsilon re-checked against the accountant)."""
    latest = ckpts.latest_step()
    if latest is None:
        state = run.initial_state()
        best = {"validation_accuracy": -1.0, "step": 0,
                "params": checkpoint.to_host(state.params)}
        return state, Progress(best=best)
    ledger = ckpts.read_ledger(latest)
    changed = checkpoint.changed_settings(ledger["settings"], settings.as_json())
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

    run: build.Run
    settings: Settings
    ckpts: Any  # checkpoint.RunCheckpoints
    state: Any  # the TrainState at its first step
    progress: Progress
    end_step: int
    stop_reason: str


def start(workdir: Path, stages: Sequence[Stage] | ValidatedPipeline, config: TrainConfig,
          pipeline_name: str, overwrite: bool = False) -> Started:
    """The one home of a run before its first step: the workdir (a finished run refused, or
    archived with ``overwrite``), the run built (``build_run``), the step the budget stops it
    at, its settings (what its checkpoints' ledger depends on) and config.gin, and its state:
    restored from the workdir's newest intact checkpoint (same settings, epsilon re-checked)
    or initialized. A run refused before training leaves no empty workdir behind."""
    created = not workdir.exists()
    prepare_workdir(workdir, overwrite)
    try:
        run = build.build_run(stages, config)
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
    end_step, stop_reason = budget_stop(compiled, run.budget, config)
    settings = Settings.of(pipeline=pipeline_name, compiled=compiled, dataset=run.dataset,
                           model=run.model_name, config=config, budget=run.budget)
    records.atomic_write_text(workdir / records.CONFIG_NAME, gin.config_str())
    ckpts = checkpoint.RunCheckpoints(workdir / CHECKPOINTS,
                                      max_to_keep=config.checkpoints_to_keep,
                                      save_key=config.seed is not None)
    state, progress = restore_or_init(run, ckpts, settings, workdir, config)
    return Started(run, settings, ckpts, state, progress, end_step, stop_reason)
