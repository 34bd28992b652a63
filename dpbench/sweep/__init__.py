"""``dpbench sweep``: the board's trials on Ray Tune (the optional ``[sweep]`` extra).

  dpbench sweep [--protocol=leaderboard/protocol.json] [--families F ...] [--epsilons E ...]
                [--methods M ...] [--runs_dir=runs/sweep] [--records=leaderboard/records]
                [--address=ray://host:10001] [--cpus_per_trial=1] [--group_size=0]
  dpbench sweep --cost [--runs_dir=runs/sweep]   (core-hours the runs took, per group)
  dpbench sweep --progress [--records=DIR]       (where a sweep stands, from its records)

Per group (family, epsilon) of the protocol (dpbench/search/tuning.py):
  1. prepare: J is drawn, every method's K = 1 + J trial bindings are fixed, and the event of
     every point of the space's privacy support is computed (no training); all of it goes to
     ``<records>/<group>/search.json`` once (a rerun checks the protocol has not changed);
  2. search: every method's K trials on seed 0;
  3. seeds: each method's winner on validation (the board's rule) on the other seeds, once
     that method's own search is published (sweep/jobs.searched).
A Tune trial is a pack of one method's trials (sweep/jobs.py): one ``dpbench train --trials``
process trains them as groups, one compiled step per group (dpbench/run/trials.py;
``--group_size`` caps a pack, and ``--group_size=1`` runs one process per trial). Each trial trains in
``<runs_dir>/<group>/<method>-t<trial>-seed<seed>`` (its own checkpoints: a trial Tune
restarts resumes) and its record is published atomically to
``<records>/<group>/<method>-t<trial>-seed<seed>/run_record.json``; a run that diverges
publishes ``diverged.json`` there instead (a trial it was, and it can never win). Both phases
are Tune experiments under ``<runs_dir>/tune/``: rerunning the same command restores them with
Tune's own restore, so no finished trial runs again. Locally Ray gets every core and each Tune
trial one (``--cpus_per_trial``), pinned to a free core when one is; ``--address`` joins a running Ray
cluster instead (its workers need dpbench installed at the same path).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from dpbench.cli_args import FlagParser
from dpbench.search import registration, tuning
from dpbench.sweep import cost as sweep_cost
from dpbench.sweep.jobs import (LAUNCH_LOG, is_published, jobs_of, pack_jobs, published,
                                result, run_pack, seed_jobs, winners_of)
from dpbench.sweep import planning as sweep_plan
from dpbench.sweep import secret as sweep_secret
from dpbench.sweep import window
from dpbench.search.protocol import ProtocolError, load_protocol
from dpbench.sweep.preflight import (foreign_protocol_reason, frozen_board_reason, retry_advice,
                                     unreachable_reason)
from dpbench.sweep.planning import prepare
from dpbench.sweep.jobs import REPO

SEARCH_FILE, DIVERGED, run_dir_name = tuning.SEARCH_FILE, tuning.DIVERGED, tuning.run_dir_name


def _trainable(config: dict) -> None:
    from ray import tune
    tune.report(run_pack(config["jobs"]))


def _jobs(plans, phase: str, args, winners=None) -> list:
    return jobs_of(plans, phase, args.records, args.runs_dir, winners)


def run_phase(name: str, jobs: list, args) -> list:
    """One Tune experiment over ``jobs`` in packs (jobs.pack_jobs; restored when it exists).
    Returns the jobs left unpublished, each with its pack's error."""
    if not jobs:  # e.g. the seeds phase of a protocol with one seed (Tune fails on no trials)
        return []
    import ray
    from ray import tune
    workers = int(ray.cluster_resources().get("CPU", 1) // args.cpus_per_trial) or 1
    packs = pack_jobs(jobs, args.group_size, workers)
    storage = (args.runs_dir / "tune").resolve()
    key = hashlib.sha256(json.dumps(packs, sort_keys=True).encode()).hexdigest()[:10]
    path = storage / f"{name}-{key}"
    trainable = tune.with_resources(_trainable, {"cpu": args.cpus_per_trial})
    if tune.Tuner.can_restore(str(path)):
        print(f"restoring {path}", flush=True)
        tuner = tune.Tuner.restore(str(path), trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space={"jobs": tune.grid_search(packs)},
                           tune_config=tune.TuneConfig(reuse_actors=False),
                           run_config=tune.RunConfig(storage_path=str(storage), name=path.name,
                                                     verbose=1))
    results = tuner.fit()
    return [(job, str(r.error)) for r in results if r.error is not None
            for job in r.config["jobs"] if not is_published(job)]


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
         "progress": ["--progress"], "cost": ["--cost"], "local": ["--local"],
         "window": ["--window"], "land": ["--land"]}


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
        "progress (= --progress), cost (= --cost), local (= --local: without Ray, until a deadline), "
        "window (= --window: a registered board's cells on a lent device), land (= --land: a "
        "window's runs onto the board, whole cells only).",
        usage="dpbench sweep [run|prepare|secret|progress|cost|local|window|land] [flags]")
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
                        help="CPUs Ray reserves for each Tune trial")
    parser.add_argument("--group_size", type=int, default=0,
                        help="trials of one method and group trained by one compiled step "
                             "(dpbench/run/group.py), at most; 0 (default): as many as the "
                             "device's memory holds, split to fill every worker; 1: one "
                             "`dpbench train` process per trial")
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
    local = parser.add_argument_group("local (without Ray, until a deadline: sweep/local.py)")
    local.add_argument("--local", action="store_true",
                       help="run the trials on this machine without Ray until --deadline_s: "
                            "--gpu_workers device processes (packs of one method's trials of "
                            "one structure), --cpu_workers CPU processes (one trial each)")
    local.add_argument("--deadline_s", type=float, default=None,
                       help="--local: seconds from the start after which nothing is started "
                            "and what runs is stopped (required with --local)")
    local.add_argument("--gpu_workers", type=int, default=1,
                       help="--local: processes training packs on the accelerator")
    local.add_argument("--cpu_workers", type=int, default=0,
                       help="--local: processes training one trial each on the CPU")
    local.add_argument("--gpu_binding", action="append", default=[],
                       help="--local: a gin binding added to every device trial, e.g. "
                            "'train.accelerator_micro_batch_size = 0'")
    local.add_argument("--out", type=Path, default=None,
                       help="--local: where records.tar.gz (the newly published runs), "
                            "failed_logs.tar.gz and local.json go (default: --runs_dir/local)")
    local.add_argument("--pack_every_s", type=float, default=60.0,
                       help="--local: how often the outputs are rewritten while it runs")
    _add_window_flags(parser)
    return parser


