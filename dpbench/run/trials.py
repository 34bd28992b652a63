"""Trials in, records out: the one way dpbench trains.

``train_trials`` starts every trial as ``dpbench train`` would (its own gin configuration,
workdir, checkpoints, resume, budget stop), packs them by their declared structure into groups
whose steps differ only in their numbers (run/group.py), and trains each group with the one
loop (run/loop.train_members). A trial alone is a group of one: its own compiled step, no
trace (the cost of a run). Every record carries ``group``: how many trials shared its step,
its place among them, the batching, and the settings in which its group's trials differ.

A trial past its planned steps takes no step and is charged nothing: its ledger and record
count the steps it took. A trial that diverges stops alone; the others go on.

``dpbench train --trials=TRIALS.json [--outcomes=OUTCOMES.json]`` (``run_trials_file``) is
the launcher every sweep uses (run/launch.py: its files and its command line).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
from absl import logging

from dpbench import config as config_lib
from dpbench import records
from dpbench.compiler import check as stage_check
from dpbench.compiler import group as group_lib
from dpbench.compiler.rules import validate_pipeline
from dpbench.run import group as run_group
from dpbench.run import launch
from dpbench.run.launch import Trial
from dpbench.run import loop as run_loop
from dpbench.run import start as run_start

__all__ = ["Trial", "begin", "run_trials_file", "start", "train", "train_trials"]


def eval_fn_for(model) -> Callable:
    """The jitted count of correct predictions of ``model`` on a batch (shared by the trials
    of a group, whose model is one)."""
    return jax.jit(lambda p, x, y: jnp.sum(jnp.argmax(model.apply(p, x), -1) == y))


def begin(workdir: Path, config: config_lib.TrainConfig, overwrite: bool, wall_start: float,
          gin_files: Sequence[str] = (), operative_config: Callable = lambda: "",
          label: str = "") -> run_loop.Member:
    """The configured trial (its gin parsed) up to its first step: the pipeline validated once,
    an outside stage verified, the workdir started (``run.start``). ``operative_config()`` is
    read once the run is built (gin's operative config lists what the build used)."""
    config.validate()
    pipeline_name, stages = config_lib.pipeline_stages()
    pipeline = validate_pipeline(stages)  # once, before any data is loaded
    # a stage that is not dpbench's own: its declaration verified on synthetic data first
    verified = stage_check.verify_pipeline(pipeline.stages)
    started = run_start.start(workdir, pipeline, config, pipeline_name, overwrite)
    return run_loop.Member(started.run, config, workdir, started,
                           int(jax.device_get(started.state.step)), verified,
                           eval_fn_for(started.run.model), wall_start, tuple(gin_files),
                           operative_config(), label)


def start(trial: Trial, overwrite: bool = False) -> run_loop.Member:
    """``trial`` configured (its gin parsed: gin is global, so trials start one at a time)
    and started up to its first step (:func:`begin`)."""
    config_lib.parse_config(list(trial.gin_files), list(trial.bindings))
    return begin(Path(trial.workdir), config_lib.TrainConfig(), overwrite, time.time(),
                 trial.gin_files, gin.operative_config_str,
                 label=f"[{Path(trial.workdir).name}] ")


def _train_alone(member: run_loop.Member, timings: Optional[dict] = None):
    """A group of one: its own compiled step (run/loop.Alone)."""
    timings = {} if timings is None else timings
    stepping, t0 = run_loop.Alone(member), time.time()
    (diverged,) = run_loop.train_members([member], stepping)
    t_end = time.time()
    timings["loop_s"] = timings.get("loop_s", 0.0) + t_end - t0
    done = diverged or run_loop.finish(member, stepping.state,
                                       dict(size=1, index=0, batching=None, lifted=[]))
    timings["ends_s"] = timings.get("ends_s", 0.0) + time.time() - t_end
    return done


def _train_group(group, budget: int, timings: dict) -> list:
    """Trains one compiled group to the end of its last trial; returns each trial's record or
    the TrainingDiverged that stopped it (adds its loop's and its ends' seconds to
    ``timings``)."""
    shared = group.members[0].eval_fn  # one model: one compiled evaluation for the group
    members = [m._replace(eval_fn=shared) for m in group.members]
    stepping = run_group.Grouped(group._replace(members=members))
    lifted = run_group.differing_settings(members)
    logging.info("a group of %d trials (%s), %d knobs, steps %d..%d; its trials differ in %s",
                 len(members), group.step.batching, len(group.step.knobs),
                 min(m.start_step for m in members), max(m.end_step for m in members),
                 ", ".join(lifted))
    t_start = time.time()
    outcomes = run_loop.train_members(members, stepping)
    jax.block_until_ready(stepping.states)
    info = dict(size=len(members), batching=group.step.batching, lifted=lifted,
                knobs=len(group.step.knobs), group_steps=stepping.steps,
                loop_s=time.time() - t_start, host_batch_s=stepping.host_s,
                planned_bytes=group.planned, budget_bytes=budget,
                batches=("gathered on the device" if group.data is not None
                         else "gathered on the host"))
    logging.info("the group's %d steps took %.1f s, %.1f s of it drawing and placing batches",
                 stepping.steps, info["loop_s"], stepping.host_s)
    t_end = time.time()
    done = [outcome or run_loop.finish(m, stepping.state_of(i), dict(info, index=i))
            for i, (m, outcome) in enumerate(zip(members, outcomes))]
    timings["loop_s"] = timings.get("loop_s", 0.0) + info["loop_s"]
    timings["ends_s"] = timings.get("ends_s", 0.0) + time.time() - t_end
    return done


def train(workdir, config: Optional[config_lib.TrainConfig] = None,
          gin_files: Sequence[str] = (), overwrite: bool = False) -> dict:
    """Trains the configured pipeline (gin already parsed; its budget: ``budget.*``) as a group
    of one and writes metrics and the run record into ``workdir``; raises TrainingDiverged.

    A workdir holding checkpoints of an unfinished run is resumed from its newest intact
    checkpoint (same settings required); one holding a finished run is refused unless
    ``overwrite``.
    """
    config = config_lib.TrainConfig() if config is None else config
    member = begin(Path(workdir), config, overwrite, time.time(), gin_files,
                            gin.operative_config_str)
    outcome = _train_alone(member)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def train_trials(trials: Sequence[Trial], overwrite: bool = False,
                 max_group_size: Optional[int] = None, batching: Optional[str] = None,
                 memory_budget: Optional[int] = None, gather: Optional[str] = None,
                 timings: Optional[dict] = None) -> list:
    """Trains ``trials`` in groups (each group one compiled step); returns, per trial in
    order, its run record or the TrainingDiverged that stopped it. Each trial's workdir holds
    what ``dpbench train`` would leave there (resumed from its own checkpoints when it has
    some). ``max_group_size`` caps a group; ``memory_budget`` (bytes; default
    run/group.device_memory_budget) caps its compiled step's buffer plan; ``batching``:
    compiler/group.default_batching; ``gather``: where a group's examples are gathered
    (run/group.default_gather; 'device' applies to trials on the same data). ``timings``, when
    given, gets the host's seconds by phase: starts_s (every trial started, one after another),
    compare_s (their programs compared and packed), compile_s (the group steps compiled),
    loop_s (the groups' loops) and ends_s (their trials finished, one after another)."""
    timings = {} if timings is None else timings
    gather = run_group.default_gather() if gather is None else gather
    if gather not in run_group.GATHERS:
        raise ValueError(f"gather must be one of {run_group.GATHERS}, got {gather!r}")
    outcomes: list = [None] * len(trials)
    todo = []
    for i, trial in enumerate(trials):
        finished = Path(trial.workdir) / records.RECORD_NAME
        if finished.exists() and not overwrite:  # finished before a restart: never rerun
            outcomes[i] = json.loads(finished.read_text())
        else:
            todo.append(i)
    t0 = time.time()
    members = [start(trials[i], overwrite) for i in todo]
    timings["starts_s"] = time.time() - t0
    if len(members) == 1:  # alone: no trace (a group of one costs what a run does)
        outcomes[todo[0]] = _train_alone(members[0], timings)
        return outcomes
    # each step as its compile traced it for the shape check (no second trace)
    t0 = time.time()
    traced = [group_lib.traced_of(*m.run.compiled.step_program) for m in members]
    budget = run_group.device_memory_budget() if memory_budget is None else memory_budget
    declared = [run_group.declared_key(m) for m in members]
    where = {id(m): i for m, i in zip(members, todo)}
    settings_of = lambda ids: run_group.differing_settings([members[k] for k in ids])  # noqa: E731
    packs = run_group.pack(traced, max_group_size, declared, settings_of)
    timings["compare_s"] = time.time() - t0
    for ids in packs:
        t0 = time.time()
        groups = run_group.fitting_groups([members[k] for k in ids], [traced[k] for k in ids],
                                          batching, budget, gather)
        timings["compile_s"] = timings.get("compile_s", 0.0) + time.time() - t0
        for group in groups:
            results = ([_train_alone(group.members[0], timings)] if group.step is None
                       else _train_group(group, budget, timings))
            for member, result in zip(group.members, results):
                outcomes[where[id(member)]] = result
    return outcomes


def run_trials_file(path: Path, outcomes_path: Optional[Path] = None,
                    overwrite: bool = False) -> list:
    """``dpbench train --trials=PATH [--outcomes=OUTCOMES]``: the file's trials trained in
    groups; each trial's outcome printed and, given ``outcomes_path``, written there
    atomically once every trial has one (the only place a launcher reads divergence from)."""
    trials = launch.read_trials_file(path)
    outcomes = [launch.outcome_of(t, r) for t, r in zip(trials, train_trials(trials, overwrite))]
    for outcome in outcomes:
        print(f"{outcome['workdir']}: {outcome['outcome']}", flush=True)
    if outcomes_path is not None:
        records.atomic_write_text(Path(outcomes_path), json.dumps(outcomes, indent=1) + "\n")
    return outcomes
