"""``dpbench sweep``: the board's trials on Ray Tune (the optional ``[sweep]`` extra).

  dpbench sweep [--protocol=leaderboard/protocol.json] [--families F ...] [--epsilons E ...]
                [--methods M ...] [--runs_dir=runs/sweep] [--records=leaderboard/records]
                [--address=ray://host:10001] [--cpus_per_trial=1]
  dpbench sweep --cost [--runs_dir=runs/sweep]   (core-hours the runs took, per group)
  dpbench sweep --progress [--records=DIR]       (where a sweep stands, from its records)

Per group (family, epsilon) of the protocol (dpbench/search/tuning.py):
  1. prepare: J is drawn, every method's K = 1 + J trial bindings are fixed, and the event of
     every point of the space's privacy support is computed (no training); all of it goes to
     ``<records>/<group>/search.json`` once (a rerun checks the protocol has not changed);
  2. search: every method's K trials on seed 0, one Tune trial each;
  3. seeds: each method's winner on validation (the board's rule) on the other seeds.
Each dpbench run trains in ``<runs_dir>/<group>/<method>-t<trial>-seed<seed>`` (its own
checkpoints: a trial Tune restarts resumes) and its record is published atomically to
``<records>/<group>/<method>-t<trial>-seed<seed>/run_record.json``; a run that diverges
publishes ``diverged.json`` there instead (a trial it was, and it can never win). Both phases
are Tune experiments under ``<runs_dir>/tune/``: rerunning the same command restores them with
Tune's own restore, so no finished trial runs again. Locally Ray gets every core and each trial
one (``--cpus_per_trial``), pinned to a free core when one is; ``--address`` joins a running Ray
cluster instead (its workers need dpbench installed at the same path).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpbench import records as records_lib
from dpbench.cli_args import FlagParser
from dpbench.search import tuning
from dpbench.sweep import cost as sweep_cost
from dpbench.sweep import planning as sweep_plan
from dpbench.sweep import secret as sweep_secret
from dpbench.search.protocol import ProtocolError, load_protocol
from dpbench.sweep.preflight import foreign_protocol_reason, retry_advice, unreachable_reason
from dpbench.sweep.planning import prepare

REPO = Path(__file__).resolve().parents[2]
SEARCH_FILE, DIVERGED, run_dir_name = tuning.SEARCH_FILE, tuning.DIVERGED, tuning.run_dir_name
LAUNCH_LOG = "launches.log"  # one line per dpbench run a trial started (tests read it)


def _lock_free_core(lock_dir: Path):
    """(core, open lock file) for a core no other trial of this machine holds, or (None, None).
    Why: two processes each pinned to one core ran 1.7x the steps of unpinned ones here."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    lock_dir.mkdir(parents=True, exist_ok=True)
    for core in sorted(os.sched_getaffinity(0)):
        handle = open(lock_dir / f"core{core}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return core, handle
        except OSError:
            handle.close()
    return None, None


def _child_setup(core) -> None:
    """In the dpbench child: die with the Ray worker (an interrupted sweep must leave no run
    writing into a workdir that the restored trial resumes), and pin to ``core``."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if core is not None:
        os.sched_setaffinity(0, {core})


def _published(job: dict) -> Path:
    return Path(job["records"]) / job["group"] / run_dir_name(job["method"], job["trial"],
                                                             job["seed"])


def _result(target: Path) -> dict:
    if (target / DIVERGED).exists():
        return dict(validation_accuracy=-1.0, diverged=True)
    record = json.loads((target / records_lib.RECORD_NAME).read_text())
    return dict(validation_accuracy=record["validation_accuracy"], diverged=False)


def run_job(job: dict) -> dict:
    """Trains one trial with the dpbench command and publishes what it left. Skips a trial
    whose record is already published."""
    target = _published(job)
    if (target / records_lib.RECORD_NAME).exists() or (target / DIVERGED).exists():
        return _result(target)
    workdir = Path(job["runs_dir"]) / job["group"] / target.name
    workdir.parent.mkdir(parents=True, exist_ok=True)
    if (workdir / records_lib.RECORD_NAME).exists():
        # it finished, but the sweep was stopped before publishing it: publish, never rerun
        records_lib.publish_record(workdir, target)
        return _result(target)
    command = [sys.executable, "-m", "dpbench.main", f"--workdir={workdir}",
               *[f"--gin_file={f}" for f in job["gin_files"]],
               *[f"--gin_bindings={b}" for b in job["bindings"]],
               f"--gin_bindings=EPSILON = {job['epsilon']}",
               f"--gin_bindings=DELTA = {job['delta']!r}",
               f"--gin_bindings=train.seed = {job['seed']}"]
    with open(Path(job["runs_dir"]) / LAUNCH_LOG, "a") as log:
        log.write(f"{job['group']}/{target.name}\n")
    core, lock = _lock_free_core(Path(job["runs_dir"]) / "core-locks")
    try:
        with open(workdir.parent / f"{workdir.name}.log", "a") as log:
            proc = subprocess.run(command, cwd=job["repo"], stdout=log, stderr=log,
                                  preexec_fn=lambda: _child_setup(core))
    finally:
        if lock is not None:
            lock.close()
    if proc.returncode == 0 and (workdir / records_lib.RECORD_NAME).exists():
        records_lib.publish_record(workdir, target)
        return _result(target)
    tail = (workdir.parent / f"{workdir.name}.log").read_text()[-2000:]
    if "training diverged" in tail:
        records_lib.atomic_write_text(target / DIVERGED, json.dumps(
            dict(job={k: job[k] for k in ("group", "method", "trial", "seed", "bindings")},
                 log_tail=tail[-600:]), indent=1) + "\n")
        return _result(target)
    raise RuntimeError(f"{target.name} failed (exit {proc.returncode}); log: {workdir}.log:\n"
                       f"{tail[-800:]}")


def _trainable(config: dict) -> None:
    from ray import tune
    tune.report(run_job(config["job"]))


def _jobs(plans, phase: str, args, winners=None) -> list:
    base = dict(records=str(args.records.resolve()), runs_dir=str(args.runs_dir.resolve()),
                repo=str(REPO))
    jobs = []
    for plan in plans:
        for method, m in plan["methods"].items():
            if phase == "search":
                runs = [(t, plan["seeds"][0]) for t in range(plan["num_trials"])]
            else:
                runs = [(winners[(plan["group"], method)], s) for s in plan["seeds"][1:]]
            jobs += [dict(base, group=plan["group"], epsilon=plan["epsilon"],
                          delta=plan["delta"], method=method,
                          trial=t, seed=s, gin_files=m["gin_files"], bindings=m["trials"][t])
                     for t, s in runs]
    return jobs


def winners_of(plans, records: Path) -> dict:
    """(group, method) -> the trial chosen on validation among its published seed-0 runs."""
    out = {}
    for plan in plans:
        for method in plan["methods"]:
            validation = {}
            for trial in range(plan["num_trials"]):
                target = records / plan["group"] / run_dir_name(method, trial, plan["seeds"][0])
                result = _result(target)
                validation[trial] = None if result["diverged"] else result["validation_accuracy"]
            out[(plan["group"], method)] = tuning.choose_trial(validation)
    return out


def run_phase(name: str, jobs: list, args) -> list:
    """One Tune experiment over ``jobs`` (restored when it exists). Returns the failed jobs,
    each with its error."""
    if not jobs:  # e.g. the seeds phase of a protocol with one seed (Tune fails on no trials)
        return []
    from ray import tune
    storage = (args.runs_dir / "tune").resolve()
    key = hashlib.sha256(json.dumps(jobs, sort_keys=True).encode()).hexdigest()[:10]
    path = storage / f"{name}-{key}"
    trainable = tune.with_resources(_trainable, {"cpu": args.cpus_per_trial})
    if tune.Tuner.can_restore(str(path)):
        print(f"restoring {path}", flush=True)
        tuner = tune.Tuner.restore(str(path), trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space={"job": tune.grid_search(jobs)},
                           tune_config=tune.TuneConfig(reuse_actors=False),
                           run_config=tune.RunConfig(storage_path=str(storage), name=path.name,
                                                     verbose=1))
    results = tuner.fit()
    return [(r.config["job"], str(r.error)) for r in results if r.error is not None]


def _run_secret(plans, args, private: Path, t0: float) -> int:
    """The secret searches' trials on Ray Tune (records kept under ``private``), then each
    method's winner published into ``args.records``."""
    inside = argparse.Namespace(**{**vars(args), "records": private / "records"})
    failed = run_phase("secret-search", _jobs(plans, "search", inside), args)
    if not failed:
        for target in sweep_secret.publish_selected(plans, private / "records", args.records):
            print(f"released {target}", flush=True)
    for job, error in failed:
        print(f"FAILED (secret): {job['group']}/{job['method']}: {retry_advice(error)}",
              file=sys.stderr)
    print(f"secret search {'incomplete' if failed else 'done'} in {time.time() - t0:.0f}s",
          flush=True)
    return 1 if failed else 0


# ``dpbench sweep MODE [flags]``: each mode is the flag it stands for (the flags still work)
MODES = {"run": [], "prepare": ["--prepare_only"], "secret": ["--secret_trial_count"],
         "progress": ["--progress"], "cost": ["--cost"]}


def parse_args(argv=None) -> argparse.Namespace:
    """The sweep's arguments; a first argument naming a mode (``MODES``) stands for its flag."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MODES:
        argv = MODES[argv[0]] + argv[1:]
    return _parser().parse_args(argv)


def _parser():
    parser = FlagParser(
        "dpbench sweep", __doc__.split("\n")[0] + " Modes: run (the default: search, then the "
        "winners' seeds), prepare (= --prepare_only), secret (= --secret_trial_count), "
        "progress (= --progress), cost (= --cost).",
        usage="dpbench sweep [run|prepare|secret|progress|cost] [flags]")
    parser.add_argument("--protocol", type=Path, default=REPO / "leaderboard" / "protocol.json",
                        help="the tuning protocol (families, methods, search spaces, trials)")
    parser.add_argument("--families", nargs="+", default=None,
                        help="only these model families of the protocol (default: all)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=None,
                        help="only these target epsilons of the protocol (default: all)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only these methods of the protocol (default: all)")
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "sweep",
                        help="each trial's workdir and Ray Tune's state (a rerun resumes)")
    parser.add_argument("--records", type=Path, default=REPO / "leaderboard" / "records",
                        help="where finished trials publish their run records (the default is "
                             "the committed board's)")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster's address (host:port, ray://host:port "
                             "or auto); refused within 30 s when nothing answers there")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray instance")
    parser.add_argument("--cpus_per_trial", type=float, default=1.0,
                        help="CPUs Ray reserves for each trial")
    parser.add_argument("--prepare_only", action="store_true",
                        help="write each group's search.json (trials, support events) and stop")
    parser.add_argument("--official_board", action="store_true",
                        help="let a protocol other than leaderboard/protocol.json publish into "
                             "leaderboard/records")
    parser.add_argument("--secret_trial_count", action="store_true",
                        help="deploy the search as Papernot & Steinke's theorem needs it: J "
                             "from the protocol's law (its trials.deployment for a fixed K) "
                             "drawn from OS entropy, trials drawn i.i.d., everything kept under "
                             "--runs_dir/secret; only each method's winner is published, with "
                             "release.json (its epsilon, K secret). No retrains.")
    parser.add_argument("--progress", action="store_true",
                        help="print where the sweep under --records stands (runs published, "
                             "junk so far, core-hours spent and an estimate of the rest, "
                             "from the published records alone) and stop")
    parser.add_argument("--cost", action="store_true",
                        help="print the core-hours the runs under --runs_dir took and stop")
    return parser


def main(argv=None) -> int:
    """``dpbench sweep [MODE] [flags]`` called as a function: the exit code."""
    return run_sweep(parse_args(argv))


def run_sweep(args: argparse.Namespace) -> int:
    """The sweep the parsed flags ask for; the exit code."""
    if args.cost:
        sweep_cost.print_cost(args.runs_dir, args.cpus_per_trial)
        return 0
    if args.progress:
        sweep_cost.print_progress(args.records, args.cpus or os.cpu_count())
        return 0
    reason = (foreign_protocol_reason(args.protocol, args.records, args.official_board)
              or (args.secret_trial_count and sweep_secret.into_board_reason(args.records))
              or (args.address and unreachable_reason(args.address)))
    if reason:
        print(f"dpbench: error: {reason}", file=sys.stderr)
        return 2
    private = args.runs_dir / "secret"
    try:
        protocol = load_protocol(args.protocol)
        if args.secret_trial_count:
            tuning.secret_law(protocol["trials"])  # refused early when there is none
        plans = []
        for family in args.families or list(protocol["families"]):
            if family not in protocol["families"]:
                raise ProtocolError(f"family {family!r} is not in {args.protocol}; "
                                           f"it has {sorted(protocol['families'])}")
            methods = args.methods or list(protocol["families"][family]["methods"])
            unknown = set(methods) - set(protocol["families"][family]["methods"])
            if unknown:
                raise ProtocolError(f"{family} has no method(s) {sorted(unknown)}")
            workers = 1 if args.address else args.cpus or os.cpu_count()
            for epsilon in args.epsilons or protocol["epsilons"]:
                if args.secret_trial_count:
                    plans.append(sweep_plan.prepare_secret(protocol, family, epsilon, methods,
                                                             private / "records", workers))
                    print(f"{plans[-1]['group']}: K drawn in secret", flush=True)
                    continue
                plans.append(prepare(protocol, family, epsilon, methods, args.records,
                                     workers=workers))
                print(f"{plans[-1]['group']}: K = {plans[-1]['num_trials']} trials per method",
                      flush=True)
    except ProtocolError as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2
    if args.prepare_only:
        return 0
    for plan in plans:  # only the selected methods run
        keep = args.methods or list(plan["methods"])
        plan["methods"] = {m: v for m, v in plan["methods"].items() if m in keep}
    import ray
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.cpus or os.cpu_count(), include_dashboard=False)
    t0 = time.time()
    if args.secret_trial_count:  # the trials publish privately; only winners leave
        return _run_secret(plans, args, private, t0)
    failed = run_phase("search", _jobs(plans, "search", args), args)
    if not failed:
        failed = run_phase("seeds", _jobs(plans, "seeds", args,
                                          winners_of(plans, args.records)), args)
    for job, error in failed:
        print(f"FAILED: {job['group']}/{run_dir_name(job['method'], job['trial'], job['seed'])}"
              f": {retry_advice(error)}", file=sys.stderr)
    print(f"sweep {'incomplete' if failed else 'done'} in {time.time() - t0:.0f}s", flush=True)
    return 1 if failed else 0

