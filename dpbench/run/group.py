"""Trials as data: a group of trials trained by one compiled step (compiler/group.py).

``train_trials`` starts every trial as ``dpbench train`` would (its own gin configuration,
workdir, checkpoints, resume, budget stop), packs the trials whose steps differ only in their
numbers into groups, and trains each group with one step per step of all its trials, each
trial doing after each of its steps exactly what it does alone (run/loop.TrialSteps). Each
trial writes its own run record in the solo format, plus ``group``: how many trials shared
its step, its place among them, and the batching.

A trial past its planned steps takes no step (the group step leaves its state as it was) and
is charged nothing: its ledger and record count the steps it took. A trial that diverges stops
alone; the others go on.

A group's size is the device's to decide: its step is compiled for all its trials and XLA's
buffer plan for it (``memory_analysis``) must fit ``MEMORY_FRACTION`` of the device's free
memory, or the group is halved and compiled again (the executable that fits is the one that
runs). The record's ``group`` keeps the plan's bytes and the budget.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging

from dpbench import config as config_lib
from dpbench import records, sharding
from dpbench.compiler import group as group_lib
from dpbench.run import interrupts
from dpbench.run import loop as run_loop


class Trial(NamedTuple):
    """One trial: where it writes, and its configuration (gin files and bindings, as
    ``dpbench train --gin_file ... --gin_bindings ...`` would take them)."""

    workdir: Path
    gin_files: tuple = ()
    bindings: tuple = ()


class _Started(NamedTuple):
    trial: Trial
    loop: object          # run/loop._Loop
    started: object       # run/start.Started
    start_step: int
    verified: dict
    operative_config: str
    idle_batch: dict      # a batch of the right shapes for the steps it does not take
    traced: Optional[group_lib.Traced] = None


MEMORY_FRACTION = 0.5  # of the device's free memory a group's step may plan for: the rest is
#                       the data, the evaluation and the runtime's own
# Processes that share one device each plan for their share: the sweep's pool sets this to
# its fraction over its workers (the allocator's free memory is each process's own view).
MEMORY_FRACTION_ENV = "DPBENCH_MEMORY_FRACTION"


def device_memory_budget() -> int:
    """Bytes a group's compiled step may plan for: ``MEMORY_FRACTION`` (or the fraction in
    ``$DPBENCH_MEMORY_FRACTION``, for processes sharing a device) of what the first device
    reports free (an accelerator's allocator limit less what is in use; a CPU's, the host's
    available memory)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = _host_available_bytes()
    fraction = os.environ.get(MEMORY_FRACTION_ENV)
    try:
        fraction = MEMORY_FRACTION if fraction is None else float(fraction)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"${MEMORY_FRACTION_ENV} must be a number in (0, 1], got "
                         f"{os.environ.get(MEMORY_FRACTION_ENV)!r}")
    return int(free * fraction)


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: the free pages
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def planned_bytes(compiled) -> int:
    """The peak of XLA's buffer plan for a compiled function: its arguments, its outputs
    that do not reuse a donated argument, and its temporaries."""
    plan = compiled.memory_analysis()
    return int(plan.argument_size_in_bytes + plan.output_size_in_bytes
               - plan.alias_size_in_bytes + plan.temp_size_in_bytes)


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _stack_on_host(trees):
    return jax.tree.map(lambda *leaves: np.stack(leaves), *trees)


def _start(trial: Trial, overwrite: bool) -> _Started:
    config_lib.parse_config(list(trial.gin_files), list(trial.bindings))
    config = config_lib.TrainConfig()
    loop, started, start_step, verified = run_loop.begin(
        Path(trial.workdir), config, overwrite, time.time(),
        label=f"[{Path(trial.workdir).name}] ")
    run = started.run
    return _Started(trial, loop, started, start_step, verified, gin.operative_config_str(),
                    run.host_batch(start_step))


def _traced(member: _Started) -> _Started:
    run = member.loop.run
    return member._replace(traced=group_lib.trace(run.compiled.lowered.step,
                                                  member.started.state, member.idle_batch))


