"""The sweep's Ray-free local runner (``dpbench sweep local``): a sweep's remaining trials on
one machine until a deadline, for a machine without Ray (a lent accelerator: one device, many
cores, minutes of time), where a trial cut off at the end is lost anyway.

Every trial goes through the sweep's own path: its jobs (sweep/jobs.jobs_of), the one
packing rule (sweep/jobs.structure_of: one method's trials of one structure per process), the
one launcher (``run_pack``: ``dpbench train --trials``) and the one publishing path. Only the
scheduling is its own: worker threads take work from one list; a device worker takes a pack
(cells nearest whole first: a cell is a group's method, its search then its winner's seeds;
then search trials before seed runs, then the slowest on a CPU) of as many trials as fit
before the deadline at the device/CPU time ratio seen so far (none more than ``group_size``;
0: the device's memory decides, run/group.py); a CPU worker takes one trial, the cheapest
that still fits. When a method's search is published its
winner's seed runs are queued (the phase rule, sweep/jobs.searched, the Ray path's too).
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from dpbench import records as records_lib
from dpbench.run import group as run_group
from dpbench.search import tuning
from dpbench.sweep import cost
from dpbench.sweep import jobs as sweep_jobs

CPU_ENV = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
# an accelerator's child: memory allocated as needed (several processes may share it) and
# XLA's deterministic GPU operations (the numerics policy itself is the package's, numerics.py)
DEVICE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
              "XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}
DEFAULT_CPU_S = 300.0  # a trial whose (family, method) has no record made on a CPU yet
FIRST_DEVICE_S = 120.0  # a device process's time before any has finished
MARGIN = 1.3
PACK_TRIAL_SHARE = 1 / 8  # a pack costs its slowest trial times 1 + share x (T - 1) (2 CPU
#                           cores: 4.4x cheaper per trial at T 8, leaderboard/group-cost-fmnist-
#                           cpu.md); the observed ratios then correct the scale
MEMORY_SHARE = 0.9  # of the device's memory, split evenly among the device workers' processes


def _family(job: dict) -> str:
    return job["group"].split("__eps")[0]


def _name(job: dict) -> str:
    return f"{job['group']}/{tuning.run_dir_name(job['method'], job['trial'], job['seed'])}"


def published_runs(records: Path, group: str) -> set:
    group_dir = Path(records) / group
    if not group_dir.is_dir():
        return set()
    return {p.name for p in group_dir.iterdir() if (p / records_lib.RECORD_NAME).exists()
            or (p / tuning.DIVERGED).exists()}


def cpu_estimates(records: Path, plans) -> dict:
    """(group, method) and (family, method) -> the median wall_time_s of its published records
    made on a CPU (a device run's wall time says nothing of a CPU worker's)."""
    times: dict = {}
    for plan in plans:
        group = plan["group"]
        for method in plan["methods"]:
            for run in tuning.method_run_dirs(Path(records) / group, method):
                path = run / records_lib.RECORD_NAME
                record = json.loads(path.read_text()) if path.exists() else {}
                wall = record.get("wall_time_s")
                if wall and not cost.on_accelerator(record):
                    for key in ((group, method), (group.split("__eps")[0], method)):
                        times.setdefault(key, []).append(wall)
    return {k: statistics.median(v) for k, v in times.items()}


class LocalRunner:
    """The work list and its rules; worker threads call :meth:`take_pack` and :meth:`finish`."""

    def __init__(self, plans, args):
        self.plans, self.args = {p["group"]: p for p in plans}, args
        self.lock = threading.Lock()
        self.start = time.time()
        self.deadline = self.start + args.deadline_s
        self.ready_families: set = set()  # ScatterNet families wait for their features
        self.jobs, self.done, self.failures = [], [], {}
        self.alone: set = set()  # runs whose pack failed: retried in a process of their own
        self.seeded: set = set()
        self.device_ratio: list = []  # observed device time / CPU estimate
        self.device_disabled = False
        self.initial = {g: published_runs(args.records, g) for g in self.plans}
        self.cpu_s = cpu_estimates(args.records, plans)
        every = sweep_jobs.jobs_of(plans, "search", args.records, args.runs_dir)
        # each method's gin defaults, read once (in a child process) before any worker starts
        self.defaults = sweep_jobs.method_defaults(every)
        self._queue(every)
        self._queue_seeds()

    def _queue(self, jobs) -> None:
        self.jobs += [j for j in jobs if not sweep_jobs.is_published(j)]

    def _queue_seeds(self) -> None:
        """The phase rule: each method whose search is published gets its winner's seeds."""
        for alone in sweep_jobs.searched(list(self.plans.values()), self.args.records,
                                         self.args.runs_dir):
            (method,) = alone["methods"]
            if (alone["group"], method) in self.seeded:
                continue
            self.seeded.add((alone["group"], method))
            winners = sweep_jobs.winners_of([alone], self.args.records)
            self._queue(sweep_jobs.jobs_of([alone], "seeds", self.args.records,
                                           self.args.runs_dir, winners))
            self.log(f"{alone['group']} {method}: search complete, seeds queued (winner trial "
                     f"{winners[(alone['group'], method)]})")

    def cpu_estimate(self, job) -> float:
        return self.cpu_s.get((job["group"], job["method"]), self.cpu_s.get(
            (_family(job), job["method"]), DEFAULT_CPU_S))

    def pack_cpu_s(self, jobs) -> float:
        """A pack's work in CPU seconds: its slowest trial's estimate x 1 + share x (T - 1)."""
        return max(map(self.cpu_estimate, jobs)) * (1 + PACK_TRIAL_SHARE * (len(jobs) - 1))

    def device_estimate(self, jobs) -> float:
        """Seconds a device worker takes for ``jobs`` (one process): the worst device/CPU
        ratio seen so far times its work."""
        if not self.device_ratio:
            return FIRST_DEVICE_S * (1 + PACK_TRIAL_SHARE * (len(jobs) - 1))
        return max(60.0, max(self.device_ratio) * self.pack_cpu_s(jobs))

    def structure(self, job) -> tuple:
        return sweep_jobs.structure_of(job, self.defaults.get(tuple(job["gin_files"])))

    def _is_seed_run(self, job) -> bool:
        return job["seed"] != self.plans[job["group"]]["seeds"][0]

    def _available(self, job) -> bool:
        return "scatter" not in _family(job) or _family(job) in self.ready_families

    def cell_progress(self) -> dict:
        """(group, method) -> its published runs: a cell (a group's method: its search, then
        its winner's seeds) nearer whole goes first on the device, so that a window's end
        leaves as few cells half-done as it can."""
        out: dict = {}
        for group, plan in self.plans.items():
            for method in plan["methods"]:
                out[(group, method)] = sum(tuning.published(d) for d in tuning.method_run_dirs(
                    Path(self.args.records) / group, method))
        return out

    def take(self, kind: str):
        """The next job for a worker of ``kind`` ('device' or 'cpu'), or None when none fits
        before the deadline."""
        with self.lock:
            left = self.deadline - time.time()
            options = [j for j in self.jobs if self._available(j)]
            if kind == "device":
                options = [j for j in options if MARGIN * self.device_estimate([j]) < left]
                done = self.cell_progress()
                options.sort(key=lambda j: (-done.get((j["group"], j["method"]), 0),
                                            self._is_seed_run(j), -self.cpu_estimate(j)))
            else:
                options = [j for j in options if MARGIN * self.cpu_estimate(j) < left]
                options.sort(key=self.cpu_estimate)
            if not options:
                return None
            self.jobs.remove(options[0])
            return options[0]

    def take_pack(self, kind: str) -> list:
        """A worker's next jobs: the job ``take`` gives and, for a device worker, more of its
        family (any epsilon: the same program up to sigma), method, phase and structure that fit
        before the deadline (at most ``group_size``, 0: no cap); one job for a CPU worker and
        for a run whose pack failed. [] when none fits."""
        first = self.take(kind)
        if first is None or kind != "device" or _name(first) in self.alone:
            return [] if first is None else [first]
        size = getattr(self.args, "group_size", 0) or len(self.jobs) + 1
        pack = [first]
        with self.lock:
            left = self.deadline - time.time()
            for job in [j for j in self.jobs if (_family(j), j["method"]) == (
                    _family(first), first["method"]) and self._is_seed_run(j) ==
                    self._is_seed_run(first) and self._available(j)
                    and _name(j) not in self.alone and self.structure(j) == self.structure(first)]:
                if len(pack) >= size or MARGIN * self.device_estimate(pack + [job]) >= left:
                    break
                pack.append(job)
                self.jobs.remove(job)
        return pack

    def waiting(self) -> bool:
        """Whether a worker with nothing to take now may get a job later."""
        with self.lock:
            return bool(self.jobs) and time.time() < self.deadline - 60

    def finish(self, job, kind, began, outcome, pack=None) -> None:
        """``job`` ended with ``outcome``; ``pack``: the jobs its process trained with it."""
        took, pack = time.time() - began, pack or [job]
        with self.lock:
            self.done.append(dict(run=_name(job), kind=kind, began_s=round(began - self.start, 1),
                                  took_s=round(took, 1), outcome=outcome, pack=len(pack)))
            if outcome == "published" and kind == "device" and job is pack[0]:
                self.device_ratio.append(took / self.pack_cpu_s(pack))
            if outcome.startswith("failed") and time.time() < self.deadline:
                if len(pack) > 1:  # the pack failed it: once more, alone
                    self.alone.add(_name(job))
                self.failures[_name(job)] = self.failures.get(_name(job), 0) + 1
                if self.failures[_name(job)] < 2:
                    self.jobs.append(job)
                on_device = [d for d in self.done if d["kind"] == "device"]
                alone = [d for d in on_device if d["pack"] == 1]  # a failed pack says nothing
                if kind == "device" and len(alone) >= 2 and not any(  # of the device
                        d["outcome"] == "published" for d in on_device):
                    self.device_disabled = True
            if outcome in ("published", "diverged"):
                self._queue_seeds()
        self.log(f"{kind} {_name(job)}: {outcome} in {took:.0f}s")

    def env(self, kind: str) -> dict:
        """The environment of a worker's child process."""
        if kind == "cpu":
            return {**os.environ, **CPU_ENV}
        share = MEMORY_SHARE / max(1, getattr(self.args, "gpu_workers", 1))
        return {**os.environ, **DEVICE_ENV, run_group.MEMORY_FRACTION_ENV: str(share)}

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.start:6.0f}s] {text}", flush=True)


