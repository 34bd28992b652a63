"""tools/sweep_pool.py: the Ray-free pool that ran board v3's trials on a lent GPU machine. Its
scheduling (GPU workers the slowest trials, CPU workers the cheapest that fit the deadline), the
seeds queued once a group's search is published, a failed trial retried once, the GPU given up
after two failures with no success, and what it packs for the trip back."""

import argparse
import json
import tarfile
import time

import pytest

from dpbench import sweep
from tests.conftest import load_tool

GROUP = "digits__logistic__eps3.0__delta1e-05"


def load_pool_module():
    return load_tool("sweep_pool")


def make_pool(tmp_path, deadline_s=1000.0, published=()):
    """A pool over one group (methods fast and slow, K = 2, seeds 0 and 1), with ``published``
    runs' records already there (fast's: 100 s each, slow's: 400 s)."""
    pool_module = load_pool_module()
    plan = dict(group=GROUP, epsilon=3.0, delta=1e-5, seeds=[0, 1], num_trials=2,
                methods={m: dict(gin_files=["gin/data/digits.gin"], trials=[[], []])
                         for m in ("fast", "slow")})
    records = tmp_path / "records"
    (records / GROUP).mkdir(parents=True)
    (records / GROUP / "search.json").write_text(json.dumps(plan))
    for name, wall, accuracy in published:
        publish(records, name, wall, accuracy)
    args = argparse.Namespace(records=records, runs_dir=tmp_path / "runs",
                              deadline_s=deadline_s, out=tmp_path / "out")
    return pool_module, pool_module.Pool(sweep, [plan], args)


def publish(records, name, wall, accuracy, seed=0, devices=("cpu:0",)):
    target = records / GROUP / name
    target.mkdir(parents=True, exist_ok=True)
    (target / "run_record.json").write_text(json.dumps(
        dict(wall_time_s=wall, validation_accuracy=accuracy, seed=seed, devices=list(devices))))


def names(jobs):
    return sorted(f"{j['method']}-t{j['trial']}-seed{j['seed']}" for j in jobs)


def test_gpu_workers_take_the_slowest_trials_and_cpu_workers_the_cheapest_that_fit(tmp_path):
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 400.0, 0.8)])
    assert names(pool.jobs) == ["fast-t1-seed0", "slow-t1-seed0"]  # published ones skipped
    assert pool.take("gpu")["method"] == "slow"
    assert pool.take("cpu")["method"] == "fast"
    assert pool.take("cpu") is None and pool.take("gpu") is None


def test_nothing_is_started_that_cannot_finish_before_the_deadline(tmp_path):
    _, pool = make_pool(tmp_path, deadline_s=200.0,  # 1.3 x 400 s > 200 s > 1.3 x 100 s
                        published=[("fast-t0-seed0", 100.0, 0.8),
                                   ("slow-t0-seed0", 400.0, 0.8)])
    assert pool.take("cpu")["method"] == "fast"
    assert pool.take("cpu") is None  # slow's 400 s would be killed at the deadline
    assert pool.take("gpu")["method"] == "slow"  # no GPU time measured yet: 150 s assumed
    for ratio, method in ((0.5, "slow"), (1.0, "fast")):  # GPU runs measured at ratio x CPU
        _, later = make_pool(tmp_path / str(ratio), deadline_s=300.0,
                             published=[("fast-t0-seed0", 100.0, 0.8),
                                        ("slow-t0-seed0", 400.0, 0.8)])
        later.gpu_ratio.append(ratio)
        assert later.take("gpu")["method"] == method  # 1.3 x 400 s at ratio 1 misses 300 s


def test_a_gpu_records_wall_time_is_not_a_cpu_estimate(tmp_path):
    """Session 38's device call: ScatterNet GEP's published runs were GPU runs (~50 s), so the
    CPU estimate (their median) said a CPU worker could finish another before the deadline; at
    ~800 s on a core it was killed there, twice, and its group's search stayed one trial
    short. A record made on a GPU never sets the CPU estimate."""
    pool_module, pool = make_pool(tmp_path, deadline_s=1000.0,
                                  published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 700.0, 0.8)])
    publish(pool.args.records, "slow-t1-seed0", 40.0, 0.7, devices=("cuda:0",))
    publish(pool.args.records, "fast-t1-seed0", 30.0, 0.7, devices=("cuda:0",))
    estimates = pool_module.cpu_estimates(pool.args.records, [GROUP])
    assert estimates[(GROUP, "slow")] == 700.0 and estimates[(GROUP, "fast")] == 100.0


