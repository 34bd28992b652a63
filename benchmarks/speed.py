"""Speed benchmark: ``python -m benchmarks.speed [--out=report.md]`` (or ``bash tools/bench.sh``).

Measures, on the configured data and model (default Fashion-MNIST, tanh CNN), the median step
time over ``--steps`` steps after ``--warmup`` steps of:

* a non-private JAX step (same model, plain mean-loss gradient, the pipeline's optax optimizer,
  jitted) on fixed-size batches of exactly B examples;
* dpbench DP-SGD (``pipelines/dpsgd``) and every other method folder (``pipelines/<name>``),
  each built exactly as ``run.train`` builds it (gin via ``main.parse_config``, the same
  dataset, model, seeds, sampler and ``compiler.compile_pipeline`` call), on the Poisson
  sampler's padded batch;
  GEP also at the paper's MNIST setting (m = 2000 anchors, k = 500 basis vectors, basis every
  step) next to the light default of ``pipelines/gep/pipeline.gin`` (m = 512, k = 200);
* when torch and opacus import (the ``bench`` extra), the same tanh CNN in torch: a non-private
  step on the same fixed-size batches and Opacus DP-SGD on the same realized Poisson batches
  (same clip bound, noise multiplier and optimizer) in every ``grad_sample_mode`` it has for this
  model (a mode that fails becomes a row with its error);
* dpbench DP-SGD at a logical batch of ``--logical_batch`` (micro-batched), for peak memory;
* sigma calibration for the DP-SGD run's budget with RDP and with PLD.

Every configuration runs in a fresh subprocess (``--worker=spec.json``), so its peak resident
memory (ru_maxrss, the kernel's VmHWM) is its own. The ratios and targets come from a second
measurement, the interleaved run (benchmarks/interleave.py): per batch size, every timed
configuration in one process, their steps alternating one at a time, so both sides of a ratio
see the same minutes of the machine. Each step's batch is sampled before the loop,
gathered from the in-memory dataset and placed on the device (blocked until ready) before that
step's timer starts; the timer covers the step and ``block_until_ready`` of its outputs. The
report (markdown, plus the same numbers as JSON next to it) holds the command, machine facts,
versions, the table, ratios measured in the same run, and the targets.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags, logging

from benchmarks.common import COMMAND_ENV, ONCE, OPACUS_MODES, REPO_ROOT
from benchmarks.configs import (Options, parse_micro_batch_sizes, plan, run_config,
                             torch_available, torch_settings)
from benchmarks.machine import machine_facts, versions
from benchmarks.report import (aggregate_rounds, compute_ratios, interleaved_rows, render,
                               summary_line, targets)
from benchmarks.trial_cost import trial_costs
from benchmarks.workers import run_worker
from dpbench.records import atomic_write_text


FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "Timed steps per configuration (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed steps first (the first one compiles).")
flags.DEFINE_list("batch_sizes", ["256", "1024"], "Expected batch sizes B.")
flags.DEFINE_string("pipelines", "all", "Comma-separated method names (folders under pipelines/), "
                    "or 'all'. dpsgd is the reference for the ratios.")
flags.DEFINE_string("out", None, "Markdown report path (the JSON goes next to it). Default: "
                    "runs/bench-<time>.md")
flags.DEFINE_bool("skip_torch", False, "Skip the torch and Opacus rows.")
flags.DEFINE_list("micro_batch_sizes", ["32"], "Micro-batch size of the dpbench rows "
                  "per expected batch size, as 'B:size', and a bare size for every other B "
                  "(32 is pipelines/dpsgd/pipeline.gin's value, fastest with book-keeping at B=256 "
                  "and 1024 on 2 CPU cores). A speed knob only: the sampler, noise and "
                  "accounting do not change.")
flags.DEFINE_string("data_gin", "gin/data/fashion_mnist.gin", "Data gin file.")
flags.DEFINE_string("model_gin", "gin/model/tanh_cnn.gin", "Model gin file, parsed after the "
                    "data gin; '' keeps what the pipeline and data gin say.")
flags.DEFINE_multi_string("bindings", [], "Extra gin bindings for every JAX row (after the "
                          "benchmark's own).")
flags.DEFINE_string("noise_multiplier", "1.0", "Fixed sigma for the step timings, or "
                    "'calibrate'. Pipelines with a budgeted mechanism of their own (GIP's index "
                    "release needs the target epsilon) always take the calibrated path.")
flags.DEFINE_integer("logical_batch", 4096, "Logical batch (via micro-batches) of the memory "
                     "row; 0 skips it.")
flags.DEFINE_integer("gep_paper_anchors", 2000, "GEP paper setting: anchors m (0 skips the row).")
flags.DEFINE_integer("gep_paper_basis", 500, "GEP paper setting: basis size k.")
flags.DEFINE_integer("gep_refresh_every", 10, "GEP/B-GEP light also with the basis refreshed "
                     "every r steps (timed r steps at a time); 0 or 1: no such row.")
flags.DEFINE_bool("gep_floor", True, "Time GEP light's lower bounds next to the pipelines: its "
                  "matrix products alone, and those plus a plain gradient of its anchors and "
                  "JAX's non-private step (each a lower bound for any GEP step here).")
flags.DEFINE_list("opacus_modes", list(OPACUS_MODES), "Opacus grad_sample_mode values to try.")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0: the machine's core count).")
flags.DEFINE_bool("calibration", True, "Time sigma calibration (RDP and PLD).")
flags.DEFINE_integer("calibration_batch_size", 1024, "B of the calibrated DP-SGD run.")
flags.DEFINE_float("calibration_epochs", 30.0, "Epochs of the calibrated DP-SGD run.")
flags.DEFINE_integer("calibration_repeats", 3, "Calibrations per accountant (median reported).")
flags.DEFINE_integer("config_timeout", 3600, "Seconds one configuration may take.")
flags.DEFINE_integer("rounds", 3, "Round-robin rounds: every configuration once per round.")
flags.DEFINE_integer("interleaved_steps", 60, "Timed steps per configuration in the interleaved "
                     "run (all configurations of a batch size in one process, one step each in "
                     "turn), which the ratios and targets come from; split into --rounds blocks "
                     "for the spread. 0: no interleaved run (ratios from the separate runs).")
flags.DEFINE_bool("main_job", True, "Train the README's main job once; report its wall time.")
flags.DEFINE_string("worker", None, "Internal: run the configuration in this JSON spec file.")


def _update_report(report: dict, configs: list, per_round: dict, options: Options) -> None:
    """Rows aggregated over the rounds run so far; ratios from the interleaved run when there
    is one (else from the separate runs' aggregated medians); each target's spread = min-max of
    the same ratio within each block of the interleaved run (else within each complete round).
    Peak memory always comes from the separate runs (one configuration per process)."""
    report["rows"] = [dict(spec=spec, result=aggregate_rounds(per_round[i]))
                      for i, spec in enumerate(configs) if per_round[i]]
    def once(kind):
        return next((r["result"] for r in report["rows"] if r["spec"]["kind"] == kind), None)

    calibration, main_job = once("calibration"), once("main_job")
    report["calibration"], report["main_job"] = calibration, main_job
    records_dir = REPO_ROOT / "leaderboard" / "records"
    report["records_dir"] = str(records_dir.relative_to(REPO_ROOT))
    report["trial_costs"] = trial_costs(records_dir)
    timed = [r for r in report["rows"] if r["spec"]["kind"] not in ONCE]
    separate = compute_ratios(timed, options.batch_sizes)
    report["ratios_separate"] = separate
    inter = interleaved_rows(report["rows"])
    if inter:
        report["ratios"] = dict(compute_ratios(inter, options.batch_sizes),
                                memory=separate["memory"], source="interleaved")
        blocks = [dict(compute_ratios(interleaved_rows(report["rows"], k), options.batch_sizes),
                       memory=separate["memory"]) for k in range(max(1, options.rounds))]
    else:
        report["ratios"] = dict(separate, source="separate")
        rounds = min((len(per_round[i]) for i, s in enumerate(configs)
                      if s["kind"] not in ONCE), default=0)
        blocks = [compute_ratios([dict(spec=s, result=per_round[i][k])
                                  for i, s in enumerate(configs) if s["kind"] not in ONCE],
                                 options.batch_sizes) for k in range(rounds)]
    report["targets"] = targets(report["ratios"], calibration, main_job)
    by_block = [targets(r, calibration, main_job) for r in blocks]
    for t in report["targets"]:
        values = [bt["measured"] for block in by_block for bt in block
                  if bt["target"] == t["target"] and bt["measured"] is not None
                  and bt["unit"] == "x"]
        t["spread"] = [min(values), max(values)] if values else None


def run_benchmark(options: Options) -> dict:
    """Runs every configuration (each in a fresh subprocess) and writes the report."""
    started = datetime.datetime.now(datetime.timezone.utc)
    out = Path(options.out or REPO_ROOT / "runs" /
               f"bench-{started.strftime('%Y%m%d-%H%M%S')}.md")
    json_path = out.with_suffix(".json")
    wall_start = time.time()
    torch_note = "skipped (--skip_torch)"
    torch_info = {"skip": torch_note}
    if not options.skip_torch:
        reason = torch_available()
        if reason:
            torch_info, torch_note = {"skip": reason}, f"skipped: {reason}"
        else:
            torch_info = torch_settings(options)
            torch_note = torch_info.get("skip") or (
                f"same model (tanh CNN, NCHW), SGD from the pipeline's optimizer settings, clip "
                f"{torch_info['l2_bound']}, sigma as dpbench's, "
                f"torch.set_num_threads({options.torch_threads or os.cpu_count()}) for every "
                "torch row")
    configs = plan(options, torch_info)
    report = dict(command=options.command, started=started.isoformat(timespec="seconds"),
                  machine=machine_facts(), versions=versions(),
                  options=dataclasses.asdict(options), torch_note=torch_note, rows=[],
                  calibration=None)
    per_round = {i: [] for i in range(len(configs))}
    with tempfile.TemporaryDirectory(prefix="dpbench-bench-") as tmp:
        # Round-robin: every configuration once per round, so a noisy minute of the machine
        # lands on one round of many configurations, not on all rounds of one.
        for rnd in range(options.rounds):
            for i, spec in enumerate(configs):
                if spec["kind"] in ONCE and rnd > 0:
                    continue  # seconds-long: once (calibration has its own repeats)
                logging.info("round %d/%d [%d/%d] %s, B=%s", rnd + 1, options.rounds, i + 1,
                             len(configs), spec["label"], spec["batch_size"])
                result = run_config(spec, options.config_timeout, Path(tmp),
                                    rnd * len(configs) + i)
                per_round[i].append(result)
                logging.info("  %s", summary_line(spec, result))
                _update_report(report, configs, per_round, options)
                report["incomplete"] = (f"round {rnd + 1} of {options.rounds}, {i + 1} of "
                                        f"{len(configs)} configurations done")
                report["wall_s"] = time.time() - wall_start
                atomic_write_text(out, render(report))
                atomic_write_text(json_path, json.dumps(report, indent=1, default=str))
    report["incomplete"] = None
    report["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds")
    report["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report["wall_s"] = time.time() - wall_start
    report["out"], report["json"] = str(out), str(json_path)
    atomic_write_text(out, render(report))
    atomic_write_text(json_path, json.dumps(report, indent=1, default=str))
    logging.info("wrote %s and %s", out, json_path)
    return report


def options_from_flags(argv) -> Options:
    sigma = FLAGS.noise_multiplier.strip().lower()
    command = os.environ.get(COMMAND_ENV) or " ".join(
        shlex.quote(a) for a in [sys.executable, "-m", "benchmarks.speed", *sys.argv[1:]])
    return Options(
        steps=FLAGS.steps, warmup=FLAGS.warmup,
        batch_sizes=tuple(int(b) for b in FLAGS.batch_sizes), pipelines=FLAGS.pipelines,
        out=FLAGS.out, skip_torch=FLAGS.skip_torch,
        micro_batch_sizes=parse_micro_batch_sizes(FLAGS.micro_batch_sizes),
        data_gin=FLAGS.data_gin, model_gin=FLAGS.model_gin,
        gin_bindings=tuple(FLAGS.bindings),
        noise_multiplier=None if sigma in ("calibrate", "none", "") else float(sigma),
        logical_batch=FLAGS.logical_batch, gep_paper_anchors=FLAGS.gep_paper_anchors,
        gep_paper_basis=FLAGS.gep_paper_basis, gep_floor=FLAGS.gep_floor,
        gep_refresh_every=FLAGS.gep_refresh_every,
        opacus_modes=tuple(FLAGS.opacus_modes),
        torch_threads=FLAGS.torch_threads, calibration=FLAGS.calibration,
        calibration_batch_size=FLAGS.calibration_batch_size,
        calibration_epochs=FLAGS.calibration_epochs,
        calibration_repeats=FLAGS.calibration_repeats, config_timeout=FLAGS.config_timeout,
        rounds=FLAGS.rounds, main_job=FLAGS.main_job,
        interleaved_steps=FLAGS.interleaved_steps,
        command=command)


def main(argv) -> None:
    if FLAGS.worker:
        run_worker(FLAGS.worker)
        return
    if FLAGS.steps < 1 or FLAGS.warmup < 1:
        raise app.UsageError("--steps and --warmup must be >= 1 (the first warm-up step "
                             "compiles)")
    run_benchmark(options_from_flags(argv))


if __name__ == "__main__":
    app.run(main)
