"""dpbench/sweep/local.py: the sweep's Ray-free local runner (what ran board v3's trials on a
lent GPU machine, as tools/sweep_pool.py then). Its scheduling (device workers the slowest
trials, CPU workers the cheapest that fit the deadline), each method's seeds queued once its
own search is published, a failed trial retried once, the device given up after two failures
with no success, the one packing rule, and what it packs for the trip back."""

import argparse
import json
import tarfile
import time

import pytest

from dpbench import sweep
from dpbench.sweep import jobs as sweep_jobs
from dpbench.sweep import local as pool_module

GROUP = "digits__logistic__eps3.0__delta1e-05"


def make_pool(tmp_path, deadline_s=1000.0, published=()):
    """A pool over one group (methods fast and slow, K = 2, seeds 0 and 1), with ``published``
    runs' records already there (fast's: 100 s each, slow's: 400 s)."""
    plan = dict(group=GROUP, epsilon=3.0, delta=1e-5, seeds=[0, 1], num_trials=2,
                methods={m: dict(gin_files=["gin/data/digits.gin"], trials=[[], []])
                         for m in ("fast", "slow")})
    records = tmp_path / "records"
    (records / GROUP).mkdir(parents=True)
    (records / GROUP / "search.json").write_text(json.dumps(plan))
    for name, wall, accuracy in published:
        publish(records, name, wall, accuracy)
    args = argparse.Namespace(records=records, runs_dir=tmp_path / "runs",
                              deadline_s=deadline_s, out=tmp_path / "out", group_size=1)
    return pool_module, pool_module.LocalRunner([plan], args)


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
    assert pool.take("device")["method"] == "slow"
    assert pool.take("cpu")["method"] == "fast"
    assert pool.take("cpu") is None and pool.take("device") is None


def test_nothing_is_started_that_cannot_finish_before_the_deadline(tmp_path):
    _, pool = make_pool(tmp_path, deadline_s=200.0,  # 1.3 x 400 s > 200 s > 1.3 x 100 s
                        published=[("fast-t0-seed0", 100.0, 0.8),
                                   ("slow-t0-seed0", 400.0, 0.8)])
    assert pool.take("cpu")["method"] == "fast"
    assert pool.take("cpu") is None  # slow's 400 s would be killed at the deadline
    assert pool.take("device")["method"] == "slow"  # no GPU time measured yet: 150 s assumed
    for ratio, method in ((0.5, "slow"), (1.0, "fast")):  # GPU runs measured at ratio x CPU
        _, later = make_pool(tmp_path / str(ratio), deadline_s=300.0,
                             published=[("fast-t0-seed0", 100.0, 0.8),
                                        ("slow-t0-seed0", 400.0, 0.8)])
        later.device_ratio.append(ratio)
        assert later.take("device")["method"] == method  # 1.3 x 400 s at ratio 1 misses 300 s


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
    estimates = pool_module.cpu_estimates(pool.args.records, pool.plans.values())
    assert estimates[(GROUP, "slow")] == 700.0 and estimates[(GROUP, "fast")] == 100.0


def test_gpu_workers_take_search_trials_before_seed_runs(tmp_path):
    """A search trial left unpublished holds back every winner's seed runs of its group: a GPU
    worker takes one before any seed run, however slow the seed run is on a CPU."""
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 400.0, 0.8)])
    seed_run = dict(pool.jobs[0], method="slow", trial=0, seed=1)
    pool.jobs.append(seed_run)
    assert pool.take("device")["seed"] == 0  # slow-t1's search trial, not slow's seed 1
    assert pool.take("device")["seed"] == 0  # fast-t1: cheaper than the seed run, still first
    assert pool.take("device") is seed_run


def test_device_workers_take_the_cell_nearest_whole_first(tmp_path):
    """A cell (a group's method: its search, then its winner's seeds) with more runs published
    goes first, its seed runs too, so that a window's end leaves as few cells half-done as it
    can; among equals, search trials before seed runs, then the slowest."""
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("fast-t1-seed0", 100.0, 0.7)])
    assert names(pool.jobs) == ["fast-t0-seed1", "slow-t0-seed0", "slow-t1-seed0"]
    first = pool.take("device")  # fast's search is whole: its seed run before slow's 400 s
    assert (first["method"], first["seed"]) == ("fast", 1)
    assert pool.take("device")["method"] == "slow"