def test_gpu_workers_take_search_trials_before_seed_runs(tmp_path):
    """A search trial left unpublished holds back every winner's seed runs of its group: a GPU
    worker takes one before any seed run, however slow the seed run is on a CPU."""
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 400.0, 0.8)])
    seed_run = dict(pool.jobs[0], method="slow", trial=0, seed=1)
    pool.jobs.append(seed_run)
    assert pool.take("gpu")["seed"] == 0  # slow-t1's search trial, not slow's seed 1
    assert pool.take("gpu")["seed"] == 0  # fast-t1: cheaper than the seed run, still first
    assert pool.take("gpu") is seed_run


def test_scatter_trials_wait_for_their_features(tmp_path):
    _, pool = make_pool(tmp_path)
    job = dict(pool.jobs[0], group="fashion_mnist__scatter_linear__eps3.0__delta1e-05")
    pool.jobs = [job]
    assert pool.take("cpu") is None and pool.waiting()
    pool.ready_families.add("fashion_mnist__scatter_linear")
    assert pool.take("cpu") is job


def test_the_workers_publish_the_search_then_the_winners_seeds_and_pack_them(
        tmp_path, monkeypatch):
    pool_module, pool = make_pool(tmp_path)
    ran = []

    def fake_run_job(job):  # as sweep.run_job: publishes the record, returns the result
        ran.append((job["method"], job["trial"], job["seed"]))
        accuracy = 0.9 if job["trial"] == 1 else 0.7
        publish(pool.args.records, sweep.run_dir_name(job["method"], job["trial"], job["seed"]),
                1.0, accuracy, seed=job["seed"])
        return dict(validation_accuracy=accuracy, diverged=False)

    monkeypatch.setattr(sweep, "run_job", fake_run_job)
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    pool_module.worker(pool, "cpu")
    for method in ("fast", "slow"):  # each method's seed run after its own search alone
        mine = [r for r in ran if r[0] == method]
        assert sorted(mine[:2]) == [(method, 0, 0), (method, 1, 0)]
        assert mine[2:] == [(method, 1, 1)]  # its winner (trial 1), seed 1
    assert {(GROUP, 'fast'), (GROUP, 'slow')} == pool.seeded and not pool.jobs
    pool_module.pack(pool, pool.args.out)
    with tarfile.open(pool.args.out / "records.tar.gz") as tar:
        packed = sorted(n for n in tar.getnames() if n.endswith("run_record.json"))
    assert packed == sorted(f"{GROUP}/{m}-t{t}-seed{s}/run_record.json" for m, t, s in ran)
    done = json.loads((pool.args.out / "pool.json").read_text())["done"]
    assert len(done) == 6 and {d["outcome"] for d in done} == {"published"}


def test_a_failed_trial_is_retried_once_and_the_gpu_given_up_after_two_failures(tmp_path):
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 400.0, 0.8),
                                             ("slow-t1-seed0", 400.0, 0.8)])
    job = pool.take("gpu")  # fast-t1, the one job left
    began = time.time()
    pool.finish(job, "gpu", began, "failed: no CUDA device")
    assert job in pool.jobs and not pool.gpu_disabled  # back in the list, once
    again = pool.take("gpu")
    assert again is job
    pool.finish(again, "gpu", began, "failed: no CUDA device")
    assert again not in pool.jobs  # twice: dropped
    assert pool.gpu_disabled  # two GPU failures and no GPU success: CPU workers from now on


@pytest.mark.parametrize("kind,expected", [("gpu", "highest"), ("cpu", None)])
def test_each_worker_kind_runs_its_child_with_its_environment(kind, expected):
    pool_module = load_pool_module()
    seen = {}
    run = pool_module._patched_run(lambda command, **kw: seen.update(kw["env"]))
    pool_module._local.kind = kind
    run(["true"])
    assert seen.get("JAX_DEFAULT_MATMUL_PRECISION") == expected
    assert (seen.get("JAX_PLATFORMS") == "cpu") is (kind == "cpu")