def worker(runner: LocalRunner, kind: str) -> None:
    """Takes packs until the deadline or the work is done; each pack through ``run_pack``."""
    while time.time() < runner.deadline:
        if kind == "device" and runner.device_disabled:
            if getattr(runner.args, "device_only", False):
                return  # a board whose runs must all come from the device (sweep/window.py)
            kind = "cpu"
        jobs = runner.take_pack(kind)
        if not jobs:
            if not runner.waiting():
                return
            time.sleep(5)
            continue
        began = time.time()
        extra = list(getattr(runner.args, "gpu_binding", None) or []) if kind == "device" else []
        running = [dict(j, bindings=[*j["bindings"], *extra]) for j in jobs]
        try:
            sweep_jobs.run_pack(running, env=runner.env(kind))
            failed = None
        except Exception as e:  # noqa: BLE001  (a pack's failure: logged, its runs retried)
            failed = f"failed: {str(e)[-300:]}"
        for job in jobs:  # each job by what it published
            target = sweep_jobs.published(job)
            outcome = ("diverged" if (target / tuning.DIVERGED).exists() else "published"
                       if (target / records_lib.RECORD_NAME).exists() else failed or "failed")
            runner.finish(job, kind, began, outcome, jobs)


def precompute_features(runner: LocalRunner) -> None:
    """Each ScatterNet family's features computed once (the cache its trials then read), in a
    CPU process, before that family's trials are released."""
    for group, plan in runner.plans.items():
        family = group.split("__eps")[0]
        if "scatter" not in family or family in runner.ready_families:
            continue
        m = next(iter(plan["methods"].values()))
        code = ("import sys, json; from dpbench import config, data; "
                "config.parse_config(json.loads(sys.argv[1]), json.loads(sys.argv[2])); "
                "data.load_dataset()")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(m["gin_files"]),
                               json.dumps(m["trials"][0])], cwd=sweep_jobs.REPO,
                              env=runner.env("cpu"), capture_output=True, text=True)
        runner.log(f"{family} features: exit {proc.returncode} in {time.time() - t0:.0f}s "
                   f"{proc.stderr[-400:] if proc.returncode else ''}")
        with runner.lock:
            runner.ready_families.add(family)  # on failure the trials compute them themselves


