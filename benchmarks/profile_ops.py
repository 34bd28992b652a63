"""Where a pipeline's step spends its time, per XLA operation:
``python -m benchmarks.profile_ops --pipeline=dpsgd --batch_size=1024 [--top=25]``.

Builds the pipeline exactly as the speed benchmark does (``workers.build_dp_run``: run.train's
own construction), runs ``--warmup`` steps, then traces ``--steps`` steps with the JAX profiler
and sums the trace's events per operation of the compiled step (names found in the step's
optimized HLO; the runtime's own events and Python frames are left out). Prints per operation:
its exclusive thread-ms per step (summed over threads), its share of the traced operations'
time, and the JAX operation it came from (the HLO's ``op_name`` metadata). On a shared machine
the parallel operations also absorb the wait for a busy core: read shares on a quiet machine,
and time changes with benchmarks.speed.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

from absl import app, flags

from benchmarks import speed  # noqa: F401  (defines --steps, --warmup, --data_gin, ...)
from benchmarks import workers

FLAGS = flags.FLAGS
# Its own flags; --steps (traced steps), --warmup, --data_gin, --model_gin and --bindings are
# benchmarks.speed's, which it imports and shares.
flags.DEFINE_string("pipeline", "dpsgd", "a method folder name: pipelines/<name>/pipeline.gin")
flags.DEFINE_integer("batch_size", 1024, "expected batch size B")
flags.DEFINE_integer("micro_batch_size", 32, "micro-batch size")
flags.DEFINE_integer("top", 25, "operations listed")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_operations(hlo_text: str) -> dict:
    """{instruction name: its JAX op_name ('' when none)} of an optimized HLO module."""
    out = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            op_name = _OP_NAME.search(line)
            out[match.group(1)] = op_name.group(1) if op_name else ""
    return out


def _operation(event: dict, operations: dict):
    """The HLO instruction a trace event ran, or None: a CPU thunk's event is named by the
    instruction; a GPU kernel's by the kernel (a cuBLAS or fusion name), its instruction in
    the event's args (``hlo_op``)."""
    if event.get("name") in operations:
        return event["name"]
    op = (event.get("args") or {}).get("hlo_op")
    return op if op in operations else None


def per_operation_us(trace_events: list, operations: dict) -> collections.Counter:
    """Exclusive microseconds per operation of ``operations`` over complete ('X') trace
    events: a control-flow operation (while, conditional) is charged its own time only, not its
    body's operations nested inside it on the same thread. Summed over threads (thread time;
    on a GPU, its streams' kernel time)."""
    named = [(e, _operation(e, operations)) for e in trace_events if e.get("ph") == "X"]
    events = sorted(((e, op) for e, op in named if op is not None),
                    key=lambda x: (x[0].get("pid"), x[0].get("tid"), float(x[0]["ts"]),
                                   -float(x[0]["dur"])))
    totals = collections.Counter()
    stack = []  # (thread, end time, operation) of the enclosing operations
    for event, op in events:
        thread, start, dur = (event.get("pid"), event.get("tid")), float(event["ts"]), float(
            event["dur"])
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            stack.pop()
        if stack:
            totals[stack[-1][2]] -= dur  # the parent's time excludes this child
        totals[op] += dur
        stack.append((thread, start + dur, op))
    return totals


def table(totals: collections.Counter, operations: dict, steps: int, top: int) -> str:
    whole = sum(totals.values()) or 1.0
    lines = ["| operation | thread-ms/step | share | from |", "|---|---|---|---|"]
    for name, us in totals.most_common(top):
        lines.append(f"| {name} | {us / steps / 1e3:.3f} | {us / whole:.1%} | "
                     f"{operations[name][-70:]} |")
    lines.append(f"\ntraced operations: {whole / steps / 1e3:.2f} thread-ms per step (summed over "
                 f"threads) over {steps} steps")
    return "\n".join(lines)


def profile(spec: dict, steps: int, warmup: int) -> tuple:
    import jax

    from dpbench import sharding

    run = workers.build_dp_run(spec)
    compiled, sampler, dataset, mesh = run["compiled"], run["sampler"], run["dataset"], run["mesh"]

    def batch(t):
        s = sampler.sample(t)
        return sharding.put_batch(compiled.host_batch(
            dataset.train.images[s.indices], dataset.train.labels[s.indices], s.mask, t), mesh)

    state = run["state"]
    operations = hlo_operations(compiled.step.lower(state, batch(0)).compile().as_text())
    for t in range(warmup):
        state, _ = jax.block_until_ready(compiled.step(state, batch(t)))
    inputs = [jax.block_until_ready(batch(warmup + t)) for t in range(steps)]
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for b in inputs:
            state, _ = jax.block_until_ready(compiled.step(state, b))
        jax.profiler.stop_trace()
        trace = next(Path(trace_dir).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    return per_operation_us(events, operations), operations


def main(argv) -> None:
    del argv
    files = [f"pipelines/{FLAGS.pipeline}/pipeline.gin", FLAGS.data_gin] + (
        [FLAGS.model_gin] if FLAGS.model_gin else [])
    spec = dict(gin_files=files, noise_multiplier=1.0, bindings=[
        f"train.batch_size = {FLAGS.batch_size}",
        f"train.micro_batch_size = {FLAGS.micro_batch_size}", *FLAGS.bindings])
    totals, operations = profile(spec, FLAGS.steps, FLAGS.warmup)
    print(f"{FLAGS.pipeline}, B={FLAGS.batch_size}, micro-batches of {FLAGS.micro_batch_size}")
    print(table(totals, operations, FLAGS.steps, FLAGS.top))


if __name__ == "__main__":
    app.run(main)