def test_a_gpu_worker_takes_a_pack_of_one_methods_trials_and_publishes_each(tmp_path,
                                                                            monkeypatch):
    """--group_size 2: a GPU worker takes two search trials of one method (never two methods,
    never a search trial with a seed run) and trains them with run_pack; each job of the pack
    is finished by what it published; a seed run alone goes through run_job; a CPU worker
    still takes one trial."""
    pool_module, pool = make_pool(tmp_path)
    pool.args.group_size = 2
    packs = []

    def fake_run_pack(jobs):  # as sweep.run_pack: publishes every trial, one process
        packs.append(names(jobs))
        for job in jobs:
            publish(pool.args.records, sweep.run_dir_name(job["method"], job["trial"],
                                                          job["seed"]), 1.0, 0.5, job["seed"])
        return dict(trials=len(jobs))

    def fake_run_job(job):  # a pack of one: its own process, as before
        fake_run_pack([job])
        return dict(validation_accuracy=0.5, diverged=False)

    monkeypatch.setattr(sweep, "run_pack", fake_run_pack)
    monkeypatch.setattr(sweep, "run_job", fake_run_job)
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    assert len(pool.take_pack("cpu")) == 1
    pool.jobs = []
    _, pool = make_pool(tmp_path / "again")
    pool.args.group_size = 2
    pool_module.worker(pool, "gpu")
    assert sorted(packs[:2]) == [["fast-t0-seed0", "fast-t1-seed0"],
                                 ["slow-t0-seed0", "slow-t1-seed0"]]
    assert sorted(packs[2:]) == [["fast-t0-seed1"], ["slow-t0-seed1"]]  # the winners' seeds
    done = pool.done
    assert {d["outcome"] for d in done} == {"published"} and len(done) == 6
    assert sorted(d["pack"] for d in done)[-4:] == [2, 2, 2, 2]


def test_the_pool_runs_an_older_commits_sweep_module(tmp_path):
    """The pool imports the dpbench of the group's own commit: one from before sweep/jobs.py
    names the published folder ``_published`` and has no ``is_published`` nor ``run_pack``.
    The pool still sees what is published and gives its GPU workers one trial at a time."""
    from types import SimpleNamespace
    old = SimpleNamespace(**{k: getattr(sweep, k) for k in ("_jobs", "winners_of",
                                                             "run_dir_name", "run_job")},
                          _published=sweep.published)
    pool_module = load_pool_module()
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8)])
    pool = pool_module.Pool(old, list(pool.plans.values()), pool.args)
    assert "fast-t0-seed0" not in names(pool.jobs) and len(pool.jobs) == 3
    pool.args.group_size = 4
    assert len(pool.take_pack("gpu")) == 1


def test_a_pack_spans_its_familys_epsilons_and_a_failed_pack_retries_its_runs_alone(
        tmp_path, monkeypatch):
    """A GPU pack takes one method's search trials of both epsilons of a family (the same
    program up to sigma), never another method's; its GPU trials get --gpu_binding and a share
    of the device's memory, a CPU trial neither. A pack that fails leaves the GPU in use: each
    of its runs is retried once, alone."""
    pool_module = load_pool_module()
    plans = []
    for eps in (1.0, 3.0):
        group = f"digits__logistic__eps{eps}__delta1e-05"
        plans.append(dict(group=group, epsilon=eps, delta=1e-5, seeds=[0, 1], num_trials=2,
                          methods={m: dict(gin_files=["gin/data/digits.gin"], trials=[[], []])
                                   for m in ("fast", "slow")}))
        (tmp_path / "records" / group).mkdir(parents=True)
    args = argparse.Namespace(records=tmp_path / "records", runs_dir=tmp_path / "runs",
                              deadline_s=1000.0, out=tmp_path / "out", group_size=8,
                              gpu_workers=4,
                              gpu_binding=["train.accelerator_micro_batch_size = 0"])
    pool = pool_module.Pool(sweep, plans, args)
    calls = []

    def failing_pack(jobs):
        calls.append(("pack", [j["bindings"] for j in jobs]))
        raise RuntimeError("the group path broke")

    def one_job(job):
        calls.append(("job", job["bindings"]))
        return dict(validation_accuracy=0.5, diverged=False)

    monkeypatch.setattr(sweep, "run_pack", failing_pack)
    monkeypatch.setattr(sweep, "run_job", one_job)
    pack = pool.take_pack("gpu")
    assert len(pack) == 4 and len({j["method"] for j in pack}) == 1
    assert {j["group"] for j in pack} == {p["group"] for p in plans}
    pool.jobs = pack + pool.jobs  # back, to go through the worker
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    monkeypatch.setattr(pool, "waiting", lambda: False)
    pool_module.worker(pool, "gpu")
    packs = [c for c in calls if c[0] == "pack"]
    alone = [c for c in calls if c[0] == "job"]
    assert len(packs) == 2 and len(alone) == 8, calls  # each method's pack failed, then alone
    assert all(b[-1] == "train.accelerator_micro_batch_size = 0" for c in packs for b in c[1])
    assert all(c[1][-1] == "train.accelerator_micro_batch_size = 0" for c in alone)
    assert not pool.gpu_disabled
    seen = {}
    run = pool_module._patched_run(lambda command, **kw: seen.update(kw["env"]))
    run(["true"])  # this thread was the GPU worker's
    assert float(seen[pool_module.MEMORY_FRACTION_ENV]) == pytest.approx(0.9 / 4)
    pool_module._local.kind = "cpu"
    seen.clear()
    run(["true"])
    assert pool_module.MEMORY_FRACTION_ENV not in seen


