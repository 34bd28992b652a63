"""One Tune trial's work: a pack of jobs (one job: a pack of one), each a dpbench run of the
search, trained by one ``dpbench train --trials`` process (run/trials.py), and the one way a
finished run reaches the records folder.

A job is a dict: records, runs_dir, repo, group, epsilon, delta, method, trial, seed,
gin_files, bindings. Its run trains in ``<runs_dir>/<group>/<method>-t<trial>-seed<seed>`` and
is published to the same name under ``<records>/<group>/``: its run record, or ``diverged.json``
for a run that diverged. A job already published is never trained again; one that finished
but was not published (the sweep stopped in between) is published, not rerun.
"""

from __future__ import annotations

import ast
import ctypes
import fcntl
import hashlib
import json
import math
import os
import signal
import sys
import subprocess
import threading
from pathlib import Path
from typing import Optional

from dpbench import records as records_lib
from dpbench.run import launch
from dpbench.run import settings
from dpbench.search import tuning

DIVERGED, run_dir_name = tuning.DIVERGED, tuning.run_dir_name
REPO = Path(__file__).resolve().parents[2]
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


# libc loaded here, in the parent: the forked child then calls prctl without dlopen, which could
# wait forever on a loader lock another thread of a JAX-using parent held at the fork
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def _child_setup(core) -> None:
    """In the dpbench child: die with the Ray worker (an interrupted sweep must leave no run
    writing into a workdir that the restored trial resumes), and pin to ``core``."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
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


_RUNNING: set = set()  # the processes _launch started and that have not ended
_RUNNING_LOCK = threading.Lock()


def _launch(command: list, log_path: Path, runs_dir: Path, cwd: str, names: list,
            env: Optional[dict] = None) -> int:
    """Runs ``command`` (a dpbench process; in ``env``, default this one's) pinned to a free
    core, its output into ``log_path``; ``names`` go to the launch log first. Returns its exit
    code."""
    with open(runs_dir / LAUNCH_LOG, "a") as log:
        log.write("".join(f"{name}\n" for name in names))
    core, lock = _lock_free_core(runs_dir / "core-locks")
    try:
        with open(log_path, "a") as log:
            proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=log, env=env,
                                    preexec_fn=lambda: _child_setup(core))
            with _RUNNING_LOCK:
                _RUNNING.add(proc)
            try:
                return proc.wait()
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(proc)
    finally:
        if lock is not None:
            lock.close()


def kill_children() -> None:
    """Kills every process ``_launch`` started that is still running (a deadline's end)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        proc.kill()


def _trial(job: dict) -> launch.Trial:
    return launch.Trial(workdir_of(job), tuple(job["gin_files"]), tuple(_bindings(job)))


def run_pack(jobs: list, env: Optional[dict] = None) -> dict:
    """Trains ``jobs`` (one method's, one protocol group's; one job alone is a pack of one) in
    one ``dpbench train --trials`` process and publishes each: a published job is skipped, a
    finished one published, a diverged one published as diverged by what the process's
    outcomes file says (``env``: the process's environment). Raises, after publishing every
    job that finished, when any did not."""
    todo = [job for job in jobs if publish(job) is None]
    if todo:
        first = workdir_of(todo[0])
        first.parent.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256(json.dumps(todo, sort_keys=True).encode()).hexdigest()[:10]
        stem = (f"{first.name}" if len(todo) == 1 else f"pack-{key}")
        spec, outcomes = (first.parent / f"{stem}.trials.json",
                          first.parent / f"{stem}.outcomes.json")
        launch.write_trials_file(spec, [_trial(j) for j in todo])
        outcomes.unlink(missing_ok=True)
        log = first.parent / f"{stem}.log"
        code = _launch(launch.launch_command(spec, outcomes), log,
                       Path(todo[0]["runs_dir"]), todo[0]["repo"],
                       [f"{j['group']}/{workdir_of(j).name}" for j in todo], env)
        said = ({o["workdir"]: o for o in json.loads(outcomes.read_text())}
                if outcomes.exists() else {})
        missing = []
        for job in todo:
            outcome = said.get(str(workdir_of(job)), {})
            if publish(job, diverged=outcome.get("message")
                       if outcome.get("outcome") == launch.DIVERGED else None) is None:
                missing.append(workdir_of(job).name)
        if missing:
            tail = log.read_text()[-800:] if log.exists() else ""
            raise RuntimeError(f"{', '.join(missing)} failed (exit {code}); log: {log}:\n{tail}")
    results = [result(published(job)) for job in jobs]
    return dict(trials=len(jobs), diverged=sum(r["diverged"] for r in results),
                validation_accuracy=max(r["validation_accuracy"] for r in results))


def jobs_of(plans, phase: str, records: Path, runs_dir: Path, winners=None) -> list:
    """The jobs of ``phase`` ('search': every method's K trials on the first seed; 'seeds':
    each method's winner, ``winners[(group, method)]``, on the other seeds) of ``plans``."""
    base = dict(records=str(Path(records).resolve()), runs_dir=str(Path(runs_dir).resolve()),
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
                target = Path(records) / plan["group"] / run_dir_name(method, trial,
                                                                      plan["seeds"][0])
                done = result(target)
                validation[trial] = None if done["diverged"] else done["validation_accuracy"]
            out[(plan["group"], method)] = tuning.choose_trial(validation)
    return out


def searched(plans, records: Path, runs_dir: Path) -> list:
    """The phase rule: each (plan of one method) whose search is wholly published, so its
    winner's seed runs may start (a method's winner is chosen among its own trials alone:
    one slow or failed method holds back no other's seeds)."""
    out = []
    for plan in plans:
        for method in plan["methods"]:
            alone = dict(plan, methods={method: plan["methods"][method]})
            if all(is_published(j) for j in jobs_of([alone], "search", records, runs_dir)):
                out.append(alone)
    return out


def seed_jobs(plans, records: Path, runs_dir: Path) -> list:
    """The seed runs of every method of ``plans`` whose search is done (``searched``)."""
    ready = searched(plans, records, runs_dir)
    return jobs_of(ready, "seeds", records, runs_dir, winners_of(ready, records))


def _literal(text: str):
    """A binding's value as gin reads it (``1024``, ``1_024`` and ``1024`` alike; a reference
    such as ``@prune.synflow()`` as its text)."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def _bound(bindings) -> dict:
    return {k.strip(): _literal(v) for k, v in (b.split("=", 1) for b in bindings if "=" in b)}


def gin_defaults(gin_files, names) -> dict:
    """The values ``gin_files`` (a method's and its family's) bind to ``names``, parsed by
    dpbench's own gin parsing; a name they leave unbound is absent. Gin is global (and its
    configurables import JAX): a sweep's driver calls it through :func:`method_defaults`, in
    a process of its own."""
    import gin
    from dpbench import config
    config.parse_config(list(gin_files), [])
    out = {}
    for name in names:
        try:  # a macro (no dot, e.g. BANDS) is queried as %BANDS
            value = gin.query_parameter(name if "." in name else f"%{name}")
        except ValueError:  # not bound: the function's own default, the same for every trial
            continue
        # a reference (@prune.synflow()) as the gin text a binding writes it in
        out[name] = json.loads(json.dumps(value, default=str))
    gin.clear_config()
    return out


_DEFAULTS_CHILD = ("import json, sys; from dpbench.sweep import jobs; print(json.dumps("
                   "[jobs.gin_defaults(f, n) for f, n in json.loads(sys.argv[1])]))")


def method_defaults(jobs: list) -> dict:
    """tuple(gin files) -> the values its files give to every name some job binds: what a
    job that does not bind a name trains with (a search's trial 0 binds only its base). Read
    in a child process: the driver, which forks trial processes, never imports JAX."""
    names: dict = {}
    for job in jobs:
        names.setdefault(tuple(job["gin_files"]), set()).update(_bound(job["bindings"]))
    asked = [(list(files), sorted(n)) for files, n in names.items()]
    if not asked:
        return {}
    child = subprocess.run([sys.executable, "-c", _DEFAULTS_CHILD, json.dumps(asked)],
                           cwd=REPO, capture_output=True, text=True)
    if child.returncode:
        raise RuntimeError(f"reading the methods' gin defaults failed: {child.stderr[-1500:]}")
    values = json.loads(child.stdout.strip().splitlines()[-1])
    return {tuple(files): value for (files, _), value in zip(asked, values)}


def structure_of(job: dict, defaults: Optional[dict] = None) -> tuple:
    """What of ``job``'s configuration fixes its compiled step (run/settings.binding_structure:
    the one declaration, read off its bindings over its gin files' ``defaults``): jobs with
    equal structure of one method train as one group."""
    bound = {**(defaults or {}), **_bound(job["bindings"])}
    fixed = ((k, settings.binding_structure(k, v)) for k, v in bound.items())
    return tuple(sorted((k, json.dumps(v)) for k, v in fixed if v is not None))


def pack_jobs(jobs: list, group_size: int, workers: int, defaults: Optional[dict] = None) -> list:
    """``jobs`` as packs, each one Tune trial: one method's jobs of one protocol group and one
    structure (``structure_of`` over ``defaults``, :func:`method_defaults`) together (the
    trials one group step can share), each such set's n jobs split into min(n, ceil(workers /
    sets)) packs of sizes that differ by one at most (so that few methods still fill every
    worker), then into packs of at most ``group_size`` jobs (0: no cap; the process sizes
    its groups by the device's memory)."""
    defaults = method_defaults(jobs) if defaults is None else defaults
    by_method: dict = {}
    for job in jobs:
        shape = structure_of(job, defaults.get(tuple(job["gin_files"])))
        by_method.setdefault((job["group"], job["method"], shape), []).append(job)
    spread = max(1, math.ceil(workers / max(1, len(by_method))))
    packs = []
    for members in by_method.values():
        parts = min(spread, len(members))
        if group_size:
            parts = max(parts, math.ceil(len(members) / group_size))
        bounds = [round(k * len(members) / parts) for k in range(parts + 1)]
        packs += [members[a:b] for a, b in zip(bounds, bounds[1:])]
    return packs
