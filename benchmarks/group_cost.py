"""What a trial costs, grouped (T trials, one compiled step: dpbench/run/trials.py) against one
process per trial (what `dpbench sweep` ran until now), as ratios measured in one run, and how
much of a group's wall time is the host's serial work (the trials' starts and ends, one after
another, and the comparison of their programs).

    python -m benchmarks.group_cost --out=leaderboard/group-cost-cpu.md

Every trial is a whole run (start, compile, its steps, evaluation, its record) of DP-SGD with
its own learning rate, clip bound and seed, so a grouped trial's cost includes its share of the
group's one compilation. Solo: ``--solo`` trials, each `python -m dpbench.main` in a fresh
process (imports, data, compile, steps), timed from the outside. Grouped: one process trains
T trials with ``run.trials.train_trials``; its wall time (the process's start excluded, then
added back once as the measured import time) divided by T.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from benchmarks.common import REPO_ROOT

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["1", "4", "16", "64"], "group sizes T")
flags.DEFINE_integer("solo", 2, "how many solo processes to time (their mean is the reference)")
flags.DEFINE_multi_string("gin_file", ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"],
                          "the trials' gin files")
flags.DEFINE_multi_string("binding", ["train.epochs = 4"], "gin bindings of every trial")
flags.DEFINE_string("batching", None, "vmap or map (default: the platform's)")
flags.DEFINE_string("out", None, "write the Markdown report here (and the JSON beside it)")


def trial_bindings(i: int) -> list:
    """Trial i's own numbers: a learning rate and a clip bound spread over 16x, its seed."""
    lr = 0.1 * 4 ** ((i % 7) / 3)
    clip = 0.1 * 4 ** ((i % 5) / 2)
    return [*FLAGS.binding, f"optimize.optax.learning_rate = {lr:.4g}",
            f"clip.global_l2.l2_bound = {clip:.4g}", f"train.seed = {i}"]


def solo_seconds(workdir: Path, i: int) -> float:
    command = [sys.executable, "-m", "dpbench.main", f"--workdir={workdir}",
               *[f"--gin_file={f}" for f in FLAGS.gin_file],
               *[f"--gin_bindings={b}" for b in trial_bindings(i)]]
    t0 = time.time()
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    return time.time() - t0


def import_seconds() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import dpbench.run.trials"], cwd=REPO_ROOT,
                   check=True, capture_output=True)
    return time.time() - t0


def grouped_seconds(workdir: Path, size: int) -> tuple:
    from dpbench.run import trials as run_trials
    trials = [run_trials.Trial(workdir / f"t{i}", tuple(FLAGS.gin_file),
                               tuple(trial_bindings(i))) for i in range(size)]
    timings: dict = {}
    t0 = time.time()
    records = run_trials.train_trials(trials, batching=FLAGS.batching, timings=timings)
    wall = time.time() - t0
    finished = [r for r in records if isinstance(r, dict)]  # a diverged trial: its error
    return wall, finished[0]["group"], [r["steps"] for r in finished], len(finished), timings


SERIAL = ("starts_s", "compare_s", "ends_s")  # the host's work, one trial after another


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def host_name() -> str:
    """The CPU's model name and the cores this process may use."""
    model = "an unnamed CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def commit() -> str:
    """The checkout's commit (+ 'dirty' when it has uncommitted changes)."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"
    return head + (" (dirty)" if dirty else "")


def main(argv) -> None:
    del argv
    import jax
    argv_shown = map(shlex.quote, sys.argv[1:])
    report = dict(command=" ".join(["python -m benchmarks.group_cost", *argv_shown]),
                  device=str(jax.devices()[0]), platform=jax.default_backend(),
                  host=host_name(), commit=commit(),
                  gin_files=FLAGS.gin_file, bindings=FLAGS.binding)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        report["import_s"] = import_seconds()
        report["solo_s"] = [solo_seconds(tmp / f"solo{i}", i) for i in range(FLAGS.solo)]
        solo = sum(report["solo_s"]) / len(report["solo_s"])
        rows = []
        for size in map(int, FLAGS.sizes):
            try:
                wall, info, steps, finished, timings = grouped_seconds(tmp / f"group{size}",
                                                                       size)
            except Exception as e:  # noqa: BLE001  (a report row says what failed)
                rows.append(dict(T=size, error=f"{type(e).__name__}: {e}"[:600]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            per_trial = (wall + report["import_s"]) / size
            serial = sum(timings.get(k, 0.0) for k in SERIAL)
            rows.append(dict(T=size, wall_s=wall, per_trial_s=per_trial,
                             solo_over_grouped=solo / per_trial, steps=sorted(set(steps)),
                             finished=finished, timings=timings, serial_s=serial,
                             serial_share=serial / wall,
                             **{k: info.get(k) for k in ("batching", "knobs", "group_steps",
                                                     "loop_s", "host_batch_s")}))
            print(json.dumps(rows[-1]), flush=True)
            write_report(report, rows, solo)  # each row kept: a window cut off keeps the rest
    print(write_report(report, rows, solo))


def write_report(report: dict, rows: list, solo: float) -> str:
    """The Markdown report of ``rows`` so far, written to --out (and the JSON beside it)."""
    report["rows"] = rows
    lines = [f"# Cost per trial, grouped vs one process per trial ({report['device']})", "",
             f"`{report['command']}` on {report['host']}, at {report['commit']}", "",
             f"Trials: {', '.join(FLAGS.gin_file)}; {'; '.join(FLAGS.binding)}; each its own "
             "learning rate, clip bound and seed. Solo: one `python -m dpbench.main` process per "
             f"trial, mean of {len(report['solo_s'])}: {solo:.1f} s (imports alone: "
             f"{report['import_s']:.1f} s).", "",
             "| T | batching | group wall s | per trial s | solo / grouped | loop s | of it, "
             "batches on the host s | host serial s (starts + compare + ends) | serial share "
             "of wall |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['T']} | failed: {r['error'][:200]} |" if "error" in r else
              f"| {r['T']} | {r['batching'] or 'alone (the solo loop)'} | {r['wall_s']:.1f} | "
              f"{r['per_trial_s']:.2f} | {r['solo_over_grouped']:.2f}x | {_fmt(r['loop_s'])} | "
              f"{_fmt(r['host_batch_s'])} | {r['serial_s']:.1f} ("
              f"{' + '.join(_fmt(r['timings'].get(k)) for k in SERIAL)}) | "
              f"{r['serial_share']:.2f} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    if FLAGS.out:
        Path(FLAGS.out).write_text(text)
        Path(FLAGS.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    return text


if __name__ == "__main__":
    app.run(main)