def test_a_pack_holds_trials_of_one_shape(tmp_path):
    """Trials whose bindings give different batch sizes, or an EMA against none, are never in
    one pack (its process would train their groups one after another); equal shapes are. A
    trial that binds none of the shape's keys (a search's trial 0) has its gin files' shape
    (digits.gin: batch 128, no EMA), so it packs with the trials that bind that shape."""
    pool_module = load_pool_module()
    shapes = [[],
              ["train.batch_size = 1024", "train.ema_decay = 0.0"],
              ["train.batch_size = 2048", "train.ema_decay = 0.0"],
              ["train.batch_size = 1024", "train.ema_decay = 0.99"],
              ["train.batch_size = 1024", "train.ema_decay = 0.0", "optimize.lr = 2"],
              ["train.batch_size = 128", "train.ema_decay = 0.0", "optimize.lr = 2"],
              ["train.batch_size = 128", "train.ema_decay = 0.99"]]
    plan = dict(group=GROUP, epsilon=3.0, delta=1e-5, seeds=[0, 1], num_trials=len(shapes),
                methods={"fast": dict(gin_files=["gin/data/digits.gin"], trials=shapes)})
    (tmp_path / "records" / GROUP).mkdir(parents=True)
    args = argparse.Namespace(records=tmp_path / "records", runs_dir=tmp_path / "runs",
                              deadline_s=1000.0, out=tmp_path / "out", group_size=8)
    pool = pool_module.Pool(sweep, [plan], args)
    packs = []
    while pool.jobs:
        packs.append(sorted(j["trial"] for j in pool.take_pack("gpu")))
    assert sorted(packs) == [[0, 5], [1, 4], [2], [3], [6]]
    assert pool_module.shape_of(dict(bindings=shapes[1])) != pool_module.shape_of(
        dict(bindings=shapes[3]))
    # a value spelt two ways is one shape; without its gin defaults trial 0 is a shape apart
    assert pool_module.shape_of(dict(bindings=["train.batch_size = 1_024"])) == \
        pool_module.shape_of(dict(bindings=["train.batch_size=1024"]))
    assert pool_module.shape_of(dict(bindings=[])) != pool_module.shape_of(
        dict(bindings=shapes[5]))
    # BandMF's bands are shape (a macro: its pipeline's default 4 read as %BANDS)
    bandmf = pool_module.gin_defaults(["pipelines/bandmf/pipeline.gin"])
    assert bandmf["BANDS"] == 4
    assert pool_module.shape_of(dict(bindings=[]), bandmf) == pool_module.shape_of(
        dict(bindings=["BANDS = 4"]), bandmf) != pool_module.shape_of(
        dict(bindings=["BANDS = 2"]), bandmf)


def test_a_failed_packs_log_comes_back(tmp_path):
    """A pack's runs share one log (pack-<key>.log); when a pack fails, the logs that come
    back hold it (board v3's rerun brought back an empty failed_logs.tar.gz)."""
    pool_module, pool = make_pool(tmp_path)
    job = pool.take("gpu")
    log = pool.args.runs_dir / GROUP / "pack-0123456789.log"
    log.parent.mkdir(parents=True)
    log.write_text("Traceback: the group step failed\n")
    pool.finish(job, "gpu", time.time(), "failed: exit 1", pack=[job, dict(job, trial=9)])
    pool_module.pack(pool, pool.args.out)
    with tarfile.open(pool.args.out / "failed_logs.tar.gz") as tar:
        names = tar.getnames()
        assert f"{GROUP}/pack-0123456789.log" in names
        text = tar.extractfile(f"{GROUP}/pack-0123456789.log").read().decode()
    assert "the group step failed" in text