def write_outputs(runner: LocalRunner, out: Path) -> None:
    """What has left so far into ``out`` (each file replaced whole): records.tar.gz (the newly
    published runs), failed_logs.tar.gz, and local.json (each pack's kind, times, outcome)."""
    out.mkdir(parents=True, exist_ok=True)
    records, runs_dir = Path(runner.args.records), Path(runner.args.runs_dir)
    with runner.lock:
        done, left = list(runner.done), [_name(j) for j in runner.jobs]
    with tarfile.open(out / "records.tar.gz.part", "w:gz") as tar:
        for group in runner.plans:
            for name in sorted(published_runs(records, group) - runner.initial[group]):
                tar.add(records / group / name, arcname=f"{group}/{name}")
    os.replace(out / "records.tar.gz.part", out / "records.tar.gz")
    with tarfile.open(out / "failed_logs.tar.gz.part", "w:gz") as tar:
        failed = [d for d in done if d["outcome"] not in ("published", "diverged")]
        logs = sorted({p for d in failed for p in runs_dir.glob(
            f"{d['run'].split('/')[0]}/*.log")})  # a pack's log is named by the pack
        for log in logs:
            data = log.read_bytes()[-20000:]
            info = tarfile.TarInfo(str(log.relative_to(runs_dir)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(out / "failed_logs.tar.gz.part", out / "failed_logs.tar.gz")
    records_lib.atomic_write_text(out / "local.json", json.dumps(dict(
        done=done, left=left, device_disabled=runner.device_disabled,
        device_ratio=runner.device_ratio, elapsed_s=round(time.time() - runner.start, 1)),
        indent=1) + "\n")


def run_local(plans, args) -> int:
    """Runs ``plans``' unpublished trials until ``args.deadline_s``: ``args.gpu_workers``
    device workers and ``args.cpu_workers`` CPU workers; writes the outputs to ``args.out``
    every ``args.pack_every_s`` and at the end. The exit code."""
    runner = LocalRunner(plans, args)
    runner.log(f"{len(runner.jobs)} jobs queued; {args.gpu_workers} device + "
               f"{args.cpu_workers} CPU workers; deadline {args.deadline_s:.0f}s")
    threads = [threading.Thread(target=precompute_features, args=(runner,), daemon=True)]
    threads += [threading.Thread(target=worker, args=(runner, kind), daemon=True)
                for kind in ["device"] * args.gpu_workers + ["cpu"] * args.cpu_workers]
    for t in threads:
        t.start()
    written = time.time()
    while time.time() < runner.deadline and any(t.is_alive() for t in threads[1:]):
        time.sleep(2)
        if time.time() - written > args.pack_every_s:  # a call cut off early keeps these
            write_outputs(runner, args.out)
            written = time.time()
    runner.deadline = 0  # workers take nothing more; their children die with the pool
    sweep_jobs.kill_children()
    for t in threads:
        t.join(timeout=20)
    write_outputs(runner, args.out)
    published = sum(d["outcome"] == "published" for d in runner.done)
    runner.log(f"done: {published} published, {len(runner.jobs)} left")
    return 0
