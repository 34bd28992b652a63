"""``dpbench sweep``: board v2's trials on Ray Tune (the optional ``[sweep]`` extra).

  dpbench sweep [--protocol=leaderboard/protocol.json] [--families F ...] [--epsilons E ...]
                [--methods M ...] [--runs_dir=runs/sweep] [--records=leaderboard/records]
                [--address=ray://host:10001] [--cpus_per_trial=1]
  dpbench sweep --cost [--runs_dir=runs/sweep]   (core-hours the runs took, per group)

Per group (family, epsilon) of the protocol (dpbench/tuning.py):
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
import socket
import subprocess
import sys
import time
from pathlib import Path

from dpbench import records as records_lib
from dpbench import sweep_cost, tuning

REPO = Path(__file__).resolve().parents[1]
SEARCH_FILE, DIVERGED, run_dir_name = tuning.SEARCH_FILE, tuning.DIVERGED, tuning.run_dir_name
LAUNCH_LOG = "launches.log"  # one line per dpbench run a trial started (tests read it)


def support_event(gin_files, bindings) -> dict:
    """The DpEvent (JSON) a run with these settings would have, from the compiler's own
    accounting; nothing trains."""
    from dpbench import accounting, config, train
    config.parse_config(list(gin_files), list(bindings))
    _, stages = train.pipeline_stages()
    run = train.build_run(stages, config.TrainConfig(), accounting.Budget())
    return accounting.event_to_json(run.compiled.run_event())


def support_events(tasks, workers: int) -> list:
    """support_event of each (gin_files, bindings), on ``workers`` fresh processes (each call
    loads the data and calibrates sigma: seconds each, hundreds per board)."""
    if workers <= 1 or len(tasks) <= 1:
        return [support_event(*t) for t in tasks]
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(support_event, *zip(*tasks)))


def plan_group(protocol: dict, family: str, epsilon: float, methods, workers: int = 1,
               secret_rng=None) -> dict:
    """What search.json holds for one group (trial bindings and the support's events). With
    ``secret_rng`` (a secret search): J from the deployment's law and i.i.d. draws, both from
    that generator (OS entropy), never from the protocol's public seed."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    spec = protocol["families"][family]
    if secret_rng is None:
        law = dict(protocol["trials"])
        num_random = tuning.draw_random_trials(law, group)
    else:
        law = tuning.secret_law(protocol["trials"])
        num_random = tuning.sample_trial_count(secret_rng, float(law["mean_random"]),
                                               tuning.shape_of(law))
    plan = dict(group=group, family=family, epsilon=float(epsilon), delta=protocol["delta"],
                trials_law=law, num_random=num_random,
                num_trials=1 + num_random, seeds=list(protocol["seeds"]),
                family_spec=spec, methods={})
    budget_bindings = [f"EPSILON = {float(epsilon)}", f"DELTA = {protocol['delta']!r}"]
    tasks = []
    for method in methods:
        gin_files = [spec["methods"][method]["gin_file"], *spec.get("gin_files", [])]
        support = tuning.privacy_support(protocol, family, method)
        tasks += [(method, gin_files, b) for b in support]
        plan["methods"][method] = dict(
            gin_files=gin_files, support=[],
            trials=tuning.trial_bindings(protocol, family, group, method, num_random,
                                         rng=secret_rng))
        tuning.check_trials(method, gin_files, plan["methods"][method]["trials"],
                            [*budget_bindings, "train.seed = 0"])
    events = support_events([(g, [*b, *budget_bindings]) for _, g, b in tasks], workers)
    for (method, _, bindings), event in zip(tasks, events):
        plan["methods"][method]["support"].append(dict(bindings=bindings, event=event))
    return plan


def prepare(protocol: dict, family: str, epsilon: float, methods, records: Path,
            workers: int = 1) -> dict:
    """search.json of the group: written once; a rerun must find the same trials."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    path = records / group / SEARCH_FILE
    if path.exists():
        plan = json.loads(path.read_text())
        missing = [m for m in methods if m not in plan["methods"]]
        for method in set(methods) - set(missing):
            fresh = tuning.trial_bindings(protocol, family, group, method, plan["num_random"])
            if fresh != plan["methods"][method]["trials"] or plan["family_spec"] != \
                    protocol["families"][family]:
                raise tuning.ProtocolError(
                    f"{path}: the protocol changed since this search began ({method}'s trials "
                    "differ); restore the protocol, or start a new board in another --records")
        if not missing:
            return plan
        extra = plan_group(protocol, family, epsilon, missing, workers)
        plan["methods"].update(extra["methods"])
    else:
        plan = plan_group(protocol, family, epsilon, methods, workers)
    # insertion order kept (methods as the protocol lists them: the order trials are queued)
    records_lib.atomic_write_text(path, json.dumps(plan, indent=1) + "\n")
    return plan


def prepare_secret(protocol: dict, family: str, epsilon: float, methods, private: Path,
                   workers: int = 1) -> dict:
    """A secret search's plan, kept under ``private`` (never published): drawn once from OS
    entropy; a rerun reuses it (drawing J again and keeping the better search would void the
    bound)."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    path = private / group / SEARCH_FILE
    if path.exists():
        plan = json.loads(path.read_text())
        if sorted(plan["methods"]) != sorted(methods):
            raise tuning.ProtocolError(
                f"{path}: this secret search runs {sorted(plan['methods'])}; rerun with "
                "exactly those --methods (a new set of methods needs a new --runs_dir)")
        return plan
    import numpy as np
    plan = plan_group(protocol, family, epsilon, methods, workers,
                      secret_rng=np.random.default_rng())  # fresh OS entropy
    records_lib.atomic_write_text(path, json.dumps(plan, indent=1) + "\n")
    return plan


RELEASE = "release.json"  # a secret search's statement, beside the one run it publishes


def publish_selected(plans, private_records: Path, records: Path) -> list:
    """Per group and method of finished secret searches: the winner's run record (and nothing
    else of the search: not K, not the losers, not the trial's index) into
    ``<records>/<group>/<method>-selected/`` with ``release.json``, the Papernot-Steinke
    epsilon of releasing it (tuning.search_epsilon over the records' own events)."""
    published = []
    for plan in plans:
        summary = tuning.search_summary(private_records / plan["group"])
        law = plan["trials_law"]
        for method in plan["methods"]:
            s = summary[method]
            if s["winner"] is None:
                continue  # every trial diverged: nothing to release
            source = private_records / plan["group"] / run_dir_name(method, s["winner"],
                                                                   plan["seeds"][0])
            target = records / plan["group"] / f"{method}-selected"
            release = dict(
                method=method, group=plan["group"], target_epsilon=plan["epsilon"],
                delta=plan["delta"], law=dict(shape=law["shape"],
                                              mean_random=law["mean_random"]),
                epsilon=s["search_epsilon"],
                statement=(
                    f"({s['search_epsilon']:.4g}, {plan['delta']:g})-DP for this one released "
                    "model, its configuration and its validation accuracy: the best on "
                    "validation of trial 0 (the method's recipe) and J random trials drawn "
                    "i.i.d. from the protocol's space, J ~ "
                    f"{'Poisson' if tuning.shape_of(law) == float('inf') else 'TNB'}"
                    f"(mean {law['mean_random']}, shape {law['shape']}) drawn from OS entropy "
                    "and kept secret with every other trial (Papernot & Steinke, ICLR 2022; "
                    "dp_accounting's RepeatAndSelectDpEvent). Releasing anything else of the "
                    "search voids it."))
            records_lib.atomic_write_text(target / records_lib.RECORD_NAME,
                                          (source / records_lib.RECORD_NAME).read_text())
            records_lib.atomic_write_text(target / RELEASE, json.dumps(release, indent=1) + "\n")
            published.append(target)
    return published


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
        records_lib.atomic_write_text(target / records_lib.RECORD_NAME,
                                      (workdir / records_lib.RECORD_NAME).read_text())
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
        records_lib.atomic_write_text(target / records_lib.RECORD_NAME,
                                      (workdir / records_lib.RECORD_NAME).read_text())
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


def retry_advice(error: str) -> str:
    """Whether rerunning can help a failed trial: a dpbench run that exits 2 refused its input
    (settings, a stage's declaration), which a rerun meets again; anything else (a crash, a
    kill, a lost worker) may pass on a rerun, which resumes the trial."""
    if "(exit 2)" in error:
        return ("its run refused its input (exit 2): a rerun fails the same way; fix the "
                "trial's settings or stage (its log says what), then rerun")
    return "rerun the same command to retry it (the trial resumes from its checkpoint)"


def unreachable_reason(address: str, timeout: float = 30.0):
    """None when a TCP connection to the Ray address's host:port opens within ``timeout``
    seconds, else a one-line reason: ray.init would otherwise retry for minutes with warnings
    only. ``auto`` (a cluster on this machine found by Ray itself) is not checked."""
    if address == "auto":
        return None
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return f"--address={address!r} is not host:port (or ray://host:port, or auto)"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        return (f"no Ray cluster answers at --address={address} ({e.strerror or e}); start one "
                "with `ray start --head` there, or leave --address out to run Ray locally")
    return None


def foreign_protocol_reason(protocol: Path, records: Path, official_board: bool):
    """None unless a protocol other than the board's own would publish into the committed
    board's records (leaderboard/records, the default --records): a user's own search must not
    mix its runs into the official board by leaving a flag out."""
    board = REPO / "leaderboard"
    if (official_board or Path(records).resolve() != (board / "records").resolve()
            or Path(protocol).resolve() == (board / "protocol.json").resolve()):
        return None
    return (f"--protocol={protocol} is not the board's own, but --records is the committed "
            f"board's ({board / 'records'}); pass --records=DIR for your own board (or "
            "--official_board to publish into the committed one)")


def secret_into_board_reason(records: Path):
    """A secret search must not publish into the committed board (which prints every trial)."""
    if Path(records).resolve() == (REPO / "leaderboard" / "records").resolve():
        return ("--secret_trial_count publishes only each method's winner; give it a "
                "--records=DIR of its own, not the committed board's (which prints every trial)")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dpbench sweep", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    parser.add_argument("--cost", action="store_true",
                        help="print the core-hours the runs under --runs_dir took and stop")
    args = parser.parse_args(argv)
    if args.cost:
        sweep_cost.print_cost(args.runs_dir, args.cpus_per_trial)
        return 0
    reason = (foreign_protocol_reason(args.protocol, args.records, args.official_board)
              or (args.secret_trial_count and secret_into_board_reason(args.records))
              or (args.address and unreachable_reason(args.address)))
    if reason:
        print(f"dpbench: error: {reason}", file=sys.stderr)
        return 2
    private = args.runs_dir / "secret"
    try:
        protocol = tuning.load_protocol(args.protocol)
        if args.secret_trial_count:
            tuning.secret_law(protocol["trials"])  # refused early when there is none
        plans = []
        for family in args.families or list(protocol["families"]):
            if family not in protocol["families"]:
                raise tuning.ProtocolError(f"family {family!r} is not in {args.protocol}; "
                                           f"it has {sorted(protocol['families'])}")
            methods = args.methods or list(protocol["families"][family]["methods"])
            unknown = set(methods) - set(protocol["families"][family]["methods"])
            if unknown:
                raise tuning.ProtocolError(f"{family} has no method(s) {sorted(unknown)}")
            workers = 1 if args.address else args.cpus or os.cpu_count()
            for epsilon in args.epsilons or protocol["epsilons"]:
                if args.secret_trial_count:
                    plans.append(prepare_secret(protocol, family, epsilon, methods,
                                                private / "records", workers))
                    print(f"{plans[-1]['group']}: K drawn in secret", flush=True)
                    continue
                plans.append(prepare(protocol, family, epsilon, methods, args.records,
                                     workers=workers))
                print(f"{plans[-1]['group']}: K = {plans[-1]['num_trials']} trials per method",
                      flush=True)
    except tuning.ProtocolError as e:
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
        inside = argparse.Namespace(**{**vars(args), "records": private / "records"})
        failed = run_phase("secret-search", _jobs(plans, "search", inside), args)
        if not failed:
            for target in publish_selected(plans, private / "records", args.records):
                print(f"released {target}", flush=True)
        for job, error in failed:
            print(f"FAILED (secret): {job['group']}/{job['method']}: {retry_advice(error)}",
                  file=sys.stderr)
        print(f"secret search {'incomplete' if failed else 'done'} in {time.time() - t0:.0f}s",
              flush=True)
        return 1 if failed else 0
    failed = run_phase("search", _jobs(plans, "search", args), args)
    if not failed:
        failed = run_phase("seeds", _jobs(plans, "seeds", args,
                                          winners_of(plans, args.records)), args)
    for job, error in failed:
        print(f"FAILED: {job['group']}/{run_dir_name(job['method'], job['trial'], job['seed'])}"
              f": {retry_advice(error)}", file=sys.stderr)
    print(f"sweep {'incomplete' if failed else 'done'} in {time.time() - t0:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