def test_a_device_only_board_never_falls_back_to_the_cpu(tmp_path, monkeypatch):
    """A window's runs must all come from the device (sweep/window.py): once the device is
    given up, its worker stops instead of training on the CPU."""
    pool_module, pool = make_pool(tmp_path)
    pool.device_disabled, pool.args.device_only = True, True
    taken = []
    monkeypatch.setattr(pool, "take_pack", lambda kind: taken.append(kind) or [])
    pool_module.worker(pool, "device")
    assert taken == []
    pool.args.device_only = False
    monkeypatch.setattr(pool, "waiting", lambda: False)
    pool_module.worker(pool, "device")
    assert taken == ["cpu"]


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

    def fake_run_pack(jobs, env=None):  # as run_pack of one job: publishes its record
        (job,) = jobs
        ran.append((job["method"], job["trial"], job["seed"]))
        accuracy = 0.9 if job["trial"] == 1 else 0.7
        publish(pool.args.records, sweep.run_dir_name(job["method"], job["trial"], job["seed"]),
                1.0, accuracy, seed=job["seed"])
        return dict(trials=1, validation_accuracy=accuracy, diverged=0)

    monkeypatch.setattr(sweep_jobs, "run_pack", fake_run_pack)
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    pool_module.worker(pool, "cpu")
    for method in ("fast", "slow"):  # each method's seed run after its own search alone
        mine = [r for r in ran if r[0] == method]
        assert sorted(mine[:2]) == [(method, 0, 0), (method, 1, 0)]
        assert mine[2:] == [(method, 1, 1)]  # its winner (trial 1), seed 1
    assert {(GROUP, 'fast'), (GROUP, 'slow')} == pool.seeded and not pool.jobs
    pool_module.write_outputs(pool, pool.args.out)
    with tarfile.open(pool.args.out / "records.tar.gz") as tar:
        packed = sorted(n for n in tar.getnames() if n.endswith("run_record.json"))
    assert packed == sorted(f"{GROUP}/{m}-t{t}-seed{s}/run_record.json" for m, t, s in ran)
    done = json.loads((pool.args.out / "local.json").read_text())["done"]
    assert len(done) == 6 and {d["outcome"] for d in done} == {"published"}


def test_a_failed_trial_is_retried_once_and_the_device_given_up_after_two_failures(tmp_path):
    _, pool = make_pool(tmp_path, published=[("fast-t0-seed0", 100.0, 0.8),
                                             ("slow-t0-seed0", 400.0, 0.8),
                                             ("slow-t1-seed0", 400.0, 0.8)])
    job = pool.take("device")  # fast-t1, the one job left
    began = time.time()
    pool.finish(job, "device", began, "failed: no CUDA device")
    assert job in pool.jobs and not pool.device_disabled  # back in the list, once
    again = pool.take("device")
    assert again is job
    pool.finish(again, "device", began, "failed: no CUDA device")
    assert again not in pool.jobs  # twice: dropped
    assert pool.device_disabled  # two device failures, no success: CPU workers from now on