def pack(traced: Sequence[group_lib.Traced], max_size: Optional[int] = None) -> list:
    """The trials (by index) in groups: equal programs up to their numbers, in input order,
    at most ``max_size`` trials a group."""
    by_program: dict = {}
    for i, t in enumerate(traced):
        by_program.setdefault((t.signature, t.in_tree, t.out_tree), []).append(i)
    groups = []
    for members in by_program.values():
        size = max_size or len(members)
        groups += [members[k:k + size] for k in range(0, len(members), size)]
    return groups


class _Counts:
    """The group's non-finite example counts, summed on the device between log lines; a
    trial takes (reads and zeroes) its own at its log steps."""

    def __init__(self, size: int):
        self.total = jnp.zeros((size,), jnp.float32)

    def add(self, counts) -> None:
        self.total = self.total + counts

    def take(self, i: int) -> float:
        count = float(self.total[i])
        self.total = self.total.at[i].set(0.0)
        return count


class _Compiled(NamedTuple):
    members: list        # _Started
    step: Optional[group_lib.GroupStep] = None   # None: a trial alone
    executable: object = None
    planned: int = 0
    data: object = None  # the training split whose examples the device gathers (or None)


GATHERS = ("device", "host")


def default_gather() -> str:
    """Where a group's examples are gathered: 'device' on an accelerator (the host then sends
    only indices: a trial-step of the tanh CNN at B 1024 is 3.2 MB of examples, ScatterNet's
    at B 8192 130 MB), 'host' on a CPU, where numpy's gather was faster than XLA's (4 Fashion-
    MNIST tanh-CNN trials, 54 steps, 2 Intel cores: the loop 18.9 s host, 21.1 s device)."""
    return "host" if jax.default_backend() == "cpu" else "device"


def _shared_training_data(members: list):
    """The members' training images and labels when every member trains on the same arrays
    (the in-process dataset cache makes equal datasets one object), else None."""
    trains = {id(m.loop.run.dataset.train.images) for m in members}
    return members[0].loop.run.dataset.train if len(trains) == 1 else None


def _drawn(member, step: int) -> dict:
    """``member``'s batch for ``step`` as the host draws it: the sampler's indices and mask
    laid out in micro-batches (and the stages' host randomness), without the examples."""
    run = member.loop.run
    compiled = run.compiled
    drawn = run.sampler.sample(step)
    shape = (compiled.micro_steps, compiled.micro_batch_size)
    out = {"index": drawn.indices.reshape(shape).astype(np.int32),
           "mask": drawn.mask.reshape(shape)}
    inputs = compiled.stage_inputs(step)
    if inputs:
        out[sharding.STAGE_INPUTS] = inputs
    return out


def _gathering(step: Callable) -> Callable:
    """The group step on drawn batches: each trial's examples gathered on the device from the
    training data (the same values the host would gather: a gather is exact)."""
    def gathered(knobs, ends, states, drawn, images, labels):
        batch = {k: v for k, v in drawn.items() if k != "index"}
        batch["image"], batch["label"] = images[drawn["index"]], labels[drawn["index"]]
        return step(knobs, ends, states, batch)
    return gathered


def _stacked_shapes(trees):
    return jax.tree.map(lambda *x: jax.ShapeDtypeStruct((len(x),) + x[0].shape, x[0].dtype),
                        *trees)


def _compile_group(members: list, batching: Optional[str], gather: str = "host") -> _Compiled:
    step = group_lib.group_step([m.traced for m in members], batching=batching)
    ends = jax.ShapeDtypeStruct((len(members),), jnp.int32)
    states = _stacked_shapes([m.started.state for m in members])
    data = _shared_training_data(members) if gather == "device" else None
    if data is None:  # trials on different data: the host gathers each trial's examples
        executable = jax.jit(step.step, donate_argnums=(2,)).lower(
            step.knobs, ends, states, _stacked_shapes([m.idle_batch for m in members]))
    else:
        drawn = _stack_on_host([_drawn(m, m.start_step) for m in members])
        executable = jax.jit(_gathering(step.step), donate_argnums=(2,)).lower(
            step.knobs, ends, states, drawn, data.images, data.labels)
    executable = executable.compile()
    return _Compiled(members, step, executable, planned_bytes(executable), data)


