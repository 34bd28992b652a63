"""Trials as data, on the device: trials whose steps differ only in their numbers
(compiler/group.py) packed into groups, each group's step compiled to fit the device's memory,
and stepped by the one loop (run/loop.py) through :class:`Grouped`.

What trials may share a group is declared once, by their settings (``Settings.group_key``:
the data, the model, the stage list and its structural facts, the batch and micro-batch, an
EMA or none); the traced programs are the proof: trials the declaration puts together whose
programs still differ are refused (:func:`pack`), naming the settings in which they differ.

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
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dpbench import sharding
from dpbench.compiler import group as group_lib


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


def stack_on_host(trees):
    return jax.tree.map(lambda *leaves: np.stack(leaves), *trees)


def declared_key(member) -> str:
    """The settings a trial shares with every trial of its group (``Settings.group_key``),
    as one comparable value."""
    return json.dumps(member.started.settings.group_key(), sort_keys=True)


def differing_settings(members: Sequence) -> list:
    """The settings (by their record names; a stage's fact as ``stages.<stage>.<fact>``) whose
    values differ between ``members``: each trial's own numbers when they share a group."""
    flat = [_flat_settings(m.started.settings.as_json()) for m in members]
    names = sorted(set().union(*flat))
    return [n for n in names if any(f.get(n) != flat[0].get(n) for f in flat[1:])]


def _flat_settings(settings: dict) -> dict:
    out = {k: v for k, v in settings.items() if k != "stages"}
    for stage in settings["stages"]:
        out.update({f"stages.{stage['name']}.{k}": v for k, v in stage.items() if k != "name"})
    return out


def pack(traced: Sequence[group_lib.Traced], max_size: Optional[int] = None,
         declared: Optional[Sequence] = None, settings_of: Optional[Callable] = None) -> list:
    """The trials (by index) in groups: equal programs up to their numbers, in input order,
    at most ``max_size`` trials a group. Given ``declared`` (each trial's declared key), the
    trials are first packed by it and the programs are its proof: two trials it puts together
    whose programs differ are refused (NotGroupable), naming how the first of them differs
    (``settings_of(indices)``: the settings in which those trials differ)."""
    declared = [0] * len(traced) if declared is None else list(declared)
    by_key: dict = {}
    for i, key in enumerate(declared):
        by_key.setdefault(key, []).append(i)
    groups = []
    for members in by_key.values():
        by_program: dict = {}
        for i in members:
            t = traced[i]
            by_program.setdefault((t.signature, t.in_tree, t.out_tree), []).append(i)
        if declared[members[0]] != 0 and len(by_program) > 1:
            firsts = [v[0] for v in by_program.values()]
            named = settings_of(firsts[:2]) if settings_of else []
            raise group_lib.NotGroupable(
                f"trials {firsts[0]} and {firsts[1]} share every setting a group declares "
                f"(Settings.group_key) yet compile to different programs; they differ in "
                f"{', '.join(named) or 'no recorded setting'}: declare the one that is "
                "structure in SHARED_BY_A_GROUP (run/settings.py)")
        for ids in by_program.values():
            size = max_size or len(ids)
            groups += [ids[k:k + size] for k in range(0, len(ids), size)]
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
    members: list        # run/loop.Member
    traced: list         # each member's group_lib.Traced
    step: Optional[group_lib.GroupStep] = None   # None: a trial alone
    executable: object = None
    planned: int = 0
    data: object = None  # the training split whose examples the device gathers (or None)
    idle: list = None    # each trial's batch for the steps it does not take


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
    trains = {id(m.run.dataset.train.images) for m in members}
    return members[0].run.dataset.train if len(trains) == 1 else None


def drawn_batch(run, step: int) -> dict:
    """``run``'s batch for ``step`` as the host draws it: the sampler's indices and mask laid
    out in micro-batches (and the stages' host randomness), without the examples."""
    compiled = run.compiled
    drawn = run.sampler.sample(step)
    shape = (compiled.micro_steps, compiled.micro_batch_size)
    out = {"index": drawn.indices.reshape(shape).astype(np.int32),
           "mask": drawn.mask.reshape(shape)}
    inputs = compiled.stage_inputs(step)
    if inputs:
        out[sharding.STAGE_INPUTS] = inputs
    return out


def gathering(step: Callable) -> Callable:
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


def _compile_group(members: list, traced: list, batching: Optional[str],
                   gather: str = "host") -> _Compiled:
    step = group_lib.group_step(traced, batching=batching)
    ends = jax.ShapeDtypeStruct((len(members),), jnp.int32)
    states = _stacked_shapes([m.started.state for m in members])
    data = _shared_training_data(members) if gather == "device" else None
    idle = [drawn_batch(m.run, m.start_step) if data is not None else m.run.host_batch(m.start_step)
            for m in members]  # a batch of the right shapes for the steps a trial does not take
    if data is None:  # trials on different data: the host gathers each trial's examples
        executable = jax.jit(step.step, donate_argnums=(2,)).lower(
            step.knobs, ends, states, _stacked_shapes(idle))
    else:
        executable = jax.jit(gathering(step.step), donate_argnums=(2,)).lower(
            step.knobs, ends, states, stack_on_host(idle), data.images, data.labels)
    executable = executable.compile()
    return _Compiled(members, traced, step, executable, planned_bytes(executable), data, idle)


def fitting_groups(members: list, traced: list, batching: Optional[str], budget: int,
                   gather: str = "host") -> list:
    """``members`` (their steps ``traced``) compiled as one group step, halved until each
    part's buffer plan fits ``budget`` bytes; a part of one trial is left alone (its own step).
    ``gather``: where the examples are gathered ('device' only for trials on the same data)."""
    if len(members) == 1:
        return [_Compiled(members, traced)]
    compiled = _compile_group(members, traced, batching, gather)
    if compiled.planned <= budget:
        return [compiled]
    logging.info("a group of %d trials plans %.3g GB, over its budget of %.3g GB: halved",
                 len(members), compiled.planned / 1e9, budget / 1e9)
    half = math.ceil(len(members) / 2)
    return (fitting_groups(members[:half], traced[:half], batching, budget, gather)
            + fitting_groups(members[half:], traced[half:], batching, budget, gather))


class Grouped:
    """A compiled group's side of the loop (run/loop.Stepping): one call of its executable
    steps every trial (a trial past its end is left as it was); each trial's examples gathered by the host, or on
    the device from the one training split they share."""

    def __init__(self, group: _Compiled):
        self.group, self.jitted = group, group.executable
        self.knobs = jax.device_put(group.step.knobs)
        self.states = _stack([m.started.state for m in group.members])
        self.metrics = None
        self.counts = _Counts(len(group.members))
        data = group.data
        self.on_device = () if data is None else (jax.device_put(data.images),
                                                  jax.device_put(data.labels))
        self.host_s, self.steps = 0.0, 0

    def step(self, at: list, ends) -> None:
        t0, members, idle = time.time(), self.group.members, self.group.idle
        if self.group.data is None:
            batch = _stack([m.run.host_batch(a) if a < e else i
                            for m, a, e, i in zip(members, at, ends, idle)])
        else:  # indices only: the examples are gathered on the device
            batch = stack_on_host([drawn_batch(m.run, a) if a < e else i
                                    for m, a, e, i in zip(members, at, ends, idle)])
        self.host_s += time.time() - t0
        ends = np.asarray(ends, np.int32)
        self.states, self.metrics = self.jitted(self.knobs, ends, self.states, batch,
                                                *self.on_device)
        # one sum for the group (a finished trial's rows are masked out); a trial's metrics
        # are sliced only when one of its actions reads them
        self.counts.add(jnp.where(jnp.asarray(np.asarray(at) < ends),
                                  self.metrics["nonfinite_examples"], 0.0))
        self.steps += 1

    def state_of(self, i: int):
        return jax.tree.map(lambda x: x[i], self.states)

    def metrics_of(self, i: int):
        return jax.tree.map(lambda x: x[i], self.metrics)

    def take_nonfinite(self, i: int) -> float:
        return self.counts.take(i)
