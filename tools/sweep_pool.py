"""Runs a sweep's remaining trials on one machine without Ray, until a deadline: made for a lent
accelerator machine (one GPU and many cores, no network, minutes of time), where Ray is absent
and a trial cut off at the end is lost anyway.

Each trial goes through ``run_job`` of the dpbench checkout given by ``--repo`` (the commit the
group's records come from), exactly as the sweep's Tune trainable calls it: same command, same
bindings from the group's ``search.json``, same atomic publishing into ``--records``. Only the
scheduling differs: worker threads take jobs from one list, GPU workers the search's trials
first (they hold back the seed runs) and then the slowest on a CPU (estimated from CPU records
only), CPU workers the cheapest that still fits before the deadline (a trial killed at the
deadline publishes nothing). When a group's search is complete its winners' seed runs are
queued (``winners_of``, the board's rule). With ``--group_size`` T > 1 a GPU worker takes a pack
of up to T trials of one method, group and phase and trains them with ``run_pack`` (one
process, one compiled step per group of trials: dpbench/run/group.py), sized to what fits
before the deadline at the GPU/CPU time ratio seen so far.

GPU trials run with float32 matrix products at full precision (``JAX_DEFAULT_MATMUL_PRECISION=
highest``: TF32 would round the per-example norms the clip relies on) and XLA's deterministic
GPU operations; CPU trials with ``JAX_PLATFORMS=cpu``. ``--out`` receives what left:
``records.tar.gz`` (the newly published run dirs, paths relative to ``--records``),
``pool.json`` (each trial's worker kind, times and outcome) and ``failed_logs.tar.gz``.

  python3 tools/sweep_pool.py --repo=DIR --records=leaderboard/sweep-v3/records \
      --groups G [G ...] --runs_dir=/tmp/runs --deadline_s=500 --gpu_workers=7 \
      --cpu_workers=8 --out=$OUT
"""

from __future__ import annotations

import argparse
import ast
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

MEMORY_FRACTION_ENV = "DPBENCH_MEMORY_FRACTION"  # dpbench/run/group.py reads it (a copy:
#                                                 the pool imports no dpbench of its own)
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}
CPU_ENV = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
DEFAULT_CPU_S = 300.0  # a trial whose (family, method) has no published record yet
FIRST_GPU_S = 120.0    # a GPU process's time before any has finished
MARGIN = 1.3
PACK_TRIAL_SHARE = 1 / 8  # a pack's process costs its slowest trial times 1 + share x (T - 1):
#                           a trial added to a group step costs a fraction of the first (2 CPU
#                           cores: 4.4x cheaper per trial at T 8, leaderboard/group-cost-fmnist-
#                           cpu.md); the observed ratios then correct the scale
MEMORY_SHARE = 0.9     # of the device's memory, split evenly among the GPU workers' processes


# BANDS: BandMF's bands (its noise buffer's length and its sampler's parts)
SHAPE_KEYS = ("train.batch_size", "train.micro_batch_size", "train.accelerator_micro_batch_size",
              "BANDS")
EMA_KEY = "train.ema_decay"


def shape_of(job, defaults=None) -> tuple:
    """What of a trial's bindings fixes its compiled step's shapes or structure (the batch, the
    micro-batch, whether it keeps an EMA): a pack holds one shape, so its process trains one
    group step, not several in turn (board v3's rerun on an H100: packs of 12-16 mixed trials
    ran as 6-8 groups of 1-2 trials one after another, 440-525 s a pack). A key the trial does
    not bind takes its value from ``defaults`` (its gin files' own: ``gin_defaults``), so a
    search's trial 0, which binds only the family's base, packs with the trials equal to it."""
    bound = {k.strip(): _literal(v) for k, v in
             (b.split("=", 1) for b in job["bindings"] if "=" in b)}
    value = {k: bound.get(k, (defaults or {}).get(k)) for k in (*SHAPE_KEYS, EMA_KEY)}
    ema = value.pop(EMA_KEY)
    return tuple(value.values()), None if ema is None else float(ema) > 0


