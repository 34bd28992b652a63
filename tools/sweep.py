"""The leaderboard sweep: every method's grid, then more seeds for the configuration chosen.

Usage:
  .venv/bin/python tools/sweep.py [--epsilons 3 1] [--seeds 0 1 2] [--methods dpsgd rs ...]
                                  [--workers 2] [--runs_dir runs/sweep]
                                  [--records leaderboard/records] [--dry_run]
  .venv/bin/dpbench leaderboard

Protocol, per (epsilon, method):
  1. every configuration of GRID[method] trains with the first seed (the selection seed);
  2. unless the method's grid already varies the learning rate (DP-SGD's is its lr axis), the
     grid's winner trains again with the selection seed and its learning rate halved
     (configuration "<winner>-halflr"), so every method gets the same two learning rates;
  3. ``leaderboard.choose_configuration`` (the board's own rule: best mean VALIDATION accuracy
     over the seeds all configurations share) picks one of all these;
  4. only that configuration trains with the other seeds.
Test accuracy picks nothing. Jobs run in list order (epsilon by epsilon, as given; within one,
the grids, then the halved learning rates, then the seeds method by method, cheapest first), a
job as soon as what it depends on is published, on ``--workers`` processes, each pinned to its
own core
(two one-core processes did 1.7x the steps per second of one two-core process on the 2-core
machine, see WORKSPACE "Speed").

Each run trains in ``<runs_dir>/<group>/<method>-<config>-seed<S>`` (git-ignored; a rerun of
the sweep resumes it from its checkpoints) and, when it has finished, its run_record.json is
copied atomically to ``<records>/<group>/<method>-<config>-seed<S>/``: the board reads only
finished runs, and no checkpoint is ever published. A job whose record is published is skipped,
so the sweep can be interrupted and rerun at any time. Every run records the gradient-fidelity
diagnostics (non-private benchmark output) and uses micro-batches of 64 (a speed knob only).
Measured 2026-11-23 on the 2-core VM, two pinned workers (wall time per run, from the
records' wall_time_s): DP-SGD, RS, DP-SSGD, GIP, random-k 7.7-8.7 min; Nasr 11.6; B-GEP 17.6;
GEP 21.1. One epsilon (13 grid + 7 halved-lr + 16 seed runs) is about 3.3 h on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpbench import leaderboard, records as records_lib  # noqa: E402

DELTA = "1e-05"
# Bindings every sweep run gets: fidelity diagnostics (non-private, recorded as such) and the
# micro-batch size that was fastest on one pinned core (never changes what is computed).
SWEEP_BINDINGS = ("train.fidelity_every_steps = 50", "train.micro_batch_size = 64")

# method -> {config name: (gin file, bindings)}; the first config is the pipeline's default.
# The grids are small on purpose (2 CPU cores): each method's own main knob, read off its paper
# (docs/methods/); training hyperparameters are DP-SGD's tuned recipe everywhere.
GRID = {
    "dpsgd": {"lr4": ("pipelines/dpsgd.gin", []),
              "lr2": ("pipelines/dpsgd.gin", ["optimize.optax.learning_rate = 2.0"])},
    "rs": {"r0.7": ("pipelines/rs.gin", []),
           "r0.9": ("pipelines/rs.gin", ["sparsify.random_mask.final_rate = 0.9"])},
    # DP-SSGD's variants are configurations of one method, so the board shows the best variant.
    "dpssgd": {"synflow-random": ("pipelines/dpssgd.gin", []),
               "random-random": ("pipelines/dpssgd.gin", ["PRUNE = @prune.random()"]),
               "synflow-magnitude": ("pipelines/dpssgd.gin",
                                     ["drop.gradients.criterion = 'magnitude'"])},
    "gip": {"k0.1": ("pipelines/gip.gin", []),
            "k0.3": ("pipelines/gip.gin", ["select.gip.k_end = 0.3"])},
    "randomk": {"k0.5": ("pipelines/randomk.gin", [])},
    "nasr": {"tau1e-3": ("pipelines/nasr.gin", [])},
    "gep": {"m512": ("pipelines/gep.gin", [])},
    "bgep": {"m512": ("pipelines/bgep.gin", [])},
}

# The learning-rate step (protocol step 2). Why: the recipe's lr 4 was tuned on DP-SGD at
# epsilon 3; at epsilon 1 DP-SGD's validation accuracy was 81.6% at lr 4 and 84.0% at lr 2
# (seed 0), so a method given only lr 4 would lose to DP-SGD on the learning rate alone.
HALF_LR = "-halflr"
POLL_S = 5.0  # how often the scheduler looks for finished runs
LEARNING_RATE = "optimize.optax.learning_rate"


# Pins the process to one core, then becomes the run (exec: no fork of a threaded parent).
PIN_AND_EXEC = ("import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
                "os.execv(sys.argv[2], sys.argv[2:])")


def group_name(eps: float) -> str:
    return f"fashion_mnist__tanh_cnn__eps{float(eps)}__delta{DELTA}"


def run_name(method: str, config: str, seed: int) -> str:
    return f"{method}-{config}-seed{seed}"


def varies_learning_rate(method: str) -> bool:
    """Whether the method's grid is itself a learning-rate axis (then it gets no lr step)."""
    return any(b.startswith(LEARNING_RATE) for _, bindings in GRID[method].values()
               for b in bindings)


