"""One Tune trial's work: a job (one dpbench run of the search) or a pack of jobs trained as
groups by one process (dpbench/run/group.py), and the one way a finished run reaches the
records folder.

A job is a dict: records, runs_dir, repo, group, epsilon, delta, method, trial, seed,
gin_files, bindings. Its run trains in ``<runs_dir>/<group>/<method>-t<trial>-seed<seed>`` and
is published to the same name under ``<records>/<group>/``: its run record, or ``diverged.json``
for a run that diverged. A job already published is never trained again; one that finished
but was not published (the sweep stopped in between) is published, not rerun.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from dpbench import records as records_lib
from dpbench.search import tuning

DIVERGED, run_dir_name = tuning.DIVERGED, tuning.run_dir_name
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


def published(job: dict) -> Path:
    """Where ``job``'s run is published."""
    return Path(job["records"]) / job["group"] / run_dir_name(job["method"], job["trial"],
                                                             job["seed"])


def workdir_of(job: dict) -> Path:
    return Path(job["runs_dir"]) / job["group"] / published(job).name


def is_published(job: dict) -> bool:
    target = published(job)
    return (target / records_lib.RECORD_NAME).exists() or (target / DIVERGED).exists()


def result(target: Path) -> dict:
    """What Tune is told of a published run."""
    if (target / DIVERGED).exists():
        return dict(validation_accuracy=-1.0, diverged=True)
    record = json.loads((target / records_lib.RECORD_NAME).read_text())
    return dict(validation_accuracy=record["validation_accuracy"], diverged=False)


def publish(job: dict, diverged: Optional[str] = None) -> Optional[dict]:
    """The one path from a run to the records folder: ``job``'s published result when it has
    one; else its finished run's record (atomically, records.publish_record), or, given the
    divergence's message, ``diverged.json``; else None (nothing to publish yet)."""
    target, workdir = published(job), workdir_of(job)
    if is_published(job):
        return result(target)
    if (workdir / records_lib.RECORD_NAME).exists():
        records_lib.publish_record(workdir, target)
        return result(target)
    if diverged is not None:
        records_lib.atomic_write_text(target / DIVERGED, json.dumps(
            dict(job={k: job[k] for k in ("group", "method", "trial", "seed", "bindings")},
                 log_tail=diverged[-600:]), indent=1) + "\n")
        return result(target)
    return None


def _bindings(job: dict) -> list:
    return [*job["bindings"], f"EPSILON = {job['epsilon']}", f"DELTA = {job['delta']!r}",
            f"train.seed = {job['seed']}"]


def _launch(command: list, log_path: Path, runs_dir: Path, cwd: str, names: list) -> int:
    """Runs ``command`` (a dpbench process) pinned to a free core, its output into
    ``log_path``; ``names`` go to the launch log first. Returns its exit code."""
    with open(runs_dir / LAUNCH_LOG, "a") as log:
        log.write("".join(f"{name}\n" for name in names))
    core, lock = _lock_free_core(runs_dir / "core-locks")
    try:
        with open(log_path, "a") as log:
            return subprocess.run(command, cwd=cwd, stdout=log, stderr=log,
                                  preexec_fn=lambda: _child_setup(core)).returncode
    finally:
        if lock is not None:
            lock.close()


def run_job(job: dict) -> dict:
    """Trains one trial with the dpbench command and publishes what it left. Skips a trial
    whose record is already published."""
    done = publish(job)
    if done is not None:
        return done
    workdir = workdir_of(job)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "dpbench.main", f"--workdir={workdir}",
               *[f"--gin_file={f}" for f in job["gin_files"]],
               *[f"--gin_bindings={b}" for b in _bindings(job)]]
    log = workdir.parent / f"{workdir.name}.log"
    code = _launch(command, log, Path(job["runs_dir"]), job["repo"],
                   [f"{job['group']}/{workdir.name}"])
    tail = log.read_text()[-2000:]
    done = publish(job, diverged=tail if "training diverged" in tail else None)
    if done is not None:
        return done
    raise RuntimeError(f"{workdir.name} failed (exit {code}); log: {log}:\n{tail[-800:]}")


def run_pack(jobs: list) -> dict:
    """Trains ``jobs`` (one method's, one protocol group's) in groups, one process
    (``python -m dpbench.run.group``), and publishes each; a published job is skipped, a
    finished one published. Raises, after publishing every job that finished, when any did
    not."""
    todo = [job for job in jobs if publish(job) is None]
    if todo:
        first = workdir_of(todo[0])
        first.parent.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256(json.dumps(todo, sort_keys=True).encode()).hexdigest()[:10]
        spec, outcomes = (first.parent / f"pack-{key}.json",
                          first.parent / f"pack-{key}.outcomes.json")
        records_lib.atomic_write_text(spec, json.dumps(
            [dict(workdir=str(workdir_of(j)), gin_files=j["gin_files"], bindings=_bindings(j))
             for j in todo], indent=1) + "\n")
        outcomes.unlink(missing_ok=True)
        log = first.parent / f"pack-{key}.log"
        code = _launch([sys.executable, "-m", "dpbench.run.group", str(spec), str(outcomes)],
                       log, Path(todo[0]["runs_dir"]), todo[0]["repo"],
                       [f"{j['group']}/{workdir_of(j).name}" for j in todo])
        said = ({o["workdir"]: o for o in json.loads(outcomes.read_text())}
                if outcomes.exists() else {})
        missing = []
        for job in todo:
            outcome = said.get(str(workdir_of(job)), {})
            if publish(job, diverged=outcome.get("message")
                       if outcome.get("outcome") == "diverged" else None) is None:
                missing.append(workdir_of(job).name)
        if missing:
            tail = log.read_text()[-800:]
            raise RuntimeError(f"{', '.join(missing)} failed (exit {code}); log: {log}:\n{tail}")
    results = [result(published(job)) for job in jobs]
    return dict(trials=len(jobs), diverged=sum(r["diverged"] for r in results),
                validation_accuracy=max(r["validation_accuracy"] for r in results))


def pack_jobs(jobs: list, group_size: int, workers: int) -> list:
    """``jobs`` as packs, each one Tune trial: one method's jobs of one protocol group
    together (the trials a group step can share), each method-group's n jobs split into
    min(n, ceil(workers / method-groups)) packs of sizes that differ by one at most (so that
    few methods still fill every worker), then into packs of at most ``group_size`` jobs
    (0: no cap; the group process sizes its groups by the device's memory)."""
    by_method: dict = {}
    for job in jobs:
        by_method.setdefault((job["group"], job["method"]), []).append(job)
    spread = max(1, math.ceil(workers / max(1, len(by_method))))
    packs = []
    for members in by_method.values():
        parts = min(spread, len(members))
        if group_size:
            parts = max(parts, math.ceil(len(members) / group_size))
        bounds = [round(k * len(members) / parts) for k in range(parts + 1)]
        packs += [members[a:b] for a, b in zip(bounds, bounds[1:])]
    return packs