def _literal(text: str):
    """A binding's value as gin would read it (``1024`` and ``1024.0`` and ``1_024`` alike)."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def gin_defaults(gin_files) -> dict:
    """The shape keys' values that ``gin_files`` (a method's and its family's) bind, parsed by
    the checkout's own dpbench (``config.parse_config``); a key they leave unbound is absent."""
    import gin
    from dpbench import config
    config.parse_config(list(gin_files), [])
    out = {}
    for key in (*SHAPE_KEYS, EMA_KEY):
        try:  # a macro (no dot, BANDS) is queried as %BANDS
            out[key] = gin.query_parameter(key if "." in key else f"%{key}")
        except ValueError:  # not bound: the function's own default, the same for every trial
            pass
    gin.clear_config()
    return out


def published_runs(records: Path, group: str) -> set:
    group_dir = records / group
    if not group_dir.is_dir():
        return set()
    return {p.name for p in group_dir.iterdir()
            if (p / "run_record.json").exists() or (p / "diverged.json").exists()}


def cpu_estimates(records: Path, groups) -> dict:
    """(group, method) -> median wall_time_s of its published records made on a CPU;
    (family, method) too. A GPU run's wall time says nothing of a CPU worker's."""
    times: dict = {}
    for group in groups:
        for path in (records / group).glob("*/run_record.json"):
            method = path.parent.name.split("-t")[0]
            record = json.loads(path.read_text())
            wall = record.get("wall_time_s")
            # dpbench.sweep.cost._on_gpu's rule, written out: this pool imports the dpbench of
            # the group's (older) commit, which does not have it
            on_gpu = any(str(d).startswith(("cuda", "gpu", "rocm"))
                         for d in record.get("devices") or [])
            if wall and not on_gpu:
                times.setdefault((group, method), []).append(wall)
                times.setdefault((group.split("__eps")[0], method), []).append(wall)
    return {k: statistics.median(v) for k, v in times.items()}