def fitting_groups(members: list, batching: Optional[str], budget: int,
                   gather: str = "host") -> list:
    """``members`` compiled as one group step, halved until each part's buffer plan fits
    ``budget`` bytes; a part of one trial is left alone (the solo loop). ``gather``: where
    the examples are gathered ('device' only for trials on the same data)."""
    if len(members) == 1:
        return [_Compiled(members)]
    compiled = _compile_group(members, batching, gather)
    if compiled.planned <= budget:
        return [compiled]
    logging.info("a group of %d trials plans %.3g GB, over its budget of %.3g GB: halved",
                 len(members), compiled.planned / 1e9, budget / 1e9)
    half = math.ceil(len(members) / 2)
    return (fitting_groups(members[:half], batching, budget, gather)
            + fitting_groups(members[half:], batching, budget, gather))


def _train_group(group: _Compiled, budget: int) -> list:
    """Trains one group to the end of its last trial; returns each trial's record or the
    TrainingDiverged that stopped it."""
    members, step, jitted = group.members, group.step, group.executable
    knobs = jax.device_put(step.knobs)
    shared = members[0].loop.eval_fn  # one model: one compiled evaluation for the group
    members = [m._replace(loop=m.loop._replace(eval_fn=shared)) for m in members]
    states = _stack([m.started.state for m in members])
    ends = np.array([m.started.end_step for m in members], np.int32)
    at = [m.start_step for m in members]
    counts = _Counts(len(members))
    data = group.data
    on_device = () if data is None else (jax.device_put(data.images),
                                         jax.device_put(data.labels))
    idle = [_drawn(m, m.start_step) if data is not None else m.idle_batch for m in members]
    sides = [run_loop.TrialSteps(m.loop, m.started.progress, m.start_step,
                                  m.started.end_step, notes=(i == 0),
                                  take_nonfinite=lambda i=i: counts.take(i))
             for i, m in enumerate(members)]
    outcomes: list = [None] * len(members)
    logging.info("a group of %d trials (%s), %d knobs, steps %d..%d", len(members),
                 step.batching, len(step.knobs), min(at), int(ends.max()))
    host_s, group_steps, t_start = 0.0, 0, time.time()
    with interrupts.between_steps() as ctrl_c:
        while any(a < e for a, e in zip(at, ends)):
            t0 = time.time()
            if data is None:
                batch = _stack([m.loop.run.host_batch(a) if a < e else i
                                for m, a, e, i in zip(members, at, ends, idle)])
            else:  # indices only: the examples are gathered on the device
                batch = _stack_on_host([_drawn(m, a) if a < e else i
                                        for m, a, e, i in zip(members, at, ends, idle)])
            host_s += time.time() - t0
            states, metrics = jitted(knobs, ends, states, batch, *on_device)
            # one sum for the group (a finished trial's rows are masked out); a trial's metrics
            # are sliced only when one of its actions reads them
            counts.add(jnp.where(jnp.asarray(np.array(at) < ends),
                                 metrics["nonfinite_examples"], 0.0))
            group_steps += 1
            for i, m in enumerate(members):
                if at[i] >= ends[i]:
                    continue
                at[i] += 1
                try:
                    sides[i].after_step(lambda i=i: jax.tree.map(lambda x: x[i], states),
                                        lambda i=i: jax.tree.map(lambda x: x[i], metrics), at[i])
                except run_loop.TrainingDiverged as e:  # this trial stops; the others go on
                    logging.warning("%s%s", m.loop.label, e)
                    outcomes[i], ends[i] = e, at[i]
                    m.loop.ckpts.close()
            ctrl_c.check()
    jax.block_until_ready(states)
    info = dict(size=len(members), batching=step.batching, knobs=len(step.knobs),
                group_steps=group_steps, loop_s=time.time() - t_start, host_batch_s=host_s,
                planned_bytes=group.planned, budget_bytes=budget,
                batches="gathered on the device" if data is not None else "gathered on the host")
    logging.info("the group's %d steps took %.1f s, %.1f s of it drawing and placing batches",
                 group_steps, info["loop_s"], host_s)
    for i, m in enumerate(members):
        if outcomes[i] is None:
            outcomes[i] = run_loop.finish(
                m.loop, m.started, jax.tree.map(lambda x: x[i], states), m.started.progress,
                m.start_step, list(m.trial.gin_files), m.verified, m.operative_config,
                group=dict(info, index=i))
    return outcomes