def command_for(method: str, config: str, eps: float, seed: int, workdir: Path,
                learning_rate: float | None = None) -> list[str]:
    """The run's command line. A "<base>-halflr" config is the base config with
    ``learning_rate`` (half the base run's recorded one) bound on top."""
    halved = config.endswith(HALF_LR)
    gin_file, bindings = GRID[method][config.removesuffix(HALF_LR)]
    if halved != (learning_rate is not None):
        raise ValueError(f"{config}: a learning rate is given exactly to a {HALF_LR} config")
    if halved:
        bindings = [*bindings, f"{LEARNING_RATE} = {learning_rate!r}"]
    return [str(REPO / ".venv/bin/dpbench"), f"--gin_file={gin_file}",
            f"--gin_bindings=EPSILON = {float(eps)}", f"--gin_bindings=train.seed = {seed}",
            *[f"--gin_bindings={b}" for b in (*SWEEP_BINDINGS, *bindings)],
            f"--workdir={workdir}"]


def jobs(epsilons, seeds, methods) -> list[tuple]:
    """(eps, method, config, seed) in priority order. Config HALF_LR means 'the grid winner
    with its learning rate halved', known once the grid's runs are published; None means 'the
    config chosen on validation', known once every selection-seed run is published."""
    out = []
    for eps in epsilons:
        out += [(eps, m, c, seeds[0]) for m in methods for c in GRID[m]]
        out += [(eps, m, HALF_LR, seeds[0]) for m in methods if not varies_learning_rate(m)]
        # method by method, in GRID order (cheapest first), so an interrupted sweep leaves
        # whole rows with every seed rather than every row short of one
        out += [(eps, m, None, s) for m in methods for s in seeds[1:]]
    return out


def published(records: Path, eps: float, method: str, config: str, seed: int) -> Path:
    return records / group_name(eps) / run_name(method, config, seed) / records_lib.RECORD_NAME


def choose(records: Path, eps: float, method: str, configs: list[str], seed0: int):
    """The config name (of ``configs``) chosen on validation by the board's rule, or None while
    one of their selection runs is unpublished."""
    by_key, name_of = {}, {}
    for config in configs:
        path = published(records, eps, method, config, seed0)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        key = leaderboard.config_key(record)
        if key in name_of:  # the board would merge them into one configuration
            raise ValueError(f"{method}: configs {name_of[key]} and {config} ran the same "
                             "settings; give each grid entry a distinct binding")
        by_key.setdefault(key, []).append(record)
        name_of[key] = config
    key, _, _ = leaderboard.choose_configuration(by_key)
    return name_of[key]


def halved_config(records: Path, eps: float, method: str, seed0: int):
    """The grid winner's name with HALF_LR appended, or None while the winner is unknown."""
    winner = choose(records, eps, method, list(GRID[method]), seed0)
    return None if winner is None else winner + HALF_LR


def candidates(records: Path, eps: float, method: str, seed0: int):
    """Every config the method's selection compares (the grid, and the grid winner with its
    learning rate halved), or None while the grid winner is unknown."""
    if varies_learning_rate(method):
        return list(GRID[method])
    halved = halved_config(records, eps, method, seed0)
    return None if halved is None else [*GRID[method], halved]


def chosen_config(records: Path, eps: float, method: str, seed0: int):
    """The config name chosen on validation, or None while a selection run is unpublished.
    Chosen among all of the method's candidates, as the board chooses among all its records."""
    configs = candidates(records, eps, method, seed0)
    return None if configs is None else choose(records, eps, method, configs, seed0)