class Pool:
    def __init__(self, sweep, plans, args):
        self.sweep, self.plans, self.args = sweep, {p["group"]: p for p in plans}, args
        self.lock = threading.Lock()
        self.start = time.time()
        self.deadline = self.start + args.deadline_s
        self.ready_families = set()  # scatter families wait for their features
        self.jobs, self.done, self.failures = [], [], {}
        self.alone = set()  # runs whose pack failed: retried in a process of their own
        self.seeded = set()
        self.gpu_ratio = []  # observed GPU time / CPU estimate
        self.gpu_disabled = False
        ns = argparse.Namespace(records=args.records, runs_dir=args.runs_dir)
        self.ns = ns
        self.initial = {g: published_runs(args.records, g) for g in self.plans}
        self.cpu_s = cpu_estimates(args.records, self.plans)
        # each method's gin defaults, parsed once before any worker starts (gin is global)
        self.defaults = {tuple(m["gin_files"]): gin_defaults(m["gin_files"])
                         for p in plans for m in p["methods"].values()}
        for plan in plans:
            self._queue(sweep._jobs([plan], "search", ns))
            self._maybe_seeds(plan["group"])

    def _queue(self, jobs):
        for job in jobs:
            if not self._is_published(job):
                self.jobs.append(job)

    def _is_published(self, job) -> bool:
        target = self._target(job)
        return (target / "run_record.json").exists() or (target / "diverged.json").exists()

    def _target(self, job) -> Path:
        """Where ``job`` publishes, by the group's commit's own sweep module (``published``
        since sweep/jobs.py, ``_published`` before)."""
        return (getattr(self.sweep, "published", None) or self.sweep._published)(job)

    def _maybe_seeds(self, group):
        """Queues the seed runs of each method of ``group`` whose search is published (its
        winner is chosen among its own trials alone: one slow method holds back no other's)."""
        plan = self.plans[group]
        for method in plan["methods"]:
            if (group, method) in self.seeded:
                continue
            alone = dict(plan, methods={method: plan["methods"][method]})
            search = self.sweep._jobs([alone], "search", self.ns)
            if all(self._is_published(j) for j in search):
                self.seeded.add((group, method))
                winners = self.sweep.winners_of([alone], self.args.records)
                self._queue(self.sweep._jobs([alone], "seeds", self.ns, winners))
                self.log(f"{group} {method}: search complete, seeds queued (winner trial "
                         f"{winners[(group, method)]})")

    def cpu_estimate(self, job) -> float:
        family = job["group"].split("__eps")[0]
        return self.cpu_s.get((job["group"], job["method"]),
                              self.cpu_s.get((family, job["method"]), DEFAULT_CPU_S))

    def pack_cpu_s(self, jobs) -> float:
        """A GPU process's work for ``jobs`` (one process) in CPU seconds: its slowest trial's
        CPU estimate times 1 + PACK_TRIAL_SHARE x (T - 1)."""
        return max(map(self.cpu_estimate, jobs)) * (1 + PACK_TRIAL_SHARE * (len(jobs) - 1))

    def gpu_estimate(self, job) -> float:
        """Seconds a GPU worker takes for ``job`` (or a pack: a list of jobs, one process):
        the worst GPU/CPU ratio seen so far times its work (:meth:`pack_cpu_s`)."""
        jobs = job if isinstance(job, list) else [job]
        if not self.gpu_ratio:
            return FIRST_GPU_S * (1 + PACK_TRIAL_SHARE * (len(jobs) - 1))
        return max(60.0, max(self.gpu_ratio) * self.pack_cpu_s(jobs))

    def shape(self, job) -> tuple:
        return shape_of(job, self.defaults.get(tuple(job["gin_files"])))

    def _is_seed_run(self, job) -> bool:
        return job["seed"] != self.plans[job["group"]]["seeds"][0]

    def _available(self, job) -> bool:
        family = job["group"].split("__eps")[0]
        return "scatter" not in family or family in self.ready_families

    def _name(self, job) -> str:
        return f"{job['group']}/{self.sweep.run_dir_name(job['method'], job['trial'], job['seed'])}"

    def take_pack(self, kind: str) -> list:
        """A GPU worker's next jobs: the job ``take`` gives, and up to ``--group_size`` - 1
        more of its family (any epsilon: the same program up to sigma), method, phase and shape
        (``shape_of``) that fit before the deadline, trained as groups by one process (dpbench/run/group.py); one
        job for a CPU worker, and for a run whose pack failed. [] when none fits."""
        first = self.take(kind)
        if first is None:
            return []
        size = getattr(self.args, "group_size", 1)
        if (kind != "gpu" or size <= 1 or not hasattr(self.sweep, "run_pack")
                or self._name(first) in self.alone):
            return [first]
        pack = [first]
        family = first["group"].split("__eps")[0]
        with self.lock:
            left = self.deadline - time.time()
            same = [j for j in self.jobs if (j["group"].split("__eps")[0], j["method"]) == (
                family, first["method"]) and self._is_seed_run(j) ==
                self._is_seed_run(first) and self._available(j)
                and self._name(j) not in self.alone and self.shape(j) == self.shape(first)]
            for job in same:
                if len(pack) >= size or MARGIN * self.gpu_estimate(pack + [job]) >= left:
                    break
                pack.append(job)
                self.jobs.remove(job)
        return pack

    def take(self, kind: str):
        """The next job for a worker of ``kind``, or None when none fits before the deadline."""
        with self.lock:
            left = self.deadline - time.time()
            options = [j for j in self.jobs if self._available(j)]
            if kind == "gpu":
                options = [j for j in options if MARGIN * self.gpu_estimate(j) < left]
                # a search trial first (an unpublished one holds back its group's seed runs),
                # then the slowest on a CPU
                options.sort(key=lambda j: (self._is_seed_run(j), -self.cpu_estimate(j)))
            else:
                options = [j for j in options if MARGIN * self.cpu_estimate(j) < left]
                options.sort(key=self.cpu_estimate)
            if not options:
                return None
            self.jobs.remove(options[0])
            return options[0]

    def waiting(self) -> bool:
        """Whether a worker with nothing to take now may get a job later (features pending,
        seeds to queue, a failed job back)."""
        with self.lock:
            return bool(self.jobs) and time.time() < self.deadline - 60

    def finish(self, job, kind, began, outcome, pack=None):
        """``job`` ended with ``outcome``; ``pack``: the jobs its process trained with it."""
        name = self._name(job)
        took = time.time() - began
        pack = pack or [job]
        with self.lock:
            self.done.append(dict(run=name, kind=kind, began_s=round(began - self.start, 1),
                                  took_s=round(took, 1), outcome=outcome, pack=len(pack)))
            if outcome == "published" and kind == "gpu" and job is pack[0]:
                self.gpu_ratio.append(took / self.pack_cpu_s(pack))
            if outcome.startswith("failed") and time.time() < self.deadline:
                if len(pack) > 1:  # the group path failed it: once more, alone
                    self.alone.add(name)
                self.failures[name] = self.failures.get(name, 0) + 1
                if self.failures[name] < 2:
                    self.jobs.append(job)  # once more (on whichever worker takes it)
                gpu_done = [d for d in self.done if d["kind"] == "gpu"]
                alone = [d for d in gpu_done if d["pack"] == 1]  # a failed pack says nothing
                #                                                  of the GPU: its runs retry
                if kind == "gpu" and not any(d["outcome"] == "published" for d in gpu_done) \
                        and len(alone) >= 2:
                    self.gpu_disabled = True
            if outcome in ("published", "diverged"):
                self._maybe_seeds(job["group"])
        self.log(f"{kind} {name}: {outcome} in {took:.0f}s")

    def log(self, text):
        print(f"[{time.time() - self.start:6.0f}s] {text}", flush=True)