def _train_alone(member: _Started):
    """A trial with no group: the solo loop, its record marked as a group of one."""
    loop, started = member.loop, member.started
    try:
        state = run_loop.train_steps(loop, started.state, started.progress, member.start_step,
                                     started.end_step)
    except run_loop.TrainingDiverged as e:
        logging.warning("%s%s", loop.label, e)
        loop.ckpts.close()
        return e
    return run_loop.finish(loop, started, state, started.progress, member.start_step,
                           list(member.trial.gin_files), member.verified,
                           member.operative_config, group=dict(size=1, index=0, batching=None))


def train_trials(trials: Sequence[Trial], overwrite: bool = False,
                 max_group_size: Optional[int] = None, batching: Optional[str] = None,
                 memory_budget: Optional[int] = None, gather: Optional[str] = None) -> list:
    """Trains ``trials`` in groups (each group one compiled step); returns, per trial in
    order, its run record or the TrainingDiverged that stopped it. Each trial's workdir holds
    what ``dpbench train`` would leave there (resumed from its own checkpoints when it has
    some). ``max_group_size`` caps a group; ``memory_budget`` (bytes; default
    :func:`device_memory_budget`) caps its compiled step's buffer plan; ``batching``:
    compiler/group.default_batching; ``gather``: where a group's examples are gathered
    (:func:`default_gather`; 'device' applies to trials on the same data)."""
    gather = default_gather() if gather is None else gather
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
    outcomes: list = [None] * len(trials)
    todo = []
    for i, trial in enumerate(trials):
        finished = Path(trial.workdir) / records.RECORD_NAME
        if finished.exists() and not overwrite:  # finished before a restart: never rerun
            outcomes[i] = json.loads(finished.read_text())
        else:
            todo.append(i)
    started = {i: _start(trials[i], overwrite) for i in todo}
    if len(todo) == 1:  # alone: the solo loop, no trace (a group of one costs what a run does)
        (i,) = todo
        outcomes[i] = _train_alone(started[i])
        return outcomes
    started = {i: _traced(s) for i, s in started.items()}
    budget = device_memory_budget() if memory_budget is None else memory_budget
    for members in pack([started[i].traced for i in todo], max_group_size):
        indices = [todo[k] for k in members]
        by_trial = {id(started[i]): i for i in indices}
        for group in fitting_groups([started[i] for i in indices], batching, budget, gather):
            results = ([_train_alone(group.members[0])] if group.step is None
                       else _train_group(group, budget))
            for member, result in zip(group.members, results):
                outcomes[by_trial[id(member)]] = result
    return outcomes


def main(argv: Sequence[str]) -> None:
    """``python -m dpbench.run.group TRIALS.json [OUTCOMES.json]``: the trials of a JSON list
    of {workdir, gin_files, bindings} trained in groups (what a sweep's worker runs); each
    trial's outcome ('finished' or 'diverged', with the divergence's message) is printed and,
    when OUTCOMES.json is given, written there atomically once every trial has one."""
    spec = json.loads(Path(argv[1]).read_text())
    trials = [Trial(Path(t["workdir"]), tuple(t.get("gin_files", ())),
                    tuple(t.get("bindings", ()))) for t in spec]
    outcomes = []
    for trial, outcome in zip(trials, train_trials(trials)):
        diverged = isinstance(outcome, Exception)
        outcomes.append(dict(workdir=str(trial.workdir),
                             outcome="diverged" if diverged else "finished",
                             message=str(outcome) if diverged else None))
        print(f"{trial.workdir}: {outcomes[-1]['outcome']}", flush=True)
    if len(argv) > 2:
        records.atomic_write_text(Path(argv[2]), json.dumps(outcomes, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