def _add_window_flags(parser) -> None:
    flags = parser.add_argument_group(
        "window (a registered board on a lent device: sweep/window.py)")
    flags.add_argument("--window", action="store_true",
                       help="train the unfinished cells of --board that this device may "
                            "train (its kind and JAX as registered, one kind per group) "
                            "until --deadline_s; --out gets records.tar.gz and window.json")
    flags.add_argument("--land", action="store_true",
                       help="land a window's files (--files: its records.tar.gz and "
                            "window.json) on --board: every run to <board>/pending, each "
                            "whole cell on to <board>/records, the cost to windows.json")
    flags.add_argument("--board", type=Path, default=REPO / "leaderboard" / "v4",
                       help="--window/--land/--write_proof: the registered board's folder")
    flags.add_argument("--proof", type=Path, default=None,
                       help="--window: the registration proof --write_proof wrote here")
    flags.add_argument("--write_proof", type=Path, default=None,
                       help="check --board's registration with git and write its proof "
                            "(commit, date, analysis SHA-256) to this file, for --window")
    flags.add_argument("--files", type=Path, default=None,
                       help="--land: the folder a window's files came back in")
    flags.add_argument("--setup_s", type=float, default=0.0,
                       help="--window: the device seconds spent before it (install, ...)")
    flags.add_argument("--device_s", type=float, default=None,
                       help="--land: the window's device seconds, when known better than "
                            "its window.json's (the device tool's wall_s)")


def main(argv=None) -> int:
    """``dpbench sweep [MODE] [flags]`` called as a function: the exit code."""
    return run_sweep(parse_args(argv))