_local = threading.local()


def _patched_run(original):
    def run(command, **kwargs):
        env = dict(os.environ)
        env.update(GPU_ENV if getattr(_local, "kind", "cpu") == "gpu" else CPU_ENV)
        if getattr(_local, "kind", "cpu") == "gpu":
            env[MEMORY_FRACTION_ENV] = str(MEMORY_SHARE / max(1, getattr(_local, "gpu_workers",
                                                                           1)))
        kwargs["env"] = env
        return original(command, **kwargs)
    return run


def worker(pool: Pool, kind: str):
    _local.kind = kind
    _local.gpu_workers = getattr(pool.args, "gpu_workers", 1)
    while time.time() < pool.deadline:
        if kind == "gpu" and pool.gpu_disabled:
            _local.kind = kind = "cpu"
        jobs = pool.take_pack(kind)
        if not jobs:
            if not pool.waiting():
                return
            time.sleep(5)
            continue
        began = time.time()
        extra = list(getattr(pool.args, "gpu_binding", None) or []) if kind == "gpu" else []
        running = [dict(j, bindings=[*j["bindings"], *extra]) for j in jobs]
        try:
            if len(jobs) == 1:
                result = pool.sweep.run_job(running[0])
                outcomes = ["diverged" if result["diverged"] else "published"]
            else:
                pool.sweep.run_pack(running)
                outcomes = [None] * len(jobs)
        except Exception as e:  # a trial's failure (or the deadline's kill): logged, retried once
            outcomes = [f"failed: {str(e)[-300:]}"] * len(jobs)
        for job, outcome in zip(jobs, outcomes):
            if len(jobs) > 1:  # a pack: each job by what it published (a failed pack publishes
                #                every trial that finished)
                target = pool._target(job)
                outcome = ("diverged" if (target / "diverged.json").exists() else "published"
                           if (target / "run_record.json").exists() else outcome)
            pool.finish(job, kind, began, outcome, jobs)


def precompute_features(pool: Pool, repo: Path):
    """Each scatter family's features computed once (the cache every trial then reads), on
    the CPU, before that family's trials are released."""
    for group, plan in pool.plans.items():
        family = group.split("__eps")[0]
        if "scatter" not in family or family in pool.ready_families:
            continue
        m = next(iter(plan["methods"].values()))
        code = ("import sys, json; from dpbench import config, data; "
                "config.parse_config(json.loads(sys.argv[1]), json.loads(sys.argv[2])); "
                "data.load_dataset()")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(m["gin_files"]),
                               json.dumps(m["trials"][0])], cwd=repo,
                              env={**os.environ, **CPU_ENV}, capture_output=True, text=True)
        pool.log(f"{family} features: exit {proc.returncode} in {time.time() - t0:.0f}s "
                 f"{proc.stderr[-400:] if proc.returncode else ''}")
        with pool.lock:
            pool.ready_families.add(family)  # on failure the trials compute them themselves