def recorded_learning_rate(record_path: Path) -> float:
    """The learning rate a finished run trained with, read from its record's stages."""
    record = json.loads(record_path.read_text())
    rates = [s["learning_rate"] for s in record["stages"] if "learning_rate" in s]
    if len(rates) != 1:
        raise ValueError(f"{record_path}: expected one stage with a learning_rate, got {rates}")
    return float(rates[0])


def publish(workdir: Path, target: Path) -> None:
    """Copies a finished run's record into the board's records, atomically."""
    records_lib.atomic_write_text(target, (workdir / records_lib.RECORD_NAME).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[3.0, 1.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(GRID), choices=list(GRID))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "sweep")
    parser.add_argument("--records", type=Path, default=REPO / "leaderboard" / "records")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the selection-seed commands (seed jobs need their results)")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pending = jobs(args.epsilons, args.seeds, args.methods)
    if args.dry_run:  # the grid; the later jobs' configurations depend on its results
        for eps, method, config, seed in pending:
            if config is not None and config != HALF_LR:
                workdir = args.runs_dir / group_name(eps) / run_name(method, config, seed)
                print(" ".join(command_for(method, config, eps, seed, workdir)))
        return 0
    running = {}  # worker slot -> (job, config, workdir, Popen, open log file)
    failed = []
    blocked = set()  # (eps, method) whose selection runs failed

    def start(slot, job, config):
        eps, method, _, seed = job
        workdir = args.runs_dir / group_name(eps) / run_name(method, config, seed)
        learning_rate = None
        if config.endswith(HALF_LR):
            base = published(args.records, eps, method, config.removesuffix(HALF_LR),
                             args.seeds[0])
            learning_rate = recorded_learning_rate(base) / 2
        command = command_for(method, config, eps, seed, workdir, learning_rate)
        print(f"[{time.strftime('%H:%M:%S')}] worker {slot}: " + " ".join(command), flush=True)
        workdir.parent.mkdir(parents=True, exist_ok=True)
        log = open(workdir.parent / f"{workdir.name}.log", "a")
        if cores and 1 < args.workers <= len(cores):
            command = [sys.executable, "-c", PIN_AND_EXEC, str(cores[slot]), *command]
        running[slot] = (job, config, workdir, subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=log), log)

    while pending or running:
        for slot in [s for s, (_, _, _, proc, _) in running.items() if proc.poll() is not None]:
            job, config, workdir, proc, log = running.pop(slot)
            log.close()
            eps, method, _, seed = job
            target = published(args.records, eps, method, config, seed)
            if proc.returncode == 0 and (workdir / records_lib.RECORD_NAME).exists():
                publish(workdir, target)
                print(f"[{time.strftime('%H:%M:%S')}] published {target}", flush=True)
            else:
                failed.append(workdir)
                if seed == args.seeds[0]:
                    blocked.add((eps, method))
                print(f"FAILED (exit {proc.returncode}): {workdir} (log: {workdir}.log)",
                      file=sys.stderr, flush=True)
        free = [s for s in range(args.workers) if s not in running]
        for job in list(pending):
            if not free:
                break
            eps, method, config, seed = job
            if (eps, method) in blocked:
                pending.remove(job)
                continue
            if config == HALF_LR:
                config = halved_config(args.records, eps, method, args.seeds[0])
                if config is None:
                    continue  # its grid is still training; try a later job
            elif config is None:
                config = chosen_config(args.records, eps, method, args.seeds[0])
                if config is None:
                    continue  # its selection runs are still training; try a later job
            pending.remove(job)
            target = published(args.records, eps, method, config, seed)
            if target.exists():
                continue
            workdir = args.runs_dir / group_name(eps) / run_name(method, config, seed)
            if (workdir / records_lib.RECORD_NAME).exists():
                # it finished while no sweep was watching (the sweep was stopped): publish it,
                # as rerunning would be refused (a finished workdir is never overwritten)
                publish(workdir, target)
                print(f"[{time.strftime('%H:%M:%S')}] published {target} (finished earlier)",
                      flush=True)
                continue
            start(free.pop(0), job, config)
        if running:
            time.sleep(POLL_S)
        elif pending:
            # Nothing runs and nothing can start: the remaining seed jobs wait on failed grids.
            break
    for workdir in failed:
        print(f"FAILED: {workdir}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