def _require_registered(protocol: dict, args) -> None:
    """A protocol that names its board's analysis trains only into that board's records, and
    only once the analysis is registered (committed, unchanged, before every record)."""
    if not protocol.get("analysis"):
        return
    analysis = (Path(args.protocol).resolve().parent / protocol["analysis"]).resolve()
    board = analysis.parent
    if analysis.name != registration.ANALYSIS:
        raise ProtocolError(f"the protocol's analysis must be a board's "
                            f"{registration.ANALYSIS}, got {protocol['analysis']!r}")
    if Path(args.records).resolve() != board / "records":
        raise ProtocolError(f"this protocol's board is {board} (its analysis): pass "
                            f"--records={board / 'records'}")
    try:
        analysis = registration.registration(board)["analysis"]
    except registration.RegistrationError as e:
        raise ProtocolError(str(e)) from e
    device = analysis.get("design", {}).get("device")
    if device and not args.prepare_only:
        raise ProtocolError(
            f"{board}'s registered analysis puts every run of a group on one device kind "
            f"({device['kinds']}) under JAX {device['jax']}, landing whole cells: its runs come "
            "only from lent-GPU windows (tools/gpu_window.sh: `dpbench sweep window` there, "
            "`dpbench sweep land` here); here, `dpbench sweep prepare` writes its plans")


def run_window_mode(args: argparse.Namespace) -> int:
    """--write_proof (here), --window (there) or --land (here); the exit code."""
    try:
        if args.write_proof:
            args.write_proof.write_text(json.dumps(window.registration_proof(args.board)) + "\n")
            print(f"{args.write_proof}: {args.board}'s registration, proved")
            return 0
        if args.land:
            if args.files is None:
                raise window.WindowError("--land needs --files: the window's files' folder")
            done = window.land(args.board, args.files, args.device_s)
            for key in ("landed", "refused", "skipped"):
                print(f"{key}: {len(done[key])}" + "".join(f"\n  {x}" for x in done[key]))
            for group, method, found, needed in window.pending_cells(args.board):
                print(f"pending: {group} {method}: {found} of {needed} runs")
            print(f"cost: {json.dumps(done['entry'])}")
            return 0
        if args.proof is None or args.deadline_s is None:
            raise window.WindowError("--window needs --proof (from --write_proof, here) and "
                                     "--deadline_s (seconds it may run)")
        from dpbench.sweep import local  # imports run/: only when it trains here
        said = window.run_window(args.board, json.loads(args.proof.read_text()),
                                 window.query_device(local.DEVICE_ENV), prepare,
                                 local.run_local,
                                 args.deadline_s, args.out or args.runs_dir / "window",
                                 args.runs_dir, args.group_size, args.gpu_binding, args.setup_s)
        print(json.dumps(said, indent=1))
        return 3 if said["refused"] else 0
    except (window.WindowError, registration.RegistrationError, ProtocolError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2


def run_sweep(args: argparse.Namespace) -> int:
    """The sweep the parsed flags ask for; the exit code."""
    if args.cost:
        sweep_cost.print_cost(args.runs_dir, args.cpus_per_trial)
        return 0
    if args.progress:
        sweep_cost.print_progress(args.records, args.cpus or os.cpu_count())
        return 0
    if args.window or args.land or args.write_proof:
        return run_window_mode(args)
    if args.local and args.deadline_s is None:
        print("dpbench: error: --local needs --deadline_s (seconds it may run)", file=sys.stderr)
        return 2
    reason = (foreign_protocol_reason(args.protocol, args.records, args.official_board)
              or frozen_board_reason(args.records)
              or (args.secret_trial_count and sweep_secret.into_board_reason(args.records))
              or (args.address and unreachable_reason(args.address)))
    if reason:
        print(f"dpbench: error: {reason}", file=sys.stderr)
        return 2
    private = args.runs_dir / "secret"
    try:
        protocol = load_protocol(args.protocol)
        _require_registered(protocol, args)
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
    if args.local:
        from dpbench.sweep import local  # imports run/: only when it trains here
        args.out = args.out or args.runs_dir / "local"
        return local.run_local(plans, args)
    import ray
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.cpus or os.cpu_count(), include_dashboard=False)
    t0 = time.time()
    if args.secret_trial_count:  # the trials publish privately; only winners leave
        return _run_secret(plans, args, private, t0)
    failed = run_phase("search", _jobs(plans, "search", args), args)
    # the phase rule (sweep/jobs.searched): every method whose search is published goes on
    # to its winner's seeds, whatever another method's search did
    failed += run_phase("seeds", seed_jobs(plans, args.records, args.runs_dir), args)
    for job, error in failed:
        print(f"FAILED: {job['group']}/{run_dir_name(job['method'], job['trial'], job['seed'])}"
              f": {retry_advice(error)}", file=sys.stderr)
    print(f"sweep {'incomplete' if failed else 'done'} in {time.time() - t0:.0f}s", flush=True)
    return 1 if failed else 0