def kill_children():
    import psutil
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def pack(pool: Pool, out: Path):
    """What has left so far into ``out`` (each file replaced whole: renamed into place)."""
    out.mkdir(parents=True, exist_ok=True)
    records = pool.args.records
    with pool.lock:
        done = list(pool.done)
        left = [f"{j['group']}/{j['method']}-t{j['trial']}-seed{j['seed']}" for j in pool.jobs]
    with tarfile.open(out / "records.tar.gz.part", "w:gz") as tar:
        for group in pool.plans:
            for name in sorted(published_runs(records, group) - pool.initial[group]):
                tar.add(records / group / name, arcname=f"{group}/{name}")
    os.replace(out / "records.tar.gz.part", out / "records.tar.gz")
    with tarfile.open(out / "failed_logs.tar.gz.part", "w:gz") as tar:
        logs = [f"{d['run']}.log" for d in done if d["outcome"] != "published"]
        if any(d["outcome"] != "published" and d.get("pack", 1) > 1 for d in done):
            # a pack's runs share one log (sweep/jobs.run_pack): every pack's goes back
            logs += sorted(str(p.relative_to(pool.args.runs_dir))
                           for p in pool.args.runs_dir.glob("*/pack-*.log"))
        for name in dict.fromkeys(logs):
            log = pool.args.runs_dir / name
            if log.exists():
                data = log.read_bytes()[-20000:]
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(out / "failed_logs.tar.gz.part", out / "failed_logs.tar.gz")
    (out / "pool.json.part").write_text(json.dumps(dict(
        done=done, left=left, gpu_disabled=pool.gpu_disabled, gpu_ratio=pool.gpu_ratio,
        elapsed_s=round(time.time() - pool.start, 1)), indent=1))
    os.replace(out / "pool.json.part", out / "pool.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--groups", nargs="+", required=True)
    parser.add_argument("--runs_dir", type=Path, required=True)
    parser.add_argument("--deadline_s", type=float, required=True)
    parser.add_argument("--gpu_workers", type=int, default=0)
    parser.add_argument("--cpu_workers", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--group_size", type=int, default=1,
                        help="a GPU worker's pack: up to this many trials of one method, group "
                             "and phase trained as groups by one process (run_pack); 1: one "
                             "process per trial")
    parser.add_argument("--gpu_binding", action="append", default=[],
                        help="a gin binding added to every GPU worker's trial, e.g. "
                             "'train.accelerator_micro_batch_size = 0' (the whole padded "
                             "batch a micro-step; same sampler and DpEvent as on a CPU)")
    parser.add_argument("--pack_every_s", type=float, default=60.0)
    args = parser.parse_args(argv)
    args.repo, args.records = args.repo.resolve(), args.records.resolve()
    args.runs_dir = args.runs_dir.resolve()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(args.repo))
    from dpbench import sweep  # the checkout's own, at the group's commit
    assert Path(sweep.REPO).resolve() == args.repo, (sweep.REPO, args.repo)
    subprocess.run = _patched_run(subprocess.run)  # run_job's child gets its worker's env
    plans = [json.loads((args.records / g / "search.json").read_text()) for g in args.groups]
    pool = Pool(sweep, plans, args)
    pool.log(f"{len(pool.jobs)} jobs queued; {args.gpu_workers} GPU + {args.cpu_workers} CPU "
             f"workers; deadline {args.deadline_s:.0f}s")
    threads = [threading.Thread(target=precompute_features, args=(pool, args.repo), daemon=True)]
    threads += [threading.Thread(target=worker, args=(pool, kind), daemon=True)
                for kind in ["gpu"] * args.gpu_workers + ["cpu"] * args.cpu_workers]
    for t in threads:
        t.start()
    packed = time.time()
    while time.time() < pool.deadline and any(t.is_alive() for t in threads[1:]):
        time.sleep(2)
        if time.time() - packed > args.pack_every_s:  # a call cut off early still returns these
            pack(pool, args.out)
            packed = time.time()
    pool.deadline = 0  # workers take nothing more
    kill_children()
    for t in threads:
        t.join(timeout=20)
    pack(pool, args.out)
    published = sum(d["outcome"] == "published" for d in pool.done)
    pool.log(f"done: {published} published, {len(pool.jobs)} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