def test_each_worker_kind_runs_its_child_with_its_environment(tmp_path):
    """A CPU worker's child sees no accelerator; a device worker's allocates as it needs, on
    a share of the device's memory (the numerics policy is the package's, in every child)."""
    _, pool = make_pool(tmp_path)
    pool.args.gpu_workers = 4
    cpu, device = pool.env("cpu"), pool.env("device")
    assert cpu["JAX_PLATFORMS"] == "cpu" and "JAX_PLATFORMS" not in pool_module.DEVICE_ENV
    assert device["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert float(device[pool_module.run_group.MEMORY_FRACTION_ENV]) == pytest.approx(0.9 / 4)
    assert pool_module.run_group.MEMORY_FRACTION_ENV not in cpu
    assert "JAX_DEFAULT_MATMUL_PRECISION" not in device


def test_a_device_worker_takes_a_pack_of_one_methods_trials_and_publishes_each(tmp_path,
                                                                              monkeypatch):
    """group_size 2: a device worker takes two search trials of one method (never two
    methods, never a search trial with a seed run) and trains them with run_pack, in the
    device's environment; each job of the pack is finished by what it published; a CPU
    worker still takes one trial."""
    pool_module, pool = make_pool(tmp_path)
    pool.args.group_size = 2
    packs = []

    def fake_run_pack(jobs, env=None):  # as run_pack: publishes every trial, one process
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        packs.append(names(jobs))
        for job in jobs:
            publish(pool.args.records, sweep.run_dir_name(job["method"], job["trial"],
                                                          job["seed"]), 1.0, 0.5, job["seed"])
        return dict(trials=len(jobs), validation_accuracy=0.5, diverged=0)

    monkeypatch.setattr(sweep_jobs, "run_pack", fake_run_pack)
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    assert len(pool.take_pack("cpu")) == 1
    _, pool = make_pool(tmp_path / "again")
    pool.args.group_size = 2
    pool_module.worker(pool, "device")
    # each cell whole before the next: a method's search, then its winner's seed
    assert packs == [["fast-t0-seed0", "fast-t1-seed0"], ["fast-t0-seed1"],
                     ["slow-t0-seed0", "slow-t1-seed0"], ["slow-t0-seed1"]]
    done = pool.done
    assert {d["outcome"] for d in done} == {"published"} and len(done) == 6
    assert sorted(d["pack"] for d in done)[-4:] == [2, 2, 2, 2]


def _plans(tmp_path, methods=("fast", "slow"), trials=([], [])) -> list:
    plans = []
    for eps in (1.0, 3.0):
        group = f"digits__logistic__eps{eps}__delta1e-05"
        plans.append(dict(group=group, epsilon=eps, delta=1e-5, seeds=[0, 1],
                          num_trials=len(trials),
                          methods={m: dict(gin_files=["gin/data/digits.gin"],
                                           trials=list(trials)) for m in methods}))
        (tmp_path / "records" / group).mkdir(parents=True)
    return plans


def test_a_pack_spans_its_familys_epsilons_and_a_failed_pack_retries_its_runs_alone(
        tmp_path, monkeypatch):
    """A device pack takes one method's search trials of both epsilons of a family (the same
    program up to sigma), never another method's; its trials get --gpu_binding. A pack that
    fails leaves the device in use: each of its runs is retried once, alone."""
    plans = _plans(tmp_path)
    args = argparse.Namespace(records=tmp_path / "records", runs_dir=tmp_path / "runs",
                              deadline_s=1000.0, out=tmp_path / "out", group_size=8,
                              gpu_workers=4,
                              gpu_binding=["train.accelerator_micro_batch_size = 0"])
    pool = pool_module.LocalRunner(plans, args)
    calls = []

    def failing_pack(jobs, env=None):  # a pack of several fails; one job alone trains
        if len(jobs) == 1:
            calls.append(("job", jobs[0]["bindings"]))
            publish_in = tmp_path / "records" / jobs[0]["group"] / sweep.run_dir_name(
                jobs[0]["method"], jobs[0]["trial"], jobs[0]["seed"])
            publish_in.mkdir(parents=True)
            (publish_in / "run_record.json").write_text(json.dumps(dict(
                validation_accuracy=0.5, wall_time_s=1.0)))
            return dict(trials=1, validation_accuracy=0.5, diverged=0)
        calls.append(("pack", [j["bindings"] for j in jobs]))
        raise RuntimeError("the group path broke")

    monkeypatch.setattr(sweep_jobs, "run_pack", failing_pack)
    pack = pool.take_pack("device")
    assert len(pack) == 4 and len({j["method"] for j in pack}) == 1
    assert {j["group"] for j in pack} == {p["group"] for p in plans}
    pool.jobs = pack + pool.jobs  # back, to go through the worker
    monkeypatch.setattr(pool_module.time, "sleep", lambda s: None)
    monkeypatch.setattr(pool, "waiting", lambda: False)
    pool_module.worker(pool, "device")
    packs = [c for c in calls if c[0] == "pack"]
    alone = [c for c in calls if c[0] == "job"]
    # each method's search pack (4 trials) failed, then its runs trained alone (then its
    # seeds: their packs fail too, and they train alone)
    assert [len(c[1]) for c in packs[:2]] == [4, 4] and len(alone) >= 8, calls
    assert all(b[-1] == "train.accelerator_micro_batch_size = 0" for c in packs for b in c[1])
    assert all(c[1][-1] == "train.accelerator_micro_batch_size = 0" for c in alone)
    assert not pool.device_disabled


def test_the_one_packing_rule_holds_one_structure_per_pack(tmp_path):
    """The local runner and the Ray path pack by one rule (sweep/jobs.structure_of, from
    run/settings.binding_structure): a pack holds one structure (the batch, an EMA or none,
    a count such as BandMF's bands); a trial's real numbers (a learning rate) and its seed,
    epochs and budget never split a pack. A search's trial 0, which binds only its gin files
    (digits.gin: batch 128), packs with the trials that bind that structure."""
    shapes = [[],
              ["train.batch_size = 1024", "train.ema_decay = 0.0"],
              ["train.batch_size = 2048", "train.ema_decay = 0.0"],
              ["train.batch_size = 1024", "train.ema_decay = 0.99"],
              ["train.batch_size = 1024", "train.ema_decay = 0.0", "optimize.lr = 2.5"],
              ["train.batch_size = 128", "train.ema_decay = 0.0", "train.epochs = 3",
               "train.seed = 4", "EPSILON = 1.0"],
              ["train.batch_size = 128", "train.ema_decay = 0.99"]]
    plan = dict(group=GROUP, epsilon=3.0, delta=1e-5, seeds=[0, 1], num_trials=len(shapes),
                methods={"fast": dict(gin_files=["gin/data/digits.gin"], trials=shapes)})
    (tmp_path / "records" / GROUP).mkdir(parents=True)
    args = argparse.Namespace(records=tmp_path / "records", runs_dir=tmp_path / "runs",
                              deadline_s=1000.0, out=tmp_path / "out", group_size=8)
    pool = pool_module.LocalRunner([plan], args)
    packs = []
    while pool.jobs:
        packs.append(sorted(j["trial"] for j in pool.take_pack("device")))
    assert sorted(packs) == [[0, 5], [1, 4], [2], [3], [6]]
    jobs = sweep_jobs.jobs_of([plan], "search", args.records, args.runs_dir)
    ray_packs = sweep_jobs.pack_jobs(jobs, 0, 1)  # the Ray path: the same rule
    assert sorted(sorted(j["trial"] for j in p) for p in ray_packs) == sorted(packs)
    structure = sweep_jobs.structure_of
    assert structure(dict(bindings=["train.batch_size = 1_024"])) == \
        structure(dict(bindings=["train.batch_size=1024"]))  # one value spelt two ways
    assert structure(dict(bindings=[])) != structure(dict(bindings=shapes[5]))  # no defaults
    # BandMF's bands are structure (a macro: its pipeline's default 4 read as %BANDS)
    (bandmf,) = sweep_jobs.method_defaults([dict(gin_files=["pipelines/bandmf/pipeline.gin"],
                                                 bindings=["BANDS = 2"])]).values()
    assert bandmf["BANDS"] == 4
    assert structure(dict(bindings=[]), bandmf) == structure(
        dict(bindings=["BANDS = 4"]), bandmf) != structure(dict(bindings=["BANDS = 2"]), bandmf)
    # a reference is structure too, read as its gin text (DP-SSGD's pre-prune stage: the
    # rehearsal on board v4's protocol found gin's reference object where text was expected)
    (dpssgd,) = sweep_jobs.method_defaults([dict(gin_files=["pipelines/dpssgd/pipeline.gin"],
                                                 bindings=["PRUNE = @prune.random()"])]).values()
    assert structure(dict(bindings=[]), dpssgd) == structure(
        dict(bindings=["PRUNE = @prune.synflow()"]), dpssgd) != structure(
        dict(bindings=["PRUNE = @prune.random()"]), dpssgd)


def test_a_failed_packs_log_comes_back(tmp_path):
    """A pack's runs share one log (pack-<key>.log); when a pack fails, the logs that come
    back hold it (board v3's rerun brought back an empty failed_logs.tar.gz)."""
    pool_module, pool = make_pool(tmp_path)
    job = pool.take("device")
    log = pool.args.runs_dir / GROUP / "pack-0123456789.log"
    log.parent.mkdir(parents=True)
    log.write_text("Traceback: the group step failed\n")
    pool.finish(job, "device", time.time(), "failed: exit 1", pack=[job, dict(job, trial=9)])
    pool_module.write_outputs(pool, pool.args.out)
    with tarfile.open(pool.args.out / "failed_logs.tar.gz") as tar:
        names = tar.getnames()
        assert f"{GROUP}/pack-0123456789.log" in names
        text = tar.extractfile(f"{GROUP}/pack-0123456789.log").read().decode()
    assert "the group step failed" in text


def test_dpbench_sweep_local_trains_every_pack_as_one_compiled_group(tmp_path):
    """The local runner rehearsed end to end (``dpbench sweep local``, digits, K = 2 per method,
    two seeds; the CPU stands in for the device): each method's search is one pack, trained by
    one ``dpbench train --trials`` process as one compiled group (every record's
    ``group.size`` is its pack's size), and each winner's seed run follows its own search."""
    from tests.test_sweep import PROTOCOL, sweep_command
    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    argv = sweep_command(tmp_path)[3:] + ["local", "--deadline_s=900", "--gpu_workers=1",
                                          "--cpu_workers=0", f"--out={tmp_path / 'out'}"]
    assert sweep.main(argv[-5:] + argv[:-5]) == 0
    done = json.loads((tmp_path / "out" / "local.json").read_text())["done"]
    assert {d["outcome"] for d in done} == {"published"} and len(done) == 6
    for d in done:
        record = json.loads((tmp_path / "records" / d["run"] / "run_record.json").read_text())
        assert record["group"]["size"] == d["pack"], (d, record["group"])
    assert sorted(d["pack"] for d in done) == [1, 1, 2, 2, 2, 2]
    with tarfile.open(tmp_path / "out" / "records.tar.gz") as tar:
        assert len([n for n in tar.getnames() if n.endswith("run_record.json")]) == 6
